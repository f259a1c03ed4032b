//! The shared store: Redis (standalone, with replicas, Sentinel, or Cluster) through `fred`.
//!
//! [`RedisStore`] (`store.rs`) is built and configured there; the rest is one file per concern,
//! each below the store, none importing it back but the two that extend it:
//! - `commands.rs`: the claim (`SET … NX GET`), the owner-checked transitions, and the `Store` impl;
//! - `acknowledged.rs`: the durability option's claim and completion (`ReplicaAcks`), over
//!   `replica_acks.rs` (its connections and `WAIT`);
//! - `record.rs`: the record's byte layout; `scripts.rs`: the Lua scripts;
//! - `coalesce.rs`: concurrent commands handed to fred together, completions merged;
//! - `connection.rs`, `liveness.rs`: the connections, and the heartbeat that replaces a silent one;
//! - `notices.rs`: the pub/sub feed that wakes requests waiting for a running one;
//! - `cache_feed.rs`: the replay cache's purge feed;
//! - `sentinel/`: the failover watch and its fence.

mod acknowledged;
mod cache_feed;
mod coalesce;
mod commands;
mod connection;
#[cfg(test)]
mod fence_tests;
mod liveness;
mod notices;
mod record;
mod replica_acks;
mod scripts;
mod sentinel;
mod store;

pub use self::replica_acks::ReplicaAcks;
pub use self::store::RedisStore;
// The record layout's fuzz check, for `crate::__fuzz` (crate feature `fuzzing`, not an API).
#[cfg(feature = "fuzzing")]
pub(crate) use self::record::check as check_record;
