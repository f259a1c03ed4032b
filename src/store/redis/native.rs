//! The owner-checked transitions as native compare-and-set commands, where the server has them.
//!
//! Redis 8.4 and later have `SET … IFEQ <value>` and `DELEX … IFEQ <value>`; Valkey 8.1 and later
//! have `SET … IFEQ`, and Valkey 9.0 `DELIFEQ`. Each writes (or deletes) only when the record is
//! byte for byte the value given, which is how an owner proves the record is still its own:
//! a completion is `SET key <completed record> IFEQ <in-flight record> PX <retention> GET`, about
//! a quarter of Redis's time for `complete.lua`. The record layout is the scripts' (the
//! completed record is the in-flight one with its state and deadline rewritten and the payload
//! appended, as `complete.lua` writes it), so instances on either path share one Redis.
//!
//! What the scripts compare is the record's head (magic, version, owner) and its state byte;
//! what `IFEQ` compares is the whole record, deadline and fingerprint included. So this process
//! remembers, per claim it holds, the exact record it last wrote ([`Native::held`]): the claim's,
//! then each renewal's. `GET` on the same `SET` hands back what was there, so a record that is
//! still this owner's but differs from the one remembered (a renewal applied whose answer was
//! lost) is compared again with what was found, and a completion re-sent after a dropped
//! connection (the record already is the one written) is recognised as done. A claim this
//! process does not remember (made before a restart of the store, or before the server's
//! capabilities were known) takes the script, as does any transition on a server without them.
//!
//! The scripts' path remembers the same records ([`Native::remembered`]): complete.lua takes
//! the in-flight record this owner wrote last and the completed record built here, so that Redis
//! compares two strings and writes one, and builds a record only when they differ.
//!
//! What the server can do is asked once the store starts (`COMMAND INFO`, `COMMAND DOCS`), and
//! again after every reconnect (a failover can land on an older replica). A native command
//! refused as unknown (a node not yet upgraded) or as not allowed (an ACL written for the
//! scripts' commands) turns the store back to the scripts until the next reconnect, and that
//! call is made again with its script: the refused command wrote nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface};
use fred::types::{ClusterHash, CustomCommand, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::record;
use crate::store::error::StoreError;

/// `SET … IFEQ`: completion and renewal.
const SET_IFEQ: u8 = 1;
/// `DELEX … IFEQ` (Redis 8.4+): release.
const DELEX: u8 = 2;
/// `DELIFEQ` (Valkey 9.0+): release.
const DELIFEQ: u8 = 4;

/// Which compare-and-set commands the store uses, and the records of the claims it holds.
/// Shared by every clone of a store.
pub(super) struct Native {
    /// On: the native commands the server has; off (the default): always the scripts
    /// ([`RedisStore::with_native_transitions`](super::RedisStore::with_native_transitions)).
    enabled: bool,
    /// What the server was found to have ([`SET_IFEQ`], [`DELEX`], [`DELIFEQ`]); 0 until known.
    commands: AtomicU8,
    /// The server has answered what it has (`commands` is its answer, not the 0 of not knowing).
    detected: AtomicBool,
    /// The record each claim this process holds was last written with, by head.
    held: Mutex<Held>,
    /// Wakes the detecting task after a reconnect.
    redetect: Arc<Notify>,
    /// The detecting task and the reconnect listeners, stopped with the last store clone.
    tasks: OnceLock<Vec<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct Held {
    records: HashMap<Bytes, (Bytes, Instant)>,
    /// The size at which expired entries are swept (a claim whose owner never completed nor
    /// released it: its future dropped mid-way). Doubles with the live entries, so a sweep costs
    /// a constant per insertion.
    sweep_at: usize,
}

const FIRST_SWEEP: usize = 1024;

impl Native {
    pub(super) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            commands: AtomicU8::new(0),
            detected: AtomicBool::new(false),
            held: Mutex::new(Held {
                records: HashMap::new(),
                sweep_at: FIRST_SWEEP,
            }),
            redetect: Arc::new(Notify::new()),
            tasks: OnceLock::new(),
        }
    }

    /// The same store's choice turned on or off, with what the server was found to have kept,
    /// so that turning it on after [`RedisStore::connect`](super::RedisStore::connect) (which
    /// asks either way) takes effect with the first call.
    pub(super) fn turned(&self, enabled: bool) -> Self {
        let native = Self::new(enabled);
        native
            .commands
            .store(self.commands.load(Ordering::Relaxed), Ordering::Relaxed);
        native
            .detected
            .store(self.detected.load(Ordering::Relaxed), Ordering::Relaxed);
        native
    }

    /// Whether completions and renewals go as `SET … IFEQ`.
    pub(super) fn sets(&self) -> bool {
        self.enabled && self.commands.load(Ordering::Relaxed) & SET_IFEQ != 0
    }

    /// The command that deletes a record if it equals a value, if the server has one.
    pub(super) fn deleter(&self) -> Option<Deleter> {
        if !self.enabled {
            return None;
        }
        let commands = self.commands.load(Ordering::Relaxed);
        if commands & DELEX != 0 {
            Some(Deleter::Delex)
        } else if commands & DELIFEQ != 0 {
            Some(Deleter::DelIfEq)
        } else {
            None
        }
    }

    /// A native command was refused as unknown, or as not allowed to this user (an ACL that
    /// lists the commands the store needed before, without `DELEX` or `DELIFEQ`): the scripts,
    /// until the next reconnect.
    pub(super) fn refused(&self, error: &fred::error::Error) -> bool {
        let details = error.details();
        let refused = details.starts_with("ERR syntax error")
            || details.starts_with("ERR unknown command")
            || details.starts_with("NOPERM");
        if refused && self.commands.swap(0, Ordering::Relaxed) != 0 {
            tracing::warn!(
                %error,
                "the Redis server refused a compare-and-set command; using the Lua scripts until the next reconnect"
            );
        }
        refused
    }

    /// Remembers the record a claim was written with (or renewed to), on either path: the
    /// native commands compare with it, and complete.lua takes it with the completed record
    /// built here, so that Redis compares two strings and writes one instead of building it.
    pub(super) fn hold(&self, written: Bytes, lease: Duration) {
        let Some(head_len) = record::head_len(&written).map(|len| len - 9) else {
            return;
        };
        let head = written.slice(..head_len.min(written.len()));
        let until = Instant::now() + lease;
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.records.insert(head, (written, until));
        if held.records.len() >= held.sweep_at {
            // A record whose lease ran out is gone from Redis too, or another owner's: nothing
            // would compare equal to it.
            let now = Instant::now();
            held.records.retain(|_, (_, until)| *until > now);
            held.sweep_at = (held.records.len() * 2).max(FIRST_SWEEP);
        }
    }

    /// After `renew.lua`: the record remembered follows the renewal (`state`, a state byte and
    /// the new deadline, with the remembered record's waited mark), or is forgotten when the
    /// claim was lost (`None`). A mark set since it was remembered is not known here: the next
    /// compare-and-set finds the record different and compares again with what it found.
    pub(super) fn renewed(&self, head: &Bytes, state: Option<&Bytes>, lease: Duration) {
        match (state, self.remembered(head)) {
            (Some(state), Some(record)) => {
                // renew.lua kept the mark of a record a request waits for.
                let state = record::keeping_mark(state, &record, head.len());
                self.hold(rewritten(&record, head.len(), &state, b""), lease)
            }
            (None, _) => self.forget(head),
            (Some(_), None) => {}
        }
    }

    /// The record the claim of `head` was last written with, if this process remembers it and
    /// native commands are in use: `None` is the native path's cue to leave the call to the
    /// script.
    pub(super) fn held(&self, head: &Bytes) -> Option<Bytes> {
        if !self.sets() {
            return None;
        }
        self.remembered(head)
    }

    /// The record the claim of `head` was last written with, if this process remembers it,
    /// whichever path is in use (complete.lua's expected record).
    pub(super) fn remembered(&self, head: &Bytes) -> Option<Bytes> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.records.get(head).map(|(record, _)| record.clone())
    }

    /// The claim of `head` is over (completed, released or lost).
    pub(super) fn forget(&self, head: &Bytes) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.records.remove(head);
    }

    /// Asks the server what it has, once, before the store's first call ([`RedisStore::connect`](super::RedisStore::connect)),
    /// on or off: two `COMMAND` calls, so that turning native transitions on afterwards needs no
    /// wait. A failure leaves the scripts in use until the background task has an answer.
    pub(super) async fn detect_now(&self, client: &Client) {
        match detect(client).await {
            Ok(commands) => {
                self.commands.store(commands, Ordering::Relaxed);
                self.detected.store(true, Ordering::Relaxed);
            }
            Err(error) => tracing::debug!(%error, "could not ask the Redis server for its commands"),
        }
    }

    /// Starts asking the server what it has, now and after every reconnect of `clients`: once
    /// per store (an atomic load after that). Needs a runtime.
    pub(super) fn start(self: &Arc<Self>, clients: &[Client]) {
        if !self.enabled {
            return;
        }
        self.tasks.get_or_init(|| {
            let mut tasks = Vec::with_capacity(clients.len() + 1);
            for client in clients {
                let mut reconnects = client.reconnect_rx();
                let native = Arc::downgrade(self);
                tasks.push(
                    tokio::spawn(async move {
                        loop {
                            use tokio::sync::broadcast::error::RecvError;
                            match reconnects.recv().await {
                                Ok(_) | Err(RecvError::Lagged(_)) => {}
                                Err(RecvError::Closed) => return,
                            }
                            let Some(native) = native.upgrade() else { return };
                            native.redetect.notify_one();
                        }
                    })
                    .abort_handle(),
                );
            }
            let client = clients.first().cloned();
            let redetect = self.redetect.clone();
            tasks.push(tokio::spawn(keep_detecting(Arc::downgrade(self), redetect, client)).abort_handle());
            tasks
        });
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        for task in self.tasks.get().into_iter().flatten() {
            task.abort();
        }
    }
}

/// Asks the server what it has, then again after each reconnect, until the store is dropped.
async fn keep_detecting(native: Weak<Native>, redetect: Arc<Notify>, client: Option<Client>) {
    let Some(client) = client else { return };
    // Asked already (by `connect`, before the store was turned on): not again until a reconnect,
    // nor alongside the store's first calls.
    if native
        .upgrade()
        .is_some_and(|native| native.detected.load(Ordering::Relaxed))
    {
        redetect.notified().await;
    }
    let mut pause = Duration::from_millis(100);
    loop {
        match detect(&client).await {
            Ok(commands) => {
                let Some(native) = native.upgrade() else { return };
                let before = native.commands.swap(commands, Ordering::Relaxed);
                native.detected.store(true, Ordering::Relaxed);
                if before != commands {
                    tracing::debug!(
                        set_ifeq = commands & SET_IFEQ != 0,
                        delex = commands & DELEX != 0,
                        delifeq = commands & DELIFEQ != 0,
                        "the Redis server's compare-and-set commands"
                    );
                }
                drop(native);
                redetect.notified().await;
                pause = Duration::from_millis(100);
            }
            Err(error) if error.details().starts_with("NOPERM") => {
                // An ACL that denies COMMAND: the scripts, and no more asking until a reconnect.
                tracing::debug!(%error, "may not ask the Redis server for its commands; using the Lua scripts");
                redetect.notified().await;
            }
            Err(error) => {
                // Not connected yet: what was found before meanwhile (a command the server lacks is
                // refused, and the store turns to the scripts).
                tracing::debug!(%error, "could not ask the Redis server for its commands; asking again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
                if native.strong_count() == 0 {
                    return;
                }
            }
        }
    }
}

/// The compare-and-set commands the server behind `client` has: `COMMAND INFO DELEX DELIFEQ`
/// (`nil` for an unknown command) and `COMMAND DOCS SET` (whether `SET` documents an `IFEQ`
/// argument). On a Cluster, one node answers; a node without them refuses the commands, which
/// turns the store back to the scripts ([`Native::refused`]).
pub(super) async fn detect(client: &Client) -> Result<u8, fred::error::Error> {
    let command = || CustomCommand::new_static("COMMAND", ClusterHash::Random, false);
    let info: Value = client
        .custom(
            command(),
            vec![Value::from_static_str("INFO"), "DELEX".into(), "DELIFEQ".into()],
        )
        .await?;
    let docs: Value = client
        .custom(command(), vec![Value::from_static_str("DOCS"), "SET".into()])
        .await?;
    let mut commands = 0;
    if mentions(&docs, "ifeq") {
        commands |= SET_IFEQ;
    }
    if let Value::Array(found) = info {
        let known = |at: usize| found.get(at).is_some_and(|value| !matches!(value, Value::Null));
        // Conditional deletes are used only with SET IFEQ (every server that has one has both).
        if commands & SET_IFEQ != 0 && known(0) {
            commands |= DELEX;
        }
        if commands & SET_IFEQ != 0 && known(1) {
            commands |= DELIFEQ;
        }
    }
    Ok(commands)
}

/// Whether `value`, nested however deep, holds the string `word` (any case).
fn mentions(value: &Value, word: &str) -> bool {
    match value {
        Value::String(text) => text.eq_ignore_ascii_case(word),
        Value::Bytes(bytes) => bytes.eq_ignore_ascii_case(word.as_bytes()),
        Value::Array(values) => values.iter().any(|value| mentions(value, word)),
        Value::Map(map) => map.iter().any(|(key, value)| {
            key.as_str().is_some_and(|key| key.eq_ignore_ascii_case(word)) || mentions(value, word)
        }),
        _ => false,
    }
}

/// A server's conditional delete.
#[derive(Clone, Copy)]
pub(super) enum Deleter {
    /// `DELEX key IFEQ value` (Redis 8.4+).
    Delex,
    /// `DELIFEQ key value` (Valkey 9.0+).
    DelIfEq,
}

impl Deleter {
    pub(super) fn command(self, key: Value, expected: Bytes) -> (CustomCommand, Vec<Value>) {
        match self {
            Deleter::Delex => (
                CustomCommand::new_static("DELEX", ClusterHash::FirstKey, false),
                vec![key, Value::from_static_str("IFEQ"), Value::Bytes(expected)],
            ),
            Deleter::DelIfEq => (
                CustomCommand::new_static("DELIFEQ", ClusterHash::FirstKey, false),
                vec![key, Value::Bytes(expected)],
            ),
        }
    }
}

/// `SET key <written> IFEQ <expected> PX <ms> GET`: what a compare-and-set writes, over what.
pub(super) struct Swap {
    pub(super) written: Bytes,
    pub(super) expected: Bytes,
    /// The record's time to live from now, in milliseconds.
    pub(super) ms: i64,
}

impl Swap {
    pub(super) fn command(self, key: Value) -> (CustomCommand, Vec<Value>) {
        let set = CustomCommand::new_static("SET", ClusterHash::FirstKey, false);
        let args = vec![
            key,
            Value::Bytes(self.written),
            Value::from_static_str("IFEQ"),
            Value::Bytes(self.expected),
            Value::from_static_str("PX"),
            Value::Integer(self.ms),
            Value::from_static_str("GET"),
        ];
        (set, args)
    }
}

/// The record a `SET … GET` found there: `None` for `nil`.
pub(super) fn swapped(answer: Value) -> Result<Option<Bytes>, StoreError> {
    match answer {
        Value::Null => Ok(None),
        Value::Bytes(bytes) => Ok(Some(bytes)),
        Value::String(text) => Ok(Some(text.into_inner())),
        other => Err(StoreError::Corrupt(format!(
            "unexpected answer to SET IFEQ: {other:?}"
        ))),
    }
}

/// `SPUBLISH <channel> ""`: the notice complete.lua and release.lua publish for waiters.
pub(super) fn publish_settled(channel: &str) -> (CustomCommand, Vec<Value>) {
    let publish = CustomCommand::new_static("SPUBLISH", ClusterHash::FirstKey, false);
    (publish, vec![Value::from(channel), Value::from_static_str("")])
}

/// What a `SET … IFEQ <expected> GET` that wrote `written` for the owner of `head` found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// The expected record, now replaced by the one written.
    Written,
    /// The record already is the one written: a command re-sent after a dropped connection,
    /// whose first copy was applied. This command wrote nothing, which matters to a `WAIT`
    /// behind it (it counts its own connection's writes).
    AlreadyWritten,
    /// This owner's record in flight, not the one remembered: compare again with it.
    OursInFlight(Bytes),
    /// This owner's record, completed already (with another deadline than this write's).
    OursCompleted(Bytes),
    /// No record, or another owner's: the claim is lost.
    Lost,
}

pub(super) fn found(answer: Option<&Bytes>, head: &[u8], expected: &[u8], written: &[u8]) -> Found {
    let Some(current) = answer else {
        return Found::Lost;
    };
    if current[..] == *expected {
        return Found::Written;
    }
    if current[..] == *written {
        return Found::AlreadyWritten;
    }
    match current.strip_prefix(head).and_then(|rest| rest.first()) {
        Some(&record::IN_FLIGHT) => Found::OursInFlight(current.clone()),
        Some(&record::COMPLETED) => Found::OursCompleted(current.clone()),
        _ => Found::Lost,
    }
}

/// `record` (this owner's, starting with its `head`) with its state and deadline replaced by
/// `state` (a state byte and a deadline, [`record::state_until`]) and `payload` after the
/// fingerprint and its policy tag: what the scripts write in place, as one new value.
pub(super) fn rewritten(record: &Bytes, head_len: usize, state: &[u8], payload: &[u8]) -> Bytes {
    let fingerprint = record
        .get(head_len + 9..head_len + 9 + record::FINGERPRINT_LEN)
        .unwrap_or_default();
    let mut written = BytesMut::with_capacity(head_len + state.len() + fingerprint.len() + payload.len());
    written.put_slice(&record[..head_len.min(record.len())]);
    written.put_slice(state);
    written.put_slice(fingerprint);
    written.put_slice(payload);
    written.freeze()
}

/// A completed record of this owner with its retention restarted: `state` (`'C'` and the new
/// deadline) in place of its own, its payload kept.
pub(super) fn restarted(record: &Bytes, head_len: usize, state: &[u8]) -> Bytes {
    let payload = record
        .get(head_len + 9 + record::FINGERPRINT_LEN..)
        .unwrap_or_default();
    rewritten(record, head_len, state, payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::record::OwnerToken;

    fn claim(owner: &OwnerToken, lease: Duration) -> (Bytes, Bytes) {
        let fingerprint = Fingerprint::new([b"body".as_slice()]);
        let head = record::head(owner).expect("a head");
        (
            head,
            record::in_flight(owner, &fingerprint, lease).expect("a record"),
        )
    }

    #[test]
    fn a_completion_written_natively_is_what_the_script_writes() {
        let owner = OwnerToken::generate();
        let (head, in_flight) = claim(&owner, Duration::from_secs(30));
        let state = record::state_until(record::COMPLETED, Duration::from_secs(60));
        let written = rewritten(&in_flight, head.len(), &state, b"payload");
        // complete.lua: the head, the new state and deadline, the in-flight record's
        // fingerprint (from `head + 10` in Lua's 1-based strings), the payload, in one SET.
        let mut scripted = in_flight[..head.len()].to_vec();
        scripted.extend_from_slice(&state);
        scripted.extend_from_slice(&in_flight[head.len() + 9..]);
        scripted.extend_from_slice(b"payload");
        assert_eq!(written[..], scripted[..]);
        let parsed = record::parse(&written).expect("it reads");
        assert_eq!(parsed.state, record::COMPLETED);
        assert_eq!(&parsed.payload[..], b"payload");
    }

    #[test]
    fn what_a_compare_and_set_found_is_told_apart() {
        let owner = OwnerToken::generate();
        let (head, expected) = claim(&owner, Duration::from_secs(30));
        let renewal = record::state_until(record::IN_FLIGHT, Duration::from_secs(45));
        let renewed = rewritten(&expected, head.len(), &renewal, b"");
        let done = record::state_until(record::COMPLETED, Duration::from_secs(60));
        let written = rewritten(&expected, head.len(), &done, b"p");
        assert_eq!(found(Some(&expected), &head, &expected, &written), Found::Written);
        assert_eq!(
            found(Some(&written), &head, &expected, &written),
            Found::AlreadyWritten
        );
        assert_eq!(found(None, &head, &expected, &written), Found::Lost);
        assert_eq!(
            found(Some(&renewed), &head, &expected, &written),
            Found::OursInFlight(renewed.clone())
        );
        let earlier = rewritten(&expected, head.len(), &done, b"other");
        assert_eq!(
            found(Some(&earlier), &head, &expected, &written),
            Found::OursCompleted(earlier.clone())
        );
        let (_, theirs) = claim(&OwnerToken::generate(), Duration::from_secs(30));
        assert_eq!(found(Some(&theirs), &head, &expected, &written), Found::Lost);
        assert_eq!(
            found(Some(&Bytes::from_static(b"junk")), &head, &expected, &written),
            Found::Lost
        );
    }

    #[test]
    fn a_held_record_is_forgotten_and_expired_ones_are_swept() {
        let native = Native::new(true);
        native.commands.store(SET_IFEQ, Ordering::Relaxed);
        let (head, record) = claim(&OwnerToken::generate(), Duration::from_secs(30));
        native.hold(record.clone(), Duration::from_secs(30));
        assert_eq!(native.held(&head), Some(record));
        native.forget(&head);
        assert_eq!(native.held(&head), None);
        for _ in 0..FIRST_SWEEP {
            let (_, record) = claim(&OwnerToken::generate(), Duration::ZERO);
            native.hold(record, Duration::ZERO);
        }
        let held = native.held.lock().expect("not poisoned");
        assert!(
            held.records.is_empty(),
            "{} expired records kept",
            held.records.len()
        );
    }

    #[test]
    fn a_claims_record_is_remembered_on_either_path_and_compared_natively_only_where_the_server_can() {
        for enabled in [true, false] {
            // Until the server is known to have compare-and-set (never, here), the scripts.
            let native = Native::new(enabled);
            let (head, record) = claim(&OwnerToken::generate(), Duration::from_secs(30));
            native.hold(record.clone(), Duration::from_secs(30));
            assert_eq!(native.held(&head), None);
            assert!(native.deleter().is_none());
            // complete.lua takes it either way.
            assert_eq!(native.remembered(&head), Some(record));
            native.forget(&head);
            assert_eq!(native.remembered(&head), None);
        }
    }
}
