//! The test authentication shared by the idempotency test binaries.

use axum::extract::Request;
use retrysafe_tower::idempotency::Principal;

/// Authentication: `authorization: Bearer T` → principal T, none → "anonymous".
pub async fn auth(mut req: Request) -> Request {
    let principal = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("anonymous")
        .to_owned();
    req.extensions_mut().insert(Principal::new(principal));
    req
}
