//! The history checker: a pure function over everything a run recorded (every request and its
//! answer, every effect in the ledger, every fault injected, every report the layer made), and
//! the rules it holds the history to. No I/O, no clock: the unit tests below feed it small
//! hand-made histories, one per rule, and see each rule fire.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use bytes::Bytes;

/// Nanoseconds on the machine's monotonic clock (`CLOCK_MONOTONIC`), shared by every process of
/// a run, so that events of the test and of its child nodes are ordered against each other.
pub type Nanos = u64;

/// One HTTP request a client sent, and what became of it.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// The client's logical call this attempt belongs to (a call is retried until a 2xx).
    pub call: u64,
    pub client: u64,
    /// The node it was sent to (`a`, `b`, `c`: each behind its own proxy to Redis).
    pub node: String,
    pub scope: String,
    pub key: String,
    /// A hash of the request body (every client of a key sends the same body).
    pub fingerprint: u64,
    pub sent: Nanos,
    pub finished: Nanos,
    pub outcome: Outcome,
}

#[derive(Clone, Debug)]
pub enum Outcome {
    /// An HTTP answer.
    Answer {
        status: u16,
        /// The `Idempotent-Replayed: true` header.
        replayed: bool,
        /// `content-type: application/problem+json`.
        problem: bool,
        body: Bytes,
    },
    /// No HTTP answer: the connection was refused or broke (a node process killed).
    Transport(String),
    /// The client gave up on purpose (its patience ran out: a hang-up, not a fault).
    HungUp,
    /// No answer within the run's bound: a hang.
    Hung,
}

/// A handler's side effect, as the ledger outside the system under test holds it.
#[derive(Clone, Debug)]
pub struct Effect {
    pub at: Nanos,
    /// The process that ran it: `a`, `b`, or an incarnation of the child node (`c1`, `c2`, …).
    pub node: String,
    pub scope: String,
    pub key: String,
    /// Unique in the run: the node's incarnation and a counter.
    pub id: String,
}

impl Effect {
    /// What the handler answers for this effect: it names its scope, key and effect id.
    pub fn value(&self) -> Bytes {
        effect_value(&self.scope, &self.key, &self.id)
    }
}

/// The handler's answer for an effect.
pub fn effect_value(scope: &str, key: &str, id: &str) -> Bytes {
    Bytes::from(format!("{scope}/{key}/{id}"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// Every byte between a node and Redis late (a slow network).
    Delay,
    /// Nothing forwarded between a node and Redis; connections stay open.
    Freeze,
    /// Every connection between a node and Redis closed (and new ones, for a while).
    Reset,
    /// A write reaches Redis and the connection closes instead of delivering its answer.
    CutAfterWrite,
    /// Redis stopped (SIGSTOP) and continued (SIGCONT).
    RedisPaused,
    /// Redis killed -9 and restarted (from its append-only file).
    RedisKilled,
    /// A layer node's process killed -9 (a new incarnation started after it).
    NodeKilled,
    /// `SENTINEL FAILOVER`: the master demoted, a replica promoted.
    SentinelFailover,
    /// A master killed -9 (Sentinel's, or a Cluster shard's): a replica promoted once it is
    /// seen down (the old master comes back as a replica).
    MasterKilled,
    /// `CLUSTER FAILOVER` on a Cluster master's replica: the replica takes over once it has
    /// every write of its master.
    ClusterFailover,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Delay => "delay",
            FaultKind::Freeze => "freeze",
            FaultKind::Reset => "reset",
            FaultKind::CutAfterWrite => "cut after write",
            FaultKind::RedisPaused => "redis paused",
            FaultKind::RedisKilled => "redis killed",
            FaultKind::NodeKilled => "node killed",
            FaultKind::SentinelFailover => "sentinel failover",
            FaultKind::MasterKilled => "master killed",
            FaultKind::ClusterFailover => "cluster failover",
        }
    }
}

/// A fault injected: on the path between a node and Redis (`target` the node: `a`, `b`, `c`),
/// on Redis (`redis`: a standalone server, a Sentinel or a Cluster failover), or on a node's
/// process (`target` its incarnation: `c1`).
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: FaultKind,
    pub target: String,
    pub start: Nanos,
    pub end: Nanos,
}

/// A report the layer made through its reconciliation hook.
#[derive(Clone, Debug)]
pub struct Report {
    pub at: Nanos,
    /// The process that made it (as [`Effect::node`]).
    pub node: String,
    pub scope: String,
    pub key: String,
    /// `ClaimLost`, `CompletionFailed`, `LostBeforeReplicated`, … (the `ReconciliationKind`).
    pub kind: String,
}

#[derive(Clone, Debug, Default)]
pub struct History {
    pub attempts: Vec<Attempt>,
    pub effects: Vec<Effect>,
    pub faults: Vec<Fault>,
    pub reports: Vec<Report>,
}

/// The documented limits (docs/guarantees.md, "Where the guarantees end") an extra effect may be
/// excused by, each only when the history shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Excuse {
    /// "A process that dies": the earlier effect's process was killed after that effect and
    /// before the later one began.
    KilledBeforeCompletion,
    /// "A lease that ends while a live handler is cut off from Redis" and "a completion that
    /// cannot be written": a fault on the earlier effect's path to Redis (or on Redis) overlapped
    /// the time between the two effects, and that process reported the key's claim lost or its
    /// completion failed.
    LeaseLapsedUnderFault,
}

impl Excuse {
    pub fn name(self) -> &'static str {
        match self {
            Excuse::KilledBeforeCompletion => "process killed between effect and completion",
            Excuse::LeaseLapsedUnderFault => "lease lapsed under a fault, reported by the layer",
        }
    }
}

/// The reports that say a key's result was not stored under its claim, or not durably:
/// `ReplicationAbandoned` is a completion on the master that no replica acknowledged before the
/// claim's lease ended, which a failover before the replicas have it loses (its documented
/// limit, `ReconciliationKind::ReplicationAbandoned`). Found missing by the hour-long Sentinel
/// run: the three keys it printed of five run twice were each the master killed just after the
/// completion and a failover longer than the lease, reported `ReplicationAbandoned`.
const LOST_REPORTS: [&str; 4] = [
    "ClaimLost",
    "CompletionFailed",
    "LostBeforeReplicated",
    "ReplicationAbandoned",
];

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// (a) A key's effect beyond its first that no documented limit in the history explains.
    UnexcusedEffect { scope: String, key: String, id: String },
    /// (a) More keys ran twice (excused) than the bound allows: a run where everything is
    /// excused tests nothing.
    TooManyExcuses { excused: usize, bound: usize },
    /// (b) A 2xx answer whose body is not the value of the key's effect (of one of them, for a
    /// key run more than once within the limits).
    AnswerDiffers {
        scope: String,
        key: String,
        replayed: bool,
        body: Bytes,
    },
    /// (c) A 2xx answer that names another scope or key than the request's.
    ForeignAnswer { scope: String, key: String, body: Bytes },
    /// (d) An answer that is neither 2xx nor a clear error (409 or 5xx, as problem+json).
    UnclearStatus { scope: String, key: String, status: u16 },
    /// (d) No answer within the bound.
    Hung {
        scope: String,
        key: String,
        node: String,
        client: u64,
    },
    /// (d) No HTTP answer, with no process killed on that node meanwhile.
    UnexplainedTransportError {
        scope: String,
        key: String,
        node: String,
        error: String,
    },
    /// (d) A call whose attempts all ended without a 2xx.
    CallUnanswered { call: u64, scope: String, key: String },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = |b: &Bytes| String::from_utf8_lossy(b).into_owned();
        match self {
            Violation::UnexcusedEffect { scope, key, id } => {
                write!(
                    f,
                    "(a) {scope}/{key}: effect {id} beyond the first, no documented limit shown"
                )
            }
            Violation::TooManyExcuses { excused, bound } => {
                write!(
                    f,
                    "(a) {excused} keys ran more than once within the limits, above the bound {bound}"
                )
            }
            Violation::AnswerDiffers {
                scope,
                key,
                replayed,
                body,
            } => write!(
                f,
                "(b) {scope}/{key}: a {} answer {:?} is no effect's value",
                if *replayed { "replayed" } else { "fresh" },
                text(body)
            ),
            Violation::ForeignAnswer { scope, key, body } => {
                write!(
                    f,
                    "(c) {scope}/{key}: answered with another's value {:?}",
                    text(body)
                )
            }
            Violation::UnclearStatus { scope, key, status } => {
                write!(f, "(d) {scope}/{key}: status {status} is no clear answer")
            }
            Violation::Hung {
                scope,
                key,
                node,
                client,
            } => {
                write!(
                    f,
                    "(d) {scope}/{key}: client {client} got no answer from {node} in time"
                )
            }
            Violation::UnexplainedTransportError {
                scope,
                key,
                node,
                error,
            } => write!(
                f,
                "(d) {scope}/{key}: no HTTP answer from {node} ({error}) and no process of it killed"
            ),
            Violation::CallUnanswered { call, scope, key } => {
                write!(f, "(d) {scope}/{key}: call {call} never got a 2xx")
            }
        }
    }
}

/// What the checker holds a history to, beyond the rules themselves.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// At most this share of the keys that ran may have run more than once, excused.
    pub max_excused_share: f64,
}

/// The checker's verdict and figures.
#[derive(Debug, Default)]
pub struct Verdict {
    pub violations: Vec<Violation>,
    /// Extra effects excused, by the rule that excused them.
    pub excuses: BTreeMap<Excuse, usize>,
    /// Keys (scope, key) that ran at least once.
    pub keys: usize,
    pub calls: usize,
    pub replays: usize,
    pub transport_errors: usize,
    pub hang_ups: usize,
}

/// The node a process serves: its incarnation's name without the number (`c2` → `c`).
fn node_of(process: &str) -> &str {
    process.trim_end_matches(|c: char| c.is_ascii_digit())
}

fn overlaps(fault: &Fault, from: Nanos, to: Nanos) -> bool {
    fault.start <= to && fault.end >= from
}

/// Why `later` may be a second run of the key that `earlier` ran, if the history shows a reason.
fn excuse(history: &History, earlier: &Effect, later: &Effect) -> Option<Excuse> {
    let killed = history.faults.iter().any(|f| {
        f.kind == FaultKind::NodeKilled
            && f.target == earlier.node
            && earlier.at <= f.start
            && f.start <= later.at
    });
    if killed {
        return Some(Excuse::KilledBeforeCompletion);
    }
    let reported = history.reports.iter().any(|r| {
        r.node == earlier.node
            && r.scope == earlier.scope
            && r.key == earlier.key
            && r.at >= earlier.at
            && LOST_REPORTS.contains(&r.kind.as_str())
    });
    let cut_off = history.faults.iter().any(|f| {
        f.kind != FaultKind::NodeKilled
            && (f.target == "redis" || f.target == node_of(&earlier.node))
            && overlaps(f, earlier.at, later.at)
    });
    (reported && cut_off).then_some(Excuse::LeaseLapsedUnderFault)
}

/// Checks `history` against the rules: (a) at most one effect per (scope, key) outside the
/// documented limits, (b) every 2xx answer, replayed or not, is the value of the key's effect,
/// (c) none names another scope or key, (d) every attempt got an answer or a clear error in time,
/// and every call a 2xx in the end.
pub fn check(history: &History, limits: Limits) -> Verdict {
    let mut verdict = Verdict::default();
    let mut effects: HashMap<(&str, &str), Vec<&Effect>> = HashMap::new();
    for effect in &history.effects {
        effects
            .entry((&effect.scope, &effect.key))
            .or_default()
            .push(effect);
    }
    verdict.keys = effects.len();
    let mut excused_keys = 0;
    for runs in effects.values_mut() {
        runs.sort_by_key(|e| e.at);
        let mut excused_here = false;
        for (n, later) in runs.iter().enumerate().skip(1) {
            match runs[..n]
                .iter()
                .find_map(|earlier| excuse(history, earlier, later))
            {
                Some(excuse) => {
                    *verdict.excuses.entry(excuse).or_default() += 1;
                    excused_here = true;
                }
                None => verdict.violations.push(Violation::UnexcusedEffect {
                    scope: later.scope.clone(),
                    key: later.key.clone(),
                    id: later.id.clone(),
                }),
            }
        }
        excused_keys += usize::from(excused_here);
    }
    let bound = ((verdict.keys as f64) * limits.max_excused_share).ceil() as usize;
    if excused_keys > bound {
        verdict.violations.push(Violation::TooManyExcuses {
            excused: excused_keys,
            bound,
        });
    }

    let mut fingerprints: HashMap<(&str, &str), Vec<u64>> = HashMap::new();
    for attempt in &history.attempts {
        let seen = fingerprints.entry((&attempt.scope, &attempt.key)).or_default();
        if !seen.contains(&attempt.fingerprint) {
            seen.push(attempt.fingerprint);
        }
    }
    let bodies: HashMap<(&str, &str), usize> = fingerprints.into_iter().map(|(k, v)| (k, v.len())).collect();
    let mut answered_calls: HashMap<u64, bool> = HashMap::new();
    for attempt in &history.attempts {
        let (scope, key) = (attempt.scope.clone(), attempt.key.clone());
        let answered = answered_calls.entry(attempt.call).or_default();
        match &attempt.outcome {
            Outcome::Answer {
                status,
                replayed,
                body,
                ..
            } if (200..300).contains(status) => {
                *answered = true;
                verdict.replays += usize::from(*replayed);
                let own = effect_value(&scope, &key, "");
                if !body.starts_with(&own) {
                    verdict.violations.push(Violation::ForeignAnswer {
                        scope,
                        key,
                        body: body.clone(),
                    });
                    continue;
                }
                let known = effects
                    .get(&(attempt.scope.as_str(), attempt.key.as_str()))
                    .is_some_and(|runs| runs.iter().any(|e| e.value() == *body));
                if !known {
                    verdict.violations.push(Violation::AnswerDiffers {
                        scope,
                        key,
                        replayed: *replayed,
                        body: body.clone(),
                    });
                }
            }
            Outcome::Answer { status, problem, .. } => {
                // A 422 (another body under the key) is clear only where the key was sent with
                // another body.
                let mismatched =
                    *status == 422 && bodies.get(&(attempt.scope.as_str(), attempt.key.as_str())) > Some(&1);
                let clear = *problem && (*status == 409 || mismatched || (500..600).contains(status));
                if !clear {
                    verdict.violations.push(Violation::UnclearStatus {
                        scope,
                        key,
                        status: *status,
                    });
                }
            }
            Outcome::Transport(error) => {
                verdict.transport_errors += 1;
                let killed = history.faults.iter().any(|f| {
                    f.kind == FaultKind::NodeKilled
                        && node_of(&f.target) == attempt.node
                        && overlaps(f, attempt.sent, attempt.finished)
                });
                if !killed {
                    verdict.violations.push(Violation::UnexplainedTransportError {
                        scope,
                        key,
                        node: attempt.node.clone(),
                        error: error.clone(),
                    });
                }
            }
            Outcome::HungUp => verdict.hang_ups += 1,
            Outcome::Hung => verdict.violations.push(Violation::Hung {
                scope,
                key,
                node: attempt.node.clone(),
                client: attempt.client,
            }),
        }
    }
    verdict.calls = answered_calls.len();
    let mut unanswered: Vec<u64> = (answered_calls.iter())
        .filter(|(_, answered)| !**answered)
        .map(|(call, _)| *call)
        .collect();
    unanswered.sort_unstable();
    for call in unanswered {
        let attempt = (history.attempts.iter())
            .find(|a| a.call == call)
            .expect("a call has attempts");
        verdict.violations.push(Violation::CallUnanswered {
            call,
            scope: attempt.scope.clone(),
            key: attempt.key.clone(),
        });
    }
    verdict
}

/// The timeline of one (scope, key): its requests and answers, its effects and the reports
/// about it, and the faults that overlapped it, in time order, in milliseconds from `origin`:
/// what a failure is reduced to.
pub fn trace(history: &History, scope: &str, key: &str, origin: Nanos) -> String {
    let ms = |t: Nanos| t.saturating_sub(origin) as f64 / 1e6;
    let mut lines: Vec<(Nanos, String)> = Vec::new();
    for a in (history.attempts.iter()).filter(|a| a.scope == scope && a.key == key) {
        let outcome = match &a.outcome {
            Outcome::Answer {
                status,
                replayed,
                body,
                ..
            } => format!(
                "{status}{} {}",
                if *replayed { " replayed" } else { "" },
                String::from_utf8_lossy(body)
            ),
            other => format!("{other:?}"),
        };
        let line = format!(
            "call {} (client {}) to {} -> {outcome} at {:.1}",
            a.call,
            a.client,
            a.node,
            ms(a.finished)
        );
        lines.push((a.sent, format!("{:>9.1} ms  {line}", ms(a.sent))));
    }
    let effects = history
        .effects
        .iter()
        .filter(|e| e.scope == scope && e.key == key);
    let mut span = (Nanos::MAX, 0);
    for e in effects {
        span = (span.0.min(e.at), span.1.max(e.at));
        lines.push((
            e.at,
            format!("{:>9.1} ms  effect {} on {}", ms(e.at), e.id, e.node),
        ));
    }
    for r in (history.reports.iter()).filter(|r| r.scope == scope && r.key == key) {
        lines.push((
            r.at,
            format!("{:>9.1} ms  report {} from {}", ms(r.at), r.kind, r.node),
        ));
    }
    for f in (history.faults.iter())
        .filter(|f| span.0 != Nanos::MAX && overlaps(f, span.0, span.1 + 2_000_000_000))
    {
        let line = format!("fault {} on {} until {:.1}", f.kind.name(), f.target, ms(f.end));
        lines.push((f.start, format!("{:>9.1} ms  {line}", ms(f.start))));
    }
    lines.sort_by_key(|(at, _)| *at);
    lines
        .into_iter()
        .map(|(_, line)| line)
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_excused_share: 0.5,
    };

    fn effect(at: Nanos, node: &str, scope: &str, key: &str, id: &str) -> Effect {
        Effect {
            at,
            node: node.into(),
            scope: scope.into(),
            key: key.into(),
            id: id.into(),
        }
    }

    fn answer(
        call: u64,
        node: &str,
        (scope, key): (&str, &str),
        at: Nanos,
        status: u16,
        replayed: bool,
        body: &str,
    ) -> Attempt {
        Attempt {
            call,
            client: call,
            node: node.into(),
            scope: scope.into(),
            key: key.into(),
            fingerprint: 0,
            sent: at,
            finished: at + 1,
            outcome: Outcome::Answer {
                status,
                replayed,
                problem: !(200..300).contains(&status),
                body: Bytes::from(body.to_owned()),
            },
        }
    }

    fn fault(kind: FaultKind, target: &str, start: Nanos, end: Nanos) -> Fault {
        Fault {
            kind,
            target: target.into(),
            start,
            end,
        }
    }

    fn report(at: Nanos, node: &str, scope: &str, key: &str, kind: &str) -> Report {
        Report {
            at,
            node: node.into(),
            scope: scope.into(),
            key: key.into(),
            kind: kind.into(),
        }
    }

    /// One key run once on `a`, answered fresh to one client and replayed to another.
    fn clean() -> History {
        History {
            attempts: vec![
                answer(1, "a", ("t0", "k"), 20, 201, false, "t0/k/a-1"),
                answer(2, "b", ("t0", "k"), 30, 409, false, ""),
                answer(2, "b", ("t0", "k"), 40, 201, true, "t0/k/a-1"),
                // The same key name in another scope is another key.
                answer(3, "b", ("t1", "k"), 40, 201, false, "t1/k/b-1"),
            ],
            effects: vec![
                effect(10, "a", "t0", "k", "a-1"),
                effect(35, "b", "t1", "k", "b-1"),
            ],
            ..History::default()
        }
    }

    #[test]
    fn a_clean_history_passes() {
        let verdict = check(&clean(), LIMITS);
        assert_eq!(verdict.violations, vec![]);
        assert_eq!((verdict.keys, verdict.calls, verdict.replays), (2, 3, 1));
    }

    #[test]
    fn a_second_effect_without_an_excuse_is_a_violation() {
        let mut history = clean();
        history.effects.push(effect(50, "b", "t0", "k", "b-2"));
        let verdict = check(&history, LIMITS);
        assert_eq!(
            verdict.violations,
            vec![Violation::UnexcusedEffect {
                scope: "t0".into(),
                key: "k".into(),
                id: "b-2".into()
            }]
        );
    }

    #[test]
    fn a_fault_alone_or_a_report_alone_excuses_nothing() {
        let mut history = clean();
        history.effects.push(effect(50, "b", "t0", "k", "b-2"));
        history.faults.push(fault(FaultKind::Freeze, "a", 15, 45));
        assert_eq!(
            check(&history, LIMITS).violations.len(),
            1,
            "a fault without a report"
        );
        history.faults.clear();
        history.reports.push(report(40, "a", "t0", "k", "ClaimLost"));
        assert_eq!(
            check(&history, LIMITS).violations.len(),
            1,
            "a report without a fault"
        );
        // A fault on another node's path does not cut `a` off.
        history.faults.push(fault(FaultKind::Freeze, "b", 15, 45));
        assert_eq!(check(&history, LIMITS).violations.len(), 1, "a fault elsewhere");
        // A report of another key, or from another process, neither.
        history.faults.push(fault(FaultKind::Freeze, "a", 15, 45));
        history.reports[0].key = "other".into();
        assert_eq!(
            check(&history, LIMITS).violations.len(),
            1,
            "a report of another key"
        );
        history.reports[0].key = "k".into();
        history.reports[0].node = "b".into();
        assert_eq!(
            check(&history, LIMITS).violations.len(),
            1,
            "a report of another process"
        );
        // A fault that ended before the first run does not explain it either.
        history.reports[0].node = "a".into();
        history.faults = vec![fault(FaultKind::Freeze, "a", 1, 5)];
        assert_eq!(check(&history, LIMITS).violations.len(), 1, "a fault over before");
    }

    #[test]
    fn a_lapsed_lease_under_a_fault_reported_by_the_layer_is_excused_and_counted() {
        let mut history = clean();
        history.effects.push(effect(50, "b", "t0", "k", "b-2"));
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 60, 201, true, "t0/k/b-2"));
        history
            .faults
            .push(fault(FaultKind::RedisPaused, "redis", 15, 45));
        history.reports.push(report(55, "a", "t0", "k", "ClaimLost"));
        let verdict = check(&history, LIMITS);
        assert_eq!(verdict.violations, vec![]);
        assert_eq!(verdict.excuses[&Excuse::LeaseLapsedUnderFault], 1);
    }

    #[test]
    fn a_completion_no_replica_acknowledged_lost_in_a_failover_excuses_the_next_run_and_only_then() {
        let run_twice = |faults: bool| {
            let mut history = clean();
            history.effects.push(effect(50, "b", "t0", "k", "b-2"));
            history
                .attempts
                .push(answer(4, "a", ("t0", "k"), 60, 201, true, "t0/k/b-2"));
            if faults {
                history
                    .faults
                    .push(fault(FaultKind::MasterKilled, "redis", 15, 45));
            }
            history
                .reports
                .push(report(70, "a", "t0", "k", "ReplicationAbandoned"));
            check(&history, LIMITS)
        };
        let verdict = run_twice(true);
        assert_eq!(verdict.violations, vec![]);
        assert_eq!(verdict.excuses[&Excuse::LeaseLapsedUnderFault], 1);
        assert!(
            !run_twice(false).violations.is_empty(),
            "a report without a fault between the runs excused a second run"
        );
    }

    #[test]
    fn a_process_killed_after_its_effect_excuses_the_next_run() {
        let mut history = clean();
        history.effects = vec![
            effect(10, "c1", "t0", "k", "c1-1"),
            effect(50, "c2", "t0", "k", "c2-1"),
        ];
        history.attempts = vec![answer(1, "c", ("t0", "k"), 60, 201, false, "t0/k/c2-1")];
        history.faults.push(fault(FaultKind::NodeKilled, "c1", 20, 30));
        let verdict = check(&history, LIMITS);
        assert_eq!(verdict.violations, vec![]);
        assert_eq!(verdict.excuses[&Excuse::KilledBeforeCompletion], 1);
        // Killed before its effect: no excuse (it never ran there).
        history.faults[0] = fault(FaultKind::NodeKilled, "c1", 5, 8);
        assert_eq!(check(&history, LIMITS).violations.len(), 1);
    }

    #[test]
    fn too_many_excused_keys_are_a_violation() {
        let mut history = clean();
        history.effects.push(effect(50, "b", "t0", "k", "b-2"));
        history.effects.push(effect(60, "a", "t1", "k", "a-3"));
        history.faults.push(fault(FaultKind::Freeze, "a", 0, 100));
        history.faults.push(fault(FaultKind::Freeze, "b", 0, 100));
        history
            .reports
            .push(report(55, "a", "t0", "k", "CompletionFailed"));
        history.reports.push(report(65, "b", "t1", "k", "ClaimLost"));
        let verdict = check(
            &history,
            Limits {
                max_excused_share: 1.0,
            },
        );
        assert_eq!(verdict.violations, vec![], "both keys, within all of them");
        let verdict = check(
            &history,
            Limits {
                max_excused_share: 0.5,
            },
        );
        assert_eq!(
            verdict.violations,
            vec![Violation::TooManyExcuses { excused: 2, bound: 1 }]
        );
    }

    #[test]
    fn a_replay_that_differs_from_the_effect_is_a_violation() {
        let mut history = clean();
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 50, 201, true, "t0/k/a-9"));
        let verdict = check(&history, LIMITS);
        assert_eq!(
            verdict.violations,
            vec![Violation::AnswerDiffers {
                scope: "t0".into(),
                key: "k".into(),
                replayed: true,
                body: Bytes::from("t0/k/a-9")
            }]
        );
    }

    #[test]
    fn an_answer_for_another_scope_or_key_is_a_violation() {
        let mut history = clean();
        // t1's own effect, answered to a t0 client: the cross-tenant replay.
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 50, 201, true, "t1/k/b-1"));
        history
            .attempts
            .push(answer(5, "a", ("t0", "k"), 50, 201, true, "t0/kk/a-1"));
        let verdict = check(&history, LIMITS);
        assert_eq!(verdict.violations.len(), 2);
        assert!(verdict
            .violations
            .iter()
            .all(|v| matches!(v, Violation::ForeignAnswer { .. })));
    }

    #[test]
    fn unclear_statuses_hangs_and_unanswered_calls_are_violations() {
        let mut history = clean();
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 50, 422, false, ""));
        let mut plain_500 = answer(4, "a", ("t0", "k"), 50, 500, false, "");
        if let Outcome::Answer { problem, .. } = &mut plain_500.outcome {
            *problem = false;
        }
        history.attempts.push(plain_500);
        let mut hung = answer(4, "b", ("t0", "k"), 60, 0, false, "");
        hung.outcome = Outcome::Hung;
        history.attempts.push(hung);
        let verdict = check(&history, LIMITS);
        let names: Vec<String> = verdict.violations.iter().map(|v| format!("{v:?}")).collect();
        assert_eq!(verdict.violations.len(), 4, "{names:?}");
        assert!(matches!(
            verdict.violations[0],
            Violation::UnclearStatus { status: 422, .. }
        ));
        assert!(matches!(
            verdict.violations[1],
            Violation::UnclearStatus { status: 500, .. }
        ));
        assert!(matches!(verdict.violations[2], Violation::Hung { .. }));
        assert!(matches!(
            verdict.violations[3],
            Violation::CallUnanswered { call: 4, .. }
        ));
    }

    #[test]
    fn a_mismatch_is_clear_only_where_the_key_had_another_body() {
        let mut history = clean();
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 50, 422, false, ""));
        history
            .attempts
            .push(answer(4, "a", ("t0", "k"), 60, 201, true, "t0/k/a-1"));
        assert!(matches!(
            check(&history, LIMITS).violations[..],
            [Violation::UnclearStatus { status: 422, .. }]
        ));
        history.attempts[4].fingerprint = 7;
        assert_eq!(check(&history, LIMITS).violations, vec![]);
    }

    #[test]
    fn a_transport_error_is_excused_only_by_a_kill_of_that_node() {
        let mut history = clean();
        let mut refused = answer(1, "c", ("t0", "k"), 12, 0, false, "");
        refused.outcome = Outcome::Transport("connection refused".into());
        history.attempts.push(refused);
        let verdict = check(&history, LIMITS);
        assert!(matches!(
            verdict.violations[..],
            [Violation::UnexplainedTransportError { .. }]
        ));
        history.faults.push(fault(FaultKind::NodeKilled, "c1", 10, 15));
        assert_eq!(check(&history, LIMITS).violations, vec![]);
        assert_eq!(check(&history, LIMITS).transport_errors, 1);
    }
}
