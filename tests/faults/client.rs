//! The client side: one logical request through the stack, to its outcome.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use retrysafe_test_support::client_stack::{Stack, error_kind};
use serde_json::json;
use tower::ServiceExt;

use super::PAD;

/// How one logical request ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Outcome {
    Succeeded { key: String },
    Status(u16),
    BodyError,
    Error(&'static str),
    Stuck,
}

impl Outcome {
    pub(super) fn label(&self) -> String {
        match self {
            Outcome::Succeeded { .. } => "succeeded".to_owned(),
            Outcome::Status(s) => format!("status_{s}"),
            Outcome::BodyError => "body_error".to_owned(),
            Outcome::Error(e) => format!("error_{e}"),
            Outcome::Stuck => "stuck".to_owned(),
        }
    }
}

pub(super) async fn logical(stack: Stack, base: String, id: u64) -> Outcome {
    let body = json!({ "id": id, "pad": "q".repeat(PAD) }).to_string();
    let request = Request::post(format!("{base}/pay"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let call = async {
        let response = match stack.oneshot(request).await {
            Ok(r) => r,
            Err(e) => return Outcome::Error(error_kind(&e)),
        };
        let status = response.status();
        let Ok(body) = response.into_body().collect().await.map(|b| b.to_bytes()) else {
            return Outcome::BodyError;
        };
        if status != StatusCode::CREATED {
            return Outcome::Status(status.as_u16());
        }
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], id, "a 201 for another logical request: {v}");
        Outcome::Succeeded {
            key: v["key"].as_str().unwrap().to_owned(),
        }
    };
    tokio::time::timeout(Duration::from_secs(60), call)
        .await
        .unwrap_or(Outcome::Stuck)
}
