//! What the benches share: the yardsticks the client and server benches measure the
//! layers against ([`floor`], [`idem_floor`], [`hand_guard`]), the peers' glue
//! ([`failsafe_service`], [`tower_policy`], [`seatbelt`]), and the load drivers' pieces ([`http1`], [`body`], [`load`],
//! [`recorder`], [`report`]).

pub mod body;
pub mod failsafe_service;
pub mod floor;
pub mod hand_guard;
pub mod http1;
pub mod idem_floor;
pub mod load;
pub mod recorder;
pub mod report;
pub mod seatbelt;
pub mod stores;
pub mod tower_policy;
