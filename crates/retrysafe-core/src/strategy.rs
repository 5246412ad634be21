//! Retry strategies in the Smithy shape: acquire a token before the first attempt,
//! refresh it after each retryable failure (which yields the delay, or a reason to
//! give up), record a success.
//!
//! [`StandardRetryStrategy`] has these defaults: 3 attempts counting the
//! first, full-jitter exponential backoff (base 50 ms, 1 s after a throttle, cap 20 s),
//! the default [ratio budget](crate::budget), and — when the request has no deadline —
//! a 10 s timeout per attempt and 30 s overall (or [`no_timeout`]).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! use std::time::Duration;
//! use retrysafe::classify::{Classifier, DefaultClassifier, RequestFacts};
//! use retrysafe::retry::{GiveUp, RetryStrategy};
//! use retrysafe::StandardRetryStrategy;
//! use http::{HeaderMap, StatusCode};
//!
//! let strategy = StandardRetryStrategy::new().seed(1);
//! let get = RequestFacts::SAFE;
//! let failure = DefaultClassifier::default()
//!     .classify_response(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new(), &get);
//!
//! let token = strategy.acquire_initial_retry_token(None);
//! let token = strategy.refresh_retry_token(token, &failure, &get, None).unwrap();
//! assert_eq!(token.attempt(), 2);
//! assert!(token.delay() <= Duration::from_millis(50));
//! let token = strategy.refresh_retry_token(token, &failure, &get, None).unwrap();
//! assert!(token.delay() <= Duration::from_millis(100));
//! assert_eq!(
//!     strategy.refresh_retry_token(token, &failure, &get, None).unwrap_err(),
//!     GiveUp::AttemptsExhausted,
//! );
//! # }
//! ```
//!
//! [`no_timeout`]: StandardRetryStrategy::no_timeout

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::ConfigError;
use crate::backoff::{Backoff, RetryRng, RngSource};
use crate::budget::{BudgetId, RetryBudget, RetryCost};
use crate::classify::{Classification, DelayHint, RequestFacts};
use crate::config::Validate;
use crate::wire::MAX_TIMEOUT;

/// The least time an attempt is started with: 1 ms, the smallest `request-timeout-ms`.
pub(crate) const MIN_ATTEMPT_TIME: Duration = Duration::from_millis(1);

/// Why a strategy stopped retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUp {
    /// The outcome is not retryable for this request.
    NotRetryable,
    /// The maximum number of attempts was made.
    AttemptsExhausted,
    /// The retry budget refused the retry.
    BudgetExhausted,
    /// The delay needed, or the next attempt, does not fit in the time left.
    NotEnoughTime,
    /// A layer below (a budget, a breaker, a deadline) refused the retry locally.
    RefusedBelow,
}

impl GiveUp {
    /// The reason as a label: `not_retryable`, `attempts_exhausted`,
    /// `budget_exhausted`, `not_enough_time`, `refused_below`.
    pub fn as_str(self) -> &'static str {
        match self {
            GiveUp::NotRetryable => "not_retryable",
            GiveUp::AttemptsExhausted => "attempts_exhausted",
            GiveUp::BudgetExhausted => "budget_exhausted",
            GiveUp::NotEnoughTime => "not_enough_time",
            GiveUp::RefusedBelow => "refused_below",
        }
    }

    /// Whether the failure was retryable and retrying stopped for another reason: the
    /// caller must then not retry either (the response is marked `do-not-retry`).
    #[doc(hidden)]
    pub fn after_retryable_failure(self) -> bool {
        !matches!(self, GiveUp::NotRetryable)
    }
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GiveUp::NotRetryable => "not retryable",
            GiveUp::AttemptsExhausted => "attempts exhausted",
            GiveUp::BudgetExhausted => "retry budget exhausted",
            GiveUp::NotEnoughTime => "not enough time left",
            GiveUp::RefusedBelow => "refused by a layer below",
        })
    }
}

/// The state of one logical request's retries.
#[derive(Debug)]
pub struct RetryToken {
    attempt: u32,
    max_attempts: u32,
    delay: Duration,
    last_cost: Option<RetryCost>,
    /// Made on the first retry (boxed: a token that never retries stays small).
    rng: Option<Box<RetryRng>>,
    budget: Option<RetryBudget>,
    budget_id: Option<BudgetId>,
}

impl RetryToken {
    /// The token of a hedge's copy of a request: one attempt, no deposit (the request
    /// it copies made it), accounted for in `budget` (the hedge was withdrawn there).
    #[doc(hidden)]
    pub fn hedge(budget: Option<BudgetId>) -> Self {
        RetryToken {
            attempt: 1,
            max_attempts: 1,
            delay: Duration::ZERO,
            last_cost: None,
            rng: None,
            budget: None,
            budget_id: budget,
        }
    }

    /// The 1-based number of the attempt this token is for.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The delay to wait before this attempt (zero for the first).
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Limits this request to `max` attempts (for example one, when the caller is the
    /// retry point). Never raises the strategy's limit.
    #[doc(hidden)]
    pub fn limit_attempts(&mut self, max: u32) {
        self.max_attempts = self.max_attempts.min(max.max(1));
    }

    /// Whether this request is accounted for in a budget (its deposit was made, and
    /// its retries are withdrawn): then a budget layer below must not count it again.
    #[doc(hidden)]
    pub fn is_budgeted(&self) -> bool {
        self.budget_id.is_some()
    }

    /// The budget this request is accounted for in, if any.
    #[doc(hidden)]
    pub fn budget_id(&self) -> Option<BudgetId> {
        self.budget_id
    }

    /// The cost of the retry charged for this attempt, if it was a retry.
    #[doc(hidden)]
    pub fn charged(&self) -> Option<RetryCost> {
        self.last_cost
    }
}

/// A retry strategy (the Smithy shape).
pub trait RetryStrategy: fmt::Debug + Send + Sync + 'static {
    /// Before the first attempt of a logical request. Makes the request's one deposit
    /// into the budget: `budget` when the request overrides it, otherwise the
    /// strategy's.
    fn acquire_initial_retry_token(&self, budget: Option<RetryBudget>) -> RetryToken;

    /// [`acquire_initial_retry_token`](Self::acquire_initial_retry_token) at `now`, a
    /// reading of tokio's clock the caller has just made (for the call's deadline): a
    /// budget that counts requests by time takes it instead of reading the clock again
    /// ([`RetryBudget::deposit_at`]). The default ignores `now`.
    #[doc(hidden)]
    fn acquire_initial_retry_token_at(
        &self,
        budget: Option<RetryBudget>,
        now: Instant,
    ) -> RetryToken {
        let _ = now;
        self.acquire_initial_retry_token(budget)
    }

    /// After a failed attempt: the token of the next attempt (with its
    /// [`delay`](RetryToken::delay)), or why to give up. `time_left` is the time left
    /// on the call's deadline, if it has one. Charges the budget once per retry.
    fn refresh_retry_token(
        &self,
        token: RetryToken,
        failure: &Classification,
        request: &RequestFacts,
        time_left: Option<Duration>,
    ) -> Result<RetryToken, GiveUp>;

    /// After a successful attempt.
    fn record_success(&self, token: &RetryToken);

    /// The timeouts used when a request carries no deadline: `(per attempt, overall)`.
    fn default_timeouts(&self) -> (Option<Duration>, Option<Duration>);

    /// A bound on each attempt that also holds when the request carries a deadline
    /// (each attempt then ends at the sooner of the two, and the time-left header it
    /// carries says so). `None` (the default): under a deadline an attempt may use all
    /// the time left.
    fn attempt_timeout_under_deadline(&self) -> Option<Duration> {
        None
    }
}

/// The standard strategy (see the [module docs](self)).
#[derive(Debug)]
pub struct StandardRetryStrategy {
    max_attempts: u32,
    backoff: Backoff,
    budget: Option<RetryBudget>,
    attempt_timeout: Option<Duration>,
    /// Whether `attempt_timeout` was set by the user (then it also bounds attempts
    /// of requests with a deadline).
    attempt_timeout_set: bool,
    overall_timeout: Option<Duration>,
    rng: RngSource,
}

impl Default for StandardRetryStrategy {
    fn default() -> Self {
        StandardRetryStrategy {
            max_attempts: 3,
            backoff: Backoff::default(),
            budget: Some(RetryBudget::ratio()),
            attempt_timeout: Some(Duration::from_secs(10)),
            attempt_timeout_set: false,
            overall_timeout: Some(Duration::from_secs(30)),
            rng: RngSource::os(),
        }
    }
}

impl StandardRetryStrategy {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// At most `n` attempts, counting the first (1 to 100, checked by
    /// [`build`](Self::build); out of range, the nearest bound is used).
    #[must_use]
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// The backoff.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The budget every retry is charged to (shared by clones of the handle).
    #[must_use]
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// No budget: only the attempt limit bounds retries. Not recommended.
    #[must_use]
    pub fn no_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// The timeout of each attempt (at least 1 ms). Without this call: 10 s for
    /// requests without a deadline, and none under a deadline (an attempt may use all
    /// the time left). Set here, it also bounds the attempts of a request with a
    /// deadline that may be retried (a safe request, not limited to one attempt): the
    /// sooner of the two, so that an attempt lost in a black hole leaves time for a
    /// retry; the time-left header of such an attempt carries the shorter bound.
    ///
    /// From 1 ms to 30 days, checked by [`build`](Self::build) (out of range, the nearest
    /// bound is used).
    #[must_use]
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self.attempt_timeout_set = true;
        self
    }

    /// The timeout of the whole call, retries included, when the request has no
    /// deadline (default 30 s; greater than zero and at most 30 days, checked by
    /// [`build`](Self::build)).
    #[must_use]
    pub fn overall_timeout(mut self, timeout: Duration) -> Self {
        self.overall_timeout = Some(timeout);
        self
    }

    /// Checks the settings, the backoff's included: the error names every one out of
    /// range.
    pub fn build(self) -> Result<Self, ConfigError> {
        let mut v = Validate::new();
        v.check(
            (1..=100).contains(&self.max_attempts),
            "max attempts",
            "must be between 1 and 100",
        );
        if let Some(timeout) = self.attempt_timeout.filter(|_| self.attempt_timeout_set) {
            // Shorter would send a time-left header of 0: "already expired".
            v.check(
                timeout >= MIN_ATTEMPT_TIME,
                "attempt timeout",
                "must be at least 1 ms",
            );
            v.check(
                timeout <= MAX_TIMEOUT,
                "attempt timeout",
                "must be at most 30 days",
            );
        }
        if let Some(timeout) = self.overall_timeout {
            v.check(
                !timeout.is_zero(),
                "overall timeout",
                "must be greater than zero",
            );
            v.check(
                timeout <= MAX_TIMEOUT,
                "overall timeout",
                "must be at most 30 days",
            );
        }
        self.backoff.validate(&mut v);
        v.finish(self)
    }

    /// No default timeouts: without a deadline an attempt may take forever.
    #[must_use]
    pub fn no_timeout(mut self) -> Self {
        self.attempt_timeout = None;
        self.attempt_timeout_set = false;
        self.overall_timeout = None;
        self
    }

    /// Seeds the jitter, so delays are reproducible (tests).
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.rng = RngSource::seeded(seed);
        self
    }

    /// The configured budget.
    #[doc(hidden)]
    pub fn retry_budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }
}

/// An attempt timeout as used: from [`MIN_ATTEMPT_TIME`] to 30 days.
fn attempt_bound(timeout: Duration) -> Duration {
    timeout.clamp(MIN_ATTEMPT_TIME, MAX_TIMEOUT)
}

impl StandardRetryStrategy {
    /// The first attempt's token, its request's one deposit made by `deposit` into
    /// `budget` (the request's own) or the strategy's.
    #[inline]
    fn initial_token(
        &self,
        budget: Option<RetryBudget>,
        deposit: impl FnOnce(&RetryBudget),
    ) -> RetryToken {
        let budget_id = budget.as_ref().or(self.budget.as_ref()).map(|budget| {
            deposit(budget);
            budget.id()
        });
        RetryToken {
            attempt: 1,
            max_attempts: self.max_attempts.clamp(1, 100),
            delay: Duration::ZERO,
            last_cost: None,
            rng: None,
            budget,
            budget_id,
        }
    }
}

impl RetryStrategy for StandardRetryStrategy {
    fn acquire_initial_retry_token(&self, budget: Option<RetryBudget>) -> RetryToken {
        self.initial_token(budget, RetryBudget::deposit)
    }

    fn acquire_initial_retry_token_at(
        &self,
        budget: Option<RetryBudget>,
        now: Instant,
    ) -> RetryToken {
        self.initial_token(budget, |budget| budget.deposit_at(now))
    }

    fn refresh_retry_token(
        &self,
        mut token: RetryToken,
        failure: &Classification,
        request: &RequestFacts,
        time_left: Option<Duration>,
    ) -> Result<RetryToken, GiveUp> {
        if !failure.is_retryable(request) {
            return Err(GiveUp::NotRetryable);
        }
        if token.attempt >= token.max_attempts {
            return Err(GiveUp::AttemptsExhausted);
        }
        let retries_so_far = token.attempt - 1;
        let delay = match failure.delay {
            DelayHint::Exactly(d) => d,
            hint => {
                let rng = token
                    .rng
                    .get_or_insert_with(|| Box::new(self.rng.next_rng()));
                let backoff =
                    self.backoff
                        .delay(retries_so_far, token.delay, failure.throttle, rng);
                match hint {
                    DelayHint::AtLeast(min) => backoff.max(min),
                    _ => backoff,
                }
            }
        };
        if let Some(left) = time_left {
            // The next attempt needs the delay and at least a millisecond more (the
            // least a timeout header can say).
            if delay.saturating_add(MIN_ATTEMPT_TIME) >= left {
                return Err(GiveUp::NotEnoughTime);
            }
        }
        let cost = if failure.timeout {
            RetryCost::Timeout
        } else {
            RetryCost::Failure
        };
        if let Some(budget) = token.budget.as_ref().or(self.budget.as_ref())
            && !budget.withdraw(cost)
        {
            return Err(GiveUp::BudgetExhausted);
        }
        token.attempt += 1;
        token.delay = delay;
        token.last_cost = Some(cost);
        Ok(token)
    }

    fn record_success(&self, token: &RetryToken) {
        if let Some(budget) = token.budget.as_ref().or(self.budget.as_ref()) {
            budget.record_success(token.last_cost);
        }
    }

    fn default_timeouts(&self) -> (Option<Duration>, Option<Duration>) {
        (
            self.attempt_timeout.map(attempt_bound),
            self.overall_timeout.map(|t| t.min(MAX_TIMEOUT)),
        )
    }

    fn attempt_timeout_under_deadline(&self) -> Option<Duration> {
        self.attempt_timeout
            .filter(|_| self.attempt_timeout_set)
            .map(attempt_bound)
    }
}

/// Per-request override (a request extension): never retry this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NoRetry;

/// Per-request override (a request extension): this request is safe to repeat even
/// though its method is not idempotent (for example a gRPC call to a read-only
/// method, or a POST the user knows to be idempotent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idempotent;

/// Marks an attempt a `RetryLayer` already accounted for in a budget (one deposit for the
/// logical request, one withdrawal per retry), so a budget layer below it that holds
/// *the same* budget does not count it again (one holding another budget counts it).
///
/// The `RetryLayer` puts it in the extensions of every attempt it makes of a budgeted
/// request, the first included ([`RetryCall::prepare_attempt`](crate::retry::RetryCall::prepare_attempt)).
/// It travels with the request, so any layer in between — a `Buffer` that hands the
/// request to another task, a spawn — keeps it, and the budget layer reads it with
/// [`RetryCharged::covers`].
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryCharged {
    /// The 1-based attempt number.
    pub attempt: u32,
    /// The budget that counted it.
    pub budget: BudgetId,
}

impl RetryCharged {
    /// The mark of attempt `attempt`, counted by the budget `budget`.
    pub fn new(attempt: u32, budget: BudgetId) -> Self {
        RetryCharged { attempt, budget }
    }

    /// Whether a request with these extensions was already accounted for in `budget`
    /// by a `RetryLayer` above.
    pub fn covers(budget: &RetryBudget, extensions: &http::Extensions) -> bool {
        extensions
            .get::<RetryCharged>()
            .is_some_and(|c| c.budget == budget.id())
    }
}
