//! The Redis and PostgreSQL every test shares (`REDIS_URL`, `DATABASE_URL`): their
//! URLs, plain connections, and names unique to one test.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use retrysafe_core::idempotency::Token;
use retrysafe_postgres::sqlx::postgres::PgConnectOptions;
use retrysafe_postgres::sqlx::{self, Connection, PgConnection};

use crate::proxy::FaultProxy;

/// `REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// The development default of `DATABASE_URL`.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL`, or the development default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// Fails the test: PostgreSQL at `DATABASE_URL` cannot be reached.
pub fn pg_unreachable(e: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach PostgreSQL at DATABASE_URL={} ({e}); start it or point DATABASE_URL \
         at a server (default {DEFAULT_DATABASE_URL})",
        database_url()
    )
}

/// The connection options of `DATABASE_URL`; fails the test with a clear message.
pub fn pg_options() -> PgConnectOptions {
    let url = database_url();
    PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("DATABASE_URL={url} is not a PostgreSQL URL: {e}"))
}

/// One plain connection to `DATABASE_URL`, for inspecting and tampering with rows.
pub async fn pg_admin() -> PgConnection {
    PgConnection::connect_with(&pg_options())
        .await
        .unwrap_or_else(|e| pg_unreachable(e))
}

/// Drops the schemas named `<prefix><unix seconds>_…` that earlier runs left (older
/// than an hour), once per prefix and process.
pub async fn drop_stale_schemas(prefix: &str) {
    static DONE: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    if !DONE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(prefix.to_owned())
    {
        return;
    }
    let mut conn = pg_admin().await;
    let pattern = format!("{}%", prefix.replace('_', "\\_"));
    let names: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1")
            .bind(pattern)
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for name in names {
        let secs = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.split('_').next())
            .and_then(|s| s.parse::<u64>().ok());
        if secs.is_some_and(|s| s + 3600 < now) {
            let _ = sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                .execute(&mut conn)
                .await;
        }
    }
    let _ = conn.close().await;
}

/// One plain connection to the PostgreSQL server at `url`.
pub async fn pg_connect(url: &str) -> PgConnection {
    let options = PgConnectOptions::from_str(url)
        .unwrap_or_else(|e| panic!("{url} is not a PostgreSQL URL: {e}"));
    PgConnection::connect_with(&options)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url}: {e}"))
}

/// Something unique to one test, usable in Redis keys and PostgreSQL names:
/// `<unix seconds>_<12 hex digits>`.
pub fn unique() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rand = Token::random().to_hex();
    format!("{secs}_{}", &rand[..12])
}

/// `host:port` of a `scheme://[user[:password]@]host[:port][/…]` URL.
pub fn host_port(url: &str, default_port: u16) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let hp = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    if hp.contains(':') {
        hp.to_owned()
    } else {
        format!("{hp}:{default_port}")
    }
}

/// `url` with its `host:port` replaced by `addr`.
pub fn with_addr(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let userinfo = authority
        .rsplit_once('@')
        .map_or(String::new(), |(u, _)| format!("{u}@"));
    format!("{scheme}://{userinfo}{addr}{tail}")
}

/// The first address `host_port` resolves to.
pub async fn resolve(host_port: &str) -> SocketAddr {
    tokio::net::lookup_host(host_port)
        .await
        .unwrap_or_else(|e| panic!("cannot resolve {host_port}: {e}"))
        .next()
        .unwrap_or_else(|| panic!("{host_port} resolves to nothing"))
}

/// A [`FaultProxy`] copying bytes to and from the server at `host_port` (a store's):
/// a test cuts, stalls or shuts it down to take that server away.
pub async fn proxy_to(host_port: &str) -> FaultProxy {
    FaultProxy::tcp(resolve(host_port).await)
        .await
        .unwrap_or_else(|e| panic!("cannot start a proxy to {host_port}: {e}"))
}
