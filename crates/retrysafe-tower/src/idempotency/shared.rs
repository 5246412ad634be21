//! What every request of one layer shares: its settings — the [`Rules`] it guards by,
//! the [`Answers`] it writes, its [`Telemetry`] — and its state in flight (the bound of
//! guarded requests and the tracked tasks).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http::Response;
use retrysafe_core::__private::Validate;
use retrysafe_core::__private::protocol::Policy;
use retrysafe_core::idempotency::Scope;
use tokio_util::task::TaskTracker;

use super::answers::Answers;
use super::body::ResponseBody;
use super::problem::ProblemKind;
use super::rules::Rules;
use super::slots::{self, Slot, Slots};
use super::telemetry::Telemetry;

/// The default bound of guarded requests in flight.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 1024;

/// A layer's settings, set by its builder methods.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) rules: Rules,
    pub(crate) answers: Answers,
    pub(crate) telemetry: Telemetry,
    /// The settings a setter refused, reported by `build`.
    pub(crate) checks: Validate,
}

/// A layer's state in flight, shared by every clone of it and its services.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub(crate) slots: Slots,
    pub(crate) tracker: TaskTracker,
    /// The missing scope (a configuration error) is logged once.
    pub(crate) scope_warned: AtomicBool,
}

impl InFlight {
    pub(crate) fn new(max_in_flight: usize, tracker: TaskTracker) -> Self {
        InFlight {
            slots: Slots::new(max_in_flight),
            tracker,
            scope_warned: AtomicBool::new(false),
        }
    }
}

/// What every request of one layer shares: its settings and its state in flight. A
/// backend gets it with every request it runs, to answer and report as the layer does.
#[derive(Clone)]
pub struct Shared {
    pub(crate) config: Arc<Config>,
    pub(crate) in_flight: Arc<InFlight>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("rules", &self.config.rules)
            .field("bound", &self.in_flight.slots.bound())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn new(rolls_back: bool) -> Self {
        Shared {
            config: Arc::new(Config {
                rules: Rules::new(rolls_back),
                answers: Answers::default(),
                telemetry: Telemetry::default(),
                checks: Validate::new(),
            }),
            in_flight: Arc::new(InFlight::new(DEFAULT_MAX_IN_FLIGHT, TaskTracker::new())),
        }
    }

    /// The rules the layer guards by.
    pub(crate) fn rules(&self) -> &Rules {
        &self.config.rules
    }

    /// How the layer answers.
    pub fn answers(&self) -> &Answers {
        &self.config.answers
    }

    /// What the layer reports.
    pub fn telemetry(&self) -> &Telemetry {
        &self.config.telemetry
    }

    /// The protocol's settings for this layer.
    pub fn policy(&self) -> &Policy {
        &self.config.rules.policy
    }

    /// How long a completed record is kept.
    pub fn retention(&self) -> Duration {
        self.config.rules.retention
    }

    /// The layer's answer of `kind`, with the `retry-after` and `do-not-retry` its case
    /// requires (see [`Policy::problem`]).
    pub fn problem_of<B>(
        &self,
        kind: ProblemKind,
        detail: &'static str,
    ) -> Response<ResponseBody<B>> {
        self.answers().problem(self.policy().problem(kind, detail))
    }

    /// A slot of the in-flight bound for a request of `scope` (none: a request without
    /// a key), within the scope's fair share; `None` when the bound is full or the scope
    /// holds its share.
    pub(crate) fn slot(&self, scope: Option<&Scope>) -> Option<Slot> {
        let slots = &self.in_flight.slots;
        let share = self
            .rules()
            .max_in_flight_per_scope
            .unwrap_or_else(|| slots::default_share(slots.bound()));
        slots.acquire(scope, share)
    }

    /// Runs `work` in the background, tracked like the guarded requests, so a graceful
    /// shutdown waits for it.
    pub fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.in_flight.tracker.spawn(work));
    }
}
