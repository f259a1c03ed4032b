//! The Lua scripts of the owner-checked transitions (complete, release, renew), a waiter's
//! claim (wait), and the operators' calls (purge, inspect), each named once (sources in
//! `scripts/*.lua`), and the arguments and answers they share.

use std::sync::LazyLock;
use std::time::Duration;

use bytes::Bytes;
use fred::types::Value;

use crate::store::error::StoreError;

/// One Lua script: its source, embedded at compile time, and its SHA-1 for EVALSHA.
pub(super) struct Script {
    pub(super) name: &'static str,
    pub(super) source: &'static str,
    /// Leaked once per script per process, so every call can pass it without a copy.
    pub(super) sha1: &'static str,
    /// Takes any number of records in one call (complete.lua): calls made at the same time are
    /// merged into one (`coalesce`).
    pub(super) per_record: bool,
}

impl Script {
    fn new(name: &'static str, source: &'static str) -> Self {
        let sha1 = fred::types::scripts::Script::from_lua(source).sha1().to_string();
        Self {
            name,
            source,
            sha1: Box::leak(sha1.into_boxed_str()),
            per_record: false,
        }
    }

    fn per_record(mut self) -> Self {
        self.per_record = true;
        self
    }
}

pub(super) static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new("complete", include_str!("../../../scripts/complete.lua")).per_record());
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new("release", include_str!("../../../scripts/release.lua")));
pub(super) static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new("renew", include_str!("../../../scripts/renew.lua")));
pub(super) static WAIT: LazyLock<Script> =
    LazyLock::new(|| Script::new("wait", include_str!("../../../scripts/wait.lua")));
pub(super) static PURGE: LazyLock<Script> =
    LazyLock::new(|| Script::new("purge", include_str!("../../../scripts/purge.lua")));
pub(super) static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new("inspect", include_str!("../../../scripts/inspect.lua")));

pub(super) fn millis(duration: Duration) -> Value {
    Value::from(lease_millis(duration))
}

pub(super) fn lease_millis(duration: Duration) -> i64 {
    // A lease of 0 ms would make PEXPIRE delete the key at once.
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX).max(1)
}

pub(super) fn unexpected(script: &str, value: &Value) -> StoreError {
    StoreError::Corrupt(format!("unexpected answer from the {script} script: {value:?}"))
}

pub(super) fn as_flag(script: &str, value: Value) -> Result<bool, StoreError> {
    match value.as_i64() {
        Some(0) => Ok(false),
        Some(1) => Ok(true),
        _ => Err(unexpected(script, &value)),
    }
}

pub(super) fn into_bytes(value: Value) -> Option<Bytes> {
    match value {
        Value::Bytes(bytes) => Some(bytes),
        Value::String(text) => Some(text.into_inner()),
        _ => None,
    }
}
