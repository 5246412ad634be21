//! `RetryBudget` as tower's `Budget` (feature `tower`): a tower `Retry` policy shares it
//! with retrysafe's layers, and the budget bounds that policy's retries too.
#![cfg(feature = "tower")]
#![allow(clippy::unwrap_used)]

use std::future::{Ready, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use retrysafe_core::budget::{RatioConfig, RetryBudget};
use tower::retry::budget::Budget;
use tower::retry::{Policy, Retry};
use tower::{ServiceExt, service_fn};

/// Retries every failure while the budget allows it.
#[derive(Clone)]
struct Budgeted<B>(B);

impl<B: Budget + Clone> Policy<u32, (), &'static str> for Budgeted<B> {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut u32,
        result: &mut Result<(), &'static str>,
    ) -> Option<Self::Future> {
        match result {
            Ok(()) => None,
            Err(_) => self.0.withdraw().then(|| ready(())),
        }
    }

    fn clone_request(&mut self, req: &u32) -> Option<u32> {
        Some(*req)
    }
}

#[tokio::test(start_paused = true)]
async fn a_tower_retry_policy_draws_on_the_shared_budget() {
    // Retries may be 20 % of requests, with no per-second floor.
    let config = RatioConfig::default()
        .with_min_per_sec(0)
        .with_retry_ratio(0.2)
        .build()
        .unwrap();
    let budget = RetryBudget::ratio_with(config);
    let calls = Arc::new(AtomicUsize::new(0));
    let failing = {
        let calls = Arc::clone(&calls);
        service_fn(move |_: u32| {
            calls.fetch_add(1, Ordering::SeqCst);
            ready(Err::<(), _>("down"))
        })
    };
    let retry = Retry::new(Budgeted(budget.clone()), failing);
    for i in 0..10 {
        Budget::deposit(&budget); // one deposit per logical request
        assert!(retry.clone().oneshot(i).await.is_err());
    }
    // Ten requests, and 20 % of them in retries: the budget bounds tower's policy.
    assert_eq!(calls.load(Ordering::SeqCst), 12);
    // The same budget, seen by retrysafe: spent.
    assert_eq!(budget.available_retries(), 0);
}
