//! The two forms of the standard client stack that the behavioural tests run on alike,
//! so that they cannot drift: the separate layers stacked by hand (`DeadlineLayer` →
//! `RetryLayer` → `RetryBudgetLayer` → `CircuitBreakerLayer`) and `ClientLayers`, one
//! fused service; for reqwest ([`reqwest`]), the separate middleware and
//! `ClientMiddlewares`. A test describes its stack once, as a [`Client`] (or a
//! [`reqwest::Stack`]), and builds it in the form it is given; [`both_forms!`](crate::both_forms) runs it
//! once per form.

pub mod reqwest;

use std::time::Duration;

use retrysafe_core::budget::RetryBudget;
use retrysafe_core::strategy::StandardRetryStrategy;
use retrysafe_tower::breaker::CircuitBreakerLayer;
use retrysafe_tower::budget::RetryBudgetLayer;
use retrysafe_tower::client::ClientLayers;
use retrysafe_tower::deadline::DeadlineLayer;
use retrysafe_tower::retry::RetryLayer;
use tower::ServiceBuilder;
use tower::layer::util::{Identity, Stack};
use tower::util::Either;

/// Which form of the stack a test builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `DeadlineLayer` → `RetryLayer` → `RetryBudgetLayer` → `CircuitBreakerLayer`
    /// (reqwest: `DeadlineMiddleware` → `RetryMiddleware` → `CircuitBreakerMiddleware`).
    Separate,
    /// `ClientLayers`, one fused service (reqwest: `ClientMiddlewares`, one fused
    /// middleware).
    Fused,
}

impl Default for Client {
    fn default() -> Self {
        Self::new()
    }
}

/// The separate layers, outermost first (the deadline only when one is set).
pub type Separate = ServiceBuilder<
    Stack<
        CircuitBreakerLayer,
        Stack<
            RetryBudgetLayer,
            Stack<RetryLayer, Stack<Either<DeadlineLayer, Identity>, Identity>>,
        >,
    >,
>;

/// The layer of either form: its services answer alike, `Response<ResponseBody<B>>`
/// or a `BoxError`.
pub type FormLayer = Either<Separate, ClientLayers>;

/// One description of a client stack: the same settings for both forms.
#[derive(Debug)]
pub struct Client {
    deadline: Option<Duration>,
    retry: RetryLayer,
    strategy: StandardRetryStrategy,
    budget: RetryBudget,
    breaker: CircuitBreakerLayer,
}

impl Client {
    /// No deadline, `RetryLayer::new()` with `StandardRetryStrategy::new()`, a ratio
    /// budget and a default breaker of the stack's own.
    pub fn new() -> Self {
        Client {
            deadline: None,
            retry: RetryLayer::new(),
            strategy: StandardRetryStrategy::new(),
            budget: RetryBudget::ratio(),
            breaker: CircuitBreakerLayer::default(),
        }
    }

    /// A deadline on every whole call.
    pub fn deadline(mut self, timeout: Duration) -> Self {
        self.deadline = Some(timeout);
        self
    }

    /// The retry layer's settings but its strategy (hooks, keys, convention, cap…):
    /// its strategy is replaced by [`strategy`](Self::strategy).
    pub fn retry(mut self, retry: RetryLayer) -> Self {
        self.retry = retry;
        self
    }

    /// The retry strategy; its budget is replaced by [`budget`](Self::budget).
    pub fn strategy(mut self, strategy: StandardRetryStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The budget, given once: the retry layer's and the budget layer's.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The breaker layer.
    pub fn breaker(mut self, breaker: CircuitBreakerLayer) -> Self {
        self.breaker = breaker;
        self
    }

    /// The stack in `form`, as a layer (clone it for more services of one stack).
    pub fn layer(self, form: Form) -> FormLayer {
        let strategy = self.strategy.budget(self.budget.clone());
        let retry = self.retry.strategy(strategy);
        match form {
            Form::Separate => Either::Left(
                ServiceBuilder::new()
                    .option_layer(self.deadline.map(DeadlineLayer::new))
                    .layer(retry)
                    .layer(RetryBudgetLayer::new(self.budget))
                    .layer(self.breaker),
            ),
            Form::Fused => {
                let mut layers = ClientLayers::new()
                    .retry(retry)
                    .budget(self.budget)
                    .breaker(self.breaker);
                if let Some(timeout) = self.deadline {
                    layers = layers.deadline(timeout);
                }
                Either::Right(layers)
            }
        }
    }
}

/// Runs a test once per [`Form`], as the tests `NAME::separate` and `NAME::fused`.
///
/// Two shapes: `both_forms!(name)` (extra `#[tokio::test]` arguments after it, as in
/// `both_forms!(name, start_paused = true)`) runs the test body `async fn name(form:
/// Form)` defined beside it; and
///
/// ```ignore
/// both_forms! {
///     /// What it checks.
///     #[tokio::test]
///     async fn a_test(form) {
///         let client = Stack::new().client(form);
///         // ...
///     }
/// }
/// ```
///
/// defines the body inline, with its attributes (the test one included) on both tests.
#[macro_export]
macro_rules! both_forms {
    ($(
        $(#[$attr:meta])*
        async fn $name:ident($form:ident) $body:block
    )+) => {$(
        mod $name {
            #[allow(clippy::wildcard_imports)]
            use super::*;

            async fn body($form: $crate::forms::Form) $body

            $(#[$attr])*
            async fn separate() {
                body($crate::forms::Form::Separate).await;
            }

            $(#[$attr])*
            async fn fused() {
                body($crate::forms::Form::Fused).await;
            }
        }
    )+};
    ($name:ident $(, $($arg:tt)*)?) => {
        mod $name {
            #[tokio::test$(($($arg)*))?]
            async fn separate() {
                super::$name($crate::forms::Form::Separate).await;
            }

            #[tokio::test$(($($arg)*))?]
            async fn fused() {
                super::$name($crate::forms::Form::Fused).await;
            }
        }
    };
}
