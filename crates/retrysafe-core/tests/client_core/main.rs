//! Tests of the sans-IO client core: the classification table, `Failure::of`, backoff
//! and jitter (exact values, bounds over many seeded draws), the standard retry strategy
//! (attempts, time left, delay hints, budgets), and the inherited `CallContext`.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    unreachable_pub
)]

mod backoff;
mod call_context;
mod classification;
mod failure_of;
mod strategy;

use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use retrysafe_core::classify::{
    Classification, Classifier, DefaultClassifier, Failure, RequestFacts,
};

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in pairs {
        h.append(*name, HeaderValue::from_str(value).unwrap());
    }
    h
}

fn classify(status: u16, pairs: &[(&'static str, &str)], facts: &RequestFacts) -> Classification {
    DefaultClassifier::default().classify_response(
        StatusCode::from_u16(status).unwrap(),
        &headers(pairs),
        facts,
    )
}

fn grpc(pairs: &[(&'static str, &str)], facts: &RequestFacts) -> Classification {
    let mut all = vec![("content-type", "application/grpc")];
    all.extend_from_slice(pairs);
    classify(200, &all, facts)
}

fn failure(f: Failure, facts: &RequestFacts) -> Classification {
    DefaultClassifier::default().classify_failure(f, facts)
}

const GET: RequestFacts = RequestFacts::SAFE;
const POST: RequestFacts = RequestFacts::UNSAFE;
