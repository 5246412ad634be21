use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::StatusCode;
use retrysafe_core::__private::{RngSource, Validate};
use retrysafe_core::ConfigError;
use retrysafe_core::wire::MAX_TIMEOUT;
use tower_layer::Layer;

use super::FaultService;

/// Injects seeded faults into the calls of the service below; see the
/// [module docs](super).
///
/// Clones of a layer (and every service it makes) share one random sequence and one
/// set of counts ([`stats`](Self::stats)). A setter starts a new sequence and new
/// counts.
#[must_use]
#[derive(Clone)]
pub struct FaultLayer {
    config: Arc<Config>,
}

pub(super) struct Config {
    latency: Latency,
    resets: f64,
    errors: f64,
    error_status: StatusCode,
    lost_replies: f64,
    seed: u64,
    rng: RngSource,
    pub(super) counts: Counts,
}

#[derive(Debug, Clone, Copy)]
struct Latency {
    probability: f64,
    min: Duration,
    max: Duration,
}

/// What happens to one call, drawn when it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    /// Waited before anything else.
    pub(super) delay: Option<Duration>,
    pub(super) fault: Option<Fault>,
}

/// A fault of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// Fails without calling the inner service.
    Reset,
    /// Answers this status without calling the inner service.
    Error(StatusCode),
    /// Calls the inner service, drops its answer and fails.
    LostReply,
}

/// The shared counts behind [`FaultStats`].
#[derive(Default)]
pub(super) struct Counts {
    calls: AtomicU64,
    pub(super) delayed: AtomicU64,
    pub(super) resets: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) lost_replies: AtomicU64,
}

impl Counts {
    pub(super) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// What a [`FaultLayer`] did so far (every clone and service of it together). A fault
/// counts when it happens: a call dropped by its caller during an injected delay counts
/// as delayed, not as the fault that was drawn for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct FaultStats {
    /// Calls made.
    pub calls: u64,
    /// Calls delayed by an injected latency.
    pub delayed: u64,
    /// Connections reset before the inner service was called.
    pub resets: u64,
    /// Error answers given instead of calling the inner service.
    pub errors: u64,
    /// Answers of the inner service dropped after it ran.
    pub lost_replies: u64,
}

impl Config {
    /// Draws what happens to the next call.
    pub(super) fn plan(&self) -> Plan {
        Counts::add(&self.counts.calls);
        let mut rng = self.rng.next_rng();
        let latency = self.latency;
        let delay =
            (rng.unit() < latency.probability).then(|| rng.between(latency.min, latency.max));
        let draw = rng.unit();
        let fault = if draw < self.resets {
            Some(Fault::Reset)
        } else if draw < self.resets + self.errors {
            Some(Fault::Error(self.error_status))
        } else if draw < self.resets + self.errors + self.lost_replies {
            Some(Fault::LostReply)
        } else {
            None
        };
        Plan { delay, fault }
    }
}

impl FaultLayer {
    /// A layer that injects nothing until told to, with a random seed.
    pub fn new() -> Self {
        FaultLayer::from_config(Config {
            latency: Latency {
                probability: 0.0,
                min: Duration::ZERO,
                max: Duration::ZERO,
            },
            resets: 0.0,
            errors: 0.0,
            error_status: StatusCode::SERVICE_UNAVAILABLE,
            lost_replies: 0.0,
            seed: rand::random(),
            rng: RngSource::seeded(0),
            counts: Counts::default(),
        })
    }

    fn from_config(mut config: Config) -> Self {
        // The source seeds call n with a mix of `seed + n`: spread the seeds so that
        // seeds 1 and 2 do not draw the same sequence one call apart.
        config.rng = RngSource::seeded(config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        FaultLayer {
            config: Arc::new(config),
        }
    }

    fn map(self, f: impl FnOnce(&mut Config)) -> Self {
        let old = &self.config;
        let mut config = Config {
            latency: old.latency,
            resets: old.resets,
            errors: old.errors,
            error_status: old.error_status,
            lost_replies: old.lost_replies,
            seed: old.seed,
            rng: RngSource::seeded(0),
            counts: Counts::default(),
        };
        f(&mut config);
        FaultLayer::from_config(config)
    }

    /// Delays a share of calls (`probability`, from 0 to 1) by a time drawn uniformly
    /// from `min` to `max` (at most 30 days), on tokio's clock, before anything else
    /// happens to them.
    pub fn latency(self, probability: f64, min: Duration, max: Duration) -> Self {
        self.map(|c| {
            c.latency = Latency {
                probability,
                min,
                max,
            };
        })
    }

    /// Fails a share of calls (`probability`) with a [`ConnectionReset`](super::ConnectionReset)
    /// before the inner service is called: nothing runs.
    pub fn connection_resets(self, probability: f64) -> Self {
        self.map(|c| c.resets = probability)
    }

    /// Answers a share of calls (`probability`) with `status` (a 4xx or 5xx, such as
    /// 503) and an empty body, without calling the inner service: nothing runs.
    pub fn error_answers(self, probability: f64, status: StatusCode) -> Self {
        self.map(|c| {
            c.errors = probability;
            c.error_status = status;
        })
    }

    /// Runs a share of calls (`probability`) through the inner service to its answer,
    /// drops the answer and fails with [`ReplyLost`](super::ReplyLost): the effect
    /// happened, the caller cannot know it.
    pub fn lost_replies(self, probability: f64) -> Self {
        self.map(|c| c.lost_replies = probability)
    }

    /// Seeds the draws, for reproducible faults (default: a random seed). The faults
    /// drawn depend on the seed and the order in which calls are made.
    pub fn seed(self, seed: u64) -> Self {
        self.map(|c| c.seed = seed)
    }

    /// Checks the settings: the error names every one out of range (`latency`,
    /// `connection_resets`, `error_answers`, `error_status`, `lost_replies`, and
    /// `faults` when the three fault probabilities add up to more than 1).
    pub fn build(self) -> Result<Self, ConfigError> {
        let c = &self.config;
        let mut v = Validate::new();
        let share = |p: f64| (0.0..=1.0).contains(&p);
        let range = "must be a probability from 0 to 1";
        v.check(
            share(c.latency.probability)
                && c.latency.min <= c.latency.max
                && c.latency.max <= MAX_TIMEOUT,
            "latency",
            "must have a probability from 0 to 1 and min <= max <= 30 days",
        );
        v.check(share(c.resets), "connection_resets", range);
        v.check(share(c.errors), "error_answers", range);
        v.check(
            c.error_status.is_client_error() || c.error_status.is_server_error(),
            "error_status",
            "must be a 4xx or 5xx status",
        );
        v.check(share(c.lost_replies), "lost_replies", range);
        if [c.resets, c.errors, c.lost_replies].into_iter().all(share) {
            v.check(
                c.resets + c.errors + c.lost_replies <= 1.0,
                "faults",
                "connection_resets, error_answers and lost_replies must add up to at most 1",
            );
        }
        v.finish(self)
    }

    /// What the layer did so far.
    pub fn stats(&self) -> FaultStats {
        let c = &self.config.counts;
        FaultStats {
            calls: c.calls.load(Ordering::Relaxed),
            delayed: c.delayed.load(Ordering::Relaxed),
            resets: c.resets.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            lost_replies: c.lost_replies.load(Ordering::Relaxed),
        }
    }
}

impl Default for FaultLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for FaultLayer {
    type Service = FaultService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FaultService::new(inner, Arc::clone(&self.config))
    }
}

impl fmt::Debug for FaultLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.config, f)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultLayer")
            .field("latency", &self.latency)
            .field("connection_resets", &self.resets)
            .field("error_answers", &self.errors)
            .field("error_status", &self.error_status)
            .field("lost_replies", &self.lost_replies)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}
