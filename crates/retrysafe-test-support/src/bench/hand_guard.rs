//! The server yardstick: the idempotency guard a competent user would write in an
//! afternoon with `axum::middleware::from_fn`, and nothing more.
//!
//! It checks the `Idempotency-Key`, fingerprints the request (SHA-256 of method, path,
//! content-type and body), claims the key in one sharded `HashMap`, runs the handler,
//! captures the response body and stores it; a repeat replays from the map with
//! `idempotent-replayed: true`. A concurrent copy gets 409, a reused key with another
//! request 422; a 5xx or an unreadable answer frees the key.
//!
//! What it does not do, and `IdempotencyLayer` does: no bound on memory and no expiry,
//! no tenant scope on keys, no store shared by replicas or surviving a restart, no
//! recovery of a key whose handler was cancelled or panicked (it stays claimed), no
//! stored headers but content-type, no telemetry.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

const SHARDS: usize = 16;
const MAX_BODY: usize = 1 << 20;

#[derive(Debug)]
enum Entry {
    Running([u8; 32]),
    Done([u8; 32], StatusCode, Option<HeaderValue>, Bytes),
}

/// The guard's map: `SHARDS` mutex-guarded `HashMap`s, picked by the key's hash.
#[derive(Clone, Debug, Default)]
pub struct HandStore {
    shards: Arc<[Mutex<HashMap<String, Entry>>; SHARDS]>,
    hasher: RandomState,
}

impl HandStore {
    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let i = usize::from(self.hasher.hash_one(key).to_le_bytes()[0]) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The guard, for `axum::middleware::from_fn_with_state(HandStore::default(), hand_guard)`.
pub async fn hand_guard(State(store): State<HandStore>, req: Request, next: Next) -> Response {
    let Some(key) = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    else {
        return next.run(req).await;
    };
    let key = key.to_owned();
    let (parts, body) = req.into_parts();
    let Ok(body) = to_bytes(body, MAX_BODY).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let mut sha = Sha256::new();
    for part in [
        parts.method.as_str().as_bytes(),
        parts.uri.path().as_bytes(),
    ] {
        sha.update(part);
        sha.update([0]);
    }
    sha.update(
        parts
            .headers
            .get(CONTENT_TYPE)
            .map_or(&b""[..], |v| v.as_bytes()),
    );
    sha.update([0]);
    sha.update(&body);
    let fingerprint: [u8; 32] = sha.finalize().into();
    {
        let mut shard = store.shard(&key);
        match shard.get(&key) {
            Some(Entry::Running(f) | Entry::Done(f, ..)) if *f != fingerprint => {
                return StatusCode::UNPROCESSABLE_ENTITY.into_response();
            }
            Some(Entry::Running(_)) => return StatusCode::CONFLICT.into_response(),
            Some(Entry::Done(_, status, content_type, body)) => {
                let mut res = (*status, body.clone()).into_response();
                if let Some(content_type) = content_type {
                    res.headers_mut().insert(CONTENT_TYPE, content_type.clone());
                }
                res.headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return res;
            }
            None => shard.insert(key.clone(), Entry::Running(fingerprint)),
        };
    }
    let (parts, body) = next
        .run(Request::from_parts(parts, Body::from(body)))
        .await
        .into_parts();
    let Ok(body) = to_bytes(body, MAX_BODY).await else {
        store.shard(&key).remove(&key);
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if parts.status.is_server_error() {
        store.shard(&key).remove(&key);
    } else {
        let content_type = parts.headers.get(CONTENT_TYPE).cloned();
        let done = Entry::Done(fingerprint, parts.status, content_type, body.clone());
        store.shard(&key).insert(key, done);
    }
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::routing::post;
    use tokio::sync::Notify;
    use tower::ServiceExt;

    use super::*;

    fn post_with(key: &str, body: &'static str) -> Request {
        Request::post("/pay")
            .header("idempotency-key", key)
            .header(CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap()
    }

    async fn read(res: Response) -> (StatusCode, bool, Bytes) {
        let replayed = res.headers().contains_key("idempotent-replayed");
        let status = res.status();
        (
            status,
            replayed,
            to_bytes(res.into_body(), MAX_BODY).await.unwrap(),
        )
    }

    #[tokio::test]
    async fn runs_once_replays_and_refuses_another_request_on_the_key() {
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let app = Router::new()
            .route(
                "/pay",
                post(move || async move {
                    let n = counted.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, format!("payment {n}"))
                }),
            )
            .layer(axum::middleware::from_fn_with_state(
                HandStore::default(),
                hand_guard,
            ));
        let first = read(app.clone().oneshot(post_with("k", "{}")).await.unwrap()).await;
        assert_eq!(
            first,
            (StatusCode::CREATED, false, Bytes::from("payment 0"))
        );
        let again = read(app.clone().oneshot(post_with("k", "{}")).await.unwrap()).await;
        assert_eq!(again, (StatusCode::CREATED, true, Bytes::from("payment 0")));
        let other = read(
            app.clone()
                .oneshot(post_with("k", "{\"a\":1}"))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_concurrent_copy_gets_409_and_a_5xx_frees_the_key() {
        let entered = Arc::new(Notify::new());
        let release = Arc::new(Notify::new());
        let (e, r) = (Arc::clone(&entered), Arc::clone(&release));
        let app = Router::new()
            .route(
                "/pay",
                post(move || async move {
                    e.notify_one();
                    r.notified().await;
                    StatusCode::SERVICE_UNAVAILABLE
                }),
            )
            .layer(axum::middleware::from_fn_with_state(
                HandStore::default(),
                hand_guard,
            ));
        let running = tokio::spawn(app.clone().oneshot(post_with("k", "{}")));
        entered.notified().await;
        let copy = read(app.clone().oneshot(post_with("k", "{}")).await.unwrap()).await;
        assert_eq!(copy.0, StatusCode::CONFLICT);
        release.notify_one();
        let done = read(running.await.unwrap().unwrap()).await;
        assert_eq!(done.0, StatusCode::SERVICE_UNAVAILABLE);
        let retried = tokio::spawn(app.oneshot(post_with("k", "{}")));
        entered.notified().await;
        release.notify_one();
        assert_eq!(
            read(retried.await.unwrap().unwrap()).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
