//! Classification of outcomes, shared by retry, budget and breaker.
//!
//! A [`Classifier`] looks at what came back for one attempt — a response head (which
//! carries a gRPC Trailers-Only status when there is one), the trailers at the end of a
//! response stream (for breakers), or a transport [`Failure`] — and yields a
//! [`Classification`]: whether a retry is safe, whether the callee throttled or timed
//! out, whose fault it was, and any delay the callee asked for.
//!
//! The [`DefaultClassifier`] follows these rules:
//!
//! | outcome | retry | notes |
//! |---|---|---|
//! | connect failed, h2 `REFUSED_STREAM` | any request | nothing was processed |
//! | closed or reset before a response; attempt timeout | safe requests | timeout for the latter |
//! | 408, 502, 503, 504 | safe requests | 503 with `retry-after` throttles; 408 and 504 are timeouts |
//! | 429 | safe requests | throttle |
//! | 500 | safe requests, only with [`DefaultClassifier::retry_500`] | |
//! | 409 with `retry-after`, request with an `Idempotency-Key` | after that delay | "still in flight" |
//! | other 4xx, other 5xx | never | |
//! | marked `do-not-retry` or `idempotent-replayed` | never | |
//! | gRPC `UNAVAILABLE` | safe requests | |
//! | gRPC `RESOURCE_EXHAUSTED` | only with `grpc-retry-pushback-ms` | throttle |
//! | gRPC status in trailers after headers | never | past the commit point |
//!
//! "Safe requests" are those the caller may repeat: an RFC 9110 idempotent method, a
//! request carrying an `Idempotency-Key`, or one the user declared idempotent
//! ([`RequestFacts::safe`]).
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use retrysafe::classify::{Classifier, DefaultClassifier, FaultSide, RequestFacts};
//!
//! let c = DefaultClassifier::default();
//! let get = RequestFacts::SAFE;
//! let post = RequestFacts::UNSAFE;
//!
//! let unavailable = c.classify_response(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new(), &get);
//! assert!(unavailable.is_retryable(&get));
//! assert!(!unavailable.is_retryable(&post)); // a POST without a key is sent once
//! assert_eq!(unavailable.fault, Some(FaultSide::Server));
//!
//! let mut marked = HeaderMap::new();
//! marked.insert("do-not-retry", "1".parse().unwrap());
//! let given_up = c.classify_response(StatusCode::SERVICE_UNAVAILABLE, &marked, &get);
//! assert!(!given_up.is_retryable(&get));
//! assert_eq!(given_up.fault, Some(FaultSide::Dependency)); // neutral for breakers
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode};

use crate::error::{BudgetExhausted, CircuitOpen, DeadlineExceeded, Throttled};
use crate::wire::{
    Convention, Pushback, parse_do_not_retry, parse_flag, parse_pushback, parse_retry_after,
};

/// Whether an outcome may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetrySafety {
    /// Retryable whatever the request: provably nothing was processed.
    Yes,
    /// Retryable when the request is safe to repeat ([`RequestFacts::safe`]).
    Maybe,
    /// Never retried.
    No,
}

/// Whose fault a failure was; breakers count only [`FaultSide::Server`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultSide {
    /// The request was wrong (most 4xx).
    Client,
    /// The callee itself failed.
    Server,
    /// The callee failed because one of *its* dependencies did (the answer was marked
    /// `do-not-retry` by a server that gave up downstream, or is a replay). Neutral for
    /// breakers, so one leaf outage cannot open every breaker up a chain.
    Dependency,
    /// The callee ran out of the deadline the caller propagated: a 504 /
    /// `DEADLINE_EXCEEDED` that came when that deadline was spent
    /// ([`RequestFacts::deadline_spent`]). Neutral for breakers.
    CallerDeadline,
}

/// A delay the callee asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum DelayHint {
    /// None: the strategy's backoff decides.
    #[default]
    Backoff,
    /// At least this long (`retry-after`).
    AtLeast(Duration),
    /// Exactly this long (`grpc-retry-pushback-ms`, gRFC A6).
    Exactly(Duration),
}

/// What a breaker makes of an outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BreakerOutcome {
    /// The callee answered as it should.
    Success,
    /// The callee failed.
    Failure,
    /// Neither: a dependency's failure or the caller's own deadline.
    Neutral,
}

/// The classification of one attempt's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Classification {
    /// Whether a retry may follow.
    pub safety: RetrySafety,
    /// The callee throttled (429, 503 with `retry-after`, `RESOURCE_EXHAUSTED`): the
    /// backoff uses its throttle base.
    pub throttle: bool,
    /// The attempt timed out (408, 504, `DEADLINE_EXCEEDED`, attempt timeout): a budget
    /// charges its timeout cost.
    pub timeout: bool,
    /// Whose fault it was; `None` for a success.
    pub fault: Option<FaultSide>,
    /// The delay the callee asked for.
    pub delay: DelayHint,
    /// The response was marked `do-not-retry` (or `idempotent-replayed`): a downstream
    /// layer already retried or answered for good.
    pub marked: bool,
}

impl Classification {
    /// A success: nothing to retry, nobody's fault.
    pub const SUCCESS: Classification = Classification {
        safety: RetrySafety::No,
        throttle: false,
        timeout: false,
        fault: None,
        delay: DelayHint::Backoff,
        marked: false,
    };

    /// A failure with `safety` and `fault`, no throttle, timeout or delay.
    pub const fn failure(safety: RetrySafety, fault: FaultSide) -> Self {
        Classification {
            safety,
            throttle: false,
            timeout: false,
            fault: Some(fault),
            delay: DelayHint::Backoff,
            marked: false,
        }
    }

    /// Whether this is a success (no fault at all).
    pub fn is_success(&self) -> bool {
        self.fault.is_none()
    }

    /// Whether a retry of `request` is allowed by this outcome.
    pub fn is_retryable(&self, request: &RequestFacts) -> bool {
        match self.safety {
            RetrySafety::Yes => true,
            RetrySafety::Maybe => request.safe,
            RetrySafety::No => false,
        }
    }

    /// What a breaker counts.
    #[doc(hidden)]
    pub fn breaker_outcome(&self) -> BreakerOutcome {
        match self.fault {
            None | Some(FaultSide::Client) => BreakerOutcome::Success,
            Some(FaultSide::Server) => BreakerOutcome::Failure,
            Some(FaultSide::Dependency | FaultSide::CallerDeadline) => BreakerOutcome::Neutral,
        }
    }

    #[must_use]
    const fn throttled(mut self) -> Self {
        self.throttle = true;
        self
    }

    #[must_use]
    const fn timed_out(mut self) -> Self {
        self.timeout = true;
        self
    }

    #[must_use]
    const fn with_delay(mut self, delay: DelayHint) -> Self {
        self.delay = delay;
        self
    }
}

/// What a classifier knows about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct RequestFacts {
    /// The request may be repeated: an idempotent method, an `Idempotency-Key`, or
    /// declared idempotent by the user.
    pub safe: bool,
    /// The request carries an `Idempotency-Key`.
    pub has_key: bool,
    /// A gRPC request (`content-type: application/grpc…`).
    pub grpc: bool,
    /// The request carried a deadline (`request-timeout-ms` / `grpc-timeout`).
    pub deadline_sent: bool,
    /// The deadline the request carried had run out, or nearly (within a tenth of it,
    /// at least 50 ms, of its end), when the answer came: a 504 / `DEADLINE_EXCEEDED` is then the
    /// caller's deadline at work, not the callee's fault, and neutral for breakers.
    pub deadline_spent: bool,
}

impl RequestFacts {
    /// A request safe to repeat (and nothing else known).
    pub const SAFE: RequestFacts = RequestFacts {
        safe: true,
        has_key: false,
        grpc: false,
        deadline_sent: false,
        deadline_spent: false,
    };

    /// A request not safe to repeat (a POST without a key).
    pub const UNSAFE: RequestFacts = RequestFacts {
        safe: false,
        has_key: false,
        grpc: false,
        deadline_sent: false,
        deadline_spent: false,
    };

    /// These facts for a gRPC request.
    #[doc(hidden)]
    #[must_use]
    pub const fn grpc(mut self) -> Self {
        self.grpc = true;
        self
    }

    /// These facts for a request carrying an `Idempotency-Key` (which makes it safe).
    #[must_use]
    pub const fn with_key(mut self) -> Self {
        self.has_key = true;
        self.safe = true;
        self
    }

    /// These facts for a request that carried a deadline header.
    #[doc(hidden)]
    #[must_use]
    pub const fn with_deadline_sent(mut self) -> Self {
        self.deadline_sent = true;
        self
    }

    /// These facts for a request whose deadline had run out (or nearly) when the answer
    /// came (see [`deadline_spent`]); it was sent, too.
    #[doc(hidden)]
    #[must_use]
    pub const fn with_deadline_spent(mut self) -> Self {
        self.deadline_sent = true;
        self.deadline_spent = true;
        self
    }

    /// Facts about a request with this method and these headers (`safe` from the
    /// method and key only; set it for a request the user declared idempotent).
    #[doc(hidden)]
    pub fn of(method: &http::Method, headers: &HeaderMap, convention: &Convention) -> Self {
        let has_key = headers.contains_key(convention.idempotency_key());
        RequestFacts {
            safe: method.is_idempotent() || has_key,
            has_key,
            grpc: is_grpc(headers),
            deadline_sent: headers.contains_key(convention.request_timeout_ms())
                || headers.contains_key(convention.grpc_timeout()),
            deadline_spent: false,
        }
    }
}

/// What a breaker needs to know of a request it admitted, shared by every breaker
/// adapter: whether it is gRPC, and the deadline it carries to the callee (its
/// `request-timeout-ms` / `grpc-timeout`). Whether it is safe to repeat changes no
/// breaker outcome, so it is not looked up.
///
/// ```
/// use std::time::Duration;
/// use http::HeaderMap;
/// use retrysafe_core::classify::BreakerFacts;
/// use retrysafe::wire::Convention;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("request-timeout-ms", "1000".parse().unwrap());
/// let facts = BreakerFacts::of(&headers, &Convention::default());
/// assert!(facts.carries_deadline());
/// // An answer after 100 ms: the deadline is not spent; after 950 ms it is.
/// assert!(!facts.after(Some(Duration::from_millis(100))).deadline_spent);
/// assert!(facts.after(Some(Duration::from_millis(950))).deadline_spent);
/// ```
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerFacts {
    facts: RequestFacts,
    given: Option<Duration>,
}

impl BreakerFacts {
    /// The facts of a request with these headers.
    pub fn of(headers: &HeaderMap, convention: &Convention) -> Self {
        let mut facts = RequestFacts::default();
        let given = if is_grpc(headers) {
            facts = facts.grpc();
            headers
                .get(convention.grpc_timeout())
                .and_then(|v| crate::wire::parse_grpc_timeout(v.as_bytes()).ok())
        } else {
            headers
                .get(convention.request_timeout_ms())
                .and_then(|v| crate::wire::parse_request_timeout_ms(v.as_bytes()).ok())
        };
        if given.is_some() {
            facts = facts.with_deadline_sent();
        }
        BreakerFacts { facts, given }
    }

    /// The facts of a request whose timeout header the caller wrote itself from the
    /// time `left` (the value [`RetryCall::prepare_attempt_with`](crate::retry::RetryCall::prepare_attempt_with)
    /// returns): what [`of`](Self::of) would find in its headers, without parsing them.
    #[must_use]
    #[inline]
    pub fn sent(grpc: bool, left: Option<Duration>) -> Self {
        let given = left.map(|left| crate::wire::timeout_as_read(left, grpc));
        let mut facts = RequestFacts::default();
        if grpc {
            facts = facts.grpc();
        }
        if given.is_some() {
            facts = facts.with_deadline_sent();
        }
        BreakerFacts { facts, given }
    }

    /// The request carries a deadline: time the call, to tell when it is spent.
    #[must_use]
    pub fn carries_deadline(&self) -> bool {
        self.given.is_some()
    }

    /// A gRPC request.
    #[must_use]
    pub fn is_grpc(&self) -> bool {
        self.facts.grpc
    }

    /// The facts to classify an answer with that came `elapsed` after the request was
    /// sent (`None`: it was never sent, or not timed): with
    /// [`deadline_spent`](RequestFacts::deadline_spent) when the deadline it carried had
    /// (nearly) run out by then.
    #[must_use]
    pub fn after(&self, elapsed: Option<Duration>) -> RequestFacts {
        match (self.given, elapsed) {
            (Some(given), Some(elapsed)) if deadline_spent(given, elapsed) => {
                self.facts.with_deadline_spent()
            }
            _ => self.facts,
        }
    }
}

/// The least slack of [`deadline_spent`].
const SPENT_SLACK_MIN: Duration = Duration::from_millis(50);

/// Whether a deadline of `given` had run out, or nearly, `elapsed` after the request was
/// sent: within a tenth of `given` (at least 50 ms) of its end.
///
/// A 504 / `DEADLINE_EXCEEDED` that comes then is the caller's deadline at work — the
/// callee gave up on the time it was given, less the margins of the hops in between —
/// and neutral for breakers. One that comes early is the callee's own timeout, a fault
/// of the callee.
///
/// ```
/// use std::time::Duration;
/// use retrysafe_core::__private::deadline_spent;
///
/// let given = Duration::from_secs(1);
/// assert!(deadline_spent(given, Duration::from_millis(950)));
/// assert!(deadline_spent(given, Duration::from_secs(2)));
/// assert!(!deadline_spent(given, Duration::from_millis(100)));
/// ```
#[must_use]
pub(crate) fn deadline_spent(given: Duration, elapsed: Duration) -> bool {
    let slack = (given / 10).max(SPENT_SLACK_MIN);
    elapsed.saturating_add(slack) >= given
}

/// Whether headers describe a gRPC message (`content-type: application/grpc…`).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// A transport failure: an attempt that produced no response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Failure {
    /// The connection could not be made; nothing was sent.
    ConnectFailed,
    /// HTTP/2 `REFUSED_STREAM`: the server did not process the stream.
    RefusedStream,
    /// The request was (maybe) sent, but the connection closed or reset before a
    /// response arrived.
    NoResponse,
    /// The attempt timed out.
    Timeout,
    /// The call was refused locally by a layer of ours (budget, breaker, deadline):
    /// never retried.
    Local,
    /// Anything else.
    Other,
}

impl Failure {
    /// Finds what kind of failure `error` is by walking its `source()` chain: our own
    /// local errors (never retried), `std::io::Error` kinds, and (through `extra`) what a
    /// transport adapter recognises, such as hyper-util's connect errors or h2's
    /// `REFUSED_STREAM`. A refused connection counts as "nothing sent" only when it is
    /// `error` itself or `extra` says so: deeper in a chain it may be a dependency's.
    #[doc(hidden)]
    pub fn of(
        error: &(dyn StdError + 'static),
        extra: impl Fn(&(dyn StdError + 'static)) -> Option<Failure>,
    ) -> Failure {
        let mut current: Option<&(dyn StdError + 'static)> = Some(error);
        let mut found = Failure::Other;
        let mut depth = 0usize;
        while let Some(e) = current {
            if let Some(f) = extra(e) {
                return f;
            }
            if e.is::<BudgetExhausted>()
                || e.is::<CircuitOpen>()
                || e.is::<DeadlineExceeded>()
                || e.is::<Throttled>()
            {
                // Refused or given up by a layer of ours: never retried again.
                return Failure::Local;
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind as K;
                match io.kind() {
                    // "Nothing was sent" is trusted only from the error itself (a
                    // connector's own error), never from deep inside a chain, where a
                    // service may report a refused connection of its own after doing
                    // its work.
                    K::ConnectionRefused | K::AddrNotAvailable if depth == 0 => {
                        return Failure::ConnectFailed;
                    }
                    K::TimedOut => found = Failure::Timeout,
                    K::ConnectionReset
                    | K::ConnectionAborted
                    | K::BrokenPipe
                    | K::UnexpectedEof
                    | K::NotConnected => found = Failure::NoResponse,
                    _ => {}
                }
            }
            current = e.source();
            depth += 1;
        }
        found
    }
}

/// Classifies outcomes; shared by retry, budget and breaker. Implement it to change the
/// rules (wrap a [`DefaultClassifier`] to change only some).
pub trait Classifier: fmt::Debug + Send + Sync + 'static {
    /// A response head. For a gRPC request this also sees a Trailers-Only status, whose
    /// `grpc-status` is in the head.
    fn classify_response(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        request: &RequestFacts,
    ) -> Classification;

    /// The trailers at the end of a response stream (for breakers): a gRPC status there
    /// came after the response headers, past the commit point, and is never retried.
    fn classify_trailers(&self, trailers: &HeaderMap, request: &RequestFacts) -> Classification;

    /// A transport failure.
    fn classify_failure(&self, failure: Failure, request: &RequestFacts) -> Classification;

    /// Whether [`RequestFacts::deadline_spent`] may turn what is a success without it
    /// into something else. `true` (the default) makes a breaker time every call that
    /// carries a deadline before classifying its answer; the [`DefaultClassifier`] reads
    /// it for failures only, so a breaker skips that clock read on its successes.
    #[doc(hidden)]
    fn reads_spent_on_success(&self) -> bool {
        true
    }
}

/// The default rules (see the [module docs](self)).
#[derive(Debug, Clone, Default)]
pub struct DefaultClassifier {
    convention: Convention,
    retry_500: bool,
}

impl DefaultClassifier {
    /// The defaults, reading headers by `convention`.
    pub fn new(convention: Convention) -> Self {
        DefaultClassifier {
            convention,
            retry_500: false,
        }
    }

    /// Also retries 500 on safe requests (off by default: a 500 is usually
    /// deterministic, and gRPC does not retry `INTERNAL` either).
    #[must_use]
    pub fn retry_500(mut self, yes: bool) -> Self {
        self.retry_500 = yes;
        self
    }

    fn retry_after(&self, headers: &HeaderMap) -> Option<Duration> {
        let value = headers.get(self.convention.retry_after())?;
        parse_retry_after(value.as_bytes()).map(|r| r.delay_from(SystemTime::now()))
    }

    fn grpc(&self, code: u32, headers: &HeaderMap, request: &RequestFacts) -> Classification {
        use RetrySafety::{Maybe, No};
        match code {
            0 => Classification::SUCCESS,
            // UNAVAILABLE
            14 => match self.pushback(headers) {
                Some(Pushback::DoNotRetry) => Classification::failure(No, FaultSide::Server),
                Some(Pushback::After(d)) => Classification::failure(Maybe, FaultSide::Server)
                    .with_delay(DelayHint::Exactly(d)),
                None => Classification::failure(Maybe, FaultSide::Server),
            },
            // RESOURCE_EXHAUSTED: only with a pushback
            8 => match self.pushback(headers) {
                Some(Pushback::After(d)) => Classification::failure(Maybe, FaultSide::Server)
                    .throttled()
                    .with_delay(DelayHint::Exactly(d)),
                _ => Classification::failure(No, FaultSide::Server).throttled(),
            },
            // DEADLINE_EXCEEDED
            4 => {
                let side = if request.deadline_spent {
                    FaultSide::CallerDeadline
                } else {
                    FaultSide::Server
                };
                Classification::failure(No, side).timed_out()
            }
            // INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED,
            // FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE, UNIMPLEMENTED, UNAUTHENTICATED,
            // CANCELLED (the caller's own cancellation)
            1 | 3 | 5 | 6 | 7 | 9 | 10 | 11 | 12 | 16 => {
                Classification::failure(No, FaultSide::Client)
            }
            // UNKNOWN, INTERNAL, DATA_LOSS, and anything unknown
            _ => Classification::failure(No, FaultSide::Server),
        }
    }

    fn pushback(&self, headers: &HeaderMap) -> Option<Pushback> {
        headers
            .get(self.convention.grpc_retry_pushback_ms())
            .map(|v| parse_pushback(v.as_bytes()))
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    let value = headers.get("grpc-status")?;
    let s = std::str::from_utf8(value.as_bytes()).ok()?;
    // Status codes are small; anything longer is garbage, read as UNKNOWN.
    if s.is_empty() || s.len() > 3 {
        return Some(2);
    }
    Some(s.trim().parse().unwrap_or(2))
}

impl Classifier for DefaultClassifier {
    fn classify_response(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        request: &RequestFacts,
    ) -> Classification {
        use RetrySafety::{Maybe, No};
        // The common case first: a plain success needs no header lookup.
        if !request.grpc && (status.is_success() || status.is_redirection()) {
            return Classification::SUCCESS;
        }
        let marked = parse_do_not_retry(
            headers
                .get(self.convention.do_not_retry())
                .map(|v| v.as_bytes()),
        ) || parse_flag(
            headers
                .get(self.convention.idempotent_replayed())
                .map(|v| v.as_bytes()),
        );

        let mut c = if request.grpc && status.is_success() {
            match grpc_status(headers) {
                // A Trailers-Only response: the status is in the head.
                Some(code) => self.grpc(code, headers, request),
                // Headers first: the status will come in the trailers.
                None => Classification::SUCCESS,
            }
        } else {
            match status.as_u16() {
                200..=399 => Classification::SUCCESS,
                408 => Classification::failure(Maybe, FaultSide::Server).timed_out(),
                429 => Classification::failure(Maybe, FaultSide::Server).throttled(),
                409 if request.has_key => match self.retry_after(headers) {
                    // The IdempotencyLayer's "still in flight": not a fault.
                    // (Client side, so breakers count it as the callee's success.)
                    Some(d) => Classification::failure(Maybe, FaultSide::Client)
                        .with_delay(DelayHint::AtLeast(d)),
                    None => Classification::failure(No, FaultSide::Client),
                },
                400..=499 => Classification::failure(No, FaultSide::Client),
                500 if self.retry_500 => Classification::failure(Maybe, FaultSide::Server),
                502 => Classification::failure(Maybe, FaultSide::Server),
                503 => {
                    let c = Classification::failure(Maybe, FaultSide::Server);
                    if headers.contains_key(self.convention.retry_after()) {
                        c.throttled()
                    } else {
                        c
                    }
                }
                504 => {
                    let side = if request.deadline_spent {
                        FaultSide::CallerDeadline
                    } else {
                        FaultSide::Server
                    };
                    Classification::failure(Maybe, side).timed_out()
                }
                _ => Classification::failure(No, FaultSide::Server),
            }
        };

        if !c.is_success()
            && let (DelayHint::Backoff, Some(d)) = (c.delay, self.retry_after(headers))
        {
            c.delay = DelayHint::AtLeast(d);
        }
        if marked {
            c.safety = RetrySafety::No;
            c.marked = true;
            if matches!(c.fault, Some(FaultSide::Server)) {
                c.fault = Some(FaultSide::Dependency);
            }
        }
        c
    }

    fn classify_trailers(&self, trailers: &HeaderMap, request: &RequestFacts) -> Classification {
        match grpc_status(trailers) {
            Some(code) => {
                let mut c = self.grpc(code, trailers, request);
                c.safety = RetrySafety::No;
                if parse_do_not_retry(
                    trailers
                        .get(self.convention.do_not_retry())
                        .map(|v| v.as_bytes()),
                ) && matches!(c.fault, Some(FaultSide::Server))
                {
                    c.fault = Some(FaultSide::Dependency);
                    c.marked = true;
                }
                c
            }
            // A gRPC stream must end with a status: one that ends without is a
            // protocol error (tonic reports it as UNKNOWN), never a success.
            None if request.grpc => Classification::failure(RetrySafety::No, FaultSide::Server),
            None => Classification::SUCCESS,
        }
    }

    fn classify_failure(&self, failure: Failure, request: &RequestFacts) -> Classification {
        use RetrySafety::{Maybe, No, Yes};
        // A failure that comes as the deadline the request carried runs out (a
        // transport's own timer on that deadline, such as a tonic `Channel`'s, or a
        // connection dropped then) is that deadline at work, not the callee's fault.
        let side = if request.deadline_spent {
            FaultSide::CallerDeadline
        } else {
            FaultSide::Server
        };
        match failure {
            Failure::ConnectFailed | Failure::RefusedStream => {
                Classification::failure(Yes, FaultSide::Server)
            }
            Failure::NoResponse => Classification::failure(Maybe, side),
            Failure::Timeout => Classification::failure(Maybe, side).timed_out(),
            Failure::Local => Classification {
                marked: true,
                ..Classification::failure(No, FaultSide::Dependency)
            },
            Failure::Other => Classification::failure(No, side),
        }
    }

    fn reads_spent_on_success(&self) -> bool {
        false
    }
}
