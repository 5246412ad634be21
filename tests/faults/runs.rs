//! One run per store: the load through the proxy, then the invariants and the JSON
//! summary.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use retrysafe::idempotency::{RecordId, Scope};
use retrysafe::wire::IdempotencyKey;
use retrysafe_postgres::PostgresStore;
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};
use retrysafe_redis::redis;
use retrysafe_test_support::client_stack::{StackCounts, client_stack, client_stack_with};
use retrysafe_test_support::proxy::{FaultMix, FaultProxy, ProxyConfig, ProxyStats};
use retrysafe_test_support::rng::{env_number, seed_from_env};
use retrysafe_test_support::services::database_url;
use tokio::time::Instant;

use super::client::{Outcome, logical};
use super::server::{Backing, ServerSide, start_server};
use super::{Mode, posts};

/// Effects per key as the backend holds them.
async fn effects_of(server: &ServerSide) -> HashMap<String, u32> {
    match (&server.backing, &server.state.effects_table) {
        (Backing::Postgres { store, .. }, Some(table)) => {
            let rows: Vec<(String, i64)> =
                sqlx::query_as(&format!("SELECT key, count(*) FROM {table} GROUP BY key"))
                    .fetch_all(store.pool())
                    .await
                    .unwrap();
            rows.into_iter().map(|(k, n)| (k, n as u32)).collect()
        }
        _ => server.state.effects.lock().unwrap().clone(),
    }
}

/// Record ids of the committed key rows (PostgreSQL).
async fn committed_records(store: &PostgresStore) -> HashSet<Vec<u8>> {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(&format!("SELECT k FROM {}", store.table()))
        .fetch_all(store.pool())
        .await
        .unwrap();
    rows.into_iter().collect()
}

async fn cleanup(backing: &Backing) {
    match backing {
        Backing::Memory => {}
        Backing::Redis { conn, prefix } => {
            let mut conn = conn.clone();
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{prefix}*"))
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            for batch in keys.chunks(1000) {
                let _: redis::RedisResult<i64> =
                    redis::cmd("DEL").arg(batch).query_async(&mut conn).await;
            }
        }
        Backing::Postgres { store, schema } => {
            store.pool().close().await;
            let options = PgConnectOptions::from_str(&database_url()).unwrap();
            if let Ok(mut conn) = PgConnection::connect_with(&options).await {
                let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .execute(&mut conn)
                    .await;
                let _ = conn.close().await;
            }
        }
    }
}

async fn run(mode: Mode) {
    let started = Instant::now();
    let n = posts();
    let concurrency = env_number("FAULT_CONCURRENCY", 64) as usize;
    let run_seed = seed_from_env("FAULT_SEED", "faults");
    let seed = run_seed ^ mode.index();
    let server = start_server(mode, seed).await;
    let mut config = ProxyConfig::new(FaultMix::standard(), seed);
    config.black_hole_hold = Duration::from_secs(20);
    let proxy = FaultProxy::start(server.addr, config).await.unwrap();
    let counts = Arc::new(StackCounts::default());
    // The pair run crashes an instance every 0.15–0.4 s, so many of its attempts fail
    // by design (every connection of the crashed instance is reset). At the default
    // 50 % its breaker once opened under load, and, the driver not pacing, every
    // remaining request was refused at once, before any lease could expire: the run
    // saw no takeover, which is what it is for. There the breaker opens only when every
    // call fails; the other runs keep the default rate and test the breaker under faults.
    let stack = match mode {
        Mode::RedisPair => client_stack_with(seed, &counts, |config| {
            config.with_failure_rate_threshold(100.0)
        }),
        _ => client_stack(seed, &counts),
    };
    let base = format!("http://{}", proxy.addr);

    let outcomes: Vec<(u64, Outcome)> = futures_util::stream::iter(0..n)
        .map(|id| {
            let (stack, base) = (stack.clone(), base.clone());
            async move { (id, logical(stack, base, id).await) }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;

    // Requests already forwarded by the proxy may still be on their way to a handler;
    // then wait for every guarded call the server spawned.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut server = server;
    if let Some(pair) = server.pair.take() {
        pair.settle().await;
    }
    tokio::time::timeout(Duration::from_secs(60), server.shutdown.clone().drain())
        .await
        .expect("the server's guarded calls did not finish");
    let stats: ProxyStats = proxy.stats();
    let effects = effects_of(&server).await;
    let committed = match (&server.backing, mode) {
        (Backing::Postgres { store, .. }, Mode::PostgresTx) => Some(committed_records(store).await),
        _ => None,
    };
    cleanup(&server.backing).await;

    // ----- invariants (checked after the summary is printed)
    let mut violations: Vec<String> = Vec::new();
    let seen = server.state.seen.lock().unwrap().clone();
    for (id, keys) in &seen {
        if keys.len() != 1 {
            violations.push(format!("logical request {id} arrived with keys {keys:?}"));
        }
    }
    let key_of = |id: u64| seen.get(&id).and_then(|k| k.iter().next().cloned());
    let duplicates: Vec<(&String, &u32)> = effects.iter().filter(|(_, n)| **n > 1).collect();
    if !duplicates.is_empty() {
        violations.push(format!("keys with two effects or more: {duplicates:?}"));
    }
    let effects_total: u64 = effects.values().map(|n| u64::from(*n)).sum();
    let mut by_outcome: BTreeMap<String, u64> = BTreeMap::new();
    let mut succeeded = 0u64;
    for (id, outcome) in &outcomes {
        *by_outcome.entry(outcome.label()).or_default() += 1;
        if let Outcome::Succeeded { key } = outcome {
            succeeded += 1;
            if key_of(*id).as_deref() != Some(key.as_str()) {
                violations.push(format!(
                    "logical request {id} succeeded with key {key}, which the server did not \
                     see for it"
                ));
            }
            if effects.get(key).copied() != Some(1) {
                violations.push(format!(
                    "logical request {id} succeeded but its key {key} has {:?} effects",
                    effects.get(key)
                ));
            }
        }
    }
    if !(succeeded <= effects_total && effects_total <= n) {
        violations.push(format!(
            "succeeded {succeeded} <= effects {effects_total} <= logical {n} does not hold"
        ));
    }
    if let Some(committed) = &committed {
        let with_effect: HashSet<Vec<u8>> = effects
            .keys()
            .map(|k| {
                RecordId::new(&Scope::global(), &IdempotencyKey::new(k).unwrap())
                    .as_bytes()
                    .to_vec()
            })
            .collect();
        if committed != &with_effect {
            violations.push(format!(
                "transactional mode: {} committed key rows, {} keys with an effect, {} in both",
                committed.len(),
                with_effect.len(),
                committed.intersection(&with_effect).count()
            ));
        }
    }
    let evicted = server.events.evicted.load(Ordering::Relaxed);
    if evicted != 0 {
        violations.push(format!(
            "{evicted} copies answered response-evicted, but no store here evicts"
        ));
    }
    if mode == Mode::RedisPair && server.events.takeover.load(Ordering::Relaxed) == 0 {
        violations.push("two instances, one crashing, and no takeover".to_owned());
    }
    if by_outcome.contains_key("stuck") {
        violations.push("logical requests stuck past 60 s".to_owned());
    }
    if stats.unframed != 0 {
        violations.push(format!(
            "the proxy could not frame {} connections",
            stats.unframed
        ));
    }

    // ----- the summary
    let attempts = counts.attempts.load(Ordering::Relaxed);
    let retries = counts.retries.load(Ordering::Relaxed);
    let st = &server.state;
    let outcomes_json: Vec<String> = by_outcome
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v}"))
        .collect();
    let give_ups: Vec<String> = counts
        .give_ups
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("\"{k}\":{v}"))
        .collect();
    println!(
        "{{\"store\":\"{}\",\"seed\":{run_seed},\"logical\":{n},\"succeeded\":{succeeded},\
         \"success_rate\":{:.4},\"effects\":{effects_total},\"duplicates\":0,\
         \"attempts\":{attempts},\"retries\":{retries},\"outcomes\":{{{}}},\
         \"give_ups\":{{{}}},\"breaker_opened\":{},\"server\":{{\"handler_calls\":{},\
         \"transient_503\":{},\"fail_after_effect_500\":{},\"events\":{}}},\
         \"proxy\":{{\"connections\":{},\"requests\":{},\"faults\":{}}},\"secs\":{:.1}}}",
        mode.name(),
        succeeded as f64 / n as f64,
        outcomes_json.join(","),
        give_ups.join(","),
        counts.breaker_opened.load(Ordering::Relaxed),
        st.handler_calls.load(Ordering::Relaxed),
        st.transient.load(Ordering::Relaxed),
        st.fail_after_effect.load(Ordering::Relaxed),
        server.events.json(),
        stats.connections,
        stats.requests,
        stats.faults_json(),
        started.elapsed().as_secs_f64(),
    );
    violations.truncate(20);
    assert!(
        violations.is_empty(),
        "{} ({}): {violations:#?}",
        mode.name(),
        run_seed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_memory_store() {
    run(Mode::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_redis_store() {
    run(Mode::Redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_redis_store_default_configuration() {
    run(Mode::RedisDefault).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_redis_two_instances_one_crashing() {
    run(Mode::RedisPair).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_postgres_store() {
    run(Mode::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_postgres_transactional() {
    run(Mode::PostgresTx).await;
}
