use std::sync::Arc;

pub use retrysafe_core::idempotency::{
    Decision, EventKind, IdempotencyEvent, UnknownOutcome, UnknownReason,
};

pub(crate) type EventHook = Arc<dyn Fn(&IdempotencyEvent) + Send + Sync>;
pub(crate) type ReconcileHook = Arc<dyn Fn(&UnknownOutcome) + Send + Sync>;
