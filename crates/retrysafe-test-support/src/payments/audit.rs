//! Crash and outage audits: resend every key to a definitive answer, then read what the
//! backend holds for it (its record and its account's payments) and tally the result.

use std::time::{Duration, Instant};

use http::StatusCode;

use super::{Answer, Api};

/// Where a key's idempotency record stands, read directly from the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// No record (none was ever written, or it was released or rolled back).
    Absent,
    /// Claimed; `passed` once its holder passed its commit point, `expired` when its
    /// lease has ended by the store's clock.
    InProgress {
        /// Its holder passed its commit point.
        passed: bool,
        /// Its lease has ended by the store's clock.
        expired: bool,
    },
    /// Completed: the answer is stored.
    Completed,
    /// `outcome_unknown`: whether the effect happened is not known.
    OutcomeUnknown,
}

/// What the backend holds for one key: its record and the ids of its account's
/// payments (every key of these tests has an account of its own), as the API shows
/// them (`pay_…`).
#[derive(Debug, Clone)]
pub struct KeyAudit {
    /// The key's record.
    pub record: RecordState,
    /// The ids of its account's payments.
    pub payments: Vec<String>,
}

/// One logical payment of a run: its own key and account.
#[derive(Debug, Clone)]
pub struct Payment {
    /// Its idempotency key.
    pub key: String,
    /// Its account, its own.
    pub account: String,
    /// Its amount, in cents.
    pub amount: i64,
}

impl Payment {
    /// A payment whose key is `key` and whose account is `acct-KEY`.
    pub fn new(key: String, amount: i64) -> Payment {
        Payment {
            account: format!("acct-{key}"),
            key,
            amount,
        }
    }
}

/// The definitive answer to a key: its 201 (the first answer replayed, or a run), or the
/// 500 `outcome-unknown` problem.
#[derive(Debug)]
pub enum Final {
    /// The 201.
    Created(Answer),
    /// The 500 `outcome-unknown` problem.
    OutcomeUnknown(Answer),
}

/// Whether `answer` is the idempotency layer's 500 `outcome-unknown` problem.
pub fn is_outcome_unknown(answer: &Answer) -> bool {
    answer.status == StatusCode::INTERNAL_SERVER_ERROR
        && answer
            .headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"))
        && answer.json()["type"]
            .as_str()
            .is_some_and(|t| t.ends_with(":outcome-unknown"))
}

/// Sends `payment` to the servers in turn until it has a definitive answer (a 201, or
/// the 500 `outcome-unknown` problem), pausing `pause` between tries. A 409 (in flight:
/// a dead holder's lease has not expired yet), a 503 with `retry-after`, the app's own
/// 500 `payment-outcome-unknown` (the next copy gets the stable problem) and a failed
/// connection are retried; anything else fails the test. Returns the answer and how
/// many sends it took.
pub async fn resolve_payment(
    apis: &[Api],
    payment: &Payment,
    pause: Duration,
    patience: Duration,
) -> (Final, u32) {
    let started = Instant::now();
    let mut sends = 0u32;
    loop {
        let api = &apis[sends as usize % apis.len()];
        sends += 1;
        match api
            .try_pay(&payment.key, &payment.account, payment.amount, &[])
            .await
        {
            Ok(a) if a.status == StatusCode::CREATED => {
                a.assert_created(&payment.account, payment.amount);
                return (Final::Created(a), sends);
            }
            Ok(a) if is_outcome_unknown(&a) => {
                assert_eq!(a.headers["do-not-retry"], "1", "{a:?}");
                return (Final::OutcomeUnknown(a), sends);
            }
            Ok(a) if a.status == StatusCode::CONFLICT => {
                a.assert_problem_type(409, "request-in-flight");
                assert!(a.headers.contains_key("retry-after"), "{a:?}");
            }
            Ok(a) if a.status == StatusCode::SERVICE_UNAVAILABLE => a.assert_unavailable(),
            Ok(a) if a.status == StatusCode::INTERNAL_SERVER_ERROR => {
                a.assert_problem_type(500, "payment-outcome-unknown");
            }
            Ok(a) => panic!("unexpected answer to {}: {a:?}", payment.key),
            Err(_) => {}
        }
        assert!(
            started.elapsed() < patience,
            "{}: no definitive answer within {patience:?} ({sends} sends)",
            payment.key
        );
        tokio::time::sleep(pause).await;
    }
}

/// Resolves every payment (at most `parallel` at once): the definitive answers, in
/// order, and the number of sends in all.
pub async fn resolve_all(
    apis: &[Api],
    payments: &[Payment],
    parallel: usize,
    patience: Duration,
) -> (Vec<Final>, u64) {
    use futures_util::StreamExt;
    let results: Vec<(Final, u32)> = futures_util::stream::iter(
        payments
            .iter()
            .map(|p| resolve_payment(apis, p, Duration::from_millis(50), patience)),
    )
    .buffered(parallel.max(1))
    .collect()
    .await;
    let sends = results.iter().map(|(_, n)| u64::from(*n)).sum();
    (results.into_iter().map(|(f, _)| f).collect(), sends)
}

/// What a run left in the backend, key by key, against what its clients were told.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Logical payments (distinct keys).
    pub keys: u64,
    /// Payments in the ledger for those keys.
    pub effects: u64,
    /// Keys with more than one payment (must be 0).
    pub duplicates: u64,
    /// Keys whose definitive answer is a 201.
    pub created: u64,
    /// Keys whose definitive answer is `outcome-unknown`, with a payment.
    pub unknown_with_effect: u64,
    /// Keys whose definitive answer is `outcome-unknown`, without a payment.
    pub unknown_without_effect: u64,
    /// A 201 (now or earlier) whose payment is not in the ledger, or is another payment
    /// than the one answered (must be 0).
    pub lost: u64,
    /// Two different 201 answers for one key (must be 0).
    pub answers_differ: u64,
    /// Keys answered 201 whose record is `outcome_unknown` (the answer was returned but
    /// could not be stored; the payment is in the ledger).
    pub completion_lost: u64,
    /// A completed record without exactly one payment, an `outcome_unknown` answer
    /// without its record, or a record missing after a definitive answer (must be 0).
    pub record_mismatch: u64,
    /// `in_progress` records left after every key was answered (must be 0).
    pub in_progress_left: u64,
    /// Those of them whose lease had expired: orphans (must be 0).
    pub orphaned: u64,
}

impl Tally {
    /// Adds one key: `earlier` are the 201 answers its clients got before the definitive
    /// answer `last`; `audit` is what the backend holds.
    pub fn add(&mut self, earlier: &[&Answer], last: &Final, audit: &KeyAudit) {
        self.keys += 1;
        self.effects += audit.payments.len() as u64;
        if audit.payments.len() > 1 {
            self.duplicates += 1;
        }
        if let RecordState::InProgress { expired, .. } = audit.record {
            self.in_progress_left += 1;
            if expired {
                self.orphaned += 1;
            }
        }
        match last {
            Final::Created(answer) => {
                self.created += 1;
                let id = answer.json()["id"].as_str().unwrap_or_default().to_owned();
                let answered_elsewhere = earlier.iter().any(|e| {
                    let id = e.json()["id"].as_str().unwrap_or_default().to_owned();
                    !audit.payments.contains(&id)
                });
                if audit.payments != [id] || answered_elsewhere {
                    self.lost += 1;
                }
                if earlier.iter().any(|e| e.body != answer.body) {
                    self.answers_differ += 1;
                }
                if audit.record != RecordState::Completed {
                    self.record_mismatch += 1;
                }
            }
            Final::OutcomeUnknown(_) => {
                if audit.payments.is_empty() {
                    self.unknown_without_effect += 1;
                } else {
                    self.unknown_with_effect += 1;
                }
                if let Some(first) = earlier.first() {
                    // A client was told 201, and later copies say unknown: its answer
                    // could not be stored (the store failed after the handler ran, a
                    // `completion_lost`), which is allowed when its payment is there.
                    let id = first.json()["id"].as_str().unwrap_or_default().to_owned();
                    if audit.payments == [id] {
                        self.completion_lost += 1;
                    } else {
                        self.lost += 1;
                    }
                }
                if audit.record != RecordState::OutcomeUnknown {
                    self.record_mismatch += 1;
                }
            }
        }
    }

    /// Adds `other`'s counts to this one.
    pub fn merge(&mut self, other: &Tally) {
        self.keys += other.keys;
        self.effects += other.effects;
        self.duplicates += other.duplicates;
        self.created += other.created;
        self.unknown_with_effect += other.unknown_with_effect;
        self.unknown_without_effect += other.unknown_without_effect;
        self.lost += other.lost;
        self.answers_differ += other.answers_differ;
        self.completion_lost += other.completion_lost;
        self.record_mismatch += other.record_mismatch;
        self.in_progress_left += other.in_progress_left;
        self.orphaned += other.orphaned;
    }

    /// Keys whose definitive answer is `outcome-unknown`.
    pub fn outcome_unknown(&self) -> u64 {
        self.unknown_with_effect + self.unknown_without_effect
    }
}

/// The summary the crash and store-fault tests print: `keys N, effects N, …`.
impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "keys {}, effects {}, duplicates {}, created {}, outcome_unknown {} ({} with its \
             payment, {} without), completion_lost {}, answered payments missing {}, keys \
             answered two ways {}, in_progress left {} (orphaned {})",
            self.keys,
            self.effects,
            self.duplicates,
            self.created,
            self.outcome_unknown(),
            self.unknown_with_effect,
            self.unknown_without_effect,
            self.completion_lost,
            self.lost,
            self.answers_differ,
            self.in_progress_left,
            self.orphaned,
        )
    }
}

impl Tally {
    /// The invariants of every store: never two effects, nothing answered lost, one
    /// answer per key, records that match the ledger, no `in_progress` left. With
    /// `transactional` (PostgreSQL's transactional layer) also: exactly one effect per
    /// key and no `outcome_unknown` at all.
    pub fn assert_sound(&self, transactional: bool) {
        assert_eq!(self.duplicates, 0, "a key with two payments: {self:?}");
        assert_eq!(self.lost, 0, "an answered payment is missing: {self:?}");
        assert_eq!(self.answers_differ, 0, "two answers for one key: {self:?}");
        assert_eq!(
            self.record_mismatch, 0,
            "record and ledger disagree: {self:?}"
        );
        assert_eq!(
            self.orphaned, 0,
            "an expired in_progress record remains: {self:?}"
        );
        assert_eq!(
            self.in_progress_left, 0,
            "an in_progress record remains: {self:?}"
        );
        assert!(self.effects <= self.keys, "{self:?}");
        if transactional {
            assert_eq!(self.outcome_unknown(), 0, "exactly once: {self:?}");
            assert_eq!(self.created, self.keys, "{self:?}");
            assert_eq!(
                self.effects, self.keys,
                "exactly one effect per key: {self:?}"
            );
        }
    }
}
