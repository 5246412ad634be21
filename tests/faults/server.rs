//! The server side: the handler (effects per key, transient 503s, 500s after the effect),
//! its app state, the stores it runs on, and the crashing pair of `redis_pair`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response as AxumResponse};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http::StatusCode;
use retrysafe::idempotency::IdempotencyContext;
use retrysafe::idempotency::{
    EventKind, IdempotencyEvent, IdempotencyLayer, MemoryStore, NoEffect, Shutdown,
};
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx;
use retrysafe_postgres::tx::{IdempotentTx, TxBackend, TxIdempotencyLayer};
use retrysafe_redis::RedisStore;
use retrysafe_redis::redis::{self, aio::ConnectionManager};
use retrysafe_test_support::rng::SplitMix64;
use retrysafe_test_support::services::{database_url, redis_url, unique};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use super::{FAIL_AFTER_EFFECT_PER_MILLE, Mode, PAD, TRANSIENT_PER_MILLE};

#[derive(Debug, Default)]
pub(super) struct Events {
    claimed: AtomicU64,
    replayed: AtomicU64,
    conflict: AtomicU64,
    mismatch: AtomicU64,
    pub(super) takeover: AtomicU64,
    outcome_unknown: AtomicU64,
    completion_lost: AtomicU64,
    /// Copies answered 409 `response-evicted` (the layer's `evicted` event): none here,
    /// since no store of these runs evicts (the `MemoryStore` keeps its 64 MiB).
    pub(super) evicted: AtomicU64,
    /// Copies that found their record `outcome_unknown` (500) or pending (503).
    unknown: AtomicU64,
    pending: AtomicU64,
    /// Requests refused for their key, scope or body, or for the store or a bound.
    invalid: AtomicU64,
    unavailable: AtomicU64,
    other: AtomicU64,
    /// Calls of the reconcile hook (`on_outcome_unknown`).
    reconcile: AtomicU64,
    /// Records resolved by a reconciler, and instance crashes (`redis_pair`).
    resolved: AtomicU64,
    crashes: AtomicU64,
}

impl Events {
    fn count(&self, event: &IdempotencyEvent) {
        let c = match event.kind {
            EventKind::Claimed => &self.claimed,
            EventKind::Replayed => &self.replayed,
            EventKind::Conflict => &self.conflict,
            EventKind::Mismatch => &self.mismatch,
            EventKind::Takeover => &self.takeover,
            EventKind::OutcomeUnknown => &self.outcome_unknown,
            EventKind::CompletionLost => &self.completion_lost,
            EventKind::Evicted => &self.evicted,
            EventKind::Unknown => &self.unknown,
            EventKind::Pending => &self.pending,
            EventKind::Invalid => &self.invalid,
            EventKind::Unavailable => &self.unavailable,
            _ => &self.other,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn json(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "{{\"claimed\":{},\"replayed\":{},\"conflict\":{},\"mismatch\":{},\"takeover\":{},\
             \"outcome_unknown\":{},\"completion_lost\":{},\"evicted\":{},\"unknown\":{},\
             \"pending\":{},\"invalid\":{},\"unavailable\":{},\"reconcile_hook\":{},\
             \"resolved\":{},\"crashes\":{}}}",
            g(&self.claimed),
            g(&self.replayed),
            g(&self.conflict),
            g(&self.mismatch),
            g(&self.takeover),
            g(&self.outcome_unknown),
            g(&self.completion_lost),
            g(&self.evicted),
            g(&self.unknown),
            g(&self.pending),
            g(&self.invalid),
            g(&self.unavailable),
            g(&self.reconcile),
            g(&self.resolved),
            g(&self.crashes),
        )
    }
}

#[derive(Debug)]
pub(super) struct AppState {
    /// Key → effects (not used with the transactional layer: rows count there).
    pub(super) effects: Mutex<HashMap<String, u32>>,
    /// Logical request id → the keys it arrived with.
    pub(super) seen: Mutex<HashMap<u64, HashSet<String>>>,
    rng: Mutex<SplitMix64>,
    /// `schema.effects` with the transactional layer.
    pub(super) effects_table: Option<String>,
    pub(super) transient: AtomicU64,
    pub(super) fail_after_effect: AtomicU64,
    pub(super) handler_calls: AtomicU64,
    /// Key → the 201 body of its effect (what a resolver answers).
    answers: Mutex<HashMap<String, Bytes>>,
    /// The longest wait before the commit point, in ms (`redis_pair`: so that crashes
    /// find requests in flight).
    max_delay_ms: u64,
}

#[derive(Debug, Deserialize)]
pub(super) struct Pay {
    id: u64,
    #[allow(dead_code, reason = "padding: only its size matters")]
    pad: String,
}

fn problem(status: StatusCode, slug: &str) -> AxumResponse {
    let body = json!({
        "type": format!("urn:retrysafe-test:faults:{slug}"),
        "title": slug,
        "status": status.as_u16(),
    });
    (
        status,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

pub(super) async fn pay(
    State(st): State<Arc<AppState>>,
    ctx: Option<Extension<IdempotencyContext>>,
    tx: Option<IdempotentTx>,
    Json(p): Json<Pay>,
) -> AxumResponse {
    st.handler_calls.fetch_add(1, Ordering::Relaxed);
    let Some(Extension(ctx)) = ctx else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "not-guarded");
    };
    let key = ctx.key().as_str().to_owned();
    st.seen
        .lock()
        .unwrap()
        .entry(p.id)
        .or_default()
        .insert(key.clone());
    let roll = st.rng.lock().unwrap().below(1000);
    if roll < TRANSIENT_PER_MILLE {
        st.transient.fetch_add(1, Ordering::Relaxed);
        let mut res = problem(StatusCode::SERVICE_UNAVAILABLE, "transient");
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    if st.max_delay_ms > 0 {
        let delay = st.rng.lock().unwrap().below(st.max_delay_ms);
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if ctx.commit_point().await.is_err() {
        let mut res = problem(StatusCode::SERVICE_UNAVAILABLE, "commit-point-failed");
        res.extensions_mut().insert(NoEffect);
        return res;
    }
    match (tx, &st.effects_table) {
        (Some(mut tx), Some(table)) => {
            let insert = format!("INSERT INTO {table} (key, logical) VALUES ($1, $2)");
            let done = sqlx::query(&insert)
                .bind(&key)
                .bind(p.id as i64)
                .execute(&mut *tx)
                .await;
            if done.is_err() {
                // Rolled back with the key: nothing happened.
                return problem(StatusCode::SERVICE_UNAVAILABLE, "effect-failed");
            }
        }
        _ => {
            let body = json!({ "id": p.id, "key": key, "pad": "r".repeat(PAD) }).to_string();
            // The effect and its answer, in one step (a resolver reads both).
            let mut effects = st.effects.lock().unwrap();
            *effects.entry(key.clone()).or_default() += 1;
            st.answers
                .lock()
                .unwrap()
                .insert(key.clone(), Bytes::from(body));
        }
    }
    if roll < TRANSIENT_PER_MILLE + FAIL_AFTER_EFFECT_PER_MILLE {
        st.fail_after_effect.fetch_add(1, Ordering::Relaxed);
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "failed-after-effect");
    }
    let body = json!({ "id": p.id, "key": key, "pad": "r".repeat(PAD) });
    (StatusCode::CREATED, Json(body)).into_response()
}

/// What a store's server needs cleaning up and reading back.
pub(super) enum Backing {
    Memory,
    Redis {
        conn: ConnectionManager,
        prefix: String,
    },
    Postgres {
        store: PostgresStore,
        schema: String,
    },
}

pub(super) struct ServerSide {
    pub(super) addr: SocketAddr,
    pub(super) state: Arc<AppState>,
    pub(super) events: Arc<Events>,
    pub(super) shutdown: Shutdown,
    pub(super) backing: Backing,
    /// The crash loop of `redis_pair`.
    pub(super) pair: Option<pair::Pair>,
}

pub(super) async fn start_server(mode: Mode, seed: u64) -> ServerSide {
    let events = Arc::new(Events::default());
    let ev = Arc::clone(&events);
    let on_event = move |e: &IdempotencyEvent| ev.count(e);
    let ev = Arc::clone(&events);
    let on_unknown = move |_: &retrysafe::idempotency::UnknownOutcome| {
        ev.reconcile.fetch_add(1, Ordering::Relaxed);
    };
    let mut effects_table = None;

    if mode == Mode::RedisPair {
        return pair::start(seed, events).await;
    }
    let (backing, layer) = match mode {
        Mode::RedisPair => unreachable!("started above"),
        Mode::Memory => (
            Backing::Memory,
            Some(IdempotencyLayer::new(MemoryStore::new())),
        ),
        Mode::Redis | Mode::RedisDefault => {
            let url = redis_url();
            let client = redis::Client::open(url.as_str()).unwrap();
            let conn =
                tokio::time::timeout(Duration::from_secs(10), ConnectionManager::new(client))
                    .await
                    .unwrap_or_else(|_| panic!("timed out connecting to Redis at {url}"))
                    .unwrap_or_else(|e| panic!("cannot reach Redis at REDIS_URL={url}: {e}"));
            let prefix = format!("faults-test:{}:", unique());
            let store = RedisStore::options()
                .key_prefix(prefix.clone())
                .call_timeout(Duration::from_secs(2))
                .build(conn.clone())
                .await
                .unwrap();
            (
                Backing::Redis { conn, prefix },
                Some(IdempotencyLayer::new(store)),
            )
        }
        Mode::Postgres | Mode::PostgresTx => {
            let schema = format!("faults_test_{}", unique());
            let store = PostgresStore::options()
                .schema(schema.clone())
                .max_connections(16)
                .call_timeout(Duration::from_secs(2))
                .connect(&database_url())
                .await
                .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {}: {e}", database_url()));
            store.migrate().await.unwrap();
            // Open the pool's connections before the load starts.
            let pings = (0..16).map(|_| sqlx::query("SELECT 1").execute(store.pool()));
            for ping in futures_util::future::join_all(pings).await {
                ping.unwrap();
            }
            let layer = if mode == Mode::Postgres {
                Some(IdempotencyLayer::new(store.clone()))
            } else {
                let table = format!("{schema}.effects");
                sqlx::raw_sql(&format!(
                    "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, \
                     logical bigint NOT NULL)"
                ))
                .execute(store.pool())
                .await
                .unwrap();
                effects_table = Some(table);
                None
            };
            (Backing::Postgres { store, schema }, layer)
        }
    };

    let state = app_state(seed, effects_table, 0);
    let routes = Router::new()
        .route("/pay", post(pay))
        .with_state(Arc::clone(&state));
    let in_flight_hint = Duration::from_millis(200);
    let (router, shutdown) = match layer {
        Some(layer) => {
            let layer = layer.global_scope().require_key();
            let layer = if mode == Mode::RedisDefault {
                layer
            } else {
                layer.handlers_declare_commit_point()
            };
            let layer = layer
                .in_flight_retry_after(in_flight_hint)
                .retention(Duration::from_secs(600))
                .on_event(on_event)
                .on_outcome_unknown(on_unknown);
            let shutdown = layer.shutdown_handle();
            (routes.layer(layer), shutdown)
        }
        None => {
            let Backing::Postgres { store, .. } = &backing else {
                unreachable!()
            };
            let layer = TxIdempotencyLayer::with_backend(TxBackend::from_store(store))
                .global_scope()
                .require_key()
                .in_flight_retry_after(in_flight_hint)
                .retention(Duration::from_secs(600))
                .on_event(on_event);
            let shutdown = layer.shutdown_handle();
            (routes.layer(layer), shutdown)
        }
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    ServerSide {
        addr,
        state,
        events,
        shutdown,
        backing,
        pair: None,
    }
}

fn app_state(seed: u64, effects_table: Option<String>, max_delay_ms: u64) -> Arc<AppState> {
    Arc::new(AppState {
        effects: Mutex::new(HashMap::new()),
        seen: Mutex::new(HashMap::new()),
        rng: Mutex::new(SplitMix64::new(seed ^ 0x5E4E)),
        effects_table,
        transient: AtomicU64::new(0),
        fail_after_effect: AtomicU64::new(0),
        handler_calls: AtomicU64::new(0),
        answers: Mutex::new(HashMap::new()),
        max_delay_ms,
    })
}

/// Two instances on one listening socket, one crashed and restarted again and again
/// (`redis_pair`).
pub(super) mod pair {
    use super::*;
    use retrysafe::idempotency::StoredResponse;
    use retrysafe::recovery::{PendingRecord, ReconcilableStore, Resolution, Resolver};

    /// The lease of a claim: short, so a crashed holder's copies take over soon.
    const LEASE: Duration = Duration::from_millis(300);

    /// Finds a pending key's effect in the handler's own table: the effect happened
    /// (its answer), or it did not and cannot any more (its holder's instance is gone,
    /// or its handler finished: the reconciler waits for both).
    struct Effects(Arc<AppState>, Arc<Events>);

    impl Resolver for Effects {
        async fn resolve(&self, record: &PendingRecord) -> Resolution {
            let Some(key) = record.key() else {
                return Resolution::Unknown;
            };
            let resolution = self.look_up(key.as_str());
            if resolution != Resolution::Unknown {
                self.1.resolved.fetch_add(1, Ordering::Relaxed);
            }
            resolution
        }
    }

    impl Effects {
        fn look_up(&self, key: &str) -> Resolution {
            let effects = self.0.effects.lock().unwrap();
            match self.0.answers.lock().unwrap().get(key) {
                Some(body) => Resolution::Happened(StoredResponse::new(
                    StatusCode::CREATED,
                    vec![(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/json"),
                    )],
                    body.clone(),
                    Vec::new(),
                )),
                None if !effects.contains_key(key) => Resolution::DidNotHappen,
                None => Resolution::Unknown,
            }
        }
    }

    /// One instance: its own runtime, Redis connection, layer and reconciler.
    struct Instance {
        runtime: tokio::runtime::Runtime,
        shutdown: Shutdown,
    }

    pub(crate) struct Pair {
        stop: tokio::sync::watch::Sender<bool>,
        crasher: tokio::task::JoinHandle<Vec<Instance>>,
    }

    impl Pair {
        /// Stops crashing; the guarded calls of the instances still running finish.
        pub(crate) async fn settle(self) {
            let _ = self.stop.send(true);
            let instances = self.crasher.await.unwrap();
            for i in &instances {
                tokio::time::timeout(Duration::from_secs(60), i.shutdown.clone().drain())
                    .await
                    .expect("the instances' guarded calls did not finish");
            }
            for i in instances {
                i.runtime.shutdown_background();
            }
        }
    }

    fn instance(
        listener: &std::net::TcpListener,
        prefix: &str,
        state: &Arc<AppState>,
        events: &Arc<Events>,
    ) -> Instance {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = listener.try_clone().unwrap();
        let (prefix, state, events) = (prefix.to_owned(), Arc::clone(state), Arc::clone(events));
        let (ready, shutdown) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let client = redis::Client::open(redis_url().as_str()).unwrap();
            let conn = ConnectionManager::new(client).await.unwrap();
            let store = RedisStore::options()
                .key_prefix(prefix)
                .call_timeout(Duration::from_secs(2))
                .build(conn)
                .await
                .unwrap();
            let ev = Arc::clone(&events);
            let reconciler = store
                .reconciler(Effects(Arc::clone(&state), Arc::clone(&events)))
                .interval(Duration::from_millis(100))
                .max_execution(Duration::from_secs(2))
                .grace(Duration::from_millis(100))
                .on_outcome_unknown(move |_| {
                    ev.reconcile.fetch_add(1, Ordering::Relaxed);
                })
                .spawn()
                .unwrap();
            let ev = Arc::clone(&events);
            let layer = IdempotencyLayer::new(store)
                .global_scope()
                .require_key()
                .handlers_declare_commit_point()
                .store_keys_for_resolution()
                .lease(LEASE)
                .store_timeout(Duration::from_millis(90))
                .max_execution(Duration::from_secs(2))
                .in_flight_retry_after(Duration::from_millis(200))
                .retention(Duration::from_secs(600))
                .on_event(move |e| ev.count(e))
                .build()
                .unwrap();
            let _ = ready.send(layer.shutdown_handle());
            let router = Router::new()
                .route("/pay", post(pay))
                .with_state(state)
                .layer(layer);
            listener.set_nonblocking(true).unwrap();
            let listener = TcpListener::from_std(listener).unwrap();
            let _reconciler = reconciler;
            let _ = axum::serve(listener, router).await;
        });
        let shutdown = shutdown.recv_timeout(Duration::from_secs(10)).unwrap();
        Instance { runtime, shutdown }
    }

    pub(crate) async fn start(seed: u64, events: Arc<Events>) -> ServerSide {
        let url = redis_url();
        let client = redis::Client::open(url.as_str()).unwrap();
        let conn = tokio::time::timeout(Duration::from_secs(10), ConnectionManager::new(client))
            .await
            .unwrap_or_else(|_| panic!("timed out connecting to Redis at {url}"))
            .unwrap_or_else(|e| panic!("cannot reach Redis at REDIS_URL={url}: {e}"));
        let prefix = format!("faults-test:{}:", unique());
        let state = app_state(seed, None, 100);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let steady = instance(&listener, &prefix, &state, &events);
        let shutdown = steady.shutdown.clone();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let (p, st, ev) = (prefix.clone(), Arc::clone(&state), Arc::clone(&events));
        let crasher = tokio::spawn(async move {
            let mut rng = SplitMix64::new(seed ^ 0xC8A5);
            let mut crashing = instance(&listener, &p, &st, &ev);
            loop {
                let wait = Duration::from_millis(150 + rng.below(250));
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stopped.changed() => return vec![steady, crashing],
                }
                // A crash: every task of the instance is dropped where it stands.
                crashing.runtime.shutdown_background();
                ev.crashes.fetch_add(1, Ordering::Relaxed);
                crashing = instance(&listener, &p, &st, &ev);
            }
        });
        ServerSide {
            addr,
            state,
            events,
            shutdown,
            backing: Backing::Redis { conn, prefix },
            pair: Some(Pair { stop, crasher }),
        }
    }
}
