//! The retry point: its header on every attempt, and one attempt under an inherited one.

use http::StatusCode;
use retrysafe_core::CallContext;
use retrysafe_test_support::both_forms;
use retrysafe_test_support::forms::Form;

use super::{get, hooked, layer, marked, run, stack, stacked, status, with};

async fn retry_point_sends_the_header_on_every_attempt(form: Form) {
    let (_, seen) = run(
        stacked(form, layer().retry_point()),
        get("http://api.local/x"),
        vec![Ok(status(503)), Ok(status(503)), Ok(status(200))],
    )
    .await;
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|s| s.header("retry-point") == Some("caller"))
    );
    let (_, seen) = run(
        stack(form),
        get("http://api.local/x"),
        vec![Ok(status(200))],
    )
    .await;
    assert_eq!(seen[0].header("retry-point"), None);
}

both_forms!(
    retry_point_sends_the_header_on_every_attempt,
    start_paused = true
);

async fn an_inherited_retry_point_makes_one_attempt_and_does_not_mark(form: Form) {
    let (layer, retries, give_ups) = hooked(layer());
    let ctx = CallContext::new().with_caller_is_retry_point(true);
    let req = with(get("http://api.local/x"), ctx.clone());
    let (res, seen) = run(stacked(form, layer), req, vec![Ok(status(503))]).await;
    let res = res.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(seen.len(), 1);
    assert!(!marked(&res));
    assert!(!ctx.downstream_gave_up());
    assert!(retries.lock().unwrap().is_empty());
    assert!(give_ups.lock().unwrap().is_empty());
    // The hop below is told too: nothing under the caller may retry.
    assert_eq!(seen[0].header("retry-point"), Some("caller"));
}

both_forms!(
    an_inherited_retry_point_makes_one_attempt_and_does_not_mark,
    start_paused = true
);
