use std::sync::Arc;

use bytes::Bytes;
use http::Response;

pub use retrysafe_core::problem::{Problem, ProblemKind};

/// Replaces the layer's problem responses. The layer still adds `do-not-retry` and
/// `retry-after` where a case requires them, and the [`Problem`] extension.
pub(crate) type Responder = Arc<dyn Fn(&Problem) -> Response<Bytes> + Send + Sync>;
