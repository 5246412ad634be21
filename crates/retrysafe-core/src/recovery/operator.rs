//! The [`Operator`]: the reconciler's operations by hand.

use std::time::Duration;

use super::{PendingRecord, ReconcilableStore, Resolution, Settlement};
use crate::idempotency::{Record, RecordId, Scope, Token};
use crate::store::StoreError;
use crate::wire::IdempotencyKey;

/// How long an operator's adoption holds.
const HOLD: Duration = Duration::from_secs(30);

/// A record as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lookup {
    /// The record id.
    pub record: RecordId,
    /// Its state, `None` when absent.
    pub state: Option<Record>,
    /// What a resolver would see, when it is a claim or an unknown outcome.
    pub pending: Option<PendingRecord>,
}

/// A small admin API over a [`ReconcilableStore`], for operators: look a record up by
/// (scope, key), list pending records, release a claim that had not reached its
/// commit point, resolve a record by hand. Every change goes through an adoption, so
/// it never races a reconciler, a late holder or a copy, and follows the reconciler's
/// rules: a claim is released by [`release_before_commit_point`] only before its commit
/// point; [`resolve`] with [`Resolution::DidNotHappen`] is the operator's promise that
/// the effect can no longer happen. A claim whose lease is live (its holder runs) is
/// never changed: [`OperatorError::Live`].
///
/// [`release_before_commit_point`]: Operator::release_before_commit_point
/// [`resolve`]: Operator::resolve
#[derive(Debug, Clone)]
pub struct Operator<S> {
    store: S,
    retention: Duration,
}

/// Why an operator's change was not made.
#[derive(Debug)]
#[non_exhaustive]
pub enum OperatorError {
    /// The record is not pending (absent, completed, or adopted by someone else).
    NotPending,
    /// The claim passed (or did not declare) its commit point: only a resolution may
    /// settle it.
    PastCommitPoint,
    /// The claim's lease is live: its holder still runs and will settle it.
    Live,
    /// The store failed.
    Store(StoreError),
}

impl std::fmt::Display for OperatorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OperatorError::NotPending => f.write_str("the record is not pending"),
            OperatorError::PastCommitPoint => {
                f.write_str("the claim is past (or did not declare) its commit point")
            }
            OperatorError::Live => f.write_str("the claim's lease is live: its holder runs"),
            OperatorError::Store(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for OperatorError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OperatorError::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StoreError> for OperatorError {
    fn from(e: StoreError) -> Self {
        OperatorError::Store(e)
    }
}

impl<S: ReconcilableStore> Operator<S> {
    /// The operator of `store`; records resolved as happened are kept 24 h.
    pub fn new(store: S) -> Self {
        Operator {
            store,
            retention: Duration::from_secs(24 * 60 * 60),
        }
    }

    /// How long a record resolved as happened is kept (default 24 h).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The record of `key` in `scope`.
    pub async fn lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Lookup, StoreError> {
        let record = RecordId::new(scope, key);
        let state = self.store.get(&record).await?;
        let pending = self.store.peek(&record).await?;
        Ok(Lookup {
            record,
            state,
            pending,
        })
    }

    /// Up to `limit` pending records: claims whose lease ended (however recently) and
    /// unknown outcomes, due for a reconciler's pass or not.
    pub async fn pending(&self, limit: usize) -> Result<Vec<PendingRecord>, StoreError> {
        let mut out = Vec::new();
        for id in self.store.list_pending(limit).await? {
            if let Some(p) = self.store.peek(&id).await? {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Releases the claim of `record` if its lease ended before it reached its
    /// declared commit point (a late holder is fenced: its commit point fails from now
    /// on): the next copy runs. Anything else is left as it is.
    pub async fn release_before_commit_point(
        &self,
        record: &RecordId,
    ) -> Result<(), OperatorError> {
        match self.store.peek(record).await? {
            Some(p) if p.is_before_commit_point() => {}
            Some(_) => return Err(OperatorError::PastCommitPoint),
            None => return Err(OperatorError::NotPending),
        }
        let (token, pending) = self.adopt(record).await?;
        if !pending.is_before_commit_point() {
            // Its holder passed its commit point just before its lease ended: what a
            // copy would make of it, unknown.
            let later = Settlement::Later {
                after: Duration::ZERO,
            };
            self.store
                .settle(record, token, later, pending.notified)
                .await?;
            return Err(OperatorError::PastCommitPoint);
        }
        self.store
            .settle(record, token, Settlement::Release, pending.notified)
            .await?;
        Ok(())
    }

    /// Resolves `record` by hand, with the reconciler's rules: `Happened` completes it
    /// with the response, `DidNotHappen` releases it, `Unknown` leaves it unknown (a
    /// claim whose lease ended becomes unknown, as a copy would make it). A claim whose
    /// lease is live is refused.
    pub async fn resolve(
        &self,
        record: &RecordId,
        resolution: Resolution,
    ) -> Result<(), OperatorError> {
        let (token, pending) = self.adopt(record).await?;
        let settlement = match resolution {
            Resolution::Happened(response) => Settlement::Complete {
                response,
                retention: self.retention,
            },
            Resolution::DidNotHappen => Settlement::Release,
            Resolution::Unknown => Settlement::Later {
                after: Duration::ZERO,
            },
        };
        self.store
            .settle(record, token, settlement, pending.notified)
            .await?;
        Ok(())
    }

    /// Adopts `record` for an operator's change, with a fresh token: an unknown
    /// outcome, or a claim whose lease ended. A live claim is never adopted (that
    /// would fence its running holder).
    async fn adopt(&self, record: &RecordId) -> Result<(Token, PendingRecord), OperatorError> {
        let token = Token::random();
        let adopted = self
            .store
            .adopt(record, token, HOLD, Some(Duration::ZERO))
            .await?;
        match adopted {
            Some(pending) => Ok((token, pending)),
            None => match self.store.get(record).await? {
                Some(Record::InProgress(_)) => Err(OperatorError::Live),
                _ => Err(OperatorError::NotPending),
            },
        }
    }
}
