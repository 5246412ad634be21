//! The idempotency model: record encoding (total decoder, round trips), fingerprints,
//! scopes, record ids, the decision table and the status policy.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use proptest::prelude::*;
use retrysafe_core::__private::Disposition;
use retrysafe_core::__private::protocol::{Claimed, Policy, Protocol, Step};
use retrysafe_core::idempotency::*;
use retrysafe_core::wire::IdempotencyKey;

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn sample_records() -> Vec<Record> {
    vec![
        Record::InProgress(InProgress::new(
            123_456,
            Token::random(),
            fp(1),
            CommitPoint::Before,
        )),
        Record::Completed(Completed::new(
            fp(2),
            Some(StoredResponse::new(
                StatusCode::CREATED,
                vec![
                    (
                        HeaderName::from_static("content-type"),
                        HeaderValue::from_static("application/json"),
                    ),
                    (
                        HeaderName::from_static("link"),
                        HeaderValue::from_static("<a>"),
                    ),
                    (
                        HeaderName::from_static("link"),
                        HeaderValue::from_static("<b>"),
                    ),
                ],
                Bytes::from_static(b"{\"id\":\"p_1\"}"),
                vec![(
                    HeaderName::from_static("x-sum"),
                    HeaderValue::from_static("1"),
                )],
            )),
        )),
        Record::Completed(Completed::new(fp(3), None)),
        Record::OutcomeUnknown(OutcomeUnknown::new(fp(4))),
    ]
}

#[test]
fn records_round_trip_and_report_their_length() {
    for r in sample_records() {
        let bytes = r.encode();
        assert_eq!(bytes.len(), r.encoded_len());
        assert_eq!(bytes[0], RECORD_VERSION, "version byte first");
        assert_eq!(Record::decode(bytes).unwrap(), r);
    }
}

#[test]
fn decoder_refuses_damaged_records() {
    for r in sample_records() {
        let bytes = r.encode();
        // Every strict prefix is truncated.
        for cut in 0..bytes.len() {
            assert!(
                Record::decode(bytes.slice(..cut)).is_err(),
                "prefix of {cut} bytes"
            );
        }
        // Trailing garbage.
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert_eq!(
            Record::decode(Bytes::from(longer)),
            Err(DecodeError::TrailingBytes)
        );
        // Another version.
        let mut v2 = bytes.to_vec();
        v2[0] = 2;
        assert_eq!(
            Record::decode(Bytes::from(v2)),
            Err(DecodeError::UnknownVersion(2))
        );
    }
    assert_eq!(Record::decode(Bytes::new()), Err(DecodeError::Truncated));
    let mut bad_tag = sample_records()[3].encode().to_vec();
    bad_tag[1] = 99;
    assert_eq!(
        Record::decode(Bytes::from(bad_tag)),
        Err(DecodeError::Invalid("state tag"))
    );
}

proptest! {
    #[test]
    fn decoder_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Record::decode(Bytes::from(bytes));
    }

    #[test]
    fn decoder_is_total_on_damaged_valid_records(idx in 0usize..4, pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = sample_records()[idx].encode().to_vec();
        let i = pos.index(bytes.len());
        bytes[i] = byte;
        // A length field may now claim gigabytes: the decoder must neither panic nor allocate it.
        let _ = Record::decode(Bytes::from(bytes));
    }

    #[test]
    fn completed_records_round_trip(
        status in 200u16..600,
        body in proptest::collection::vec(any::<u8>(), 0..2048),
        values in proptest::collection::vec("[ -~]{0,40}", 0..6),
    ) {
        let headers = values
            .iter()
            .map(|v| (HeaderName::from_static("x-h"), HeaderValue::from_str(v).unwrap()))
            .collect();
        let r = Record::Completed(Completed::new(fp(9), Some(StoredResponse::new(StatusCode::from_u16(status).unwrap(), headers, Bytes::from(body), Vec::new()))));
        prop_assert_eq!(Record::decode(r.encode()).unwrap(), r);
    }
}

#[test]
fn fingerprint_covers_method_path_query_headers_and_body() {
    let f = Fingerprinter::default();
    let mut json = HeaderMap::new();
    json.insert("content-type", HeaderValue::from_static("application/json"));
    let base = f.fingerprint(&Method::POST, &"/a?x=1".parse().unwrap(), &json, b"{}");
    let uri = |s: &str| s.parse::<Uri>().unwrap();
    assert_ne!(
        base,
        f.fingerprint(&Method::PATCH, &uri("/a?x=1"), &json, b"{}")
    );
    assert_ne!(
        base,
        f.fingerprint(&Method::POST, &uri("/b?x=1"), &json, b"{}")
    );
    assert_ne!(
        base,
        f.fingerprint(&Method::POST, &uri("/a?x=2"), &json, b"{}")
    );
    assert_ne!(
        base,
        f.fingerprint(&Method::POST, &uri("/a?x=1"), &HeaderMap::new(), b"{}")
    );
    assert_ne!(
        base,
        f.fingerprint(&Method::POST, &uri("/a?x=1"), &json, b"{ }")
    );
    // Other headers and the authority are not part of it.
    let mut more = json.clone();
    more.insert("x-simulate-delay-ms", HeaderValue::from_static("5"));
    assert_eq!(
        base,
        f.fingerprint(&Method::POST, &uri("http://h/a?x=1"), &more, b"{}")
    );
    // No ambiguity between fields: path "/ab" + query "" differs from "/a" + "b".
    assert_ne!(
        f.fingerprint(&Method::POST, &uri("/ab"), &json, b""),
        f.fingerprint(&Method::POST, &uri("/a?b"), &json, b"")
    );
    // Configured headers.
    let g = Fingerprinter::with_headers([HeaderName::from_static("x-tenant")]);
    let mut t1 = HeaderMap::new();
    t1.insert("x-tenant", HeaderValue::from_static("1"));
    assert_ne!(
        g.fingerprint(&Method::POST, &uri("/a"), &t1, b""),
        g.fingerprint(&Method::POST, &uri("/a"), &HeaderMap::new(), b"")
    );
}

#[test]
fn scopes_and_record_ids_separate_callers() {
    let key = IdempotencyKey::new("k").unwrap();
    let alice = Scope::from(&Principal::new("alice"));
    let bob = Scope::from(&Principal::new("bob"));
    assert_ne!(RecordId::new(&alice, &key), RecordId::new(&bob, &key));
    assert_eq!(
        RecordId::new(&alice, &key),
        RecordId::new(&Scope::from(&Principal::new("alice")), &key)
    );
    // Domain separation: a principal and a raw scope of the same bytes differ.
    assert_ne!(alice, Scope::new("alice"));
    assert_ne!(Scope::from_authorization(b"alice"), Scope::new("alice"));
    assert_ne!(Scope::global(), Scope::new(""));
    // No bytes a `scope_by` rule hashes can name the global scope.
    assert_ne!(Scope::global(), Scope::new(b"\0global"));
    assert_ne!(Scope::global(), Scope::new("global"));
    let id = RecordId::new(&alice, &key);
    assert_eq!(RecordId::from_bytes(*id.as_bytes()), id);
    assert!(id.to_hex().chars().all(|c| c.is_ascii_hexdigit()));
}

// The hashes are a stored format (Redis key names, PostgreSQL rows): pinned, whatever
// is cached between calls (the principal's scope, the last scope's record prefix).
#[test]
fn record_ids_are_stable_across_scopes_in_any_order() {
    let alice = Principal::new("alice");
    let short = IdempotencyKey::new("k").unwrap();
    let long =
        IdempotencyKey::new("a-key-long-enough-to-need-a-third-block-of-sha-256-input-0123456789")
            .unwrap();
    let (short_hex, long_hex) = (
        "ef82ba084c439d7ac1ff26fdd3ffa2b6ef60540ec47ebfe7a195ef074899bf9f",
        "953f6539bb4dbdcecb3edd8f4a10b55c74368ba4f3df338cad51506521dd5ac3",
    );
    let bob = Scope::from(&Principal::new("bob"));
    for _ in 0..2 {
        for scope in [Scope::from(&alice), Scope::from(&alice.clone())] {
            assert_eq!(
                scope.as_bytes()[..4],
                [0x50, 0x38, 0xd0, 0x1d],
                "the scope of a principal"
            );
            assert_eq!(RecordId::new(&scope, &short).to_hex(), short_hex);
            assert_eq!(RecordId::new(&scope, &long).to_hex(), long_hex);
            assert_ne!(RecordId::new(&bob, &short).to_hex(), short_hex);
        }
    }
    let thread = std::thread::spawn(move || RecordId::new(&Scope::from(&alice), &long));
    assert_eq!(thread.join().unwrap().to_hex(), long_hex);
}

#[test]
fn tokens_are_random_and_round_trip() {
    let a = Token::random();
    let b = Token::random();
    assert_ne!(a, b);
    assert_eq!(Token::from_bytes(a.to_bytes()), a);
    assert_eq!(a.to_hex().len(), 32);
    assert!(
        !format!("{a:?}").contains(&a.to_hex()),
        "Debug does not print the whole token"
    );
}

/// What a copy with fingerprint `fp` gets from an existing `record`.
fn decide(record: &Record, fp: &Fingerprint) -> Step {
    let mut p = Protocol::new(&Policy::new(), *fp, None);
    p.claimed(Claimed::Existing {
        record: record.clone(),
        became_unknown: false,
    })
}

fn problem_of(step: Step) -> Option<retrysafe_core::problem::ProblemKind> {
    match step {
        Step::Problem(p) => Some(p.kind()),
        _ => None,
    }
}

#[test]
fn decision_table() {
    use retrysafe_core::problem::ProblemKind;
    let done = Record::Completed(Completed::new(
        fp(1),
        Some(StoredResponse::new(
            StatusCode::OK,
            vec![],
            Bytes::new(),
            vec![],
        )),
    ));
    assert!(matches!(decide(&done, &fp(1)), Step::Replay(_)));
    assert_eq!(
        problem_of(decide(&done, &fp(2))),
        Some(ProblemKind::KeyMismatch)
    );
    let running = Record::InProgress(InProgress::new(
        0,
        Token::random(),
        fp(1),
        CommitPoint::Undeclared,
    ));
    assert_eq!(
        problem_of(decide(&running, &fp(1))),
        Some(ProblemKind::InFlight)
    );
    assert_eq!(
        problem_of(decide(&running, &fp(2))),
        Some(ProblemKind::KeyMismatch)
    );
    let marker = Record::Completed(Completed::new(fp(1), None));
    assert_eq!(
        problem_of(decide(&marker, &fp(1))),
        Some(ProblemKind::ResponseNotStored)
    );
}

#[test]
fn status_policy() {
    use Disposition::*;
    for s in [200u16, 201, 204, 301, 302, 304, 400, 404, 409, 410, 422] {
        assert_eq!(
            Disposition::of(StatusCode::from_u16(s).unwrap(), false),
            Store,
            "{s}"
        );
    }
    for s in [401u16, 403, 429] {
        assert_eq!(
            Disposition::of(StatusCode::from_u16(s).unwrap(), false),
            Release,
            "{s}"
        );
    }
    for s in [408u16, 500, 502, 503, 504, 599] {
        assert_eq!(
            Disposition::of(StatusCode::from_u16(s).unwrap(), false),
            OutcomeUnknown,
            "{s}"
        );
        assert_eq!(
            Disposition::of(StatusCode::from_u16(s).unwrap(), true),
            Release,
            "NoEffect {s}"
        );
    }
    assert!(CommitPoint::Before.allows_takeover());
    assert!(!CommitPoint::Passed.allows_takeover());
    assert!(!CommitPoint::Undeclared.allows_takeover());
}

#[test]
fn header_filter_defaults() {
    let f = HeaderFilter::default();
    for stored in [
        "content-type",
        "location",
        "etag",
        "link",
        "cache-control",
        "retry-after",
    ] {
        assert!(f.is_stored(&HeaderName::from_static(stored)), "{stored}");
    }
    for never in [
        "set-cookie",
        "date",
        "x-request-id",
        "traceparent",
        "tracestate",
        "server-timing",
        "connection",
        "transfer-encoding",
        "content-length",
        "ratelimit-remaining",
        "x-ratelimit-limit",
        "idempotent-replayed",
        "keep-alive",
        "upgrade",
    ] {
        assert!(!f.is_stored(&HeaderName::from_static(never)), "{never}");
    }
    let mut map = HeaderMap::new();
    map.append("link", HeaderValue::from_static("<a>"));
    map.append("link", HeaderValue::from_static("<b>"));
    map.insert("set-cookie", HeaderValue::from_static("s=1"));
    let r = StoredResponse::capture(StatusCode::OK, &map, Bytes::new(), None, &f);
    assert_eq!(r.headers.len(), 2);
    assert_eq!(r.header_map().get_all("link").iter().count(), 2);
    assert!(r.trailer_map().is_none());
}
