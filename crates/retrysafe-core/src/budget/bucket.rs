//! The token bucket of the AWS SDKs' standard retry mode.
//!
//! One cache-padded atomic holds the level. Withdrawals and refunds below capacity are
//! compare-and-swap loops; a success on a full bucket (the steady state of a healthy
//! downstream) only loads the level, so threads recording successes share the cache
//! line read-only and do not contend.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;

use super::{BudgetSnapshot, RetryCost, TokenBucketConfig};
use crate::stripe::CachePadded;
use crate::sync::AtomicU32;

/// A token bucket's state.
pub(super) struct TokenBucket {
    config: TokenBucketConfig,
    level: CachePadded<AtomicU32>,
}

impl TokenBucket {
    /// A full bucket for a configuration in range ([`TokenBucketConfig::clamped`]).
    pub(super) fn new(config: TokenBucketConfig) -> Self {
        TokenBucket {
            config,
            level: CachePadded(AtomicU32::new(config.capacity)),
        }
    }

    /// The configuration.
    pub(super) fn config(&self) -> &TokenBucketConfig {
        &self.config
    }

    /// What a retry of this kind costs.
    fn cost(&self, cost: RetryCost) -> u32 {
        match cost {
            RetryCost::Failure => self.config.retry_cost,
            RetryCost::Timeout => self.config.timeout_cost,
        }
    }

    /// Takes the cost of one retry if the bucket holds it; takes nothing otherwise.
    pub(super) fn withdraw(&self, cost: RetryCost) -> bool {
        let cost = self.cost(cost);
        // Relaxed: the level publishes no other data.
        self.level
            .0
            .fetch_update(Relaxed, Relaxed, |level| level.checked_sub(cost))
            .is_ok()
    }

    /// Refunds `success_refund` (no retry was needed) or the cost of the retry that
    /// succeeded, up to capacity.
    pub(super) fn record_success(&self, after_retry: Option<RetryCost>) {
        let amount = after_retry.map_or(self.config.success_refund, |cost| self.cost(cost));
        let capacity = self.config.capacity;
        if amount == 0 || self.level.0.load(Relaxed) >= capacity {
            return;
        }
        // The closure refuses once the bucket is full, so a refund never overshoots.
        let _ = self.level.0.fetch_update(Relaxed, Relaxed, |level| {
            (level < capacity).then(|| level.saturating_add(amount).min(capacity))
        });
    }

    /// Tokens left.
    pub(super) fn tokens(&self) -> u32 {
        self.level.0.load(Relaxed)
    }

    /// The level and the capacity.
    pub(super) fn snapshot(&self) -> BudgetSnapshot {
        BudgetSnapshot::TokenBucket {
            tokens: self.tokens(),
            capacity: self.config.capacity,
        }
    }
}

impl fmt::Debug for TokenBucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenBucket")
            .field("config", &self.config)
            .field("tokens", &self.tokens())
            .finish()
    }
}
