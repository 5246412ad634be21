//! The peer of the retry benches: tower's `Retry` with its documented budget pattern —
//! deposit into a `TpsBudget` on success, withdraw for a retry of a 5xx or an error —
//! keeping a copy of the request (method, URI, headers) for a retry, no delay.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Empty;
use tower::retry::budget::{Budget, TpsBudget};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Req = Request<Empty<Bytes>>;

/// tower's documented budget pattern, as a `Policy` (see the module docs).
#[derive(Clone, Debug)]
pub struct TowerPolicy {
    budget: Arc<TpsBudget>,
    attempts_left: u32,
}

impl TowerPolicy {
    /// A policy with a `TpsBudget::default()` of its own and `retries` retries.
    pub fn new(retries: u32) -> Self {
        TowerPolicy {
            budget: Arc::new(TpsBudget::default()),
            attempts_left: retries,
        }
    }
}

impl<R> tower::retry::Policy<Req, Response<R>, BoxError> for TowerPolicy {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut Req,
        result: &mut Result<Response<R>, BoxError>,
    ) -> Option<Self::Future> {
        match result {
            Ok(r) if !r.status().is_server_error() => {
                self.budget.deposit();
                None
            }
            _ if self.attempts_left > 0 && self.budget.withdraw() => {
                self.attempts_left -= 1;
                Some(std::future::ready(()))
            }
            _ => None,
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        let mut clone = Request::new(Empty::new());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}
