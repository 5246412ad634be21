//! The transactional outbox, its relay and the idempotent consumer, against the real
//! PostgreSQL and RabbitMQ (`DATABASE_URL`, `AMQP_URL`) and a real downstream axum
//! server behind an `IdempotencyLayer`: crashes between send and mark and between
//! commit and ack, competing relays, a broker connection cut and restored, a failing
//! downstream, ordering, and dead letters.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::disallowed_methods,
    missing_docs,
    unreachable_pub,
    dead_code
)]

mod broker;
mod consumer;
mod downstream;
mod fencing;
mod harness;
mod messages;
mod relay;
