//! Retry budgets: a shared allowance that every retry to one downstream must draw from,
//! refilled by the requests that downstream serves.
//!
//! # Why budgets and not only a maximum number of attempts?
//!
//! A maximum number of attempts bounds the retries of one request, not the load they
//! add: when a downstream starts failing, every request retries, and 3 attempts per
//! request triple the load on a service that is already struggling. Worse, attempts
//! multiply across hops: when each of `depth` tiers makes 3 attempts, the deepest one
//! sees 3^`depth` calls per top-level request (81 at depth 4) — a retry storm that
//! grows with depth and turns a small fault into a self-inflicted denial of service.
//!
//! A budget bounds the *share* of retries instead: the default
//! [ratio budget](RetryBudget::ratio) allows retries of at most 20 % of the requests of
//! the last 10 s (plus a small floor), so one tier adds at most a fifth to the load
//! of the next, however badly it fails; together with the `do-not-retry` signal of the
//! wire convention, which keeps retries at one tier, the load of a storm stays bounded
//! at any depth. The [token bucket](RetryBudget::token_bucket) of the AWS SDKs'
//! standard retry mode is the other kind: every retry costs tokens, successes earn a
//! few back.
//!
//! # Use
//!
//! One budget is shared (a [`RetryBudget`] is a cheap `Clone` handle) by every client of
//! one downstream. Call [`deposit`](RetryBudget::deposit) exactly once per logical
//! request (not per attempt), [`withdraw`](RetryBudget::withdraw) once before every
//! retry — `false` means the budget refused it, and a refused withdrawal takes nothing
//! — and [`record_success`](RetryBudget::record_success) when a request succeeds.
//! Each kind ignores the calls it has no use for, so callers need not know which kind
//! they hold.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe::RetryBudget;
//! use retrysafe::budget::RetryCost;
//!
//! // The default: retries ≤ 20 % of the requests of the last 10 s, plus 10 retries/s.
//! let budget = RetryBudget::ratio();
//! for _ in 0..1000 {
//!     budget.deposit(); // once per logical request
//! }
//! assert_eq!(budget.available_retries(), 100 + 200); // the floor + 20 % of 1000
//! let mut retries = 0;
//! while budget.withdraw(RetryCost::Failure) {
//!     retries += 1; // ... retry the request ...
//! }
//! assert_eq!(retries, 300);
//!
//! // 10 s later, those requests and retries have left the window: only the floor is left.
//! tokio::time::advance(Duration::from_secs(10)).await;
//! assert_eq!(budget.available_retries(), 100);
//!
//! // The AWS standard mode: 500 tokens, a retry costs 5, a retry after a timeout 10.
//! let bucket = RetryBudget::token_bucket();
//! assert!(bucket.withdraw(RetryCost::Timeout));
//! assert_eq!(bucket.available_retries(), 98); // 490 tokens / 5
//! bucket.record_success(Some(RetryCost::Timeout)); // the retry worked: its cost comes back
//! assert_eq!(bucket.available_retries(), 100);
//! # }
//! ```
//!
//! # The ratio budget
//!
//! Over a sliding window of `ttl` (default 10 s), a ratio budget allows
//! `min_per_sec × ttl + retry_ratio × deposits` retries, less the retries already
//! taken in the window. The window is made of 10 buckets of `ttl / 10`, so a deposit or
//! a withdrawal counts for between 9/10 of `ttl` and `ttl` (exactly until the end of the
//! 10th bucket after its own). Retries are not weighted: a retry after a timeout takes
//! one unit like any other, and successes do not matter.
//!
//! **The floor is per process and dominates at low rates.** `min_per_sec` (default 10)
//! lets a client that sends few requests — or has just started — retry at all: it is a
//! reserve of `min_per_sec × ttl` retries per window (100 by default), which may also be
//! spent in one burst. Below 50 requests/s the floor allows more retries than the ratio
//! does: a process that sends 10 requests/s may retry every one of them. And it is per
//! budget, so per process: a fleet of 100 processes sharing a downstream may retry 1000
//! times per second however little traffic it sends. Lower `min_per_sec` where that
//! matters.
//!
//! # The token bucket
//!
//! A token bucket starts full (`capacity`, default 500). A retry takes `retry_cost`
//! tokens (5), or `timeout_cost` (10) after a timeout, and is refused when the bucket
//! holds fewer. A success that needed no retry refunds `success_refund` (1); a retry
//! that succeeds returns its own cost; neither fills the bucket beyond its capacity.
//! Time plays no part, and [`deposit`](RetryBudget::deposit) does nothing.
//!
//! # Concurrency
//!
//! Budgets are lock-free. A ratio budget counts deposits in cache-padded stripes, one per
//! thread (a thread-local index), with one atomic word per time bucket that holds the
//! bucket's epoch and count together, so the rotation of a bucket cannot race an
//! increment; threads on different stripes (handed out round-robin; at least 8) do not
//! write to a shared cache line. A withdrawal reads every stripe; its check and
//! its count are one compare-and-swap, so concurrent withdrawals do not overdraw (except
//! by at most one per racing thread at the instant a bucket rotates). A token bucket is
//! one cache-padded atomic: a success on a full bucket only reads it. Time comes from
//! [`tokio::time::Instant`], so budgets follow a paused test clock.

mod bucket;
mod ratio;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::ConfigError;
use crate::config::Validate;
use crate::observe::handles::{Counter, Lazy};
use crate::observe::{Name, names};

use self::bucket::TokenBucket;
use self::ratio::Ratio;

/// What a retry costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryCost {
    /// A retry after an ordinary failure.
    Failure,
    /// A retry after a timeout.
    Timeout,
}

/// A retry budget: a cheap `Clone` handle (one `Arc`) on state shared by every clone.
///
/// With the `tower` feature it implements `tower::retry::budget::Budget`, so a tower
/// `Retry` policy can share it with retrysafe's layers: a tower withdrawal is a
/// [`RetryCost::Failure`]. (Tower's trait has no success hook, so a token bucket shared
/// with a tower policy is never refunded by that policy's successes: prefer the ratio
/// budget there.)
///
/// Either a [ratio budget](RetryBudget::ratio) (the default) or a
/// [token bucket](RetryBudget::token_bucket); see the [module documentation](self) for
/// what each allows and how to call it.
///
/// ```
/// use retrysafe::RetryBudget;
/// use retrysafe::budget::RetryCost;
///
/// let budget = RetryBudget::default();
/// let clone = budget.clone();
/// clone.deposit();
/// assert!(budget.same_budget(&clone));
/// assert_eq!(budget.available_retries(), clone.available_retries());
/// ```
#[derive(Debug, Clone)]
pub struct RetryBudget {
    inner: Arc<Shared>,
}

/// A budget's state, and how it is observed.
struct Shared {
    kind: Inner,
    name: Name,
    /// `retrysafe_budget_refusals_total{name}`, resolved when a layer using the budget
    /// is built, or at the first refusal.
    refusals: Lazy<Counter>,
    on_refusal: Option<RefusalHook>,
}

type RefusalHook = Arc<dyn Fn(&BudgetRefusal) + Send + Sync>;

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// A withdrawal a budget refused (a retry, or a hedge), as the
/// [`on_refusal`](RetryBudget::with_on_refusal) hook sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BudgetRefusal {
    /// The budget's name.
    pub name: Name,
    /// What the refused withdrawal would have cost.
    pub cost: RetryCost,
}

/// The two kinds of budget.
#[derive(Debug)]
enum Inner {
    Ratio(Ratio),
    TokenBucket(TokenBucket),
}

/// Configuration of a ratio budget.
///
/// ```
/// use std::time::Duration;
/// use retrysafe::budget::RatioConfig;
/// use retrysafe::RetryBudget;
///
/// let config = RatioConfig::default()
///     .with_ttl(Duration::from_secs(30))
///     .with_min_per_sec(1)
///     .with_retry_ratio(0.1)
///     .build()
///     .unwrap();
/// let budget = RetryBudget::ratio_with(config);
/// assert_eq!(budget.available_retries(), 30); // 1/s × 30 s
///
/// let bad = config.with_retry_ratio(f64::NAN).with_ttl(Duration::ZERO);
/// assert_eq!(bad.build().unwrap_err().fields().collect::<Vec<_>>(), ["ttl", "retry_ratio"]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatioConfig {
    ttl: Duration,
    min_per_sec: u32,
    retry_ratio: f64,
}

/// Configuration of a token bucket.
///
/// ```
/// use retrysafe::RetryBudget;
/// use retrysafe::budget::TokenBucketConfig;
///
/// let config = TokenBucketConfig::default().with_capacity(50).build().unwrap();
/// let bucket = RetryBudget::token_bucket_with(config);
/// assert_eq!(bucket.available_retries(), 10); // 50 tokens / 5
///
/// let bad = config.with_timeout_cost(51);
/// assert_eq!(bad.build().unwrap_err().field(), "timeout_cost");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucketConfig {
    capacity: u32,
    retry_cost: u32,
    timeout_cost: u32,
    success_refund: u32,
}

/// What a budget holds at one instant, for tests and observability.
///
/// ```
/// use retrysafe::budget::BudgetSnapshot;
/// use retrysafe::RetryBudget;
///
/// let budget = RetryBudget::ratio();
/// budget.deposit();
/// match budget.snapshot() {
///     BudgetSnapshot::Ratio { deposits, withdrawals, allowed } => {
///         assert_eq!((deposits, withdrawals, allowed), (1, 0, 100));
///     }
///     other => panic!("not a ratio budget: {other:?}"),
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BudgetSnapshot {
    /// A ratio budget's current window.
    Ratio {
        /// Deposits in the window.
        deposits: u64,
        /// Retries taken in the window.
        withdrawals: u64,
        /// Retries the window allows in all (taken ones included): the reserve plus the
        /// ratio's share of the deposits, rounded down.
        allowed: u64,
    },
    /// A token bucket's level.
    TokenBucket {
        /// Tokens left.
        tokens: u32,
        /// The capacity.
        capacity: u32,
    },
}

/// The longest ratio window.
const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// The shortest ratio window (Finagle's and tower's lower bound).
const MIN_TTL: Duration = Duration::from_secs(1);

impl RatioConfig {
    /// How long a deposit counts: the length of the sliding window, from 1 s to 30 days
    /// (default 10 s). A deposit counts for between 9/10 of it and all of it.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Retries always allowed per second, whatever the traffic (per process; default
    /// 10): a reserve of `min_per_sec × ttl` retries per window, rounded down.
    #[must_use]
    pub fn with_min_per_sec(mut self, min_per_sec: u32) -> Self {
        self.min_per_sec = min_per_sec;
        self
    }

    /// Share of requests that may be retried, from 0 to 1000 (default 0.2); 2.0 allows
    /// two retries per request. Kept to 6 decimal places.
    #[must_use]
    pub fn with_retry_ratio(mut self, retry_ratio: f64) -> Self {
        self.retry_ratio = retry_ratio;
        self
    }

    /// The window length.
    #[doc(hidden)]
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The retries always allowed per second.
    #[doc(hidden)]
    pub fn min_per_sec(&self) -> u32 {
        self.min_per_sec
    }

    /// The share of requests that may be retried.
    #[doc(hidden)]
    pub fn retry_ratio(&self) -> f64 {
        self.retry_ratio
    }

    /// Checks every field: the error names each one out of range (a `ttl` outside 1 s
    /// to 30 days, a `retry_ratio` outside 0 to 1000 or NaN).
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        if self.ttl.is_zero() {
            v.refuse(ConfigError::new("ttl", "must be greater than zero"));
        } else if self.ttl < MIN_TTL {
            v.refuse(ConfigError::new("ttl", "must be at least 1 s"));
        } else if self.ttl > MAX_TTL {
            v.refuse(ConfigError::new("ttl", "must be at most 30 days"));
        }
        v.check(
            (0.0..=1000.0).contains(&self.retry_ratio),
            "retry_ratio",
            "must be a number from 0 to 1000",
        );
        v.finish(self)
    }

    /// The configuration as used: every field brought into its range (a NaN ratio is 0).
    pub(crate) fn clamped(self) -> Self {
        let retry_ratio = if self.retry_ratio.is_nan() {
            0.0
        } else {
            self.retry_ratio.clamp(0.0, 1000.0)
        };
        RatioConfig {
            ttl: self.ttl.clamp(MIN_TTL, MAX_TTL),
            min_per_sec: self.min_per_sec,
            retry_ratio,
        }
    }
}

impl TokenBucketConfig {
    /// Capacity (and initial level); at least 1 (default 500).
    #[must_use]
    pub fn with_capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity;
        self
    }

    /// Tokens a retry after a failure costs; 1 to the capacity (default 5).
    #[must_use]
    pub fn with_retry_cost(mut self, cost: u32) -> Self {
        self.retry_cost = cost;
        self
    }

    /// Tokens a retry after a timeout costs; 1 to the capacity (default 10).
    #[must_use]
    pub fn with_timeout_cost(mut self, cost: u32) -> Self {
        self.timeout_cost = cost;
        self
    }

    /// Tokens returned by a success that needed no retry; 0 to the capacity (default 1).
    #[must_use]
    pub fn with_success_refund(mut self, refund: u32) -> Self {
        self.success_refund = refund;
        self
    }

    /// The capacity.
    #[doc(hidden)]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// What a retry after a failure costs.
    #[doc(hidden)]
    pub fn retry_cost(&self) -> u32 {
        self.retry_cost
    }

    /// What a retry after a timeout costs.
    #[doc(hidden)]
    pub fn timeout_cost(&self) -> u32 {
        self.timeout_cost
    }

    /// What a success that needed no retry refunds.
    #[doc(hidden)]
    pub fn success_refund(&self) -> u32 {
        self.success_refund
    }

    /// Checks every field: the error names each one out of range (a zero capacity, a
    /// zero cost, a cost or refund greater than the capacity).
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(self.capacity > 0, "capacity", "must be greater than zero");
        for (field, value) in [
            ("retry_cost", self.retry_cost),
            ("timeout_cost", self.timeout_cost),
        ] {
            if value == 0 {
                v.refuse(ConfigError::new(field, "must be greater than zero"));
            } else if self.capacity > 0 && value > self.capacity {
                v.refuse(ConfigError::new(field, "must not exceed the capacity"));
            }
        }
        v.check(
            self.success_refund <= self.capacity,
            "success_refund",
            "must not exceed the capacity",
        );
        v.finish(self)
    }

    /// The configuration as used: every field brought into its range.
    pub(crate) fn clamped(self) -> Self {
        let capacity = self.capacity.max(1);
        TokenBucketConfig {
            capacity,
            retry_cost: self.retry_cost.clamp(1, capacity),
            timeout_cost: self.timeout_cost.clamp(1, capacity),
            success_refund: self.success_refund.min(capacity),
        }
    }
}

impl Default for RatioConfig {
    /// 10 s, 10 retries/s, 20 %: Finagle's and tower's defaults.
    fn default() -> Self {
        RatioConfig {
            ttl: Duration::from_secs(10),
            min_per_sec: 10,
            retry_ratio: 0.2,
        }
    }
}

impl Default for TokenBucketConfig {
    /// 500 tokens, 5 per retry, 10 per retry after a timeout, 1 back per success: the
    /// AWS SDKs' standard retry mode.
    fn default() -> Self {
        TokenBucketConfig {
            capacity: 500,
            retry_cost: 5,
            timeout_cost: 10,
            success_refund: 1,
        }
    }
}

impl Default for RetryBudget {
    /// The default ratio budget, [`RetryBudget::ratio`].
    fn default() -> Self {
        Self::ratio()
    }
}

impl RetryBudget {
    /// The default ratio budget: retries ≤ 20 % of the deposits of the last 10 s, plus
    /// 10 retries/s (a reserve of 100 per window; per process, see the
    /// [module documentation](self#the-ratio-budget)).
    #[must_use]
    pub fn ratio() -> Self {
        Self::from_inner(Inner::Ratio(Ratio::new(RatioConfig::default())))
    }

    /// A ratio budget configured by `config` ([`RatioConfig::build`] checks it; a field
    /// out of range is used as the nearest valid value).
    #[must_use]
    pub fn ratio_with(config: RatioConfig) -> Self {
        Self::from_inner(Inner::Ratio(Ratio::new(config.clamped())))
    }

    /// The default token bucket: the AWS SDKs' standard retry mode (capacity 500, retry
    /// cost 5, timeout cost 10, refund 1).
    #[must_use]
    pub fn token_bucket() -> Self {
        Self::from_inner(Inner::TokenBucket(TokenBucket::new(
            TokenBucketConfig::default(),
        )))
    }

    /// A token bucket configured by `config` ([`TokenBucketConfig::build`] checks it; a
    /// field out of range is used as the nearest valid value).
    #[must_use]
    pub fn token_bucket_with(config: TokenBucketConfig) -> Self {
        Self::from_inner(Inner::TokenBucket(TokenBucket::new(config.clamped())))
    }

    /// Wraps a state.
    fn from_inner(inner: Inner) -> Self {
        Self::from_parts(inner, Name::default(), None)
    }

    fn from_parts(kind: Inner, name: Name, on_refusal: Option<RefusalHook>) -> Self {
        RetryBudget {
            inner: Arc::new(Shared {
                refusals: Lazy::default(),
                kind,
                name,
                on_refusal,
            }),
        }
    }

    /// A budget like this one, named and hooked as `f` says. Meant for a budget just
    /// made: the result is a new budget of the same configuration, with fresh state,
    /// that shares nothing with the clones of `self`.
    fn remade(self, f: impl FnOnce(&mut Name, &mut Option<RefusalHook>)) -> Self {
        let mut name = self.inner.name.clone();
        let mut hook = self.inner.on_refusal.clone();
        f(&mut name, &mut hook);
        let kind = match &self.inner.kind {
            Inner::Ratio(r) => Inner::Ratio(Ratio::new(*r.config())),
            Inner::TokenBucket(b) => Inner::TokenBucket(TokenBucket::new(*b.config())),
        };
        Self::from_parts(kind, name, hook)
    }

    /// Names the budget (default `default`): the `name` of its refusal events and of
    /// `retrysafe_budget_refusals_total`.
    ///
    /// Name a budget as you make it, before cloning it: this returns a new budget of the
    /// same configuration, fresh, which shares nothing with earlier clones.
    ///
    /// ```
    /// use retrysafe::RetryBudget;
    ///
    /// let budget = RetryBudget::ratio().with_name("payments-api");
    /// assert_eq!(budget.name().as_str(), "payments-api");
    /// ```
    #[must_use]
    pub fn with_name(self, name: impl Into<Name>) -> Self {
        let name = name.into();
        self.remade(|n, _| *n = name)
    }

    /// Calls `f` on every withdrawal the budget refuses (a retry or a hedge). Like
    /// [`with_name`](Self::with_name), returns a new budget: set it as you make it.
    #[must_use]
    pub fn with_on_refusal(self, f: impl Fn(&BudgetRefusal) + Send + Sync + 'static) -> Self {
        self.remade(|_, hook| *hook = Some(Arc::new(f)))
    }

    /// The budget's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// Resolves the refusal counter now, against the recorder installed now (else at
    /// the first refusal): for a layer or stack using the budget, when it is built.
    #[doc(hidden)]
    pub fn resolve_metrics(&self) {
        let _ = self.refusals();
    }

    fn refusals(&self) -> &Counter {
        let shared = &self.inner;
        shared
            .refusals
            .get(|| Counter::new(names::BUDGET_REFUSALS_TOTAL, &shared.name, None))
    }

    /// Counts a refused withdrawal of `cost` and calls the hook.
    #[cold]
    fn refused(&self, cost: RetryCost) {
        self.refusals().increment();
        if let Some(hook) = &self.inner.on_refusal {
            hook(&BudgetRefusal {
                name: self.inner.name.clone(),
                cost,
            });
        }
    }

    /// Records one logical request: call it exactly once per request, not per attempt.
    ///
    /// A ratio budget counts it; a token bucket ignores it.
    pub fn deposit(&self) {
        match &self.inner.kind {
            Inner::Ratio(r) => r.deposit_at(crate::sync::now()),
            Inner::TokenBucket(_) => {}
        }
    }

    /// [`deposit`](Self::deposit) at `now`, a reading of tokio's clock the caller has
    /// just made (for its deadline, say): a ratio budget counts the request in the
    /// window of that instant instead of reading the clock again.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// use retrysafe::budget::BudgetSnapshot;
    /// use retrysafe::RetryBudget;
    ///
    /// let budget = RetryBudget::ratio();
    /// budget.deposit_at(tokio::time::Instant::now());
    /// assert!(matches!(budget.snapshot(), BudgetSnapshot::Ratio { deposits: 1, .. }));
    /// # }
    /// ```
    #[doc(hidden)]
    pub fn deposit_at(&self, now: Instant) {
        match &self.inner.kind {
            Inner::Ratio(r) => r.deposit_at(now),
            Inner::TokenBucket(_) => {}
        }
    }

    /// Tries to pay for one retry: call it once before every retry, and do not retry on
    /// `false`. A refused withdrawal takes nothing.
    ///
    /// A ratio budget counts every retry as one unit, whatever its `cost`.
    #[must_use = "`false` means the budget refused the retry"]
    pub fn withdraw(&self, cost: RetryCost) -> bool {
        let granted = match &self.inner.kind {
            Inner::Ratio(r) => r.withdraw(),
            Inner::TokenBucket(b) => b.withdraw(cost),
        };
        if !granted {
            self.refused(cost);
        }
        granted
    }

    /// Records a success; `after_retry` is the cost of the retry that succeeded, if any.
    ///
    /// A token bucket refunds `success_refund` for `None` and the retry's own cost for
    /// `Some`, up to its capacity; a ratio budget ignores it.
    pub fn record_success(&self, after_retry: Option<RetryCost>) {
        match &self.inner.kind {
            Inner::Ratio(_) => {}
            Inner::TokenBucket(b) => b.record_success(after_retry),
        }
    }

    /// How many retries after a failure ([`RetryCost::Failure`]) the budget would allow
    /// now, with no further deposit or success: the window's allowance less its
    /// withdrawals (ratio), or the tokens divided by `retry_cost` (token bucket).
    pub fn available_retries(&self) -> u64 {
        match &self.inner.kind {
            Inner::Ratio(r) => r.available(),
            Inner::TokenBucket(b) => u64::from(b.tokens())
                .checked_div(u64::from(b.config().retry_cost))
                .unwrap_or(0),
        }
    }

    /// What the budget holds now. For a ratio budget this reads every stripe: meant for
    /// tests, metrics and debugging, not for every request.
    pub fn snapshot(&self) -> BudgetSnapshot {
        match &self.inner.kind {
            Inner::Ratio(r) => r.snapshot(),
            Inner::TokenBucket(b) => b.snapshot(),
        }
    }

    /// The ratio configuration, or `None` for a token bucket.
    #[doc(hidden)]
    pub fn ratio_config(&self) -> Option<&RatioConfig> {
        match &self.inner.kind {
            Inner::Ratio(r) => Some(r.config()),
            Inner::TokenBucket(_) => None,
        }
    }

    /// The token bucket configuration, or `None` for a ratio budget.
    #[doc(hidden)]
    pub fn token_bucket_config(&self) -> Option<&TokenBucketConfig> {
        match &self.inner.kind {
            Inner::Ratio(_) => None,
            Inner::TokenBucket(b) => Some(b.config()),
        }
    }

    /// Whether `self` and `other` are handles on the same budget (one is a clone of the
    /// other).
    #[doc(hidden)]
    pub fn same_budget(&self, other: &RetryBudget) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The identity of this budget, shared by its clones (for marks that say which
    /// budget already counted a request).
    #[doc(hidden)]
    pub fn id(&self) -> BudgetId {
        BudgetId(Arc::as_ptr(&self.inner) as usize)
    }
}

/// The identity of a [`RetryBudget`]: equal for clones of one handle. Never zero.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BudgetId(usize);

impl BudgetId {
    /// The raw value (never zero).
    pub fn get(self) -> usize {
        self.0
    }
}

#[cfg(feature = "tower")]
impl tower::retry::budget::Budget for RetryBudget {
    fn deposit(&self) {
        RetryBudget::deposit(self);
    }

    fn withdraw(&self) -> bool {
        RetryBudget::withdraw(self, RetryCost::Failure)
    }
}
