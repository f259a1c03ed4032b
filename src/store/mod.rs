//! Where records live: the [`Store`] trait and its implementations (memory, Redis, PostgreSQL).
//!
//! A record moves through two states. A *claim* creates it **in flight**, owned by one
//! [`OwnerToken`], for the length of a lease. Its owner then either *completes* it (it becomes
//! **completed**, holding a payload, for the retention period) or *releases* it (it is deleted).
//! Every transition but the claim is owner-checked, so a request whose lease ran out and whose key
//! was claimed again can never overwrite or delete the newer owner's record.
//!
//! `contract.rs` states the [`Store`] trait, `record.rs` the record types and owner tokens,
//! `error.rs` the one error, `ticket.rs` what a transactional completion needs; each store below
//! them: `memory.rs`, `redis/`, `postgres/`.

mod contract;
mod error;
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod record;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod ticket;

pub use self::contract::{KeyWatch, Store, StoreFuture};
pub use self::error::StoreError;
pub use self::record::{ClaimOutcome, InFlightRecord, OwnerToken, RecordInfo, RecordState, RECORD_VERSION};
pub(crate) use self::ticket::ClaimFlags;
pub use self::ticket::ClaimTicket;
