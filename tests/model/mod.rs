//! A model of the claim protocol, checked exhaustively by `stateright` (`tests/model_check.rs`)
//! and tied to the stores by `tests/model_conformance.rs`: `store.rs` is one store node and its
//! transitions, each naming the script or statement that implements it; `system.rs` the clients,
//! servers, the machinery (calls lost, late or sent twice, the coordinator's background
//! releases and completions, reconnects, the `WAIT`s, a failover that takes time and its
//! fence) and the properties, with the limits that excuse a run; `explore.rs` the liveness
//! check stateright cannot express, and the traces printed for counterexamples.
#![allow(dead_code)]

pub mod explore;
pub mod linearize;
pub mod store;
pub mod system;

// Each test binary uses some of these.
#[allow(unused_imports)]
pub use self::store::{Mutation, Outcome, Payload, Token};
#[allow(unused_imports)]
pub use self::system::{Action, Call, Config, State, System};
