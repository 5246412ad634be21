//! seatbelt (Microsoft's resilience crate) as the client benches' peer: its `Retry`
//! over its `Breaker`, the closest it comes to the client stack, as tower layers.
//!
//! `Retry`: at most 3 attempts (2 retries), a retry on a 5xx or an error, the request
//! head copied for a retry (an `Empty` body has nothing to copy), `base_delay` as given
//! (the in-process bench retries at once), otherwise its defaults (exponential backoff
//! with jitter). `Breaker`: its defaults (opens at 10 % failures over 30 s once 100
//! calls were seen, 5 s open), the same classification, a rejection as an error. Each
//! call is one boxed future per layer; `Retry` calls a clone of its inner service
//! without polling it ready, which both inner services here allow.
//!
//! What it does not do that `ClientLayers` does: no retry budget, no deadline carried
//! across attempts or sent to the server (its `Timeout` bounds one attempt and is left
//! out, as tower's `Retry` has none), no `Idempotency-Key`, no retry of a non-idempotent
//! request made safe, no `Retry-After`.

use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Empty;
use seatbelt::breaker::{Breaker, BreakerLayer};
use seatbelt::retry::{Retry, RetryLayer};
use seatbelt::{RecoveryInfo, ResilienceContext};
use tick::Clock;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Req = Request<Empty<Bytes>>;
/// What the seatbelt layers see of a call: the inner service's answer or error.
pub type Out<R> = Result<Response<R>, BoxError>;

/// seatbelt's clock, its timer driver running on a runtime of its own on a background
/// thread for the rest of the process (the benches' success path sets no timer).
pub fn clock() -> Clock {
    static CLOCK: OnceLock<Clock> = OnceLock::new();
    CLOCK
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for seatbelt's clock");
                runtime.block_on(async move {
                    let _ = tx.send(Clock::new_tokio());
                    std::future::pending::<()>().await;
                });
            });
            rx.recv().expect("seatbelt's clock")
        })
        .clone()
}

fn recovery<R>(out: &Out<R>) -> RecoveryInfo {
    match out {
        Ok(res) if !res.status().is_server_error() => RecoveryInfo::never(),
        _ => RecoveryInfo::retry(),
    }
}

/// seatbelt's `Retry` (see the module docs), retrying after `base_delay`.
pub fn retry<R: 'static>(base_delay: Duration) -> RetryLayer<Req, Out<R>> {
    let context = ResilienceContext::new(clock());
    Retry::layer("retry", &context)
        .max_retry_attempts(2)
        .base_delay(base_delay)
        .clone_input_with(|req: &mut Req, _| {
            let mut copy = Request::new(Empty::new());
            *copy.method_mut() = req.method().clone();
            *copy.uri_mut() = req.uri().clone();
            *copy.headers_mut() = req.headers().clone();
            Some(copy)
        })
        .recovery_with(|out, _| recovery(out))
}

/// seatbelt's `Breaker` with its defaults (see the module docs).
pub fn breaker<R: 'static>() -> BreakerLayer<Req, Out<R>> {
    let context = ResilienceContext::new(clock());
    Breaker::layer("breaker", &context)
        .recovery_with(|out, _| recovery(out))
        .rejected_input_error(|_, _| BoxError::from("circuit open"))
}
