//! The faults of the proxy's fault mode, and how they are drawn.

use std::time::Duration;

use crate::rng::SplitMix64;

/// One fault, chosen per request (see the table of the [module docs](super)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Forwards both ways.
    Pass,
    /// Sleeps up to `max_delay` before the request, before the response, or both.
    Delay,
    /// Reads the request, then resets the client; the server never sees it.
    ResetBeforeRequest,
    /// Forwards the request, then resets the client at once.
    ResetAfterRequest,
    /// Forwards the request, waits for the whole response, then resets the client.
    LoseResponse,
    /// Forwards a strict prefix of the response, then resets the client.
    CutMidBody,
    /// Forwards the request, then shuts down its write side toward the client.
    HalfCloseClient,
    /// Forwards the request, then shuts down its write side toward the server.
    HalfCloseServer,
    /// Reads the request, never forwards it, never answers.
    BlackHole,
}

impl Fault {
    /// Every fault, in a fixed order (the index of [`ProxyStats::faults`](super::ProxyStats::faults)).
    pub const ALL: [Fault; 9] = [
        Fault::Pass,
        Fault::Delay,
        Fault::ResetBeforeRequest,
        Fault::ResetAfterRequest,
        Fault::LoseResponse,
        Fault::CutMidBody,
        Fault::HalfCloseClient,
        Fault::HalfCloseServer,
        Fault::BlackHole,
    ];

    /// The snake_case name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Pass => "pass",
            Fault::Delay => "delay",
            Fault::ResetBeforeRequest => "reset_before_request",
            Fault::ResetAfterRequest => "reset_after_request",
            Fault::LoseResponse => "lose_response",
            Fault::CutMidBody => "cut_mid_body",
            Fault::HalfCloseClient => "half_close_client",
            Fault::HalfCloseServer => "half_close_server",
            Fault::BlackHole => "black_hole",
        }
    }

    pub(crate) fn index(self) -> usize {
        Fault::ALL.iter().position(|f| *f == self).unwrap()
    }
}

/// Weights of the faults; a request gets fault `f` with probability
/// `weight(f) / sum of weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultMix {
    weights: [u32; 9],
}

impl FaultMix {
    /// Every request passes.
    pub fn none() -> FaultMix {
        FaultMix::none_but(Fault::Pass, 1)
    }

    /// Only `fault`, with weight `w` (then add others with [`with`](Self::with)).
    pub fn none_but(fault: Fault, w: u32) -> FaultMix {
        FaultMix { weights: [0; 9] }.with(fault, w)
    }

    /// Sets the weight of `fault`.
    pub fn with(mut self, fault: Fault, w: u32) -> FaultMix {
        self.weights[fault.index()] = w;
        self
    }

    /// The default mix, in per mille: 700 pass, 100 delay, and 25 each of the seven
    /// breaking faults (175 ‰ of requests broken one way or another).
    pub fn standard() -> FaultMix {
        FaultMix {
            weights: [700, 100, 25, 25, 25, 25, 25, 25, 25],
        }
    }

    /// The weight of `fault`.
    pub fn weight(&self, fault: Fault) -> u32 {
        self.weights[fault.index()]
    }

    pub(crate) fn pick(&self, rng: &mut SplitMix64) -> Fault {
        let total: u64 = self.weights.iter().map(|w| u64::from(*w)).sum();
        if total == 0 {
            return Fault::Pass;
        }
        let mut roll = rng.below(total);
        for (fault, w) in Fault::ALL.iter().zip(self.weights) {
            if roll < u64::from(w) {
                return *fault;
            }
            roll -= u64::from(w);
        }
        Fault::Pass
    }
}

/// How the proxy's fault mode ([`FaultProxy::start`](super::FaultProxy::start)) breaks
/// requests.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Which faults, how often.
    pub mix: FaultMix,
    /// The seed of the fault choices.
    pub seed: u64,
    /// The longest `delay` (uniform from 0).
    pub max_delay: Duration,
    /// How long a black-holed connection is held at most.
    pub black_hole_hold: Duration,
}

impl ProxyConfig {
    /// `mix` drawn with `seed`; delays up to 50 ms, black holes held up to 30 s.
    pub fn new(mix: FaultMix, seed: u64) -> ProxyConfig {
        ProxyConfig {
            mix,
            seed,
            max_delay: Duration::from_millis(50),
            black_hole_hold: Duration::from_secs(30),
        }
    }
}
