//! Classification: every row of the classify module's table, and the request facts it
//! reads.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, StatusCode};
use retrysafe_core::__private::deadline_spent;
use retrysafe_core::classify::{
    BreakerOutcome, Classifier, DefaultClassifier, DelayHint, Failure, FaultSide, RequestFacts,
    RetrySafety,
};
use retrysafe_core::wire::Convention;

use super::{GET, POST, classify, failure, grpc, headers, ms};

#[test]
fn success_is_nobodys_fault() {
    for status in [200, 201, 204, 301, 304] {
        let c = classify(status, &[], &GET);
        assert!(c.is_success(), "{status}");
        assert_eq!(c.safety, RetrySafety::No);
        assert_eq!(c.breaker_outcome(), BreakerOutcome::Success);
        assert!(!c.is_retryable(&GET));
    }
}

#[test]
fn connect_failed_and_refused_stream_are_retryable_for_any_request() {
    for f in [Failure::ConnectFailed, Failure::RefusedStream] {
        let c = failure(f, &POST);
        assert_eq!(c.safety, RetrySafety::Yes, "{f:?}");
        assert!(c.is_retryable(&POST));
        assert!(c.is_retryable(&GET));
        assert!(!c.timeout);
        assert_eq!(c.fault, Some(FaultSide::Server));
        assert_eq!(c.breaker_outcome(), BreakerOutcome::Failure);
    }
}

#[test]
fn closed_before_a_response_and_attempt_timeouts_retry_safe_requests_only() {
    let no_response = failure(Failure::NoResponse, &POST);
    assert_eq!(no_response.safety, RetrySafety::Maybe);
    assert!(no_response.is_retryable(&GET));
    assert!(!no_response.is_retryable(&POST));
    assert!(no_response.is_retryable(&POST.with_key()));
    assert!(!no_response.timeout);

    let timeout = failure(Failure::Timeout, &GET);
    assert_eq!(timeout.safety, RetrySafety::Maybe);
    assert!(timeout.timeout);
    assert!(timeout.is_retryable(&GET));
    assert!(!timeout.is_retryable(&POST));
    assert_eq!(timeout.fault, Some(FaultSide::Server));
}

#[test]
fn local_and_other_failures_are_never_retried() {
    let local = failure(Failure::Local, &GET);
    assert_eq!(local.safety, RetrySafety::No);
    assert!(local.marked);
    assert_eq!(local.fault, Some(FaultSide::Dependency));
    assert_eq!(local.breaker_outcome(), BreakerOutcome::Neutral);

    let other = failure(Failure::Other, &GET);
    assert_eq!(other.safety, RetrySafety::No);
    assert!(!other.is_retryable(&GET));
}

#[test]
fn gateway_statuses_retry_safe_requests_only() {
    for status in [408, 502, 503, 504] {
        let c = classify(status, &[], &GET);
        assert_eq!(c.safety, RetrySafety::Maybe, "{status}");
        assert!(c.is_retryable(&GET), "{status}");
        assert!(
            !c.is_retryable(&POST),
            "{status}: a POST without a key is sent once"
        );
        assert!(c.is_retryable(&POST.with_key()), "{status}");
        assert_eq!(c.fault, Some(FaultSide::Server), "{status}");
        assert_eq!(c.breaker_outcome(), BreakerOutcome::Failure);
        assert_eq!(c.timeout, status == 408 || status == 504, "{status}");
        assert!(!c.throttle, "{status}");
        assert_eq!(c.delay, DelayHint::Backoff);
    }
}

#[test]
fn a_503_with_retry_after_is_a_throttle_with_a_minimum_delay() {
    let c = classify(503, &[("retry-after", "7")], &GET);
    assert!(c.throttle);
    assert_eq!(c.delay, DelayHint::AtLeast(Duration::from_secs(7)));
    assert!(c.is_retryable(&GET));

    // An HTTP-date in the past asks for no delay; one in the future for about that.
    let past = httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
    let c = classify(503, &[("retry-after", &past)], &GET);
    assert_eq!(c.delay, DelayHint::AtLeast(Duration::ZERO));
    let future = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
    match classify(503, &[("retry-after", &future)], &GET).delay {
        DelayHint::AtLeast(d) => {
            assert!(d > Duration::from_secs(3500) && d <= Duration::from_secs(3600));
        }
        other => panic!("{other:?}"),
    }

    // A garbage retry-after is ignored for the delay.
    let c = classify(502, &[("retry-after", "soon")], &GET);
    assert_eq!(c.delay, DelayHint::Backoff);
}

#[test]
fn a_429_is_a_throttle_for_safe_requests() {
    let c = classify(429, &[], &GET);
    assert!(c.throttle);
    assert_eq!(c.safety, RetrySafety::Maybe);
    assert!(c.is_retryable(&GET));
    assert!(!c.is_retryable(&POST));
    let c = classify(429, &[("retry-after", "2")], &GET);
    assert_eq!(c.delay, DelayHint::AtLeast(Duration::from_secs(2)));
}

#[test]
fn a_500_is_retried_only_when_opted_in() {
    let c = classify(500, &[], &GET);
    assert_eq!(c.safety, RetrySafety::No);
    assert_eq!(c.fault, Some(FaultSide::Server));
    assert_eq!(c.breaker_outcome(), BreakerOutcome::Failure);

    let opted = DefaultClassifier::default().retry_500(true);
    let c = opted.classify_response(StatusCode::INTERNAL_SERVER_ERROR, &HeaderMap::new(), &GET);
    assert_eq!(c.safety, RetrySafety::Maybe);
    assert!(c.is_retryable(&GET));
    assert!(!c.is_retryable(&POST));
}

#[test]
fn a_409_with_retry_after_and_a_key_is_still_in_flight() {
    let keyed = POST.with_key();
    let c = classify(409, &[("retry-after", "1")], &keyed);
    assert_eq!(c.safety, RetrySafety::Maybe);
    assert!(c.is_retryable(&keyed));
    assert_eq!(c.delay, DelayHint::AtLeast(Duration::from_secs(1)));
    // Not a fault of the callee: breakers count it as a success.
    assert_eq!(c.fault, Some(FaultSide::Client));
    assert_eq!(c.breaker_outcome(), BreakerOutcome::Success);

    // Without retry-after, or without a key: a plain conflict, never retried.
    assert_eq!(classify(409, &[], &keyed).safety, RetrySafety::No);
    assert_eq!(
        classify(409, &[("retry-after", "1")], &GET).safety,
        RetrySafety::No
    );
    assert_eq!(
        classify(409, &[("retry-after", "1")], &POST).safety,
        RetrySafety::No
    );
}

#[test]
fn other_4xx_and_5xx_are_never_retried() {
    for status in [400, 401, 403, 404, 405, 410, 413, 422, 451] {
        let c = classify(status, &[], &GET);
        assert_eq!(c.safety, RetrySafety::No, "{status}");
        assert_eq!(c.fault, Some(FaultSide::Client), "{status}");
        assert_eq!(c.breaker_outcome(), BreakerOutcome::Success, "{status}");
    }
    for status in [501, 505, 507, 599] {
        let c = classify(status, &[], &GET);
        assert_eq!(c.safety, RetrySafety::No, "{status}");
        assert_eq!(c.fault, Some(FaultSide::Server), "{status}");
    }
}

#[test]
fn do_not_retry_and_replayed_are_never_retried_and_a_dependencys_fault() {
    for marker in [
        ("do-not-retry", "1"),
        ("do-not-retry", "true"),
        ("do-not-retry", "yes"),
        ("idempotent-replayed", "true"),
    ] {
        for status in [502, 503, 504, 429] {
            let c = classify(status, &[marker], &GET);
            assert_eq!(c.safety, RetrySafety::No, "{status} {marker:?}");
            assert!(c.marked, "{status} {marker:?}");
            assert!(!c.is_retryable(&GET));
            assert!(!c.is_retryable(&POST.with_key()));
            assert_eq!(c.fault, Some(FaultSide::Dependency), "{status} {marker:?}");
            assert_eq!(c.breaker_outcome(), BreakerOutcome::Neutral);
        }
    }
    // `0`, `false` and `?0` are not marks.
    for value in ["0", "false", "?0"] {
        let c = classify(503, &[("do-not-retry", value)], &GET);
        assert!(!c.marked, "{value}");
        assert!(c.is_retryable(&GET), "{value}");
    }
    // A marked gRPC status too.
    let c = grpc(&[("grpc-status", "14"), ("do-not-retry", "1")], &GET.grpc());
    assert_eq!(c.safety, RetrySafety::No);
    assert_eq!(c.fault, Some(FaultSide::Dependency));
}

#[test]
fn a_504_caused_by_the_propagated_deadline_is_neutral() {
    let own = classify(504, &[], &GET);
    assert_eq!(own.fault, Some(FaultSide::Server));
    assert_eq!(own.breaker_outcome(), BreakerOutcome::Failure);

    // A deadline was sent but the callee answered long before it ran out: its own
    // timeout, its fault.
    let early = GET.with_deadline_sent();
    let c = classify(504, &[], &early);
    assert_eq!(c.fault, Some(FaultSide::Server));
    assert_eq!(c.breaker_outcome(), BreakerOutcome::Failure);
    let g = grpc(&[("grpc-status", "4")], &GET.grpc().with_deadline_sent());
    assert_eq!(g.fault, Some(FaultSide::Server));

    let sent = GET.with_deadline_spent();
    let c = classify(504, &[], &sent);
    assert_eq!(c.fault, Some(FaultSide::CallerDeadline));
    assert!(c.timeout);
    assert_eq!(c.breaker_outcome(), BreakerOutcome::Neutral);
    // Still retryable (the retry layer decides whether time is left).
    assert!(c.is_retryable(&sent));

    let g = grpc(&[("grpc-status", "4")], &GET.grpc().with_deadline_spent());
    assert_eq!(g.fault, Some(FaultSide::CallerDeadline));
    assert!(g.timeout);
    assert_eq!(g.safety, RetrySafety::No);
    assert_eq!(g.breaker_outcome(), BreakerOutcome::Neutral);
    let g = grpc(&[("grpc-status", "4")], &GET.grpc());
    assert_eq!(g.fault, Some(FaultSide::Server));
}

#[test]
fn a_transport_failure_as_the_deadline_runs_out_is_the_callers_deadline() {
    let spent = GET.with_deadline_spent();
    for f in [Failure::Timeout, Failure::NoResponse, Failure::Other] {
        let early = failure(f, &GET.with_deadline_sent());
        assert_eq!(early.fault, Some(FaultSide::Server), "{f:?}");
        assert_eq!(early.breaker_outcome(), BreakerOutcome::Failure, "{f:?}");
        let late = failure(f, &spent);
        assert_eq!(late.fault, Some(FaultSide::CallerDeadline), "{f:?}");
        assert_eq!(late.breaker_outcome(), BreakerOutcome::Neutral, "{f:?}");
    }
    // A connection refused is the callee's, whenever it comes.
    let refused = failure(Failure::ConnectFailed, &spent);
    assert_eq!(refused.fault, Some(FaultSide::Server));
}

#[test]
fn a_deadline_is_spent_within_a_tenth_of_its_end_and_at_least_50_ms() {
    let ms = Duration::from_millis;
    // 1 s given: spent from 900 ms on.
    assert!(!deadline_spent(ms(1000), ms(899)));
    assert!(deadline_spent(ms(1000), ms(900)));
    assert!(deadline_spent(ms(1000), ms(5000)));
    // 100 ms given: the 50 ms floor.
    assert!(!deadline_spent(ms(100), ms(49)));
    assert!(deadline_spent(ms(100), ms(50)));
    // Degenerate: nothing given is spent at once; huge values do not overflow.
    assert!(deadline_spent(Duration::ZERO, Duration::ZERO));
    assert!(!deadline_spent(Duration::MAX, Duration::ZERO));
    assert!(deadline_spent(Duration::MAX, Duration::MAX));
}

#[test]
fn grpc_unavailable_retries_safe_requests_and_honours_pushback() {
    let facts = GET.grpc();
    let c = grpc(&[("grpc-status", "14")], &facts);
    assert_eq!(c.safety, RetrySafety::Maybe);
    assert!(c.is_retryable(&facts));
    assert!(!c.is_retryable(&POST.grpc()));
    assert_eq!(c.delay, DelayHint::Backoff);
    assert_eq!(c.fault, Some(FaultSide::Server));

    let c = grpc(
        &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")],
        &facts,
    );
    assert_eq!(c.delay, DelayHint::Exactly(ms(250)));
    assert!(c.is_retryable(&facts));

    // Negative or garbage pushback: do not retry.
    for value in ["-1", "-250", "soon", ""] {
        let c = grpc(
            &[("grpc-status", "14"), ("grpc-retry-pushback-ms", value)],
            &facts,
        );
        assert_eq!(c.safety, RetrySafety::No, "{value:?}");
    }
}

#[test]
fn grpc_resource_exhausted_only_with_pushback() {
    let facts = GET.grpc();
    let c = grpc(&[("grpc-status", "8")], &facts);
    assert_eq!(c.safety, RetrySafety::No);
    assert!(c.throttle);

    let c = grpc(
        &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "40")],
        &facts,
    );
    assert_eq!(c.safety, RetrySafety::Maybe);
    assert!(c.throttle);
    assert_eq!(c.delay, DelayHint::Exactly(ms(40)));
    assert!(c.is_retryable(&facts));

    let c = grpc(
        &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")],
        &facts,
    );
    assert_eq!(c.safety, RetrySafety::No);
}

#[test]
fn grpc_statuses_in_the_head() {
    let facts = GET.grpc();
    assert!(grpc(&[("grpc-status", "0")], &facts).is_success());
    // Headers first, no status yet: a success as far as the head goes.
    assert!(grpc(&[], &facts).is_success());
    for code in ["1", "3", "5", "6", "7", "9", "10", "11", "12", "16"] {
        let c = grpc(&[("grpc-status", code)], &facts);
        assert_eq!(c.safety, RetrySafety::No, "{code}");
        assert_eq!(c.fault, Some(FaultSide::Client), "{code}");
    }
    for code in ["2", "13", "15", "99", "garbage", "12345"] {
        let c = grpc(&[("grpc-status", code)], &facts);
        assert_eq!(c.safety, RetrySafety::No, "{code}");
        assert_eq!(c.fault, Some(FaultSide::Server), "{code}");
    }
    // A gRPC status on a non-gRPC request is ignored.
    assert!(classify(200, &[("grpc-status", "14")], &GET).is_success());
}

#[test]
fn grpc_status_in_trailers_is_past_the_commit_point() {
    let c = DefaultClassifier::default();
    let facts = GET.grpc();
    let t = c.classify_trailers(&headers(&[("grpc-status", "14")]), &facts);
    assert_eq!(t.safety, RetrySafety::No);
    assert_eq!(t.fault, Some(FaultSide::Server));
    assert_eq!(t.breaker_outcome(), BreakerOutcome::Failure);

    let t = c.classify_trailers(&headers(&[("grpc-status", "0")]), &facts);
    assert!(t.is_success());
    // A gRPC stream that ends without a status is a protocol error, not a success.
    let t = c.classify_trailers(&HeaderMap::new(), &facts);
    assert_eq!(t.breaker_outcome(), BreakerOutcome::Failure);
    assert_eq!(t.safety, RetrySafety::No);
    // Trailers without a status on a non-gRPC request say nothing.
    assert!(c.classify_trailers(&HeaderMap::new(), &GET).is_success());

    let t = c.classify_trailers(
        &headers(&[("grpc-status", "14"), ("do-not-retry", "1")]),
        &facts,
    );
    assert_eq!(t.fault, Some(FaultSide::Dependency));
    assert!(t.marked);
    assert_eq!(t.breaker_outcome(), BreakerOutcome::Neutral);
}

#[test]
fn request_facts_from_method_and_headers() {
    let c = Convention::default();
    let get = RequestFacts::of(&Method::GET, &HeaderMap::new(), &c);
    assert!(get.safe && !get.has_key && !get.grpc && !get.deadline_sent);
    for m in [Method::PUT, Method::DELETE, Method::HEAD, Method::OPTIONS] {
        assert!(RequestFacts::of(&m, &HeaderMap::new(), &c).safe, "{m}");
    }
    let post = RequestFacts::of(&Method::POST, &HeaderMap::new(), &c);
    assert!(!post.safe);
    let patch = RequestFacts::of(&Method::PATCH, &HeaderMap::new(), &c);
    assert!(!patch.safe);
    let keyed = RequestFacts::of(&Method::POST, &headers(&[("idempotency-key", "k")]), &c);
    assert!(keyed.safe && keyed.has_key);
    let g = RequestFacts::of(
        &Method::POST,
        &headers(&[
            ("content-type", "application/grpc+proto"),
            ("grpc-timeout", "1S"),
        ]),
        &c,
    );
    assert!(g.grpc && g.deadline_sent && !g.safe);
    let d = RequestFacts::of(&Method::GET, &headers(&[("request-timeout-ms", "5")]), &c);
    assert!(d.deadline_sent);
}
