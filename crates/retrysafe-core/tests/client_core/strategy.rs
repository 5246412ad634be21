//! The standard retry strategy: attempts, time left, delay hints, budgets and default
//! timeouts.

use std::time::Duration;

use retrysafe_core::backoff::{Backoff, Jitter, RngSource};
use retrysafe_core::budget::{BudgetSnapshot, RatioConfig, RetryBudget, RetryCost};
use retrysafe_core::classify::{Classification, Failure};
use retrysafe_core::strategy::{GiveUp, RetryStrategy, StandardRetryStrategy};

use super::{GET, MS, POST, classify, failure, grpc, ms};

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
