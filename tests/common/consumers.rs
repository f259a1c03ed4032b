//! A crash harness for queue consumers, whatever the broker: publish messages with duplicate
//! ids, run several consumer processes at once, `kill -9` them at random moments and start new
//! ones until every message is acknowledged or dead-lettered, then read back what happened
//! from the consumers' logs and the broker. A broker plugs in through [`Broker`]: how to
//! publish, count the effects, tell whether all is settled, list the dead letters, and start
//! one consumer. The faults must land where they are meant to: a run whose kills all found a
//! consumer idle, or missed the window between an effect and its completion, fails rather than
//! passes having tested nothing ([`crash_test`]).
//!
//! The consumers' logs are the protocol (`examples/stream_consumer.rs` writes it):
//! - stdout, one line per message handled: `<outcome> msg=<ref> id=<id> [key=value …]`, where
//!   `<ref>` names the message as [`Broker::publish`] answered (a stream entry id, an AMQP
//!   `message_id`), values may be quoted (`id="pay-1"`, Rust `{:?}`), and `<outcome>` is
//!   `ran`, `replayed` or `dead-lettered` (final: written right before the message is
//!   acknowledged or dead-lettered), or `in-flight`, `failed`, `unavailable` (left for another
//!   delivery). A `ran` line with `not_stored=` ran without storing its record;
//! - stderr, `tracing`'s format without colours (`… DEBUG target: <event> key=value …`), at
//!   debug level: `received msg= id=` when the consumer takes a message, `effect msg= id=`
//!   right before it applies the effect, and optionally `running msg= id=` once it has claimed
//!   the key (before its work), and `completed msg= id= window_us=` on a store apart from the
//!   effect: the time from the effect's reply to the record's completion.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::Rng;

/// A message to publish: its idempotency key and amount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub amount: i64,
}

/// `ids` distinct ids, `<prefix>-<n>`, each published once, twice or three times (in turn) with
/// the same amount every time, shuffled.
pub fn with_duplicates(prefix: &str, ids: usize) -> Vec<Message> {
    let mut messages = Vec::new();
    for n in 0..ids {
        let message = Message {
            id: format!("{prefix}-{n}"),
            amount: 10 + n as i64,
        };
        for _ in 0..(1 + n % 3) {
            messages.push(message.clone());
        }
    }
    messages.shuffle(&mut rand::rng());
    messages
}

/// What the harness needs from a broker and the consumer it runs.
#[allow(async_fn_in_trait)]
pub trait Broker {
    /// Publishes `messages` in order; answers each one's reference, as its consumer logs it
    /// (`msg=`).
    async fn publish(&self, messages: &[Message]) -> Vec<String>;
    /// How many times each id's effect was applied (the ledger).
    async fn effects(&self) -> BTreeMap<String, u64>;
    /// Whether every published message is acknowledged or dead-lettered: none waits for a
    /// consumer, none is delivered and unacknowledged.
    async fn settled(&self) -> bool;
    /// The dead-lettered messages: reference and reason.
    async fn dead_letters(&self) -> Vec<(String, String)>;
    /// A command that starts one consumer with its debug lines on (see the module doc); the
    /// harness sets its stdout and stderr.
    fn consumer(&self) -> Command;
}

/// One line a consumer wrote, parsed.
#[derive(Clone, Debug)]
pub struct Event {
    /// When the harness read it.
    pub at: Instant,
    /// Which consumer (the order they were started in).
    pub consumer: usize,
    /// From stderr (a debug line), not stdout (an outcome).
    pub debug: bool,
    /// The outcome (`ran`, …) or the debug event (`received`, `effect`, `completed`), or the
    /// first word of any other line.
    pub kind: String,
    /// `msg=`, if any.
    pub msg: String,
    /// `id=`, if any.
    pub id: String,
    pub fields: BTreeMap<String, String>,
    pub text: String,
}

impl Event {
    /// An outcome after which the message is acknowledged or dead-lettered.
    pub fn is_final(&self) -> bool {
        !self.debug && matches!(self.kind.as_str(), "ran" | "replayed" | "dead-lettered")
    }

    /// Any outcome line (final or left for another delivery).
    pub fn is_outcome(&self) -> bool {
        !self.debug
            && matches!(
                self.kind.as_str(),
                "ran" | "replayed" | "dead-lettered" | "in-flight" | "failed" | "unavailable"
            )
    }
}

/// Splits `key=value key="quoted value" …` after a leading word.
fn parse(consumer: usize, debug: bool, text: &str) -> Event {
    // tracing: "<time> LEVEL target: event k=v …"; the time holds no ": ".
    let body = if debug {
        text.split_once(": ").map_or(text, |(_, rest)| rest)
    } else {
        text
    };
    let body = body.trim();
    let (kind, rest) = body.split_once(' ').unwrap_or((body, ""));
    let mut fields = BTreeMap::new();
    for token in tokens(rest) {
        if let Some((key, value)) = token.split_once('=') {
            fields.insert(key.to_owned(), value.to_owned());
        }
    }
    Event {
        at: Instant::now(),
        consumer,
        debug,
        kind: kind.to_owned(),
        msg: fields.get("msg").cloned().unwrap_or_default(),
        id: fields.get("id").cloned().unwrap_or_default(),
        fields,
        text: text.to_owned(),
    }
}

/// Words split at spaces, where a `"…"` (with `\\` escapes) is part of its word, unquoted:
/// `a=1 b="x y" (z)` is `a=1`, `b=x y`, `(z)`.
fn tokens(text: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut token = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' if !token.is_empty() => tokens.push(std::mem::take(&mut token)),
            ' ' => {}
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => token.extend(chars.next()),
                        '"' => break,
                        c => token.push(c),
                    }
                }
            }
            c => token.push(c),
        }
    }
    if !token.is_empty() {
        tokens.push(token);
    }
    tokens
}

/// Every consumer's lines, in the order read.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<Event>>>);

impl Log {
    pub fn events(&self) -> Vec<Event> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn push(&self, event: Event) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(event);
    }

    /// Waits until some line matches `found`; panics after `timeout` with the log.
    pub async fn wait_for(&self, what: &str, timeout: Duration, found: impl Fn(&Event) -> bool) -> Event {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(event) = self.events().into_iter().find(|e| found(e)) {
                return event;
            }
            if Instant::now() > deadline {
                panic!("never: {what}\n{}", self.dump());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn dump(&self) -> String {
        let events = self.events();
        let start = events.first().map(|e| e.at);
        events
            .iter()
            .map(|e| {
                let ms = start.map_or(0, |s| e.at.duration_since(s).as_millis());
                format!("{ms:>6} ms c{} {}", e.consumer, e.text)
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A consumer process, killed (`SIGKILL`) when dropped.
pub struct Consumer {
    pub index: usize,
    child: Child,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Consumer {
    /// Starts `command` with its stdout and stderr read into `log`.
    pub fn start(index: usize, mut command: Command, log: &Log) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("start consumer {index} ({command:?}): {error}"));
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let readers = [
            (false, Box::new(stdout) as Box<dyn std::io::Read + Send>),
            (true, Box::new(stderr)),
        ]
        .into_iter()
        .map(|(debug, pipe)| {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    log.push(parse(index, debug, &line));
                }
            })
        })
        .collect();
        Self {
            index,
            child,
            readers,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`, and waits until everything it wrote has been read.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }

    /// `SIGTERM`; waits for it to exit (30 s at most, then `kill -9` and panic) and for
    /// everything it wrote to be read.
    pub fn terminate(self) -> ExitStatus {
        self.sigterm();
        self.wait()
    }

    /// Sends `SIGTERM` (see [`wait`](Consumer::wait)).
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {}", self.child.id());
    }

    /// Waits for it to exit (30 s at most, then `kill -9` and panic) and for everything it
    /// wrote to be read.
    pub fn wait(mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for a consumer") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("consumer {} did not exit within 30 s", self.index);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        status
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a crash run goes.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Consumers running at once.
    pub consumers: usize,
    /// `kill -9` at most this many at random moments (a run stops once all is settled), each
    /// replaced at once.
    pub kills: usize,
    /// The time between kills, drawn uniformly.
    pub kill_every: std::ops::Range<Duration>,
    /// One more kill, aimed between an effect and its record's completion, where random kills
    /// land once in hundreds (the window is a round trip): the first consumer runs with
    /// `PAUSE_AFTER_EFFECT_MS` set to this pause, is spared the random kills, and is killed
    /// halfway through its first pause (`effect` is logged right before the effect, so half
    /// the pause is the margin for the effect to be applied). Its replacement pauses not.
    pub aimed_pause: Option<Duration>,
    /// Fail if not settled by then.
    pub deadline: Duration,
}

/// A `kill -9` and what the killed consumer was doing.
#[derive(Clone, Debug)]
pub struct Kill {
    pub at: Instant,
    pub consumer: usize,
    /// The message it had taken and not finished (no outcome line): `(msg, id)`.
    pub in_hand: Option<(String, String)>,
    /// It had logged `effect` for its message in hand: the kill may have landed between the
    /// effect and the record's completion.
    pub after_effect: bool,
    /// The kill aimed after an effect ([`Plan::aimed_pause`]), not a random one.
    pub aimed: bool,
}

/// What a crash run did.
pub struct Run {
    pub log: Log,
    pub kills: Vec<Kill>,
    /// The exit status of every consumer still running at the end (stopped with SIGTERM).
    pub exits: Vec<ExitStatus>,
    /// From the first consumer's start until all was settled.
    pub wall: Duration,
}

/// Runs `plan` against `broker` (its messages already published): consumers at once, killed
/// and replaced at random moments, until the broker is settled; then stops the survivors with
/// SIGTERM.
pub async fn crash_run<B: Broker>(broker: &B, plan: &Plan) -> Run {
    let log = Log::default();
    let started = Instant::now();
    let mut next_index = 0;
    let mut spawn = |log: &Log, pause: Option<Duration>| {
        next_index += 1;
        let mut command = broker.consumer();
        if let Some(pause) = pause {
            command.env("PAUSE_AFTER_EFFECT_MS", pause.as_millis().to_string());
        }
        Consumer::start(next_index - 1, command, log)
    };
    // The consumer the aimed kill waits for, until it is killed.
    let mut aimed = plan.aimed_pause.map(|pause| (0, pause));
    let mut running: Vec<Consumer> = (0..plan.consumers)
        .map(|n| spawn(&log, plan.aimed_pause.filter(|_| n == 0)))
        .collect();
    let mut kills = Vec::new();
    let mut random_kills = 0;
    let between = |rng: &mut rand::rngs::ThreadRng| rng.random_range(plan.kill_every.clone());
    let mut next_kill = Instant::now() + between(&mut rand::rng());
    loop {
        if broker.settled().await {
            break;
        }
        if Instant::now() > started + plan.deadline {
            panic!(
                "not settled after {:?} ({} kills); effects {:?}\n{}",
                plan.deadline,
                kills.len(),
                broker.effects().await,
                log.dump()
            );
        }
        if let Some((index, pause)) = aimed {
            let effect =
                (log.events().into_iter()).rfind(|e| e.consumer == index && e.debug && e.kind == "effect");
            if effect.is_some_and(|effect| effect.at.elapsed() >= pause / 2) {
                let victim = running.swap_remove(position(&running, index));
                let at = Instant::now();
                victim.kill();
                kills.push(Kill {
                    at,
                    consumer: index,
                    in_hand: None,
                    after_effect: false,
                    aimed: true,
                });
                running.push(spawn(&log, None));
                aimed = None;
            }
        }
        let spared = aimed.map(|(index, _)| index);
        let candidates: Vec<usize> = (0..running.len())
            .filter(|n| Some(running[*n].index) != spared)
            .collect();
        if random_kills < plan.kills && Instant::now() >= next_kill && !candidates.is_empty() {
            // At a random moment, a consumer holding a message if one does: a kill of a
            // consumer still starting or idle tests little, and picked blindly only 2 to 4 of
            // the 6 kills found a message in hand on RabbitMQ (its consumers are slowest to
            // start), so about one run in 60 would have killed none there.
            let events = log.events();
            let holding: Vec<usize> = (candidates.iter().copied())
                .filter(|n| in_hand(&events, running[*n].index).is_some())
                .collect();
            let pool = if holding.is_empty() { &candidates } else { &holding };
            let victim = running.swap_remove(pool[rand::rng().random_range(0..pool.len())]);
            let consumer = victim.index;
            let at = Instant::now();
            victim.kill();
            kills.push(Kill {
                at,
                consumer,
                in_hand: None,
                after_effect: false,
                aimed: false,
            });
            random_kills += 1;
            running.push(spawn(&log, None));
            next_kill = Instant::now() + between(&mut rand::rng());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let wall = started.elapsed();
    running.iter().for_each(Consumer::sigterm);
    let exits = running.into_iter().map(Consumer::wait).collect();
    let events = log.events();
    for kill in &mut kills {
        if let Some((msg, id, after_effect)) = in_hand(&events, kill.consumer) {
            kill.in_hand = Some((msg, id));
            kill.after_effect = after_effect;
        }
    }
    Run {
        log,
        kills,
        exits,
        wall,
    }
}

/// The message the consumer `index` holds as of `events`: `(msg, id, after its effect)`. A
/// consumer handles one message at a time: its last `received` is the one in hand unless an
/// outcome for it follows.
fn in_hand(events: &[Event], index: usize) -> Option<(String, String, bool)> {
    let mine: Vec<&Event> = events.iter().filter(|e| e.consumer == index).collect();
    let last = mine.iter().rposition(|e| e.debug && e.kind == "received")?;
    let after = &mine[last + 1..];
    if after.iter().any(|e| e.is_outcome()) {
        return None;
    }
    let after_effect = after.iter().any(|e| e.debug && e.kind == "effect");
    Some((mine[last].msg.clone(), mine[last].id.clone(), after_effect))
}

/// Where the consumer `index` is in `running`.
fn position(running: &[Consumer], index: usize) -> usize {
    (running.iter())
        .position(|c| c.index == index)
        .unwrap_or_else(|| panic!("consumer {index} is not running"))
}

impl Run {
    pub fn events(&self) -> Vec<Event> {
        self.log.events()
    }

    /// Per id, how many times its effect may have been applied more than once: kills after
    /// the effect and before the outcome, and runs whose record was not stored.
    pub fn repeat_allowance(&self) -> BTreeMap<String, u64> {
        let mut allowed = BTreeMap::new();
        for kill in &self.kills {
            if let (Some((_, id)), true) = (&kill.in_hand, kill.after_effect) {
                *allowed.entry(id.clone()).or_insert(0) += 1;
            }
        }
        for event in self.events() {
            if event.kind == "ran" && !event.debug && event.fields.contains_key("not_stored") {
                *allowed.entry(event.id.clone()).or_insert(0) += 1;
            }
        }
        allowed
    }

    /// For each kill that left a message in hand: how long after the kill a consumer logged
    /// its final outcome. `None`: never (it was acknowledged right before the kill), or the
    /// consumer that took it over was killed too (that kill has the delay).
    ///
    /// The delay counts from the last kill, before the outcome, of a consumer holding any
    /// message with the same id (this kill, or a later one). A duplicate of the id killed in
    /// hand may have held the key's claim, and that claim lasts a lease past its kill whatever
    /// message waits behind it: counted from the first kill, two such kills in a row look like
    /// a takeover a lease too slow (one run: m6 done 3.2 s after its kill, 2.3 s after the
    /// kill of the consumer holding m7, the same id).
    pub fn takeover_delays(&self) -> Vec<(String, Option<Duration>)> {
        let events = self.events();
        self.kills
            .iter()
            .filter_map(|kill| {
                let (msg, id) = kill.in_hand.as_ref()?;
                let done = events
                    .iter()
                    .find(|e| e.is_final() && &e.msg == msg && e.at > kill.at)
                    .map(|e| e.at);
                let killed_again = self.kills.iter().any(|other| {
                    other.in_hand.as_ref().is_some_and(|(m, _)| m == msg)
                        && other.at > kill.at
                        && done.is_none_or(|done| other.at < done)
                });
                let delay = done.filter(|_| !killed_again).map(|done| {
                    let last_holder_killed = (self.kills.iter())
                        .filter(|other| other.in_hand.as_ref().is_some_and(|(_, i)| i == id))
                        .map(|other| other.at)
                        .filter(|at| *at >= kill.at && *at < done)
                        .max()
                        .unwrap_or(kill.at);
                    done.duration_since(last_holder_killed)
                });
                Some((msg.clone(), delay))
            })
            .collect()
    }

    /// The `window_us` of every `completed` line, sorted.
    pub fn windows_us(&self) -> Vec<u64> {
        let mut windows: Vec<u64> = (self.events().iter())
            .filter(|e| e.debug && e.kind == "completed")
            .filter_map(|e| e.fields.get("window_us")?.parse().ok())
            .collect();
        windows.sort_unstable();
        windows
    }

    /// Each message's last final outcome (`ran`, `replayed`, `dead-lettered`), by reference.
    pub fn last_outcomes(&self) -> BTreeMap<String, Event> {
        let mut last = BTreeMap::new();
        for event in self.events().into_iter().filter(Event::is_final) {
            last.insert(event.msg.clone(), event);
        }
        last
    }

    /// A summary for the test's output: kills, takeovers, windows, time.
    pub fn summary(&self) -> String {
        let delays: Vec<String> = (self.takeover_delays().iter())
            .map(|(msg, delay)| match delay {
                Some(delay) => format!("{msg} after {} ms", delay.as_millis()),
                None => format!("{msg} acknowledged before the kill, or killed again"),
            })
            .collect();
        let windows = self.windows_us();
        format!(
            "{} kills ({} aimed; {} with a message in hand, {} after its effect); taken over: [{}]; \
             windows (µs) p50 {} p99 {} max {} of {}; settled in {} ms",
            self.kills.len(),
            self.kills.iter().filter(|k| k.aimed).count(),
            self.kills.iter().filter(|k| k.in_hand.is_some()).count(),
            self.kills.iter().filter(|k| k.after_effect).count(),
            delays.join(", "),
            percentile(&windows, 50),
            percentile(&windows, 99),
            windows.last().copied().unwrap_or(0),
            windows.len(),
            self.wall.as_millis()
        )
    }
}

/// The `p`th percentile of sorted `values` (0 if empty).
pub fn percentile(sorted: &[u64], p: usize) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) * p).div_ceil(100).min(sorted.len() - 1)]
}

/// The checks every broker's crash test makes, given what was `published` (messages and their
/// references) and whether the effect commits with the record (`transactional`):
/// - every message ends acknowledged or dead-lettered: the broker is settled, each message
///   has a final outcome, and those whose last outcome is `dead-lettered` are exactly the
///   broker's dead letters;
/// - each id's effect applied exactly once; on a store apart from the effect, more only for
///   an id a kill hit after its effect (or whose record was not stored), at most once more
///   per such kill;
/// - the consumers stopped with SIGTERM exited 0.
pub async fn check<B: Broker>(broker: &B, run: &Run, published: &[(Message, String)], transactional: bool) {
    let context = || format!("{}\n{}", run.summary(), run.log.dump());
    assert!(broker.settled().await, "not settled\n{}", context());
    let last = run.last_outcomes();
    for (message, reference) in published {
        assert!(
            last.contains_key(reference),
            "{reference} ({message:?}) has no final outcome\n{}",
            context()
        );
    }
    let dead: BTreeSet<String> = broker.dead_letters().await.into_iter().map(|(r, _)| r).collect();
    let dead_lettered: BTreeSet<String> = (last.iter())
        .filter(|(_, e)| e.kind == "dead-lettered")
        .map(|(r, _)| r.clone())
        .collect();
    assert_eq!(dead, dead_lettered, "dead letters\n{}", context());

    let effects = broker.effects().await;
    let allowance = if transactional {
        BTreeMap::new()
    } else {
        run.repeat_allowance()
    };
    let ids: BTreeSet<&str> = published.iter().map(|(m, _)| m.id.as_str()).collect();
    for id in &ids {
        let all_dead = (published.iter())
            .filter(|(m, _)| m.id == *id)
            .all(|(_, r)| dead_lettered.contains(r));
        let count = effects.get(*id).copied().unwrap_or(0);
        let extra = allowance.get(*id).copied().unwrap_or(0);
        if all_dead {
            assert!(
                count <= 1 + extra,
                "{id}: {count} effects, all dead-lettered\n{}",
                context()
            );
        } else {
            assert!(
                (1..=1 + extra).contains(&count),
                "{id}: {count} effects, expected 1 (+ at most {extra} for kills after the effect)\n{}",
                context()
            );
        }
    }
    for id in effects.keys() {
        assert!(ids.contains(id.as_str()), "an effect for {id}, never published");
    }
    let repeated: Vec<String> = (effects.iter())
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| format!("{id} ×{n}"))
        .collect();
    eprintln!("applied more than once (each after a kill between effect and completion): {repeated:?}");
    for status in &run.exits {
        assert!(
            status.success(),
            "a consumer stopped with SIGTERM exited {status}\n{}",
            context()
        );
    }
}

/// How long each first delivery of an id works in a crash test, so that the kills land while
/// the consumers are busy.
pub const CRASH_WORK_MS: u64 = 200;

/// The environment of a crash test's consumers: the work above, and a bound on deliveries high
/// enough that nothing there is dead-lettered.
pub fn crash_env() -> Vec<(&'static str, String)> {
    vec![
        ("WORK_MS", CRASH_WORK_MS.to_string()),
        ("MAX_DELIVERIES", "50".into()),
    ]
}

/// How long the aimed kill's consumer pauses after its effect ([`Plan::aimed_pause`]).
pub const AIMED_PAUSE: Duration = Duration::from_millis(1500);

/// The crash test every broker runs, its consumers started with [`crash_env`] and `lease`:
/// three consumers over 39 messages (20 ids, each one to three times), six `kill -9` at random
/// moments and one aimed between an effect and its completion, each consumer replaced at once;
/// then [`check`], no dead letters, and each message a killed consumer held done within two
/// leases, the work and a second of the kill (its lease ends at most a lease after the kill,
/// and the consumer that takes it over may first wait out another lease of its own; each
/// broker's test says how its takeover gets there). When consumers holding duplicates of the
/// same id are killed one after another, the bound counts from the last of those kills
/// ([`Run::takeover_delays`]).
///
/// And the faults landed: all six random kills came before all was settled, at least one of
/// them found its consumer with a message in hand, and the aimed one came after an effect and
/// before its acknowledgement. On a store apart from the effect that kill applies its id's
/// effect twice (once before the kill, once on redelivery), which the counts must show; with
/// the effect in the record's transaction, once.
pub async fn crash_test<B: Broker>(broker: &B, transactional: bool, lease: Duration) {
    let messages = with_duplicates("pay", 20);
    let references = broker.publish(&messages).await;
    let published: Vec<(Message, String)> = messages.into_iter().zip(references).collect();
    let plan = Plan {
        consumers: 3,
        kills: 6,
        kill_every: Duration::from_millis(100)..Duration::from_millis(300),
        aimed_pause: Some(AIMED_PAUSE),
        deadline: Duration::from_secs(60),
    };
    let run = crash_run(broker, &plan).await;
    eprintln!("{}", run.summary());
    // Every consumer's lines, for a run that passed (a failure prints them anyway).
    if std::env::var_os("CONSUMER_LOG").is_some() {
        eprintln!("{}", run.log.dump());
    }
    check(broker, &run, &published, transactional).await;
    assert!(
        broker.dead_letters().await.is_empty(),
        "nothing here is a poison (MAX_DELIVERIES is high)\n{}",
        run.log.dump()
    );
    let bound = 2 * lease + Duration::from_millis(CRASH_WORK_MS + 1000);
    for (msg, delay) in run.takeover_delays() {
        if let Some(delay) = delay {
            assert!(
                delay < bound,
                "{msg} was done {delay:?} after its consumer was killed\n{}",
                run.log.dump()
            );
        }
    }
    faults_landed(broker, &run, &plan, transactional).await;
}

/// The faults of `plan` happened, where they were meant to (see [`crash_test`]); so a run
/// whose kills stopped landing (consumers too fast or too slow for the schedule, a log line
/// renamed, a pause no longer honoured) fails rather than passes having tested nothing.
pub async fn faults_landed<B: Broker>(broker: &B, run: &Run, plan: &Plan, transactional: bool) {
    let context = || format!("{}\n{}", run.summary(), run.log.dump());
    let random: Vec<&Kill> = run.kills.iter().filter(|k| !k.aimed).collect();
    assert_eq!(
        random.len(),
        plan.kills,
        "all was settled before every planned kill\n{}",
        context()
    );
    assert!(
        random.iter().any(|k| k.in_hand.is_some()),
        "no random kill found its consumer with a message in hand\n{}",
        context()
    );
    if plan.aimed_pause.is_none() {
        return;
    }
    let aimed: Vec<&Kill> = run.kills.iter().filter(|k| k.aimed).collect();
    let [aimed] = aimed[..] else {
        panic!("{} aimed kills, not one\n{}", aimed.len(), context());
    };
    let Some((_, id)) = aimed.in_hand.as_ref().filter(|_| aimed.after_effect) else {
        panic!(
            "the aimed kill did not land after an effect, before its outcome: {aimed:?}\n{}",
            context()
        );
    };
    let applied = broker.effects().await.get(id).copied().unwrap_or(0);
    let expected = if transactional { 1 } else { 2 };
    assert!(
        applied >= expected,
        "{id}, killed after its effect: applied {applied} times, expected {expected} at least \
         (an effect before the kill is applied again on redelivery, unless it is in the \
         record's transaction)\n{}",
        context()
    );
}
