//! Loom models of the retry budgets (run by `scripts/loom`; empty unless `--cfg loom`).
//!
//! Every model explores every interleaving of its threads (and every value a relaxed or
//! acquire load may read) within loom's bounds, and asserts the budget's invariants:
//!
//! - ratio budget: withdrawals never exceed the allowance (`ratio × deposits + floor`),
//!   a withdrawal the allowance covers at every point of the call is never refused (the
//!   race fixed in 5a33da6: an allowance read before a lost CAS held against the other
//!   threads' later withdrawals), and a rotation of a bucket into a new lap neither
//!   loses a deposit made in the new lap nor lets an old-lap write overwrite it;
//! - token bucket: concurrent withdrawals and refunds never take the level below 0 or
//!   above the capacity, and no refund or withdrawal is lost.
//!
//! Each model prints how many executions loom explored and how long it took.
#![cfg(loom)]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::disallowed_methods,
    reason = "test code; std::time::Instant only times the model run, and panics are the \
              models' assertions"
)]

mod loom_support;
use loom_support::check;

use std::time::Duration;

use loom::thread;
use retrysafe_core::budget::{
    BudgetSnapshot, RatioConfig, RetryBudget, RetryCost, TokenBucketConfig,
};
use retrysafe_core::loom_clock;

/// A ratio budget of `ratio` with no floor, over the shortest window (1 s in 10 buckets).
fn ratio(ratio: f64) -> RetryBudget {
    let mut config = RatioConfig::default();
    config = config.with_ttl(Duration::from_secs(1));
    config = config.with_min_per_sec(0);
    config = config.with_retry_ratio(ratio);
    RetryBudget::ratio_with(config)
}

/// (deposits, withdrawals, allowed) of a ratio budget's current window.
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

/// Two threads each make two requests and then one retry: 50 % of the deposits. At the
/// start of each withdrawal its own two deposits are in, and at every point the
/// withdrawals made or under way are at most half the deposits made, so no withdrawal
/// may be refused. The pre-5a33da6 `withdraw` (allowance read once, before the CAS loop)
/// refuses one: T1 reads an allowance of 1 (its own deposits), T2 deposits and withdraws,
/// T1's CAS fails and it compares T2's withdrawal with its stale allowance of 1.
#[test]
fn ratio_withdrawals_covered_by_the_allowance_are_never_refused() {
    check("ratio_never_refuses_covered", None, || {
        let budget = ratio(0.5);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let budget = budget.clone();
                thread::spawn(move || {
                    budget.deposit();
                    budget.deposit();
                    budget.withdraw(RetryCost::Failure)
                })
            })
            .collect();
        for t in threads {
            assert!(
                t.join().unwrap(),
                "a withdrawal within the ratio was refused"
            );
        }
        assert_eq!(ratio_counts(&budget), (4, 2, 2));
    });
}

/// Withdrawals race deposits and each other with too little allowance for all of them:
/// the granted ones never exceed `ratio × deposits` (here 50 % of the 2 deposits made
/// before and the 2 made during the race, so at most 2 of 3), the withdrawal count is
/// exactly the number granted, and the withdrawal that the deposits made before the race
/// already cover (1) is granted to someone.
#[test]
fn ratio_withdrawals_never_exceed_the_allowance() {
    check("ratio_never_overdraws", None, || {
        let budget = ratio(0.5);
        budget.deposit();
        budget.deposit();
        let depositor = {
            let budget = budget.clone();
            thread::spawn(move || {
                budget.deposit();
                budget.deposit();
                u64::from(budget.withdraw(RetryCost::Failure))
            })
        };
        let withdrawer = {
            let budget = budget.clone();
            thread::spawn(move || {
                u64::from(budget.withdraw(RetryCost::Failure))
                    + u64::from(budget.withdraw(RetryCost::Failure))
            })
        };
        let granted = depositor.join().unwrap() + withdrawer.join().unwrap();
        let (deposits, withdrawals, allowed) = ratio_counts(&budget);
        assert_eq!((deposits, allowed), (4, 2));
        assert_eq!(withdrawals, granted, "every grant is counted, once");
        assert!(
            granted <= allowed,
            "{granted} withdrawals granted, {allowed} allowed"
        );
        assert!(
            granted >= 1,
            "the allowance of the first deposits was refused"
        );
    });
}

/// A bucket rotates into a new lap (the clock moves by a whole window, 1 s) while
/// another thread deposits into it: the rotating thread's deposit and its withdrawal,
/// both in the new lap, are never lost or refused (an old-lap write cannot overwrite the
/// new lap: the rotation and the increment are one CAS), the other thread's deposit is
/// counted at most once, and nothing of the old lap leaks into the new window.
#[test]
fn ratio_rotation_loses_no_deposit_of_the_new_lap() {
    check("ratio_rotation", None, || {
        let budget = ratio(1.0);
        let old = {
            let budget = budget.clone();
            thread::spawn(move || budget.deposit())
        };
        let rotating = {
            let budget = budget.clone();
            thread::spawn(move || {
                loom_clock::advance(Duration::from_secs(1));
                budget.deposit();
                budget.withdraw(RetryCost::Failure)
            })
        };
        old.join().unwrap();
        assert!(
            rotating.join().unwrap(),
            "a withdrawal covered by a deposit of its own lap was refused"
        );
        let (deposits, withdrawals, allowed) = ratio_counts(&budget);
        assert!(
            (1..=2).contains(&deposits),
            "{deposits} deposits in the window: one of the new lap, and the other at most once"
        );
        assert_eq!((withdrawals, allowed), (1, deposits));
    });
}

/// A token bucket config: capacity 10, a retry costs 5, a timeout 10, success refunds 1.
fn bucket() -> RetryBudget {
    let mut config = TokenBucketConfig::default();
    config = config.with_capacity(10);
    config = config.with_retry_cost(5);
    config = config.with_timeout_cost(10);
    config = config.with_success_refund(1);
    RetryBudget::token_bucket_with(config)
}

/// Tokens left in a token bucket.
fn tokens(budget: &RetryBudget) -> u32 {
    match budget.snapshot() {
        BudgetSnapshot::TokenBucket { tokens, capacity } => {
            assert_eq!(capacity, 10);
            tokens
        }
        other => panic!("not a token bucket: {other:?}"),
    }
}

/// Three withdrawals of 5 race on a full bucket of 10: exactly two are granted and the
/// bucket ends empty, never below zero (a lost update would grant a third or leave
/// tokens behind).
#[test]
fn token_bucket_withdrawals_never_overdraw() {
    check("bucket_withdrawals", None, || {
        let budget = bucket();
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let budget = budget.clone();
                thread::spawn(move || u32::from(budget.withdraw(RetryCost::Failure)))
            })
            .collect();
        let granted: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(granted, 2);
        assert_eq!(tokens(&budget), 0);
    });
}

/// Refunds race a withdrawal on a bucket at 2 of 10: every token is conserved (the
/// level is the start plus the refunds, capped at the capacity, minus what the
/// withdrawal took) — no refund is lost, none overshoots the capacity — and the
/// withdrawal is granted whenever the refunds it must have seen cover it.
#[test]
fn token_bucket_refunds_are_never_lost_and_never_overshoot() {
    check("bucket_refunds", None, || {
        let budget = bucket();
        // 10 → 0 → 1 → 2.
        assert!(budget.withdraw(RetryCost::Timeout));
        budget.record_success(None);
        budget.record_success(None);
        assert_eq!(tokens(&budget), 2);
        let refunds: Vec<_> = (0..2)
            .map(|_| {
                let budget = budget.clone();
                // The cost of a retry that succeeded: 5.
                thread::spawn(move || budget.record_success(Some(RetryCost::Failure)))
            })
            .collect();
        let withdrawal = {
            let budget = budget.clone();
            thread::spawn(move || budget.withdraw(RetryCost::Failure))
        };
        for t in refunds {
            t.join().unwrap();
        }
        let granted = withdrawal.join().unwrap();
        let left = tokens(&budget);
        assert!(left <= 10, "above the capacity: {left}");
        if granted {
            // Withdrawn after one refund (2 + 5 − 5 + 5 = 7) or after both (2 + 10,
            // capped at 10, − 5 = 5).
            assert!(left == 7 || left == 5, "{left} tokens left after a grant");
        } else {
            // Refused on 2 tokens, before any refund: both refunds then land, capped.
            assert_eq!(left, 10, "a refund was lost");
        }
    });
}

/// A success on a full bucket refunds nothing, while a withdrawal races it: the level
/// is exactly the capacity minus the withdrawal, or the capacity when the refund came
/// after it (the full-bucket fast path must not skip a refund the bucket has room for).
#[test]
fn token_bucket_full_fast_path_races_a_withdrawal() {
    check("bucket_full_fast_path", None, || {
        let budget = bucket();
        let refund = {
            let budget = budget.clone();
            thread::spawn(move || budget.record_success(Some(RetryCost::Failure)))
        };
        let withdrawal = {
            let budget = budget.clone();
            thread::spawn(move || budget.withdraw(RetryCost::Failure))
        };
        refund.join().unwrap();
        assert!(withdrawal.join().unwrap(), "a full bucket refused a retry");
        let left = tokens(&budget);
        assert!(left == 5 || left == 10, "{left} tokens left");
    });
}
