//! The client stack of the reqwest tests, in either [`Form`]: the separate middleware
//! added one by one, or the fused middleware of `ClientMiddlewares`.
//!
//! Both forms are the same stack: the separate retry middleware charges the stack's
//! budget (given to its strategy) as `ClientMiddlewares` charges the one given with
//! `.budget`, and both have the stack's breaker (by default a fresh one each).

use std::sync::Arc;
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware};
use retrysafe_core::DeadlineExpiry;
use retrysafe_core::budget::{BudgetSnapshot, RetryBudget};
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_reqwest::{
    CircuitBreakerMiddleware, ClientMiddlewares, DeadlineMiddleware, RetryMiddleware,
};

use super::Form;

type ExpiryHook = Arc<dyn Fn(&DeadlineExpiry) + Send + Sync>;

/// The client stack of a test, in either [`Form`].
#[must_use]
pub struct Stack {
    deadline: Option<Duration>,
    on_expiry: Option<ExpiryHook>,
    retry: RetryMiddleware,
    strategy: StandardRetryStrategy,
    budget: RetryBudget,
    breaker: CircuitBreakerMiddleware,
    below: Vec<Arc<dyn Middleware>>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("deadline", &self.deadline)
            .field("below", &self.below.len())
            .finish_non_exhaustive()
    }
}

impl Default for Stack {
    fn default() -> Self {
        Self::new()
    }
}

impl Stack {
    /// No deadline of its own, `RetryMiddleware::new()` with the standard strategy, a
    /// ratio budget and a default breaker of its own.
    pub fn new() -> Self {
        Stack {
            deadline: None,
            on_expiry: None,
            retry: RetryMiddleware::new(),
            strategy: StandardRetryStrategy::new(),
            budget: RetryBudget::ratio(),
            breaker: CircuitBreakerMiddleware::default(),
            below: Vec::new(),
        }
    }

    /// A deadline of `timeout` for every call, outermost.
    pub fn deadline(mut self, timeout: Duration) -> Self {
        self.deadline = Some(timeout);
        self
    }

    /// The deadline's expiry hook.
    pub fn on_expiry(mut self, f: impl Fn(&DeadlineExpiry) + Send + Sync + 'static) -> Self {
        self.on_expiry = Some(Arc::new(f));
        self
    }

    /// The retry middleware (hooks, keys, classifier...). Its strategy is replaced by
    /// the stack's [`strategy`](Self::strategy), which carries the stack's budget.
    pub fn retry(mut self, retry: RetryMiddleware) -> Self {
        self.retry = retry;
        self
    }

    /// The retry strategy; its budget is replaced by the stack's.
    pub fn strategy(mut self, strategy: StandardRetryStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The retry budget every call charges.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The breaker every attempt passes.
    pub fn breaker(mut self, breaker: CircuitBreakerMiddleware) -> Self {
        self.breaker = breaker;
        self
    }

    /// A middleware below the stack (called once per attempt, after the breaker).
    pub fn below(mut self, middleware: impl Middleware) -> Self {
        self.below.push(Arc::new(middleware));
        self
    }

    /// The client, in `form`.
    pub fn client(self, form: Form) -> ClientWithMiddleware {
        let retry = self
            .retry
            .strategy(self.strategy.budget(self.budget.clone()));
        let builder = ClientBuilder::new(reqwest::Client::new());
        let builder = match form {
            Form::Separate => {
                let builder = match self.deadline {
                    Some(timeout) => {
                        let mut deadline = DeadlineMiddleware::new(timeout);
                        if let Some(hook) = self.on_expiry {
                            deadline = deadline.on_expiry(move |e| hook(e));
                        }
                        builder.with(deadline.build().unwrap())
                    }
                    None => builder,
                };
                builder.with(retry).with(self.breaker)
            }
            Form::Fused => {
                let mut stack = ClientMiddlewares::new();
                if let Some(timeout) = self.deadline {
                    stack = stack.deadline(timeout);
                }
                if let Some(hook) = self.on_expiry {
                    stack = stack.on_expiry(move |e| hook(e));
                }
                stack
                    .retry(retry)
                    .budget(self.budget)
                    .breaker(self.breaker)
                    .build()
                    .unwrap()
                    .apply(builder)
            }
        };
        self.below
            .into_iter()
            .fold(builder, ClientBuilder::with_arc)
            .build()
    }
}

/// A ratio budget's deposits and withdrawals in its current window.
pub fn budget_counts(budget: &RetryBudget) -> (u64, u64) {
    match budget.snapshot() {
        BudgetSnapshot::Ratio {
            deposits,
            withdrawals,
            ..
        } => (deposits, withdrawals),
        other => panic!("not a ratio budget: {other:?}"),
    }
}
