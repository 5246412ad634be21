//! Tests of the sans-IO client core: the classification table, `Failure::of`, backoff
//! and jitter (exact values, bounds over many seeded draws), the standard retry strategy
//! (attempts, time left, delay hints, budgets), and the inherited `CallContext`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::error::Error as StdError;
use std::fmt;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue, Method, StatusCode};
use retrysafe_core::backoff::{Backoff, Jitter, RetryRng, RngSource};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget, RetryCost};
use retrysafe_core::classify::{
    BreakerOutcome, Classification, Classifier, DefaultClassifier, DelayHint, Failure, FaultSide,
    RequestFacts, RetrySafety, deadline_spent,
};
use retrysafe_core::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, find};
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::strategy::{GiveUp, RetryStrategy, StandardRetryStrategy};
use retrysafe_core::wire::{Convention, IdempotencyKey};
use retrysafe_core::{CallContext, Deadline};

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.append(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

fn classify(status: u16, pairs: &[(&'static str, &str)], facts: &RequestFacts) -> Classification {
    DefaultClassifier::default().classify_response(
        StatusCode::from_u16(status).unwrap(),
        &headers(pairs),
        facts,
    )
}

fn grpc(pairs: &[(&'static str, &str)], facts: &RequestFacts) -> Classification {
    let mut all = vec![("content-type", "application/grpc")];
    all.extend_from_slice(pairs);
    classify(200, &all, facts)
}

fn failure(f: Failure, facts: &RequestFacts) -> Classification {
    DefaultClassifier::default().classify_failure(f, facts)
}

const GET: RequestFacts = RequestFacts::SAFE;
const POST: RequestFacts = RequestFacts::UNSAFE;

// ---------------------------------------------------------------------------------------
// Classification: every row of the classify module's table.
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// Failure::of
// ---------------------------------------------------------------------------------------

/// An error wrapping another, as transports nest them.
#[derive(Debug)]
struct Wrapped(Box<dyn StdError + Send + Sync + 'static>);

impl fmt::Display for Wrapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("wrapped")
    }
}

impl StdError for Wrapped {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.0)
    }
}

fn of(e: &(dyn StdError + 'static)) -> Failure {
    Failure::of(e, |_| None)
}

#[test]
fn failure_of_io_kinds() {
    use std::io::{Error, ErrorKind as K};
    for kind in [K::ConnectionRefused, K::AddrNotAvailable] {
        assert_eq!(of(&Error::from(kind)), Failure::ConnectFailed, "{kind:?}");
    }
    assert_eq!(of(&Error::from(K::NotFound)), Failure::Other);
    for kind in [
        K::ConnectionReset,
        K::ConnectionAborted,
        K::BrokenPipe,
        K::UnexpectedEof,
        K::NotConnected,
    ] {
        assert_eq!(of(&Error::from(kind)), Failure::NoResponse, "{kind:?}");
    }
    assert_eq!(of(&Error::from(K::TimedOut)), Failure::Timeout);
    assert_eq!(of(&Error::from(K::PermissionDenied)), Failure::Other);
    assert_eq!(of(&Error::other("boom")), Failure::Other);

    // A refused connection deep in a chain may be a dependency's, reported by a
    // service after it did its work: not "nothing sent" (the transport adapter's
    // recogniser vouches for its own connect errors).
    let nested = Wrapped(Box::new(Wrapped(Box::new(Error::from(
        K::ConnectionRefused,
    )))));
    assert_eq!(of(&nested), Failure::Other);
    let vouched = Failure::of(&nested, |e| {
        e.is::<Wrapped>().then_some(Failure::ConnectFailed)
    });
    assert_eq!(vouched, Failure::ConnectFailed);
    let nested = Wrapped(Box::new(Error::from(K::ConnectionReset)));
    assert_eq!(of(&nested), Failure::NoResponse);
}

#[test]
fn failure_of_our_errors_and_extra() {
    assert_eq!(of(&BudgetExhausted::new()), Failure::Local);
    assert_eq!(of(&CircuitOpen::new(ms(5))), Failure::Local);
    // A deadline given up by a layer of ours is not retried by another.
    assert_eq!(of(&DeadlineExceeded::new()), Failure::Local);
    assert_eq!(
        of(&Wrapped(Box::new(BudgetExhausted::new()))),
        Failure::Local
    );

    // The transport adapter's recogniser decides first.
    let refused = Failure::of(&std::io::Error::from(std::io::ErrorKind::TimedOut), |_| {
        Some(Failure::RefusedStream)
    });
    assert_eq!(refused, Failure::RefusedStream);

    // `find` looks through the chain.
    let boxed: Box<dyn StdError + Send + Sync> =
        Box::new(Wrapped(Box::new(CircuitOpen::new(ms(7)))));
    assert_eq!(find::<CircuitOpen>(&*boxed).unwrap().retry_in(), ms(7));
    assert!(find::<BudgetExhausted>(&*boxed).is_none());
    assert_eq!(BudgetExhausted::new().to_string(), "retry budget exhausted");
    assert_eq!(DeadlineExceeded::new().to_string(), "deadline exceeded");
    assert_eq!(
        CircuitOpen::new(ms(7)).to_string(),
        "circuit open (retry in 7 ms)"
    );
}

// ---------------------------------------------------------------------------------------
// Backoff
// ---------------------------------------------------------------------------------------

#[test]
fn no_jitter_is_exact_and_capped() {
    let b = Backoff::new(ms(50), Duration::from_secs(20), Jitter::None);
    let mut rng = RetryRng::seeded(1);
    let expected = [
        50, 100, 200, 400, 800, 1600, 3200, 6400, 12_800, 20_000, 20_000,
    ];
    for (n, want) in expected.iter().enumerate() {
        assert_eq!(
            b.delay(n as u32, Duration::ZERO, false, &mut rng),
            ms(*want),
            "n={n}"
        );
        assert_eq!(b.exponential(n as u32, false), ms(*want));
    }
    // Huge retry counts saturate at the cap.
    assert_eq!(
        b.delay(31, Duration::ZERO, false, &mut rng),
        Duration::from_secs(20)
    );
    assert_eq!(
        b.delay(u32::MAX, Duration::ZERO, false, &mut rng),
        Duration::from_secs(20)
    );

    // The throttle base: max(base, 1 s) by default, capped.
    assert_eq!(b.throttle_base(), Duration::from_secs(1));
    assert_eq!(
        b.delay(0, Duration::ZERO, true, &mut rng),
        Duration::from_secs(1)
    );
    assert_eq!(
        b.delay(2, Duration::ZERO, true, &mut rng),
        Duration::from_secs(4)
    );
    assert_eq!(
        b.delay(5, Duration::ZERO, true, &mut rng),
        Duration::from_secs(20)
    );
    let small_cap = Backoff::new(ms(10), ms(300), Jitter::None);
    assert_eq!(small_cap.throttle_base(), ms(300));
    let b = b.with_throttle_base(ms(250));
    assert_eq!(b.delay(1, Duration::ZERO, true, &mut rng), ms(500));
    assert!(
        b.with_throttle_base(Duration::from_secs(21))
            .build()
            .is_err()
    );
}

#[test]
fn the_defaults() {
    let b = Backoff::default();
    assert_eq!(b.base(), ms(50));
    assert_eq!(b.throttle_base(), Duration::from_secs(1));
    assert_eq!(b.cap(), Duration::from_secs(20));
    assert_eq!(b.jitter(), Jitter::Full);
}

#[test]
fn backoff_configuration_is_validated() {
    assert_eq!(
        Backoff::new(ms(1), Duration::ZERO, Jitter::Full)
            .build()
            .unwrap_err()
            .field(),
        "backoff cap"
    );
    assert_eq!(
        Backoff::new(ms(10), ms(5), Jitter::Full)
            .build()
            .unwrap_err()
            .field(),
        "backoff base"
    );
    assert!(
        Backoff::new(ms(1), Duration::from_secs(31 * 24 * 3600), Jitter::Full)
            .build()
            .is_err()
    );
    assert!(
        Backoff::new(Duration::ZERO, ms(5), Jitter::Full)
            .build()
            .is_ok()
    );
}

#[test]
fn full_jitter_stays_within_zero_and_the_exponential() {
    let b = Backoff::new(ms(50), Duration::from_secs(2), Jitter::Full);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        for n in 0..8 {
            let exp = b.exponential(n, false);
            let d = b.delay(n, Duration::ZERO, false, &mut rng);
            assert!(d <= exp, "seed {seed} n {n}: {d:?} > {exp:?}");
            assert!(d <= Duration::from_secs(2));
        }
    }
    // Not degenerate: over many draws the delays spread over the range.
    let mut rng = RetryRng::seeded(99);
    let draws: Vec<Duration> = (0..1000)
        .map(|_| b.delay(0, Duration::ZERO, false, &mut rng))
        .collect();
    assert!(draws.iter().any(|d| *d < ms(5)));
    assert!(draws.iter().any(|d| *d > ms(45)));
}

#[test]
fn equal_jitter_stays_within_half_and_the_exponential() {
    let b = Backoff::new(ms(50), Duration::from_secs(2), Jitter::Equal);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        for n in 0..8 {
            let exp = b.exponential(n, false);
            let d = b.delay(n, Duration::ZERO, false, &mut rng);
            assert!(
                d >= exp / 2 && d <= exp,
                "seed {seed} n {n}: {d:?} vs {exp:?}"
            );
        }
    }
}

#[test]
fn decorrelated_jitter_stays_between_base_and_three_times_the_previous_capped() {
    let base = ms(50);
    let cap = Duration::from_secs(2);
    let b = Backoff::new(base, cap, Jitter::Decorrelated);
    for seed in 0..50 {
        let mut rng = RetryRng::seeded(seed);
        let mut previous = Duration::ZERO;
        for n in 0..20 {
            let d = b.delay(n, previous, false, &mut rng);
            let upper = (previous.max(base) * 3).min(cap);
            assert!(
                d >= base && d <= upper,
                "seed {seed} n {n}: {d:?} not in [{base:?}, {upper:?}]"
            );
            previous = d;
        }
    }
    // The first draw is in [base, 3·base].
    let mut rng = RetryRng::seeded(3);
    let d = b.delay(0, Duration::ZERO, false, &mut rng);
    assert!(d >= base && d <= base * 3);
    // With a throttle, the throttle base is the floor.
    let d = b.delay(0, Duration::ZERO, true, &mut rng);
    assert!(d >= Duration::from_secs(1) && d <= cap);
}

#[test]
fn the_same_seed_gives_the_same_sequence() {
    for jitter in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated] {
        let b = Backoff::new(ms(50), Duration::from_secs(20), jitter);
        let run = |seed| {
            let mut rng = RetryRng::seeded(seed);
            let mut previous = Duration::ZERO;
            (0..10)
                .map(|n| {
                    previous = b.delay(n, previous, false, &mut rng);
                    previous
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42), "{jitter:?}");
        assert_ne!(run(42), run(43), "{jitter:?}");
    }
    // A seeded source hands out the same generators in the same order.
    let a = RngSource::seeded(5);
    let b = RngSource::seeded(5);
    for _ in 0..3 {
        let (mut x, mut y) = (a.next_rng(), b.next_rng());
        assert_eq!(
            x.between(Duration::ZERO, Duration::from_secs(1)),
            y.between(Duration::ZERO, Duration::from_secs(1))
        );
    }
    let mut r = RetryRng::seeded(1);
    assert_eq!(r.between(ms(5), ms(5)), ms(5));
    assert_eq!(r.between(ms(5), ms(1)), ms(5));
    let u = r.unit();
    assert!((0.0..1.0).contains(&u));
}

// ---------------------------------------------------------------------------------------
// Strategy
// ---------------------------------------------------------------------------------------

fn unavailable() -> Classification {
    classify(503, &[], &GET)
}

fn ratio(min_per_sec: u32, retry_ratio: f64) -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(min_per_sec);
    config = config.with_retry_ratio(retry_ratio);
    RetryBudget::ratio_with(config)
}

fn ratio_counts(budget: &RetryBudget) -> (u64, u64) {
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => (deposits, withdrawals),
        other => panic!("{other:?}"),
    }
}

fn tokens(budget: &RetryBudget) -> u32 {
    match budget.snapshot() {
        BudgetSnapshot::TokenBucket { tokens, .. } => tokens,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn three_attempts_by_default_with_seeded_full_jitter() {
    let s = StandardRetryStrategy::new().seed(11);
    let failure = unavailable();
    let t = s.acquire_initial_retry_token(None);
    assert_eq!(t.attempt(), 1);
    assert_eq!(t.delay(), Duration::ZERO);
    assert_eq!(t.charged(), None);

    // Replay the strategy's generator: the first request that retries gets the
    // source's first generator.
    let mut rng = RngSource::seeded(11).next_rng();
    let backoff = Backoff::default();
    let d1 = backoff.delay(0, Duration::ZERO, false, &mut rng);
    let d2 = backoff.delay(1, d1, false, &mut rng);

    let t = s.refresh_retry_token(t, &failure, &GET, None).unwrap();
    assert_eq!(t.attempt(), 2);
    assert_eq!(t.delay(), d1);
    assert!(t.delay() <= ms(50));
    assert_eq!(t.charged(), Some(RetryCost::Failure));
    let t = s.refresh_retry_token(t, &failure, &GET, None).unwrap();
    assert_eq!(t.attempt(), 3);
    assert_eq!(t.delay(), d2);
    assert!(t.delay() <= ms(100));
    assert_eq!(
        s.refresh_retry_token(t, &failure, &GET, None).unwrap_err(),
        GiveUp::AttemptsExhausted
    );
    assert!(GiveUp::AttemptsExhausted.after_retryable_failure());
    assert!(GiveUp::BudgetExhausted.after_retryable_failure());
    assert!(GiveUp::NotEnoughTime.after_retryable_failure());
    assert!(!GiveUp::NotRetryable.after_retryable_failure());
}

#[tokio::test(start_paused = true)]
async fn max_attempts_and_limits() {
    let s = StandardRetryStrategy::new().max_attempts(5).no_budget();
    let mut t = s.acquire_initial_retry_token(None);
    for n in 2..=5 {
        t = s
            .refresh_retry_token(t, &unavailable(), &GET, None)
            .unwrap();
        assert_eq!(t.attempt(), n);
    }
    assert_eq!(
        s.refresh_retry_token(t, &unavailable(), &GET, None)
            .unwrap_err(),
        GiveUp::AttemptsExhausted
    );

    // A token limited to one attempt (the caller is the retry point).
    let mut t = s.acquire_initial_retry_token(None);
    t.limit_attempts(1);
    assert_eq!(
        s.refresh_retry_token(t, &unavailable(), &GET, None)
            .unwrap_err(),
        GiveUp::AttemptsExhausted
    );
    // Never raised above the strategy's limit, and never below one.
    let mut t = StandardRetryStrategy::new()
        .no_budget()
        .acquire_initial_retry_token(None);
    t.limit_attempts(10);
    t.limit_attempts(0);
    assert_eq!(
        StandardRetryStrategy::new()
            .no_budget()
            .refresh_retry_token(t, &unavailable(), &GET, None)
            .unwrap_err(),
        GiveUp::AttemptsExhausted
    );

    assert_eq!(
        StandardRetryStrategy::new()
            .max_attempts(0)
            .build()
            .unwrap_err()
            .field(),
        "max attempts"
    );
    assert!(
        StandardRetryStrategy::new()
            .max_attempts(101)
            .build()
            .is_err()
    );
    assert!(StandardRetryStrategy::new().max_attempts(1).build().is_ok());
    assert!(
        StandardRetryStrategy::new()
            .attempt_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        StandardRetryStrategy::new()
            .overall_timeout(Duration::ZERO)
            .build()
            .is_err()
    );
    assert!(
        StandardRetryStrategy::new()
            .overall_timeout(Duration::from_secs(31 * 24 * 3600))
            .build()
            .is_err()
    );
}

#[test]
fn every_bad_strategy_and_backoff_setting_is_named() {
    let error = Backoff::new(ms(10), ms(5), Jitter::Full)
        .with_throttle_base(ms(6))
        .build()
        .unwrap_err();
    assert_eq!(
        error.fields().collect::<Vec<_>>(),
        ["backoff base", "throttle base"]
    );
    let error = StandardRetryStrategy::new()
        .max_attempts(0)
        .overall_timeout(Duration::ZERO)
        .backoff(Backoff::new(ms(1), Duration::ZERO, Jitter::Full))
        .build()
        .unwrap_err();
    assert_eq!(
        error.fields().collect::<Vec<_>>(),
        [
            "max attempts",
            "overall timeout",
            "backoff cap",
            "backoff base"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn not_retryable_outcomes_give_up_without_charging() {
    let budget = RetryBudget::token_bucket();
    let s = StandardRetryStrategy::new().budget(budget.clone());
    let t = s.acquire_initial_retry_token(None);
    let c = classify(503, &[], &POST);
    assert_eq!(
        s.refresh_retry_token(t, &c, &POST, None).unwrap_err(),
        GiveUp::NotRetryable
    );
    let t = s.acquire_initial_retry_token(None);
    assert_eq!(
        s.refresh_retry_token(t, &classify(404, &[], &GET), &GET, None)
            .unwrap_err(),
        GiveUp::NotRetryable
    );
    assert_eq!(tokens(&budget), 500);
}

#[tokio::test(start_paused = true)]
async fn not_enough_time_when_the_delay_is_at_least_the_time_left() {
    let budget = RetryBudget::token_bucket();
    let s = StandardRetryStrategy::new()
        .budget(budget.clone())
        .backoff(Backoff::new(ms(100), Duration::from_secs(20), Jitter::None));
    let t = s.acquire_initial_retry_token(None);
    assert_eq!(
        s.refresh_retry_token(t, &unavailable(), &GET, Some(ms(100)))
            .unwrap_err(),
        GiveUp::NotEnoughTime
    );
    // Nothing was charged for a retry that did not happen.
    assert_eq!(tokens(&budget), 500);
    // The delay and the least attempt time (1 ms) must fit.
    let t = s.acquire_initial_retry_token(None);
    assert_eq!(
        s.refresh_retry_token(t, &unavailable(), &GET, Some(ms(101)))
            .unwrap_err(),
        GiveUp::NotEnoughTime
    );
    let t = s.acquire_initial_retry_token(None);
    let t = s
        .refresh_retry_token(t, &unavailable(), &GET, Some(ms(102)))
        .unwrap();
    assert_eq!(t.delay(), ms(100));
    assert_eq!(tokens(&budget), 495);

    // retry-after longer than the time left: give up at once.
    let t = s.acquire_initial_retry_token(None);
    let c = classify(503, &[("retry-after", "5")], &GET);
    assert_eq!(
        s.refresh_retry_token(t, &c, &GET, Some(Duration::from_secs(4)))
            .unwrap_err(),
        GiveUp::NotEnoughTime
    );
    // No time left at all.
    let t = s.acquire_initial_retry_token(None);
    let pushback = grpc(
        &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "0")],
        &GET.grpc(),
    );
    assert_eq!(
        s.refresh_retry_token(t, &pushback, &GET.grpc(), Some(Duration::ZERO))
            .unwrap_err(),
        GiveUp::NotEnoughTime
    );
}

#[tokio::test(start_paused = true)]
async fn pushback_is_the_delay_and_retry_after_a_minimum() {
    let s = StandardRetryStrategy::new().seed(3).no_budget();
    let facts = GET.grpc();
    let pushback = grpc(
        &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "1234")],
        &facts,
    );
    let t = s.acquire_initial_retry_token(None);
    let t = s.refresh_retry_token(t, &pushback, &facts, None).unwrap();
    assert_eq!(t.delay(), ms(1234));
    // Exactly, even below the backoff of a later retry.
    let tiny = grpc(
        &[("grpc-status", "14"), ("grpc-retry-pushback-ms", "1")],
        &facts,
    );
    let t = s.refresh_retry_token(t, &tiny, &facts, None).unwrap();
    assert_eq!(t.delay(), MS);

    // retry-after 2 s over a throttle backoff of at most 1 s: 2 s.
    let c = classify(503, &[("retry-after", "2")], &GET);
    let t = s.acquire_initial_retry_token(None);
    let t = s.refresh_retry_token(t, &c, &GET, None).unwrap();
    assert_eq!(t.delay(), Duration::from_secs(2));

    // retry-after 0 under a backoff: the backoff wins.
    let exact = StandardRetryStrategy::new()
        .no_budget()
        .backoff(Backoff::new(ms(300), Duration::from_secs(20), Jitter::None));
    let c = classify(429, &[("retry-after", "0")], &GET);
    let t = exact.acquire_initial_retry_token(None);
    let t = exact.refresh_retry_token(t, &c, &GET, None).unwrap();
    // A throttle: the throttle base (1 s), not the base.
    assert_eq!(t.delay(), Duration::from_secs(1));
    let c = classify(409, &[("retry-after", "3")], &POST.with_key());
    let t = exact.acquire_initial_retry_token(None);
    let t = exact
        .refresh_retry_token(t, &c, &POST.with_key(), None)
        .unwrap();
    assert_eq!(t.delay(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn a_refused_withdrawal_gives_up_on_the_first_retry() {
    // No floor, no share: nothing is ever affordable.
    let budget = ratio(0, 0.0);
    let s = StandardRetryStrategy::new().budget(budget.clone());
    let t = s.acquire_initial_retry_token(None);
    assert_eq!(ratio_counts(&budget), (1, 0));
    assert_eq!(
        s.refresh_retry_token(t, &unavailable(), &GET, None)
            .unwrap_err(),
        GiveUp::BudgetExhausted
    );
    // A refused withdrawal takes nothing.
    assert_eq!(ratio_counts(&budget), (1, 0));

    // 20 % of 10 deposits: two retries, then refused.
    let budget = ratio(0, 0.2);
    let s = StandardRetryStrategy::new().budget(budget.clone());
    let tokens: Vec<_> = (0..10)
        .map(|_| s.acquire_initial_retry_token(None))
        .collect();
    assert_eq!(ratio_counts(&budget), (10, 0));
    let mut results = tokens.into_iter().map(|t| {
        s.refresh_retry_token(t, &unavailable(), &GET, None)
            .map(|t| t.attempt())
    });
    assert_eq!(results.next().unwrap(), Ok(2));
    assert_eq!(results.next().unwrap(), Ok(2));
    assert_eq!(results.next().unwrap(), Err(GiveUp::BudgetExhausted));
    drop(results);
    assert_eq!(ratio_counts(&budget), (10, 2));
}

#[tokio::test(start_paused = true)]
async fn one_deposit_per_acquire_and_a_request_override() {
    let budget = ratio(10, 0.2);
    let s = StandardRetryStrategy::new().budget(budget.clone());
    let mut t = s.acquire_initial_retry_token(None);
    assert_eq!(ratio_counts(&budget), (1, 0));
    // Retries withdraw, never deposit again.
    t = s
        .refresh_retry_token(t, &unavailable(), &GET, None)
        .unwrap();
    t = s
        .refresh_retry_token(t, &unavailable(), &GET, None)
        .unwrap();
    assert_eq!(t.attempt(), 3);
    assert_eq!(ratio_counts(&budget), (1, 2));
    s.record_success(&t);
    assert_eq!(ratio_counts(&budget), (1, 2));

    // A per-request budget replaces the strategy's for deposit and withdrawals.
    let other = RetryBudget::token_bucket();
    let t = s.acquire_initial_retry_token(Some(other.clone()));
    assert_eq!(ratio_counts(&budget), (1, 2));
    let t = s
        .refresh_retry_token(t, &unavailable(), &GET, None)
        .unwrap();
    assert_eq!(tokens(&other), 495);
    assert_eq!(ratio_counts(&budget), (1, 2));
    s.record_success(&t);
    assert_eq!(tokens(&other), 500);
}

#[tokio::test(start_paused = true)]
async fn token_bucket_levels_follow_retries_and_successes() {
    let budget = RetryBudget::token_bucket();
    let s = StandardRetryStrategy::new().budget(budget.clone());
    let t = s.acquire_initial_retry_token(None);
    // A token bucket ignores deposits.
    assert_eq!(tokens(&budget), 500);
    let t = s
        .refresh_retry_token(t, &unavailable(), &GET, None)
        .unwrap();
    assert_eq!(tokens(&budget), 495);
    let timeout = failure(Failure::Timeout, &GET);
    let t = s.refresh_retry_token(t, &timeout, &GET, None).unwrap();
    assert_eq!(t.charged(), Some(RetryCost::Timeout));
    assert_eq!(tokens(&budget), 485);
    // The retry that succeeded gets its own cost back.
    s.record_success(&t);
    assert_eq!(tokens(&budget), 495);
    // A success with no retry refunds 1, up to the capacity.
    let first = s.acquire_initial_retry_token(None);
    s.record_success(&first);
    assert_eq!(tokens(&budget), 496);
    for _ in 0..10 {
        s.record_success(&s.acquire_initial_retry_token(None));
    }
    assert_eq!(tokens(&budget), 500);
}

#[test]
fn default_timeouts() {
    let s = StandardRetryStrategy::new();
    assert_eq!(
        s.default_timeouts(),
        (Some(Duration::from_secs(10)), Some(Duration::from_secs(30)))
    );
    assert_eq!(
        StandardRetryStrategy::new().no_timeout().default_timeouts(),
        (None, None)
    );
    let s = StandardRetryStrategy::new()
        .attempt_timeout(ms(200))
        .overall_timeout(Duration::from_secs(1));
    assert_eq!(
        s.default_timeouts(),
        (Some(ms(200)), Some(Duration::from_secs(1)))
    );
    assert!(s.retry_budget().is_some());
    assert!(
        StandardRetryStrategy::new()
            .no_budget()
            .retry_budget()
            .is_none()
    );
}

// ---------------------------------------------------------------------------------------
// CallContext
// ---------------------------------------------------------------------------------------

fn idem(key: &str) -> IdempotencyContext {
    IdempotencyContext::detached(
        Scope::from(&Principal::new("alice")),
        IdempotencyKey::new(key).unwrap(),
        Token::random(),
    )
}

#[tokio::test(start_paused = true)]
async fn scope_makes_the_context_current_only_inside() {
    assert!(CallContext::current().is_none());
    let ctx = CallContext::new()
        .with_deadline(Deadline::after(ms(80)))
        .with_caller_is_retry_point(true)
        .with_idempotency(idem("k1"));
    let inside = ctx
        .clone()
        .scope(async {
            tokio::time::sleep(ms(30)).await;
            let c = CallContext::current().unwrap();
            (
                c.deadline().unwrap().remaining(),
                c.caller_is_retry_point(),
                c.idempotency().unwrap().key().as_str().to_owned(),
            )
        })
        .await;
    assert_eq!(inside, (ms(50), true, "k1".to_owned()));
    assert!(CallContext::current().is_none());

    // sync_scope, nested scopes: the innermost wins, the outer comes back.
    let outer = CallContext::new().with_caller_is_retry_point(true);
    let inner = CallContext::new();
    outer.clone().sync_scope(|| {
        assert!(CallContext::current().unwrap().caller_is_retry_point());
        inner.clone().sync_scope(|| {
            assert!(!CallContext::current().unwrap().caller_is_retry_point());
        });
        assert!(CallContext::current().unwrap().caller_is_retry_point());
    });
    assert!(CallContext::current().is_none());

    // Not inherited by spawned tasks (they carry it by hand, as an extension).
    let spawned = outer
        .scope(async {
            tokio::spawn(async { CallContext::current().is_some() })
                .await
                .unwrap()
        })
        .await;
    assert!(!spawned);
}

#[tokio::test(start_paused = true)]
async fn inherited_prefers_the_extension() {
    let mut ext = http::Extensions::new();
    assert!(CallContext::inherited(&ext).is_none());

    let task = CallContext::new().with_caller_is_retry_point(true);
    let carried = CallContext::new().with_deadline(Deadline::after(ms(5)));
    ext.insert(carried.clone());
    let (from_ext, from_task) = task.clone().sync_scope(|| {
        (
            CallContext::inherited(&ext).unwrap(),
            CallContext::inherited(&http::Extensions::new()).unwrap(),
        )
    });
    assert!(!from_ext.caller_is_retry_point());
    assert_eq!(from_ext.deadline().unwrap().remaining(), ms(5));
    assert!(from_task.caller_is_retry_point());
    assert!(from_task.deadline().is_none());
    // The inherited context is the same context: it shares the gave-up flag.
    from_ext.mark_downstream_gave_up();
    assert!(carried.downstream_gave_up());
    assert!(!task.downstream_gave_up());
}

#[tokio::test(start_paused = true)]
async fn with_deadline_only_tightens() {
    let ctx = CallContext::new().with_deadline(Deadline::after(ms(100)));
    let later = ctx.clone().with_deadline(Deadline::after(ms(500)));
    assert_eq!(later.deadline().unwrap().remaining(), ms(100));
    let sooner = ctx.clone().with_deadline(Deadline::after(ms(20)));
    assert_eq!(sooner.deadline().unwrap().remaining(), ms(20));
    assert_eq!(ctx.deadline().unwrap().remaining(), ms(100));
    assert!(CallContext::new().deadline().is_none());
    tokio::time::advance(ms(30)).await;
    assert!(sooner.deadline().unwrap().is_expired());
    assert_eq!(later.deadline().unwrap().remaining(), ms(70));
}

#[tokio::test(start_paused = true)]
async fn gave_up_is_shared_across_clones_and_derived_contexts() {
    let ctx = CallContext::new();
    assert!(!ctx.downstream_gave_up());
    let clone = ctx.clone();
    let derived = ctx
        .clone()
        .with_deadline(Deadline::after(ms(10)))
        .with_caller_is_retry_point(true)
        .with_idempotency(idem("k2"));
    derived.mark_downstream_gave_up();
    assert!(ctx.downstream_gave_up());
    assert!(clone.downstream_gave_up());
    // An independent context does not see it.
    assert!(!CallContext::new().downstream_gave_up());
    let dbg = format!("{derived:?}");
    assert!(dbg.contains("downstream_gave_up: true"), "{dbg}");

    // Marked from inside a scope, seen outside.
    let outer = CallContext::new();
    outer
        .clone()
        .scope(async { CallContext::current().unwrap().mark_downstream_gave_up() })
        .await;
    assert!(outer.downstream_gave_up());
}
