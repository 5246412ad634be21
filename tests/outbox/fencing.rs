//! Lease fencing: a relay that stalled past its lease cannot overwrite the outcome of
//! the relay that took the row over, and a row whose send is in flight is not
//! dead-lettered, however old it is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use bytes::Bytes;
use retrysafe_postgres::outbox::OutboxRelay;
use retrysafe_postgres::sqlx;
use tokio::sync::Semaphore;

use crate::harness::{Db, client, eventually};

const PENDING: i16 = 0;
const SUCCEEDED: i16 = 1;
const REJECTED: i16 = 2;

/// A downstream whose first request waits for a permit of its gate and then succeeds;
/// every later one is answered 422 at once.
struct Gated {
    requests: AtomicU64,
    gate: Semaphore,
}

async fn gated() -> (SocketAddr, Arc<Gated>) {
    let gated = Arc::new(Gated {
        requests: AtomicU64::new(0),
        gate: Semaphore::new(0),
    });
    let app = Router::new()
        .route(
            "/effects",
            post(|State(g): State<Arc<Gated>>| async move {
                if g.requests.fetch_add(1, Ordering::SeqCst) == 0 {
                    let _permit = g.gate.acquire().await.unwrap();
                    StatusCode::CREATED
                } else {
                    StatusCode::UNPROCESSABLE_ENTITY
                }
            }),
        )
        .with_state(Arc::clone(&gated));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, gated)
}

/// A relay with a send timeout long enough for the test to act while a send runs.
fn relay(db: &Db) -> OutboxRelay {
    OutboxRelay::new(db.pool.clone())
        .http_client(client())
        .send_timeout(Duration::from_secs(20))
        .lease(Duration::from_secs(30))
}

async fn enqueue_one(db: &Db, addr: SocketAddr) {
    db.enqueue(
        "k-0",
        http::Request::post(format!("http://{addr}/effects"))
            .body(Bytes::from_static(b"x"))
            .unwrap(),
    )
    .await;
}

async fn last_status(db: &Db) -> Option<i32> {
    sqlx::query_scalar("SELECT last_status FROM retrysafe_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_mark_after_the_lease_passed_to_another_relay_is_fenced() {
    let db = Db::new().await;
    let (addr, downstream) = gated().await;
    enqueue_one(&db, addr).await;
    let first = relay(&db).build().unwrap();
    let first = tokio::spawn(async move { first.run_once().await.unwrap() });
    eventually("the first send", Duration::from_secs(30), || async {
        (downstream.requests.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;

    // The first relay stalls past its lease, as a paused process would: its lease is
    // ended in the table, and a second relay takes the row and rejects it.
    sqlx::query(
        "UPDATE retrysafe_outbox SET lease_until = clock_timestamp() - interval '1 second'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let second = relay(&db).build().unwrap().run_once().await.unwrap();
    assert_eq!((second.taken, second.rejected), (1, 1));

    // The first relay's send ends with a 201, but its mark is refused.
    downstream.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!((first.taken, first.succeeded, first.fenced), (1, 0, 1));
    assert_eq!(
        db.count(REJECTED).await,
        1,
        "the second relay's outcome stands"
    );
    assert_eq!(last_status(&db).await, Some(422));
    let (_, _, attempts) = db.states().await[0];
    assert_eq!(attempts, 2);
}

#[tokio::test]
async fn a_row_whose_send_runs_past_the_dead_letter_age_is_not_dead_lettered() {
    let db = Db::new().await;
    let (addr, downstream) = gated().await;
    enqueue_one(&db, addr).await;
    let dead = Arc::new(AtomicUsize::new(0));
    let short_lived = || {
        let dead = Arc::clone(&dead);
        relay(&db)
            .dead_letter_age(Duration::from_millis(300))
            .on_dead(move |_| {
                dead.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    let sending = short_lived();
    let sending = tokio::spawn(async move { sending.run_once().await.unwrap() });
    eventually("the send", Duration::from_secs(30), || async {
        (downstream.requests.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    eventually(
        "the row past its dead-letter age",
        Duration::from_secs(30),
        || async {
            let old: bool = sqlx::query_scalar(
                "SELECT clock_timestamp() - created_at > interval '300 milliseconds' FROM retrysafe_outbox",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            old.then_some(())
        },
    )
    .await;

    // Other relays cannot take the row while its lease holds, so none marks it dead.
    let other = short_lived();
    for _ in 0..3 {
        assert_eq!(other.run_once().await.unwrap().taken, 0);
    }
    assert_eq!(db.count(PENDING).await, 1);

    // The send ends with a 201: the row succeeded, it was never dead.
    downstream.gate.add_permits(1);
    let pass = sending.await.unwrap();
    assert_eq!((pass.succeeded, pass.dead), (1, 0));
    assert_eq!(db.count(SUCCEEDED).await, 1);
    assert_eq!(dead.load(Ordering::SeqCst), 0);
    assert_eq!(downstream.requests.load(Ordering::SeqCst), 1);
}
