//! The shared store in PostgreSQL, through `sqlx`: one row per record, every transition one
//! statement, and a completion that can commit with the business rows of the handler.
//!
//! [`PostgresStore`] (`store.rs`) and its `Store` impl; below it, `sql.rs` (the schema and the
//! statements), `rows.rs` (reading what they answer), `connections.rs` (the connections it
//! holds between a claim and its completion); `transactional.rs` extends the store with
//! completion in the caller's transaction (`complete_in`, and `ClaimTransaction`, whose commit
//! does it).

mod connections;
mod rows;
mod sql;
mod store;
mod transactional;

pub use self::store::PostgresStore;
pub use self::transactional::{ClaimCommitError, ClaimTransaction};
