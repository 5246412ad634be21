//! `FloorLayer`: not a product, a yardstick for the capacity of the `IdempotencyLayer`
//! — the least per-request work a server-side idempotency guard over an in-memory
//! store must do, written as one hand-made middleware with nothing else:
//!
//! - the `Idempotency-Key` header read and validated, the scope taken from the
//!   request's `Principal` (hashed once per principal, as the layer does);
//! - the request body read whole and fingerprinted (the same `Fingerprinter`: method,
//!   path, query, `content-type`, body), the record id hashed (the same `RecordId`);
//! - one lock of one map to claim the key (a replay answers from the stored record, a
//!   different fingerprint 422, a claim in flight 409);
//! - the handler called with the body, its response body read whole (the capture);
//! - one lock to store the completed record (status, headers, body, fingerprint) in a
//!   FIFO bounded by bytes, the oldest records dropped past the bound;
//! - the answer rebuilt from the captured parts; a replay's from a clone of the record
//!   (headers cloned, the body's `Bytes` shared) with `idempotent-replayed: true`.
//!
//! [`FloorLayer::with_store`] is the same guard over a `MemoryStore` instead of its own
//! map (claim, then complete, through the public `IdempotencyStore` API; a replay is the
//! claim's existing completed record): the layer's work less the store's, so that the
//! two can be told apart.
//!
//! What it leaves out, all of it required of the `IdempotencyLayer` by DESIGN.md: the
//! lease (its expiry, renewal and fencing token) and `max_execution`, the bounds on
//! the body read and on the store's calls (timers), the detachable task that finishes a
//! request whose caller went away, per-scope fairness and the in-flight bound,
//! tombstones and `outcome-unknown` records, the recovery of a crashed claim, a
//! `RequestInfo` for the reconciler, the `IdempotencyContext` given to the handler,
//! header filtering of the stored response, the store's trait object and its encoded
//! record format, problem+json errors, tracing and metrics.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::header::HeaderValue;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use bytes::Bytes;
use http_body_util::BodyExt;
use retrysafe_core::idempotency::{CommitPoint, Completed, Record, Token};
use retrysafe_core::idempotency::{
    Fingerprint, Fingerprinter, Principal, RecordId, Scope, StoredResponse,
};
use retrysafe_core::store::IdempotencyStore;
use retrysafe_core::store::{Claim, ClaimOutcome};
use retrysafe_core::wire::IdempotencyKey;
use retrysafe_memory::MemoryStore;
use std::time::Duration;
use tower::{Layer, Service, ServiceExt};

/// The floor's guard over the routes it wraps, with `max_bytes` of records.
#[derive(Clone, Debug)]
pub struct FloorLayer {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    fingerprinter: Fingerprinter,
    records: Mutex<Records>,
    max_bytes: usize,
    /// Records kept in a `MemoryStore` instead of `records`.
    store: Option<MemoryStore>,
}

/// The lease and retention a store-backed floor claims with (the layer's defaults).
const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Default)]
struct Records {
    map: HashMap<RecordId, Slot>,
    order: VecDeque<(RecordId, usize)>,
    bytes: usize,
}

#[derive(Debug)]
enum Slot {
    InFlight,
    Done(Arc<Stored>),
}

#[derive(Debug)]
struct Stored {
    fingerprint: Fingerprint,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl FloorLayer {
    /// The guard over its own map, keeping at most `max_bytes` of records.
    pub fn new(max_bytes: usize) -> Self {
        FloorLayer {
            state: Arc::new(State {
                fingerprinter: Fingerprinter::default(),
                records: Mutex::new(Records::default()),
                max_bytes,
                store: None,
            }),
        }
    }

    /// The floor over `store` instead of its own map.
    pub fn with_store(store: MemoryStore) -> Self {
        FloorLayer {
            state: Arc::new(State {
                fingerprinter: Fingerprinter::default(),
                records: Mutex::new(Records::default()),
                max_bytes: 0,
                store: Some(store),
            }),
        }
    }
}

impl<S> Layer<S> for FloorLayer {
    type Service = FloorService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FloorService {
            inner,
            state: Arc::clone(&self.state),
        }
    }
}

/// The service of [`FloorLayer`].
#[derive(Clone, Debug)]
pub struct FloorService<S> {
    inner: S,
    state: Arc<State>,
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S> Service<Request<Body>> for FloorService<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let state = Arc::clone(&self.state);
        Box::pin(async move { Ok(guard(inner, &state, request).await) })
    }
}

fn status(code: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = code;
    response
}

async fn guard<S>(inner: S, state: &State, request: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    let Some(key) = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| IdempotencyKey::new(v).ok())
    else {
        return status(StatusCode::BAD_REQUEST);
    };
    let Some(principal) = request.extensions().get::<Principal>() else {
        return status(StatusCode::UNAUTHORIZED);
    };
    let id = RecordId::new(&Scope::from(principal), &key);
    let (parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return status(StatusCode::BAD_REQUEST);
    };
    let fingerprint =
        state
            .fingerprinter
            .fingerprint(&parts.method, &parts.uri, &parts.headers, &body);
    if let Some(store) = &state.store {
        return guard_store(
            inner,
            store,
            id,
            fingerprint,
            Request::from_parts(parts, body),
        )
        .await;
    }
    if let Some(answer) = claim(state, id, fingerprint) {
        return answer;
    }
    let Ok(response) = inner
        .oneshot(Request::from_parts(parts, Body::from(body)))
        .await;
    let (head, body) = response.into_parts();
    let body = match body.collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            let mut records = state.records.lock().unwrap_or_else(PoisonError::into_inner);
            records.map.remove(&id);
            return status(StatusCode::BAD_GATEWAY);
        }
    };
    let stored = Stored {
        fingerprint,
        status: head.status,
        headers: head.headers.clone(),
        body: body.clone(),
    };
    keep(state, id, stored);
    Response::from_parts(head, Body::from(body))
}

/// Claims `id` in the map (`None`), or answers the copy: a replay of the same request,
/// 422 for another one, 409 while the first is in flight.
fn claim(state: &State, id: RecordId, fingerprint: Fingerprint) -> Option<Response<Body>> {
    let mut records = state.records.lock().unwrap_or_else(PoisonError::into_inner);
    match records.map.get(&id) {
        Some(Slot::Done(stored)) if stored.fingerprint == fingerprint => {
            let stored = Arc::clone(stored);
            drop(records);
            Some(replay(&stored))
        }
        Some(Slot::Done(_)) => Some(status(StatusCode::UNPROCESSABLE_ENTITY)),
        Some(Slot::InFlight) => Some(status(StatusCode::CONFLICT)),
        None => {
            records.map.insert(id, Slot::InFlight);
            None
        }
    }
}

/// Stores the response of `id`, dropping the oldest records past the byte bound.
fn keep(state: &State, id: RecordId, stored: Stored) {
    let size = 32 + 64 + stored.body.len() + stored.headers.len() * 64;
    let mut records = state.records.lock().unwrap_or_else(PoisonError::into_inner);
    records.map.insert(id, Slot::Done(Arc::new(stored)));
    records.order.push_back((id, size));
    records.bytes += size;
    while records.bytes > state.max_bytes {
        let Some((oldest, size)) = records.order.pop_front() else {
            break;
        };
        records.map.remove(&oldest);
        records.bytes -= size;
    }
}

fn replay(stored: &Stored) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = stored.status;
    let headers = response.headers_mut();
    headers.reserve(stored.headers.len() + 1);
    headers.extend(stored.headers.iter().map(|(k, v)| (k.clone(), v.clone())));
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    response
}

/// The floor's guard over a `MemoryStore`: claim, run, complete; or answer from the
/// record the claim found.
async fn guard_store<S>(
    inner: S,
    store: &MemoryStore,
    id: RecordId,
    fingerprint: Fingerprint,
    request: Request<Bytes>,
) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    let token = Token::random();
    let claim = Claim::new(
        token,
        fingerprint,
        LEASE,
        RETENTION,
        CommitPoint::Undeclared,
    );
    match store.claim(&id, &claim).await {
        Ok(ClaimOutcome::Claimed { .. }) => {}
        Ok(ClaimOutcome::Existing {
            record: Record::Completed(done),
            ..
        }) if done.fingerprint == fingerprint => {
            let Some(stored) = done.response else {
                return status(StatusCode::CONFLICT);
            };
            let mut response = Response::new(Body::from(stored.body));
            *response.status_mut() = stored.status;
            let headers = response.headers_mut();
            headers.reserve(stored.headers.len() + 1);
            headers.extend(stored.headers.into_iter().map(|(k, v)| (Some(k), v)));
            headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
            return response;
        }
        Ok(_) => return status(StatusCode::CONFLICT),
        Err(_) => return status(StatusCode::SERVICE_UNAVAILABLE),
    }
    let Ok(response) = inner.oneshot(request.map(Body::from)).await;
    let (head, body) = response.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        let _ = store.release(&id, token).await;
        return status(StatusCode::BAD_GATEWAY);
    };
    let headers = head
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let stored = StoredResponse::new(head.status, headers, body.clone(), Vec::new());
    let done = Completed::new(fingerprint, Some(stored));
    if store.complete(&id, token, &done, RETENTION).await.is_err() {
        return status(StatusCode::SERVICE_UNAVAILABLE);
    }
    Response::from_parts(head, Body::from(body))
}
