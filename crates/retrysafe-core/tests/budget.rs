//! Tests of the retry budgets, on tokio's paused clock: the ratio budget's floor, ratio
//! and sliding window, the token bucket's costs and refunds, concurrency and
//! configuration.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    missing_docs
)]

use std::time::Duration;

use retrysafe_core::budget::{
    BudgetSnapshot, RatioConfig, RetryBudget, RetryCost, TokenBucketConfig,
};
use tokio::time::advance;

/// Withdraws until refused; returns how many withdrawals succeeded (at most `limit`).
fn drain(budget: &RetryBudget, cost: RetryCost, limit: u64) -> u64 {
    let mut taken = 0;
    while taken < limit && budget.withdraw(cost) {
        taken += 1;
    }
    taken
}

fn ratio(ttl_secs: u64, min_per_sec: u32, retry_ratio: f64) -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_ttl(Duration::from_secs(ttl_secs));
    config = config.with_min_per_sec(min_per_sec);
    config = config.with_retry_ratio(retry_ratio);
    RetryBudget::ratio_with(config)
}

fn ratio_counts(budget: &RetryBudget) -> (u64, u64, u64) {
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            allowed,
        } => (deposits, withdrawals, allowed),
        other => panic!("not a ratio budget: {other:?}"),
    }
}

fn tokens(budget: &RetryBudget) -> u32 {
    match budget.snapshot() {
        BudgetSnapshot::TokenBucket { tokens, .. } => tokens,
        other => panic!("not a token bucket: {other:?}"),
    }
}

// ----- ratio budget -----

#[tokio::test(start_paused = true)]
async fn floor_alone_allows_100_retries_per_10_seconds() {
    let budget = RetryBudget::ratio();
    // 10 retries in each of the 10 seconds of the window, no deposits at all.
    for second in 0..10 {
        for _ in 0..10 {
            assert!(budget.withdraw(RetryCost::Failure), "second {second}");
        }
        advance(Duration::from_secs(1)).await;
    }
    // t = 10 s: the first second's 10 retries have left the window, the others have not.
    advance(Duration::from_millis(500)).await; // t = 10.5 s
    assert_eq!(ratio_counts(&budget), (0, 90, 100));
    assert_eq!(drain(&budget, RetryCost::Failure, 1000), 10);
    assert!(
        !budget.withdraw(RetryCost::Failure),
        "the 101st retry in the window"
    );
}

#[tokio::test(start_paused = true)]
async fn floor_is_a_reserve_that_returns_when_the_window_slides() {
    let budget = RetryBudget::ratio();
    assert_eq!(budget.available_retries(), 100);
    assert_eq!(drain(&budget, RetryCost::Failure, 100), 100);
    assert!(!budget.withdraw(RetryCost::Failure), "the 101st retry");
    assert_eq!(budget.available_retries(), 0);

    advance(Duration::from_secs(10) - Duration::from_nanos(1)).await;
    assert!(
        !budget.withdraw(RetryCost::Failure),
        "still inside the window"
    );

    advance(Duration::from_nanos(1)).await; // exactly 10 s
    assert_eq!(budget.available_retries(), 100);
    assert_eq!(drain(&budget, RetryCost::Failure, 1000), 100);
}

#[tokio::test(start_paused = true)]
async fn twenty_percent_of_deposits_on_top_of_the_floor() {
    let budget = RetryBudget::ratio();
    for _ in 0..10_000 {
        budget.deposit();
    }
    assert_eq!(ratio_counts(&budget), (10_000, 0, 100 + 2_000));
    assert_eq!(drain(&budget, RetryCost::Failure, 10_000), 2_100);
    assert!(!budget.withdraw(RetryCost::Failure));

    // Five more requests earn exactly one more retry.
    for _ in 0..4 {
        budget.deposit();
    }
    assert!(
        !budget.withdraw(RetryCost::Failure),
        "4 deposits are 0.8 retries"
    );
    budget.deposit();
    assert!(
        budget.withdraw(RetryCost::Failure),
        "5 deposits are one retry"
    );
    assert!(!budget.withdraw(RetryCost::Failure));
}

#[tokio::test(start_paused = true)]
async fn ratio_without_floor_and_costs_are_not_weights() {
    let budget = ratio(10, 0, 0.5);
    assert!(
        !budget.withdraw(RetryCost::Failure),
        "no floor, no deposits"
    );
    for _ in 0..10 {
        budget.deposit();
    }
    // Five retries, whatever their kind: a timeout costs one unit too.
    assert!(budget.withdraw(RetryCost::Timeout));
    assert_eq!(drain(&budget, RetryCost::Timeout, 100), 4);
    assert!(!budget.withdraw(RetryCost::Failure));
    // Successes do not refund anything.
    budget.record_success(Some(RetryCost::Timeout));
    budget.record_success(None);
    assert!(!budget.withdraw(RetryCost::Failure));
}

#[tokio::test(start_paused = true)]
async fn ratio_above_one_and_zero() {
    let budget = ratio(1, 0, 2.5);
    budget.deposit();
    budget.deposit();
    assert_eq!(drain(&budget, RetryCost::Failure, 100), 5);

    let none = ratio(1, 0, 0.0);
    for _ in 0..1000 {
        none.deposit();
    }
    assert!(
        !none.withdraw(RetryCost::Failure),
        "a zero ratio with no floor refuses all"
    );
}

#[tokio::test(start_paused = true)]
async fn deposits_expire_exactly_at_the_window_boundary() {
    let budget = ratio(10, 0, 1.0);
    // Window buckets are 1 s wide. A deposit made anywhere in [0 s, 1 s) counts until
    // exactly 10 s.
    budget.deposit(); // t = 0
    advance(Duration::from_millis(999)).await;
    budget.deposit(); // t = 0.999 s
    advance(Duration::from_millis(1)).await;
    budget.deposit(); // t = 1 s: the next bucket

    advance(Duration::from_secs(9) - Duration::from_nanos(1)).await; // 10 s - 1 ns
    assert_eq!(ratio_counts(&budget), (3, 0, 3));

    advance(Duration::from_nanos(1)).await; // exactly 10 s
    assert_eq!(
        ratio_counts(&budget),
        (1, 0, 1),
        "the first two have expired, together"
    );

    advance(Duration::from_secs(1)).await; // exactly 11 s
    assert_eq!(ratio_counts(&budget), (0, 0, 0));
    assert!(!budget.withdraw(RetryCost::Failure));
}

#[tokio::test(start_paused = true)]
async fn withdrawals_expire_with_their_window() {
    let budget = ratio(10, 0, 1.0);
    for _ in 0..3 {
        budget.deposit();
    }
    assert!(budget.withdraw(RetryCost::Failure)); // t = 0
    advance(Duration::from_secs(5)).await;
    for _ in 0..3 {
        budget.deposit();
    }
    // 6 deposits, 1 withdrawal in the window.
    assert_eq!(drain(&budget, RetryCost::Failure, 100), 5);
    advance(Duration::from_secs(5)).await; // t = 10 s: the first 3 deposits and the first
    // withdrawal are gone; 3 deposits and 5 withdrawals remain.
    assert_eq!(ratio_counts(&budget), (3, 5, 3));
    assert_eq!(budget.available_retries(), 0);
    assert!(!budget.withdraw(RetryCost::Failure));
    advance(Duration::from_secs(5)).await; // t = 15 s: everything is gone
    assert_eq!(ratio_counts(&budget), (0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn an_idle_budget_starts_over() {
    let budget = RetryBudget::ratio();
    for _ in 0..500 {
        budget.deposit();
    }
    assert_eq!(drain(&budget, RetryCost::Failure, 1000), 200);
    // Many windows later, every bucket is stale and is rotated by the next use.
    advance(Duration::from_secs(3 * 3600 + 7)).await;
    assert_eq!(ratio_counts(&budget), (0, 0, 100));
    budget.deposit();
    assert_eq!(ratio_counts(&budget), (1, 0, 100));
    assert_eq!(drain(&budget, RetryCost::Failure, 1000), 100);
}

#[tokio::test(start_paused = true)]
async fn refused_withdrawal_takes_nothing() {
    let budget = ratio(10, 1, 0.0); // a reserve of 10
    assert_eq!(drain(&budget, RetryCost::Failure, 10), 10);
    for _ in 0..50 {
        assert!(!budget.withdraw(RetryCost::Failure));
    }
    assert_eq!(
        ratio_counts(&budget),
        (0, 10, 10),
        "refusals are not counted"
    );

    let bucket = RetryBudget::token_bucket(); // 500 tokens
    assert_eq!(drain(&bucket, RetryCost::Timeout, 1000), 50);
    assert_eq!(tokens(&bucket), 0);
    bucket.record_success(Some(RetryCost::Failure)); // 5 tokens back
    assert!(
        !bucket.withdraw(RetryCost::Timeout),
        "10 tokens needed, 5 held"
    );
    assert_eq!(tokens(&bucket), 5, "the refused timeout retry took nothing");
    assert!(bucket.withdraw(RetryCost::Failure));
    assert_eq!(tokens(&bucket), 0);
}

// ----- token bucket -----

#[tokio::test(start_paused = true)]
async fn token_bucket_costs_timeouts_refunds_and_cap() {
    let bucket = RetryBudget::token_bucket();
    assert_eq!(
        bucket.snapshot(),
        BudgetSnapshot::TokenBucket {
            tokens: 500,
            capacity: 500
        }
    );
    assert_eq!(bucket.available_retries(), 100);

    // A full bucket stays at capacity.
    bucket.record_success(None);
    bucket.record_success(Some(RetryCost::Timeout));
    assert_eq!(tokens(&bucket), 500);

    assert!(bucket.withdraw(RetryCost::Failure));
    assert_eq!(tokens(&bucket), 495);
    assert!(bucket.withdraw(RetryCost::Timeout));
    assert_eq!(tokens(&bucket), 485);

    // A success that needed no retry refunds 1, a successful retry returns its cost.
    bucket.record_success(None);
    assert_eq!(tokens(&bucket), 486);
    bucket.record_success(Some(RetryCost::Timeout));
    assert_eq!(tokens(&bucket), 496);
    bucket.record_success(Some(RetryCost::Timeout)); // 506, capped
    assert_eq!(tokens(&bucket), 500);

    // Deposits and time play no part.
    for _ in 0..100 {
        bucket.deposit();
    }
    advance(Duration::from_secs(3600)).await;
    assert_eq!(tokens(&bucket), 500);

    // 500 tokens: 100 retries after failures, then nothing.
    assert_eq!(drain(&bucket, RetryCost::Failure, 1000), 100);
    assert_eq!(bucket.available_retries(), 0);
    // 1 token per success: five successes buy one more retry.
    for _ in 0..4 {
        bucket.record_success(None);
    }
    assert!(!bucket.withdraw(RetryCost::Failure));
    bucket.record_success(None);
    assert!(bucket.withdraw(RetryCost::Failure));
}

#[tokio::test(start_paused = true)]
async fn token_bucket_custom_costs() {
    let mut config = TokenBucketConfig::default();
    config = config.with_capacity(20);
    config = config.with_retry_cost(3);
    config = config.with_timeout_cost(20);
    config = config.with_success_refund(0);
    let bucket = RetryBudget::token_bucket_with(config);
    assert_eq!(bucket.available_retries(), 6);
    assert!(bucket.withdraw(RetryCost::Timeout));
    assert!(!bucket.withdraw(RetryCost::Failure));
    bucket.record_success(None); // refund 0
    assert_eq!(tokens(&bucket), 0);
    bucket.record_success(Some(RetryCost::Failure));
    assert_eq!(tokens(&bucket), 3);
    assert_eq!(bucket.token_bucket_config(), Some(&config));
    assert_eq!(bucket.ratio_config(), None);
}

// ----- concurrency and sharing -----

#[tokio::test(start_paused = true)]
async fn concurrent_deposits_from_threads_sum_exactly() {
    const THREADS: u64 = 6;
    const PER_THREAD: u64 = 50_000;
    let budget = ratio(10, 0, 0.001);
    let handle = tokio::runtime::Handle::current();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            let budget = budget.clone();
            let handle = handle.clone();
            s.spawn(move || {
                // The runtime's (paused) clock, as on the test's own thread.
                let _runtime = handle.enter();
                for _ in 0..PER_THREAD {
                    budget.deposit();
                }
            });
        }
    });
    let deposits = THREADS * PER_THREAD;
    assert_eq!(ratio_counts(&budget), (deposits, 0, deposits / 1000));
}

#[tokio::test(start_paused = true)]
async fn concurrent_withdrawals_never_overdraw() {
    let budget = ratio(10, 0, 1.0);
    for _ in 0..1000 {
        budget.deposit();
    }
    let handle = tokio::runtime::Handle::current();
    let taken: u64 = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let budget = budget.clone();
                let handle = handle.clone();
                s.spawn(move || {
                    let _runtime = handle.enter();
                    drain(&budget, RetryCost::Failure, u64::MAX)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    assert_eq!(taken, 1000);
    assert_eq!(ratio_counts(&budget), (1000, 1000, 1000));
}

/// Eight threads on (here) two cores, each withdrawing once per ten deposits against an
/// allowance of 20 % of them: the window always has room, so no withdrawal may be
/// refused. A thread descheduled between reading the deposits and its compare-and-swap
/// once held the other threads' later withdrawals against its own stale allowance and
/// refused (found by `benches/growth_shared.rs`, `ratio_retry10`).
#[tokio::test(start_paused = true)]
async fn concurrent_withdrawals_within_the_ratio_are_never_refused() {
    let budget = ratio(10, 0, 0.2);
    let handle = tokio::runtime::Handle::current();
    let refused: u64 = std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let budget = budget.clone();
                let handle = handle.clone();
                s.spawn(move || {
                    let _runtime = handle.enter();
                    let mut refused = 0;
                    for call in 1..=50_000_u32 {
                        budget.deposit();
                        if call % 10 == 0 && !budget.withdraw(RetryCost::Failure) {
                            refused += 1;
                        }
                    }
                    refused
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).sum()
    });
    assert_eq!(refused, 0);
    assert_eq!(ratio_counts(&budget), (400_000, 40_000, 80_000));
}

#[tokio::test(start_paused = true)]
async fn concurrent_token_bucket_conserves_tokens() {
    let mut config = TokenBucketConfig::default();
    config = config.with_capacity(100_000);
    let bucket = RetryBudget::token_bucket_with(config);
    // Phase 1: four threads drain the bucket together; it empties exactly.
    let on_threads = |work: fn(&RetryBudget) -> u64| -> u64 {
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let bucket = bucket.clone();
                    s.spawn(move || work(&bucket))
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).sum()
        })
    };
    assert_eq!(
        on_threads(|b| drain(b, RetryCost::Failure, u64::MAX)),
        20_000
    );
    assert_eq!(tokens(&bucket), 0);
    // Phase 2: refunds (never reaching the capacity) race withdrawals; every token
    // refunded is either still there or was taken by exactly one withdrawal.
    let taken = on_threads(|b| {
        let mut taken = 0;
        for _ in 0..1000 {
            for _ in 0..5 {
                b.record_success(None);
            }
            taken += u64::from(b.withdraw(RetryCost::Failure));
        }
        taken
    });
    assert_eq!(u64::from(tokens(&bucket)) + 5 * taken, 4 * 5 * 1000);
}

#[tokio::test(start_paused = true)]
async fn clones_share_state() {
    let budget = RetryBudget::ratio();
    let clone = budget.clone();
    assert!(budget.same_budget(&clone));
    assert!(!budget.same_budget(&RetryBudget::ratio()));
    for _ in 0..50 {
        clone.deposit();
    }
    assert_eq!(ratio_counts(&budget), (50, 0, 110));
    assert!(budget.withdraw(RetryCost::Failure));
    assert_eq!(clone.available_retries(), 109);

    let bucket = RetryBudget::token_bucket();
    let other = bucket.clone();
    assert!(other.withdraw(RetryCost::Timeout));
    assert_eq!(tokens(&bucket), 490);
    bucket.record_success(Some(RetryCost::Timeout));
    assert_eq!(tokens(&other), 500);
}

// ----- configuration -----

#[tokio::test(start_paused = true)]
async fn ratio_config_validation() {
    let err = |edit: fn(RatioConfig) -> RatioConfig| {
        let e = edit(RatioConfig::default()).build().unwrap_err();
        (e.field(), e.reason())
    };
    assert_eq!(
        err(|c| c.with_ttl(Duration::ZERO)),
        ("ttl", "must be greater than zero")
    );
    assert_eq!(
        err(|c| c.with_ttl(Duration::from_millis(999))),
        ("ttl", "must be at least 1 s")
    );
    assert_eq!(
        err(|c| c.with_ttl(Duration::from_secs(30 * 86_400) + Duration::from_nanos(1))),
        ("ttl", "must be at most 30 days")
    );
    for bad in [f64::NAN, -0.1, 1000.001, f64::INFINITY, f64::NEG_INFINITY] {
        let mut config = RatioConfig::default();
        config = config.with_retry_ratio(bad);
        let e = config.build().unwrap_err();
        assert_eq!(e.field(), "retry_ratio", "{bad}");
        assert_eq!(
            e.to_string(),
            "invalid retry_ratio: must be a number from 0 to 1000"
        );
    }

    // The bounds themselves are valid.
    let mut config = RatioConfig::default();
    config = config.with_ttl(Duration::from_secs(1));
    config = config.with_retry_ratio(0.0);
    config = config.with_min_per_sec(u32::MAX);
    let budget = RetryBudget::ratio_with(config);
    assert_eq!(budget.available_retries(), u64::from(u32::MAX));
    assert_eq!(budget.ratio_config(), Some(&config));
    assert_eq!(budget.token_bucket_config(), None);
    config = config.with_ttl(Duration::from_secs(30 * 86_400));
    config = config.with_retry_ratio(1000.0);
    assert!(config.build().is_ok());
    assert_eq!(
        RetryBudget::default().ratio_config(),
        Some(&RatioConfig::default())
    );
}

#[tokio::test(start_paused = true)]
async fn token_bucket_config_validation() {
    let err = |edit: fn(TokenBucketConfig) -> TokenBucketConfig| {
        let e = edit(TokenBucketConfig::default()).build().unwrap_err();
        (e.field(), e.reason())
    };
    assert_eq!(
        err(|c| c.with_capacity(0)),
        ("capacity", "must be greater than zero")
    );
    assert_eq!(
        err(|c| c.with_retry_cost(0)),
        ("retry_cost", "must be greater than zero")
    );
    assert_eq!(
        err(|c| c.with_timeout_cost(0)),
        ("timeout_cost", "must be greater than zero")
    );
    assert_eq!(
        err(|c| c.with_retry_cost(501)),
        ("retry_cost", "must not exceed the capacity")
    );
    assert_eq!(
        err(|c| c.with_timeout_cost(501)),
        ("timeout_cost", "must not exceed the capacity")
    );
    assert_eq!(
        err(|c| c.with_success_refund(501)),
        ("success_refund", "must not exceed the capacity")
    );

    // Costs and refund equal to the capacity are valid; a refund of 0 too.
    let mut config = TokenBucketConfig::default();
    config = config.with_capacity(1);
    config = config.with_retry_cost(1);
    config = config.with_timeout_cost(1);
    config = config.with_success_refund(0);
    let bucket = RetryBudget::token_bucket_with(config);
    assert!(bucket.withdraw(RetryCost::Timeout));
    assert!(!bucket.withdraw(RetryCost::Failure));
    assert_eq!(
        RetryBudget::token_bucket().token_bucket_config(),
        Some(&TokenBucketConfig::default())
    );
}

#[test]
fn every_bad_budget_setting_is_named() {
    let ratio = RatioConfig::default()
        .with_ttl(Duration::ZERO)
        .with_retry_ratio(-1.0);
    assert_eq!(
        ratio.build().unwrap_err().fields().collect::<Vec<_>>(),
        ["ttl", "retry_ratio"]
    );
    let bucket = TokenBucketConfig::default()
        .with_retry_cost(0)
        .with_timeout_cost(501)
        .with_success_refund(501);
    assert_eq!(
        bucket.build().unwrap_err().fields().collect::<Vec<_>>(),
        ["retry_cost", "timeout_cost", "success_refund"]
    );
}

#[tokio::test(start_paused = true)]
async fn unvalidated_budget_settings_are_clamped() {
    // Never built: a zero window and costs out of range are used as the nearest valid
    // values, and nothing panics.
    let ratio = RetryBudget::ratio_with(
        RatioConfig::default()
            .with_ttl(Duration::ZERO)
            .with_retry_ratio(f64::NAN),
    );
    ratio.deposit();
    assert_eq!(ratio.ratio_config().unwrap().ttl(), Duration::from_secs(1));
    let bucket = RetryBudget::token_bucket_with(
        TokenBucketConfig::default()
            .with_capacity(0)
            .with_retry_cost(0),
    );
    assert!(bucket.withdraw(RetryCost::Failure));
    assert!(!bucket.withdraw(RetryCost::Failure));
}

#[tokio::test(start_paused = true)]
async fn debug_shows_the_state() {
    let budget = RetryBudget::ratio();
    budget.deposit();
    assert!(budget.withdraw(RetryCost::Failure));
    let text = format!("{budget:?}");
    assert!(
        text.contains("Ratio") && text.contains("deposits: 1, withdrawals: 1"),
        "{text}"
    );
    let bucket = RetryBudget::token_bucket();
    assert!(bucket.withdraw(RetryCost::Failure));
    let text = format!("{bucket:?}");
    assert!(
        text.contains("TokenBucket") && text.contains("tokens: 495"),
        "{text}"
    );
}
