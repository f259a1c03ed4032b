//! Redis Streams consumers and producers over the claim protocol (crate feature `streams`):
//! the group, reads and takeovers, the dead-letter stream and holding through store outages in
//! `consumer.rs` and `commands.rs`; what a message's fields mean in `message.rs`; the answers
//! in `outcome.rs`; deduplicated publishing in `publish.rs`; the shutdown future a consumer
//! process stops on in `shutdown.rs`. The user writes the effect.

mod commands;
mod consumer;
mod message;
mod outcome;
mod publish;
mod shutdown;

pub use consumer::StreamConsumer;
pub use message::{FieldError, StreamMessage};
pub use outcome::{Failure, StreamEvent, StreamOutcome};
pub use publish::StreamPublisher;
pub use shutdown::shutdown_signal;
