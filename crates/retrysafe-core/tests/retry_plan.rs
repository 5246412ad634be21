//! Tests of the sans-IO retry planner (`retrysafe_core::retry`) that the tower
//! `RetryLayer` and the reqwest `RetryMiddleware` both drive: what `begin` reads and adds
//! (facts, keys, retry point, deadline, the first token), the per-attempt headers, the
//! time bounds, and every branch of `decide` and `give_up` — on tokio's paused clock with
//! a seeded jitter, so every delay and header is exact.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use retrysafe_core::__private::Striped;
use retrysafe_core::backoff::{Backoff, RngSource};
use retrysafe_core::budget::{RatioConfig, RetryBudget, RetryCost};
use retrysafe_core::classify::{Failure, FaultSide};
use retrysafe_core::idempotency::{IdempotencyContext, Principal, Scope, Token};
use retrysafe_core::retry::{
    Attempt, GiveUpEvent, RetryCall, RetryEvent, RetryPolicy, Verdict, child_key_label,
};
use retrysafe_core::strategy::{
    GiveUp, Idempotent, NoRetry, RetryCharged, RetryStrategy, RetryToken, StandardRetryStrategy,
};
use retrysafe_core::wire::{Convention, IdempotencyKey};
use retrysafe_core::{CallContext, Deadline};
use tokio::time::Instant;

const SEED: u64 = 11;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn policy() -> RetryPolicy {
    RetryPolicy::new().with_strategy(StandardRetryStrategy::new().seed(SEED))
}

fn head(method: Method, uri: &str, headers: &[(&'static str, &str)]) -> http::request::Parts {
    let mut b = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(()).unwrap().into_parts().0
}

fn get() -> http::request::Parts {
    head(Method::GET, "http://api.local/items", &[])
}

fn post() -> http::request::Parts {
    head(Method::POST, "http://api.local/orders", &[])
}

fn with<T: Clone + Send + Sync + 'static>(
    mut parts: http::request::Parts,
    ext: T,
) -> http::request::Parts {
    parts.extensions.insert(ext);
    parts
}

fn begin(policy: RetryPolicy, parts: &mut http::request::Parts) -> (RetryCall, RetryToken) {
    RetryPolicy::begin(&Striped::new(policy), parts)
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.append(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

/// The per-attempt headers of `token`'s attempt, on a copy of `parts`.
fn attempt(
    call: &RetryCall,
    parts: &http::request::Parts,
    token: &RetryToken,
) -> http::request::Parts {
    let mut copy = parts.clone();
    call.prepare_attempt(&mut copy.headers, &mut copy.extensions, token);
    copy
}

fn header<'a>(parts: &'a http::request::Parts, name: &str) -> Option<&'a str> {
    parts.headers.get(name).map(|v| v.to_str().unwrap())
}

/// Decides a response with `status` and `pairs`, replayable, with no earlier response.
fn respond(
    call: &mut RetryCall,
    token: RetryToken,
    status: u16,
    pairs: &[(&'static str, &str)],
) -> Verdict {
    let h = headers(pairs);
    call.decide(
        Attempt::response(StatusCode::from_u16(status).unwrap(), &h),
        token,
        true,
        None,
    )
}

fn retry(decision: Verdict) -> RetryToken {
    match decision {
        Verdict::Retry(next) => next,
        other => panic!("expected a retry, got {other:?}"),
    }
}

type Events<E> = Arc<Mutex<Vec<E>>>;

fn hooked(policy: RetryPolicy) -> (RetryPolicy, Events<RetryEvent>, Events<GiveUpEvent>) {
    let retries: Events<RetryEvent> = Arc::default();
    let give_ups: Events<GiveUpEvent> = Arc::default();
    let (r, g) = (retries.clone(), give_ups.clone());
    let policy = policy
        .with_on_retry(move |e| r.lock().unwrap().push(e.clone()))
        .with_on_give_up(move |e| g.lock().unwrap().push(e.clone()));
    (policy, retries, give_ups)
}

fn empty_budget() -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(0.0);
    RetryBudget::ratio_with(config)
}

// ---------------------------------------------------------------------------------------
// begin: facts, keys, retry point
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn begin_reads_the_safe_request_rule_from_method_key_and_declarations() {
    let (call, _) = begin(policy(), &mut get());
    assert!(call.facts().safe && !call.facts().has_key && !call.facts().grpc);

    let (call, _) = begin(policy(), &mut post());
    assert!(!call.facts().safe);

    let mut keyed = head(
        Method::POST,
        "http://api.local/orders",
        &[("idempotency-key", "k-1")],
    );
    let (call, _) = begin(policy(), &mut keyed);
    assert!(call.facts().safe && call.facts().has_key);

    let (call, _) = begin(policy(), &mut with(post(), Idempotent));
    assert!(call.facts().safe && !call.facts().has_key);

    let read_only = policy().with_idempotent_if(|p| p.uri.path().starts_with("/read/"));
    let (call, _) = begin(
        read_only.clone(),
        &mut head(Method::POST, "http://api.local/read/x", &[]),
    );
    assert!(call.facts().safe);
    let (call, _) = begin(read_only, &mut post());
    assert!(!call.facts().safe);

    let mut grpc = head(
        Method::POST,
        "http://svc.local/pkg.Svc/Get",
        &[("content-type", "application/grpc+proto")],
    );
    let (call, _) = begin(policy(), &mut grpc);
    assert!(call.is_grpc() && !call.facts().safe);
}

#[tokio::test(start_paused = true)]
async fn generated_keys_go_on_post_and_patch_only_and_never_replace_the_callers() {
    let keys = policy().with_generated_keys();
    let mut p = post();
    let (call, _) = begin(keys.clone(), &mut p);
    let key = header(&p, "idempotency-key").unwrap().to_owned();
    assert_eq!(key.len(), 32);
    assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
    assert!(call.facts().safe && call.facts().has_key);

    // Another call, another random key.
    let mut again = post();
    let _ = begin(keys.clone(), &mut again);
    assert_ne!(header(&again, "idempotency-key").unwrap(), key);

    let mut patch = head(Method::PATCH, "http://api.local/orders/1", &[]);
    let _ = begin(keys.clone(), &mut patch);
    assert!(header(&patch, "idempotency-key").is_some());

    for mut parts in [get(), with(post(), NoRetry)] {
        let _ = begin(keys.clone(), &mut parts);
        assert_eq!(header(&parts, "idempotency-key"), None);
    }
    let mut own = head(
        Method::POST,
        "http://api.local/orders",
        &[("idempotency-key", "mine")],
    );
    let _ = begin(keys, &mut own);
    assert_eq!(header(&own, "idempotency-key"), Some("mine"));

    // Without the option, none.
    let mut p = post();
    let _ = begin(policy(), &mut p);
    assert_eq!(header(&p, "idempotency-key"), None);
}

#[tokio::test(start_paused = true)]
async fn keys_inside_a_guarded_handler_are_the_child_keys_of_the_record() {
    let scope = Scope::from(&Principal::new("alice"));
    let inbound = IdempotencyKey::new("order-7").unwrap();
    let expected = IdempotencyContext::detached(scope, inbound.clone(), Token::random());
    let label = child_key_label(&Method::POST, "ledger.local:8080", "/entries");
    assert_eq!(label, "POST ledger.local:8080/entries");
    let first = expected.next_child_key(&label);
    let second = expected.next_child_key(&label);

    let record = IdempotencyContext::detached(scope, inbound, Token::random());
    let ctx = CallContext::new().with_idempotency(record);
    let keys = policy().with_generated_keys();
    // Through the task-local scope, then carried by hand as an extension.
    let mut a = head(Method::POST, "http://ledger.local:8080/entries", &[]);
    ctx.clone()
        .scope(async { begin(keys.clone(), &mut a) })
        .await;
    let mut b = with(
        head(Method::POST, "http://ledger.local:8080/entries", &[]),
        ctx,
    );
    let _ = begin(keys, &mut b);
    assert_eq!(header(&a, "idempotency-key"), Some(first.as_str()));
    assert_eq!(header(&b, "idempotency-key"), Some(second.as_str()));
}

#[tokio::test(start_paused = true)]
async fn the_retry_point_header_and_an_inherited_retry_point() {
    let mut p = get();
    let (mut call, token) = begin(policy().with_retry_point(), &mut p);
    assert_eq!(header(&p, "retry-point"), Some("caller"));
    // This call is the retry point: it does retry.
    retry(respond(&mut call, token, 503, &[]));

    // The caller is the retry point: the header is passed on, one attempt, unmarked.
    let (hooked_policy, retries, give_ups) = hooked(policy());
    let ctx = CallContext::new().with_caller_is_retry_point(true);
    let mut p = with(get(), ctx.clone());
    let (mut call, token) = begin(hooked_policy, &mut p);
    assert_eq!(header(&p, "retry-point"), Some("caller"));
    assert!(matches!(
        respond(&mut call, token, 503, &[]),
        Verdict::Final
    ));
    assert!(!ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty() && give_ups.lock().unwrap().is_empty());

    // No retry point: no header.
    let mut p = get();
    let _ = begin(policy(), &mut p);
    assert_eq!(header(&p, "retry-point"), None);
}

// ---------------------------------------------------------------------------------------
// Deadlines and per-attempt headers
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_deadline_is_the_soonest_of_extension_context_and_header() {
    let soon = |n| Deadline::after(ms(n));
    let ctx = |n| CallContext::new().with_deadline(soon(n));
    let cases: [(http::request::Parts, u64); 4] = [
        (with(get(), soon(300)), 300),
        (with(with(get(), soon(300)), ctx(200)), 200),
        (
            with(
                head(
                    Method::GET,
                    "http://api.local/items",
                    &[("request-timeout-ms", "100")],
                ),
                ctx(200),
            ),
            100,
        ),
        (
            head(
                Method::GET,
                "http://api.local/items",
                &[("request-timeout-ms", "900")],
            ),
            900,
        ),
    ];
    for (mut parts, expected) in cases {
        let (call, _) = begin(policy(), &mut parts);
        assert_eq!(call.deadline().unwrap().remaining(), ms(expected));
        assert!(call.facts().deadline_sent);
    }
    let (call, _) = begin(policy(), &mut get());
    assert_eq!(call.deadline(), None);
    assert!(!call.facts().deadline_sent);

    // grpc-timeout is read for gRPC requests.
    let mut grpc = head(
        Method::POST,
        "http://svc.local/pkg.Svc/Get",
        &[
            ("content-type", "application/grpc"),
            ("grpc-timeout", "250m"),
        ],
    );
    let (call, _) = begin(policy(), &mut grpc);
    assert_eq!(call.deadline().unwrap().remaining(), ms(250));
}

#[tokio::test(start_paused = true)]
async fn per_attempt_headers_number_attempts_and_shrink_the_time_left() {
    let budget = RetryBudget::ratio();
    let mut parts = with(with(get(), Deadline::after(ms(1000))), budget.clone());
    let (mut call, token) = begin(policy(), &mut parts);
    assert!(token.is_budgeted());
    let first = attempt(&call, &parts, &token);
    assert_eq!(header(&first, "retry-attempt"), None);
    assert_eq!(header(&first, "request-timeout-ms"), Some("1000"));
    // The first attempt is tagged too: the budget that counted it is named.
    assert_eq!(
        first
            .extensions
            .get::<RetryCharged>()
            .map(|c| (c.attempt, c.budget)),
        Some((1, budget.id()))
    );

    let next = retry(respond(&mut call, token, 503, &[]));
    assert!(next.delay() <= ms(50));
    // After the backoff and some more: 599.7 ms left, rounded down, never up.
    tokio::time::advance(ms(400) + Duration::from_micros(300)).await;
    let second = attempt(&call, &parts, &next);
    assert_eq!(header(&second, "retry-attempt"), Some("2"));
    assert_eq!(header(&second, "request-timeout-ms"), Some("599"));
    let charged = second.extensions.get::<RetryCharged>().unwrap();
    assert_eq!(charged.attempt, 2);
    assert_eq!(charged.budget, budget.id());
    // The template is untouched.
    assert_eq!(header(&parts, "retry-attempt"), None);

    // gRPC: grpc-previous-rpc-attempts and grpc-timeout instead.
    let mut grpc = with(
        with(
            head(
                Method::POST,
                "http://svc.local/pkg.Svc/Get",
                &[("content-type", "application/grpc")],
            ),
            Idempotent,
        ),
        Deadline::after(ms(2000)),
    );
    let (mut call, token) = begin(policy(), &mut grpc);
    let first = attempt(&call, &grpc, &token);
    assert_eq!(header(&first, "grpc-timeout"), Some("2000000u"));
    let h = headers(&[("content-type", "application/grpc"), ("grpc-status", "14")]);
    let next = retry(call.decide(Attempt::response(StatusCode::OK, &h), token, true, None));
    let second = attempt(&call, &grpc, &next);
    assert_eq!(header(&second, "grpc-previous-rpc-attempts"), Some("1"));
    assert_eq!(header(&second, "retry-attempt"), Some("2"));
    assert_eq!(header(&second, "request-timeout-ms"), None);
}

#[tokio::test(start_paused = true)]
async fn no_attempt_starts_with_less_than_a_millisecond_left() {
    let (call, _) = begin(policy(), &mut with(get(), Deadline::after(ms(1))));
    assert!(!call.too_late());
    tokio::time::advance(Duration::from_micros(1)).await;
    assert!(call.too_late());
    let (call, _) = begin(policy(), &mut get());
    assert!(!call.too_late());
}

#[tokio::test(start_paused = true)]
async fn attempt_and_overall_bounds_follow_the_deadline_or_the_default_timeouts() {
    let t0 = Instant::now();
    let (mut call, _) = begin(policy(), &mut get());
    assert_eq!(call.attempt_until(), Some(t0 + Duration::from_secs(10)));
    assert_eq!(call.overall_until(), Some(t0 + Duration::from_secs(30)));
    tokio::time::advance(Duration::from_secs(25)).await;
    // The overall timeout counts from the start and caps the attempt timeout.
    assert_eq!(call.attempt_until(), Some(t0 + Duration::from_secs(30)));

    let deadline = Deadline::after(Duration::from_secs(3));
    let (mut call, _) = begin(policy(), &mut with(get(), deadline));
    assert_eq!(call.attempt_until(), Some(deadline.instant()));
    assert_eq!(call.overall_until(), Some(deadline.instant()));

    let forever = RetryPolicy::new().with_strategy(StandardRetryStrategy::new().no_timeout());
    let (mut call, _) = begin(forever, &mut get());
    assert_eq!(call.attempt_until(), None);
    assert_eq!(call.overall_until(), None);
}

#[tokio::test(start_paused = true)]
async fn an_explicit_attempt_timeout_also_bounds_attempts_under_a_deadline() {
    let strategy = StandardRetryStrategy::new().attempt_timeout(Duration::from_secs(1));
    assert_eq!(
        strategy.attempt_timeout_under_deadline(),
        Some(Duration::from_secs(1))
    );
    let bounded = RetryPolicy::new().with_strategy(strategy);
    let t0 = Instant::now();
    let deadline = Deadline::after(Duration::from_secs(3));
    let (mut call, token) = begin(bounded, &mut with(get(), deadline));
    // Each attempt ends after 1 s, not at the deadline, so a black-holed attempt leaves
    // time for a retry; the time-left header says 1 s, not 3 s.
    assert_eq!(call.attempt_until(), Some(t0 + Duration::from_secs(1)));
    assert_eq!(call.overall_until(), Some(deadline.instant()));
    let (mut headers, mut extensions) = (HeaderMap::new(), http::Extensions::new());
    call.prepare_attempt(&mut headers, &mut extensions, &token);
    assert_eq!(headers["request-timeout-ms"], "1000");
    // Near the deadline the deadline is the sooner bound.
    tokio::time::advance(Duration::from_millis(2500)).await;
    assert_eq!(call.attempt_until(), Some(deadline.instant()));
    call.prepare_attempt(&mut headers, &mut extensions, &token);
    assert_eq!(headers["request-timeout-ms"], "500");

    // A request that can never be repeated (a POST without a key) is not cut short:
    // that would only turn a slow answer into an unknown outcome.
    let bounded = RetryPolicy::new()
        .with_strategy(StandardRetryStrategy::new().attempt_timeout(Duration::from_secs(1)));
    let (mut call, token) = begin(bounded, &mut with(post(), deadline));
    assert_eq!(call.attempt_until(), Some(deadline.instant()));
    call.prepare_attempt(&mut headers, &mut extensions, &token);
    assert_eq!(headers["request-timeout-ms"], "500");
    // Shorter than 1 ms would send "0", which means "already expired".
    assert!(
        StandardRetryStrategy::new()
            .attempt_timeout(Duration::from_micros(999))
            .build()
            .is_err()
    );

    // The default attempt timeout (10 s) applies only without a deadline.
    assert_eq!(
        StandardRetryStrategy::new().attempt_timeout_under_deadline(),
        None
    );
    let (mut call, token) = begin(policy(), &mut with(get(), deadline));
    assert_eq!(call.attempt_until(), Some(deadline.instant()));
    call.prepare_attempt(&mut headers, &mut extensions, &token);
    assert_eq!(headers["request-timeout-ms"], "500");
    assert_eq!(
        StandardRetryStrategy::new()
            .attempt_timeout(Duration::from_secs(1))
            .no_timeout()
            .attempt_timeout_under_deadline(),
        None
    );
}

// ---------------------------------------------------------------------------------------
// decide
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn retries_with_seeded_full_jitter_then_gives_up_and_marks() {
    let mut rng = RngSource::seeded(SEED).next_rng();
    let backoff = Backoff::default();
    let d1 = backoff.delay(0, Duration::ZERO, false, &mut rng);
    let d2 = backoff.delay(1, d1, false, &mut rng);

    let (policy, retries, give_ups) = hooked(policy());
    let ctx = CallContext::new();
    let (mut call, token) = begin(policy, &mut with(get(), ctx.clone()));
    let next = retry(respond(&mut call, token, 503, &[]));
    assert_eq!((next.attempt(), next.delay()), (2, d1));
    let next = retry(respond(&mut call, next, 502, &[]));
    assert_eq!((next.attempt(), next.delay()), (3, d2));
    let decision = respond(&mut call, next, 503, &[]);
    assert!(matches!(
        decision,
        Verdict::GiveUp(GiveUp::AttemptsExhausted)
    ));
    assert!(ctx.downstream_gave_up());

    let retries = retries.lock().unwrap();
    assert_eq!(retries.len(), 2);
    assert_eq!(retries[0].attempt, 2);
    assert_eq!(retries[0].delay, d1);
    assert_eq!(retries[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(retries[1].status, Some(StatusCode::BAD_GATEWAY));
    let give_ups = give_ups.lock().unwrap();
    assert_eq!(give_ups.len(), 1);
    assert_eq!(give_ups[0].attempts, 3);
    assert_eq!(give_ups[0].reason, GiveUp::AttemptsExhausted);
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));

    let mut response = HeaderMap::new();
    call.mark_given_up(&mut response);
    assert_eq!(response["do-not-retry"], "1");
}

#[tokio::test(start_paused = true)]
async fn a_success_is_recorded_and_ends_the_call() {
    let bucket = RetryBudget::token_bucket();
    let (mut call, token) = begin(policy(), &mut with(get(), bucket.clone()));
    let next = retry(respond(&mut call, token, 503, &[]));
    assert_eq!(bucket.available_retries(), 99); // 500 - 5 tokens, / 5
    assert!(matches!(
        respond(&mut call, next, 200, &[]),
        Verdict::Success
    ));
    // The retry that succeeded got its cost back.
    assert_eq!(bucket.available_retries(), 100);
}

#[tokio::test(start_paused = true)]
async fn final_answers_for_what_is_not_retryable() {
    let (policy, retries, give_ups) = hooked(policy());
    // A POST without a key, a 404, a body that cannot be sent again, NoRetry.
    let (mut call, token) = begin(policy.clone(), &mut post());
    assert!(matches!(
        respond(&mut call, token, 503, &[]),
        Verdict::Final
    ));
    let (mut call, token) = begin(policy.clone(), &mut get());
    assert!(matches!(
        respond(&mut call, token, 404, &[]),
        Verdict::Final
    ));
    let (mut call, token) = begin(policy.clone(), &mut get());
    let h = HeaderMap::new();
    let d = call.decide(
        Attempt::response(StatusCode::SERVICE_UNAVAILABLE, &h),
        token,
        false,
        None,
    );
    assert!(matches!(d, Verdict::Final));
    let (mut call, token) = begin(policy.clone(), &mut with(get(), NoRetry));
    assert!(matches!(
        respond(&mut call, token, 503, &[]),
        Verdict::Final
    ));
    // A POST whose connection closed before a response: maybe processed.
    let (mut call, token) = begin(policy, &mut post());
    let d = call.decide(Attempt::Failure(Failure::NoResponse), token, true, None);
    assert!(matches!(d, Verdict::Final));
    assert!(retries.lock().unwrap().is_empty() && give_ups.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_failed_connect_is_retried_even_for_a_post() {
    let (mut call, token) = begin(policy(), &mut post());
    let next = retry(call.decide(Attempt::Failure(Failure::ConnectFailed), token, true, None));
    assert_eq!(next.attempt(), 2);
    // A time-out of a safe request is retried too, charged as a timeout.
    let (mut call, token) = begin(policy(), &mut get());
    let next = retry(call.decide(Attempt::TimedOut, token, true, None));
    assert_eq!(next.charged(), Some(RetryCost::Timeout));
}

#[tokio::test(start_paused = true)]
async fn a_marked_reply_is_final_and_recorded_in_the_context() {
    for pair in [("do-not-retry", "1"), ("idempotent-replayed", "true")] {
        let ctx = CallContext::new();
        let (mut call, token) = begin(policy(), &mut with(get(), ctx.clone()));
        assert!(matches!(
            respond(&mut call, token, 503, &[pair]),
            Verdict::Final
        ));
        assert!(ctx.downstream_gave_up());
    }
}

#[tokio::test(start_paused = true)]
async fn a_local_refusal_after_a_real_response_gives_that_response_up() {
    let (policy, _, give_ups) = hooked(policy());
    let (mut call, token) = begin(policy.clone(), &mut get());
    let next = retry(respond(&mut call, token, 503, &[]));
    // A budget or breaker below refused the retry.
    let d = call.decide(
        Attempt::Failure(Failure::Local),
        next,
        true,
        Some(StatusCode::SERVICE_UNAVAILABLE),
    );
    assert!(matches!(d, Verdict::GiveUp(GiveUp::RefusedBelow)));
    let give_ups = give_ups.lock().unwrap();
    assert_eq!(give_ups[0].status, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(give_ups[0].attempts, 2);
    // Without an earlier response, the refusal is passed on as it is.
    let (mut call, token) = begin(policy, &mut get());
    let d = call.decide(Attempt::Failure(Failure::Local), token, true, None);
    assert!(matches!(d, Verdict::Final));
}

#[tokio::test(start_paused = true)]
async fn a_refused_budget_and_a_delay_past_the_deadline_give_up_at_once() {
    let (policy, retries, give_ups) = hooked(policy());
    let (mut call, token) = begin(policy.clone(), &mut with(get(), empty_budget()));
    assert!(matches!(
        respond(&mut call, token, 503, &[]),
        Verdict::GiveUp(GiveUp::BudgetExhausted)
    ));
    // retry-after: 5 under a 2 s deadline.
    let (mut call, token) = begin(policy, &mut with(get(), Deadline::after(ms(2000))));
    assert!(matches!(
        respond(&mut call, token, 503, &[("retry-after", "5")]),
        Verdict::GiveUp(GiveUp::NotEnoughTime)
    ));
    assert!(retries.lock().unwrap().is_empty());
    let reasons: Vec<_> = give_ups.lock().unwrap().iter().map(|e| e.reason).collect();
    assert_eq!(reasons, [GiveUp::BudgetExhausted, GiveUp::NotEnoughTime]);

    // retry-after is a minimum delay when it fits.
    let (mut call, token) = begin(self::policy(), &mut with(get(), Deadline::after(ms(5000))));
    let next = retry(respond(&mut call, token, 503, &[("retry-after", "1")]));
    assert!(next.delay() >= Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn giving_up_after_a_wait_records_the_context_and_calls_the_hook() {
    let (policy, _, give_ups) = hooked(policy());
    let ctx = CallContext::new();
    let (call, _) = begin(policy, &mut with(get(), ctx.clone()));
    call.give_up(GiveUp::NotEnoughTime, 2, None);
    assert!(ctx.downstream_gave_up());
    let give_ups = give_ups.lock().unwrap();
    assert_eq!(give_ups[0].attempts, 2);
    assert_eq!(give_ups[0].reason, GiveUp::NotEnoughTime);
    assert_eq!(give_ups[0].status, None);
}

#[tokio::test(start_paused = true)]
async fn a_custom_convention_renames_every_header() {
    let convention = Convention::default()
        .with_idempotency_key(HeaderName::from_static("x-key"))
        .with_retry_attempt(HeaderName::from_static("x-attempt"))
        .with_request_timeout_ms(HeaderName::from_static("x-timeout"))
        .with_retry_point(HeaderName::from_static("x-point"))
        .with_do_not_retry(HeaderName::from_static("x-stop"));
    let policy = policy()
        .with_convention(convention)
        .with_generated_keys()
        .with_retry_point();
    let mut parts = with(post(), Deadline::after(ms(500)));
    let (mut call, token) = begin(policy, &mut parts);
    assert!(header(&parts, "x-key").is_some());
    assert_eq!(header(&parts, "x-point"), Some("caller"));
    // The default classifier follows the convention: x-stop marks.
    assert!(matches!(
        respond(&mut call, token, 503, &[("x-stop", "1")]),
        Verdict::Final
    ));

    let (mut call, token) = begin(
        policy_with(Convention::default().with_retry_attempt(HeaderName::from_static("x-attempt"))),
        &mut with(get(), Deadline::after(ms(500))),
    );
    let next = retry(respond(&mut call, token, 503, &[]));
    let second = attempt(&call, &get(), &next);
    assert_eq!(header(&second, "x-attempt"), Some("2"));
    assert_eq!(header(&second, "retry-attempt"), None);
    let mut response = HeaderMap::new();
    call.mark_given_up(&mut response);
    assert_eq!(response["do-not-retry"], "1");
}

fn policy_with(convention: Convention) -> RetryPolicy {
    policy().with_convention(convention)
}

#[tokio::test(start_paused = true)]
async fn a_504_is_classified_with_the_deadline_facts() {
    let (policy, retries, _) = hooked(policy());
    let (mut call, token) = begin(policy, &mut get());
    let _ = retry(respond(&mut call, token, 504, &[]));
    let retries = retries.lock().unwrap();
    assert!(retries[0].classification.timeout);
    assert_eq!(retries[0].classification.fault, Some(FaultSide::Server));
}

/// What `prepare_attempt_with` says it sent is what a breaker parsing the header reads
/// back, for plain and gRPC requests, rounded and clamped alike.
#[tokio::test(start_paused = true)]
async fn the_timeout_sent_is_what_the_header_reads_back() {
    use retrysafe_core::__private::BreakerFacts;
    let convention = Convention::default();
    let lefts = [
        Duration::ZERO,
        Duration::from_micros(1_999),
        Duration::from_nanos(99_999_999),
        Duration::from_nanos(100_000_001),
        Duration::from_nanos(123_456_789_123),
        Duration::from_secs(30),
        Duration::from_secs(40 * 24 * 60 * 60),
        Duration::MAX,
    ];
    for grpc in [false, true] {
        for left in lefts {
            // POST: no attempt bound under the deadline shortens `left`.
            let mut parts = if grpc {
                head(
                    Method::POST,
                    "http://api/svc/M",
                    &[("content-type", "application/grpc")],
                )
            } else {
                post()
            };
            let (call, token) = begin(policy(), &mut parts);
            let mut sent = parts.clone();
            let given = call.prepare_attempt_with(
                &mut sent.headers,
                &mut sent.extensions,
                &token,
                Some(left),
            );
            assert!(given.is_some());
            assert_eq!(
                BreakerFacts::sent(grpc, given),
                BreakerFacts::of(&sent.headers, &convention),
                "grpc {grpc}, left {left:?}"
            );
        }
    }
    let mut parts = get();
    let (call, token) = begin(policy(), &mut parts);
    let mut sent = parts.clone();
    let given = call.prepare_attempt_with(&mut sent.headers, &mut sent.extensions, &token, None);
    assert_eq!(given, None);
    assert_eq!(
        BreakerFacts::sent(false, given),
        BreakerFacts::of(&sent.headers, &convention)
    );
}
