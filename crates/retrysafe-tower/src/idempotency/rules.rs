//! Which requests a layer guards and how: the methods, the key, the scope, the
//! fingerprint, the limits, the retention and the protocol's policy.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::AUTHORIZATION;
use http::request::Parts;
use http::{HeaderMap, Method};
use retrysafe_core::__private::protocol::Policy;
use retrysafe_core::idempotency::{Fingerprint, Fingerprinter, Principal, Scope};
use retrysafe_core::wire::{Convention, IdempotencyKey};

use super::problem::Problem;
use super::request;

/// A user's rule from request head to scope.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Option<Scope> + Send + Sync>;

/// Where a guarded request's scope comes from.
#[derive(Clone)]
pub(crate) enum ScopeRule {
    Principal,
    Global,
    AuthorizationHash,
    Custom(ScopeFn),
}

impl fmt::Debug for ScopeRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScopeRule::Principal => "Principal",
            ScopeRule::Global => "Global",
            ScopeRule::AuthorizationHash => "AuthorizationHash",
            ScopeRule::Custom(_) => "Custom",
        })
    }
}

/// The default [`Rules::request_body_timeout`]: 30 s (1 MiB at 35 kB/s).
pub(crate) const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
pub(crate) const MIB: usize = 1024 * 1024;

/// The rules a layer guards requests by, set by its builder methods.
#[derive(Clone, Debug)]
pub(crate) struct Rules {
    pub(crate) convention: Convention,
    pub(crate) methods: Vec<Method>,
    pub(crate) guard_grpc: bool,
    pub(crate) require_key: bool,
    pub(crate) scope: ScopeRule,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) max_request_body: usize,
    /// How long a guarded request's body may take to arrive once its slot is taken.
    pub(crate) request_body_timeout: Duration,
    pub(crate) retention: Duration,
    /// How many of the in-flight slots one scope may hold; `None`: the default share
    /// of the bound.
    pub(crate) max_in_flight_per_scope: Option<usize>,
    /// The in-flight policy, the `retry-after` hints and whether the backend rolls a
    /// failed handler back.
    pub(crate) policy: Policy,
}

impl Rules {
    pub(crate) fn new(rolls_back: bool) -> Self {
        Rules {
            convention: Convention::default(),
            methods: vec![Method::POST, Method::PATCH],
            guard_grpc: false,
            require_key: false,
            scope: ScopeRule::Principal,
            fingerprinter: Fingerprinter::default(),
            max_request_body: MIB,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            retention: Duration::from_secs(24 * 60 * 60),
            max_in_flight_per_scope: None,
            policy: Policy::new().rolls_back(rolls_back),
        }
    }

    /// Whether the request is guarded at all: a guarded method, and not gRPC unless
    /// gRPC is guarded too.
    pub(crate) fn guards(&self, parts: &Parts) -> bool {
        self.methods.contains(&parts.method)
            && (self.guard_grpc || !request::is_grpc(&parts.headers))
    }

    /// The request's key (see [`request::idempotency_key`]).
    pub(crate) fn key(&self, headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
        request::idempotency_key(headers, &self.convention, self.require_key)
    }

    /// Whether the scope comes from the `Principal` extension (the default rule), which
    /// only an authentication layer can insert.
    pub(crate) fn scoped_by_principal(&self) -> bool {
        matches!(self.scope, ScopeRule::Principal)
    }

    /// The request's scope by the configured rule; `None` refuses to guard.
    pub(crate) fn scope(&self, parts: &Parts) -> Option<Scope> {
        match &self.scope {
            ScopeRule::Principal => parts.extensions.get::<Principal>().map(Scope::from),
            ScopeRule::Global => Some(Scope::global()),
            ScopeRule::AuthorizationHash => parts
                .headers
                .get(AUTHORIZATION)
                .map(|v| Scope::from_authorization(v.as_bytes())),
            ScopeRule::Custom(f) => f(parts),
        }
    }

    /// What a copy must match: method, path, query, the configured headers and `body`.
    pub(crate) fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        self.fingerprinter
            .fingerprint(&parts.method, &parts.uri, &parts.headers, body)
    }

    /// The idempotency key and the headers that change between the attempts of one
    /// request: never part of its fingerprint.
    pub(crate) fn per_attempt_headers(&self) -> [&http::HeaderName; 6] {
        let c = &self.convention;
        [
            c.idempotency_key(),
            c.retry_attempt(),
            c.grpc_previous_rpc_attempts(),
            c.request_timeout_ms(),
            c.grpc_timeout(),
            c.retry_point(),
        ]
    }
}
