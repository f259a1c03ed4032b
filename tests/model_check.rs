//! The claim protocol's model (`tests/model/`), checked exhaustively with `stateright`: every
//! interleaving of clients that retry and hang up, two servers that claim, renew, run, complete,
//! release and crash at any step, leases that run out, store calls that fail, lose their answer,
//! land late or twice, connections replaced under a `WAIT`, and a failover that takes time and
//! that each server hears at a step of its own.
//!
//! - the promises hold in bounded configurations: with the durability option across a slow
//!   failover, lost calls and reconnects, and with two replicas, both required, whichever a
//!   failover promotes; without it, up to what the promoted replica lacked;
//! - every run after a key's first is excused by a limit met, counted where it happens; each
//!   limit is found, with its shortest trace printed, requiring fewer replicas than run by both
//!   its routes (the replica promoted did not acknowledge; the `WAIT` answered on the old master
//!   after the promotion, before the store heard the failover announced);
//! - protocol and machinery bugs put into the model on purpose are caught (the fence removed, a
//!   `WAIT` answering for another connection's writes, an answer trusted after the fence was
//!   raised, owner checks dropped, …).
//!
//! `cargo test --all-features --test model_check` checks bounded configurations (seconds);
//! `MODEL_CHECK=long cargo test --release --all-features --test model_check -- --nocapture`
//! checks bigger ones and prints the figures.

mod model;

use std::collections::BTreeSet;
use std::time::Instant;

use model::explore::{done_reachable_from_everywhere, shortest, trace};
use model::system::{
    at_most_once, Excuse, ANSWERS_AGREE, AT_MOST_ONCE, EVENTUALLY_DONE, FEWER_ACKS_ONLY_IF_FEWER_REQUIRED,
    NEVER_CHANGED, OWN_RECORD, RUN_AGAIN_AFTER_A_DEATH,
};
use model::{Config, Mutation, System};
use stateright::{Checker, HasDiscoveries, Model};

fn long() -> bool {
    std::env::var("MODEL_CHECK").is_ok_and(|value| value == "long")
}

/// One key in two scopes: two clients of the first record with one payload, a third with
/// another payload (a retry with a changed body), a client of the second scope; two servers; a
/// crash, a handler failure and a hang-up anywhere (the long configuration: see [`sized`]).
fn two_scopes() -> Config {
    sized(two_scopes_bounded())
}

fn two_scopes_bounded() -> Config {
    Config {
        crashes: 1,
        failures: 1,
        hang_ups: 1,
        ..Config::quiet(vec![(0, 0), (1, 0)], vec![(0, 0), (0, 0), (0, 1), (1, 0)])
    }
}

/// `config`, or with the long configuration's bounds: a second crash, handler failure and
/// hang-up, a second failover where there is one, and one more client: with another payload for
/// one key, with another payload in the second scope for two scopes.
fn sized(mut config: Config) -> Config {
    if long() {
        config.crashes = 2;
        config.failures = 2;
        config.hang_ups = 2;
        config.failovers *= 2;
        config
            .clients
            .push(if config.records.len() == 1 { (0, 1) } else { (1, 1) });
    }
    config
}

/// One record and two clients of it with one payload; two servers; a crash, a handler failure
/// and a hang-up anywhere. The failover checks start here: a replica multiplies the states.
fn one_key_bounded() -> Config {
    Config {
        records: vec![(0, 0)],
        clients: vec![(0, 0), (0, 0)],
        ..two_scopes_bounded()
    }
}

/// One key with a replica and one failover (announced, promoted, switched to server by server,
/// the old master demoted), with or without the durability option.
/// (The long configuration: a second failover. With a third client, a second crash and a second
/// handler failure too, the failover window's interleavings took more memory than the machine
/// has.)
fn failover(replica_acks: bool) -> Config {
    let mut config = failover_bounded(replica_acks);
    if long() {
        config.failovers = 2;
    }
    config
}

fn failover_bounded(replica_acks: bool) -> Config {
    Config {
        failovers: 1,
        replica_acks,
        hang_ups: 0,
        ..one_key_bounded()
    }
}

/// [`failover_bounded`] with no crash and no handler failure: where a fault of the machinery
/// is added, these would multiply the states.
fn failover_without_crashes(replica_acks: bool) -> Config {
    Config {
        crashes: 0,
        failures: 0,
        ..failover_bounded(replica_acks)
    }
}

/// One key, a master with two replicas that lag each on its own, and a failover that may
/// promote either (the other then follows it), with the durability option requiring `acks`
/// replicas (`None`: both). (The long configuration: two failovers in a row.)
fn two_replicas(acks: Option<u8>) -> Config {
    let mut config = two_replicas_bounded(acks);
    if long() {
        config.failovers = 2;
    }
    config
}

fn two_replicas_bounded(acks: Option<u8>) -> Config {
    Config {
        replicas: 2,
        acks,
        ..failover_without_crashes(true)
    }
}

/// One key where a lease may lapse under a live owner once; a third client retries it with
/// another payload.
fn lapsing() -> Config {
    sized(lapsing_bounded())
}

fn lapsing_bounded() -> Config {
    Config {
        clients: vec![(0, 0), (0, 0), (0, 1)],
        live_lapses: 1,
        ..one_key_bounded()
    }
}

/// One key, and the machinery's faults: store calls that fail, lose their answer, land late or
/// land twice (two of them), a background completion that gives up, a crash, a handler failure.
fn lossy() -> Config {
    let mut config = lossy_bounded();
    // (Three faults, two crashes and a third client made 74 million states, 17 minutes of a
    // release build, and more memory than (d)'s search has.)
    if long() {
        config.clients.push((0, 1));
    }
    config
}

fn lossy_bounded() -> Config {
    Config {
        call_faults: 2,
        give_ups: 1,
        hang_ups: 0,
        ..one_key_bounded()
    }
}

/// The durability option through a failover with the machinery's faults: a store call that
/// fails (or lands late, or twice), a connection replaced under a server, a crash.
/// (The bounded configuration replaces a connection; the long one adds a lost call and a crash.)
fn replicated_and_lossy() -> Config {
    let mut config = replicated_and_lossy_bounded();
    if long() {
        config.call_faults = 1;
        config.crashes = 1;
    }
    config
}

fn replicated_and_lossy_bounded() -> Config {
    Config {
        reconnects: 1,
        ..failover_without_crashes(true)
    }
}

/// One key with the durability option through one failover, whose announcement reaches a
/// server again, late, once the failover is over (no crash, no handler failure: the states stay
/// few). The long configuration: two failovers, the second of which may begin before every
/// server followed the first (overtaking it), the late announcement then of the first.
fn late_announcement() -> Config {
    let mut config = late_announcement_bounded();
    if long() {
        config.failovers = 2;
    }
    config
}

fn late_announcement_bounded() -> Config {
    Config {
        late_announcements: 1,
        ..failover_without_crashes(true)
    }
}

/// `failovers` failovers back and forth between a master and its one replica (A to B, B to A,
/// A to B), each beginning once the sentinels are done with the last, perhaps before every
/// server followed it: with three, a server may follow the first, be overtaken in the second,
/// and meet the third's switch, of the same text as the first's. No durability option, no
/// fault but these: the states stay few.
fn back_and_forth(failovers: u8) -> Config {
    Config {
        failovers,
        ..failover_without_crashes(false)
    }
}

/// Two scopes of one key, a client of each and a retry in the first, with a lease that may
/// lapse under a live owner, or a failover with the durability option: no client is answered
/// with the other scope's record.
fn two_scopes_lapsing() -> Config {
    Config {
        clients: vec![(0, 0), (0, 0), (1, 0)],
        live_lapses: 1,
        crashes: 0,
        failures: 0,
        hang_ups: 0,
        ..two_scopes_bounded()
    }
}

fn two_scopes_through_a_failover() -> Config {
    Config {
        clients: vec![(0, 0), (1, 0)],
        failovers: 1,
        live_lapses: 0,
        ..two_scopes_lapsing()
    }
}

fn checked(name: &str, config: Config, until: Option<&'static str>) -> impl Checker<System> {
    let started = Instant::now();
    let mut builder = System::new(config).checker().threads(1);
    if let Some(property) = until {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])));
    }
    let checker = builder.spawn_bfs().join();
    println!(
        "{name}: {} states ({} generated), depth {}, in {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

/// The trace of `property`'s discovery, printed; panics if there is none.
fn found(checker: &impl Checker<System>, property: &'static str) -> Vec<model::Action> {
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("no trace found for {property:?}"));
    let model = checker.model();
    let mut actions = path.into_actions();
    // Up to the first state that shows it: stateright's path may run on past it.
    let shows = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .expect("a property");
    let mut state = model.initial();
    for (i, &action) in actions.iter().enumerate() {
        state = model.step(&state, action).0;
        let holds = (shows.condition)(model, &state);
        if holds == matches!(shows.expectation, stateright::Expectation::Sometimes) {
            actions.truncate(i + 1);
            break;
        }
    }
    println!("{property}:\n{}", trace(model, &actions));
    actions
}

fn liveness(name: &str, config: Config) {
    let started = Instant::now();
    let model = System::new(config);
    match done_reachable_from_everywhere(&model) {
        Ok(explored) => println!(
            "{name}, (d) every client can still get its answer from every state: {} states, {} transitions, in {:.1?}",
            explored.states,
            explored.transitions,
            started.elapsed()
        ),
        Err(path) => panic!(
            "{name}: from the end of this trace, some client can never be answered:\n{}",
            trace(&model, &path)
        ),
    }
}

/// Every always-property holds and (d) too: the promises of a configuration that meets no limit
/// but those its excuses name. (The examples, `sometimes` properties, are asserted where the
/// configuration can show them: a run again after a death needs a crash.)
fn every_promise_holds(name: &str, config: Config) {
    every_safety_promise_holds(name, config.clone());
    liveness(name, config);
}

/// [`every_promise_holds`] but (d).
fn every_safety_promise_holds(name: &str, config: Config) {
    let checker = checked(name, config.clone(), None);
    for property in [
        AT_MOST_ONCE,
        NEVER_CHANGED,
        ANSWERS_AGREE,
        OWN_RECORD,
        EVENTUALLY_DONE,
        FEWER_ACKS_ONLY_IF_FEWER_REQUIRED,
    ] {
        checker.assert_no_discovery(property);
    }
    // A replay needs a second request for one record.
    let retried = (0..config.clients.len()).any(|c| {
        config.clients[c + 1..]
            .iter()
            .any(|other| other.0 == config.clients[c].0)
    });
    if retried {
        checker.assert_any_discovery("a key runs and is replayed");
    }
}

/// The shortest trace to a state where `shows` holds, printed; panics if there is none.
fn shortest_to(name: &str, config: Config, shows: impl Fn(&model::State) -> bool) -> Vec<model::Action> {
    let model = System::new(config);
    let path = shortest(&model, shows).unwrap_or_else(|| panic!("{name}: no trace found"));
    println!("{name}, shortest:\n{}", trace(&model, &path));
    path
}

/// A key ran twice, and the one limit met, which excuses it, is `why`.
fn excused_runs(state: &model::State, why: Excuse) -> bool {
    state
        .ghosts
        .iter()
        .any(|ghost| ghost.runs >= 2 && ghost.excuses == 1 && ghost.last_excuse == Some(why))
}

#[test]
fn every_promise_holds_with_two_scopes() {
    let checker = checked("two scopes", two_scopes(), None);
    // (a), (b), (c) never fail; stateright's weak (d) neither; and the examples exist: a key run
    // and replayed, every client answered, and README's "a process that dies" limit.
    checker.assert_properties();
    let death = found(&checker, RUN_AGAIN_AFTER_A_DEATH);
    assert!(death
        .iter()
        .any(|action| matches!(action, model::Action::Crash { .. })));
    liveness("two scopes", two_scopes());
}

/// The durability option through a failover, with a crash and a handler failure. (d) in the long
/// configuration only: since each store hears a failover at a step of its own this
/// configuration has about four times the states it had, and its (d) would be the bounded
/// check's longest test (14 s); (d) through a failover with the durability option is checked
/// in the bounded check by the reconnect's configuration, below.
#[test]
fn with_the_durability_option_a_failover_runs_no_key_twice() {
    let config = failover(true);
    let name = format!("durability option, {} failover(s)", config.failovers);
    every_safety_promise_holds(&name, config.clone());
    if long() {
        liveness(&name, config);
    }
}

/// With two replicas, both required: whichever a failover promotes has every claim and
/// completion a `WAIT` acknowledged, so no key runs twice.
#[test]
fn with_every_replica_required_a_failover_to_either_of_two_replicas_runs_no_key_twice() {
    let config = two_replicas(None);
    let name = format!("two replicas, both required, {} failover(s)", config.failovers);
    // (d) in the long configuration only: since each store hears a failover at a step of its
    // own, the bounded configuration has about three times the states it had (see
    // docs/guarantees.md), and its (d) would double that test's time; (d) through a failover
    // is checked by the bounded configurations with one replica.
    every_safety_promise_holds(&name, config.clone());
    if long() {
        liveness(&name, config);
    }
    // The long configuration also crashes a server and fails a handler, through one failover:
    // a run again after a crash is excused only if the result was not on every replica that
    // could be promoted.
    if long() {
        every_promise_holds(
            "two replicas, both required, a crash, a handler failure",
            Config {
                crashes: 1,
                failures: 1,
                ..two_replicas_bounded(None)
            },
        );
    }
}

/// docs/guarantees.md's limit of `ReplicaAcks::new(n)` with n below the replica count: with two
/// replicas and one required (the configuration of the test above, but for `acks`), a key runs
/// twice, and each such run is excused by the limit, met by one of its two routes: a `WAIT`
/// answered by the replica that has the record, the failover promoting the other; or a `WAIT`
/// answered on the old master after the promotion, by the replica not promoted, before the
/// server's store heard the failover announced. The promises hold otherwise (checked under
/// `MODEL_CHECK=long`), so an answer trusted after the store heard
/// (`answers_trusted_after_the_fence_was_raised_run_a_key_twice`) shows as an unexcused run.
/// (b)'s "never changed" is not promised: an acknowledged completion can be lost.
#[test]
fn limit_requiring_fewer_acknowledgements_than_replicas_runs_a_key_twice() {
    let config = two_replicas_bounded(Some(1));
    // The whole configuration, in the long check only: 3.4 million states, a minute of a debug
    // build.
    if long() {
        let checker = checked("two replicas, one required, 1 failover", config.clone(), None);
        for held in [
            AT_MOST_ONCE,
            ANSWERS_AGREE,
            OWN_RECORD,
            FEWER_ACKS_ONLY_IF_FEWER_REQUIRED,
        ] {
            checker.assert_no_discovery(held);
        }
    }
    let model = System::new(config.clone());

    // The replica promoted did not acknowledge: at the promotion, the replica not promoted holds
    // a record a `WAIT` acknowledged (a claim its server holds past its `WAIT`, or the
    // acknowledged completion), and the promoted one lacks it.
    let path = shortest_to(
        "two replicas, one required, the other promoted",
        config.clone(),
        |state| {
            excused_runs(
                state,
                Excuse::FewerAcksThanReplicas {
                    after_promotion: false,
                },
            )
        },
    );
    let (excused_by, state) = excused_at(&model, &path);
    assert_eq!(excused_by, model::Action::Promote);
    let window = state.window.expect("a failover announced before the promotion");
    let (from, to) = (usize::from(window.from), usize::from(window.to));
    let other = (0..state.nodes.len())
        .find(|&n| n != from && n != to)
        .expect("a second replica");
    let acknowledged = |rec: model::store::Rec| match rec.state {
        model::store::RecState::InFlight => state.servers.iter().any(|server| {
            matches!(
                server.phase,
                model::system::Phase::Claimed { token, .. } | model::system::Phase::Ran { token, .. }
                    if token == rec.owner
            )
        }),
        model::store::RecState::Completed(payload) => state.ghosts[0].acknowledged == Some(payload),
    };
    let kept = state.nodes[other].records[0];
    assert!(
        kept.is_some_and(acknowledged) && state.nodes[to].records[0] != kept,
        "the promoted replica did not lack an acknowledged record"
    );

    // Acknowledged on the old master after the promotion, before the server heard.
    let why = Excuse::FewerAcksThanReplicas {
        after_promotion: true,
    };
    let (excused_by, state) =
        shortest_excused_at("two replicas, one required, acknowledged unheard", config, why);
    let server = match excused_by {
        model::Action::ClaimAcked { server } | model::Action::CompleteAcked { server } => server,
        other => panic!("excused at {other:?}, not at an acknowledgement"),
    };
    assert!(System::unheard_on_the_old_master(&state, &state.servers[usize::from(server)]).is_some());
}

/// The fence's count (issue 36): a claim or completion whose `WAIT` answered enough after its
/// server's store heard the failover announced is not trusted, because the write may have landed
/// on the old master after the promotion, acknowledged there by the replica not promoted. Trust
/// it (`Mutation::TrustsAnswersAfterRaise`) and, with two replicas and one required, the checker
/// finds a key run twice that no limit excuses, in 12 steps: S0 claims on the old master (node
/// 0) and the claim reaches node 1; the failover of node 2 is announced and S0's store hears it
/// (its fence raised); node 2 is promoted without the claim; S0's `WAIT` is answered by node 1,
/// which still follows the old master, and trusted; S0 runs the handler; S1 switches to the new
/// master and claims there, the old master is demoted (taking the new master's records), S1's
/// claim is acknowledged and it runs the handler too. The same configuration without the
/// mutation passes: up to that trace's depth and two more steps here, whole under
/// `MODEL_CHECK=long` (`limit_requiring_fewer_acknowledgements_than_replicas_runs_a_key_twice`).
#[test]
fn answers_trusted_after_the_fence_was_raised_run_a_key_twice() {
    let config = Config {
        mutation: Some(Mutation::TrustsAnswersAfterRaise),
        ..two_replicas_bounded(Some(1))
    };
    let model = System::new(config.clone());
    let path = shortest_to("answers trusted after a raise", config, |state| {
        !at_most_once(state)
    });
    // Replay the trace: an answer was trusted though the fence was raised since its write.
    let mut state = model.initial();
    let mut trusted_after_raise = false;
    for &action in &path {
        if let model::Action::ClaimAcked { server } | model::Action::CompleteAcked { server } = action {
            trusted_after_raise |= matches!(
                state.servers[usize::from(server)].phase,
                model::system::Phase::AwaitClaimAck { raised: true, .. }
                    | model::system::Phase::AwaitCompleteAck { raised: true, .. }
                    | model::system::Phase::Completing { raised: true, .. }
            );
        }
        state = model.step(&state, action).0;
    }
    assert!(trusted_after_raise, "no answer trusted after a raise");
    assert_eq!(state.ghosts[0].excuses, 0, "the second run is excused");
    // Without the mutation no key runs twice unexcused in as many steps and two more (the whole
    // configuration passes too, under `MODEL_CHECK=long`; bounded here, as it is 3.4 million
    // states).
    let depth = path.len() + 2;
    let started = Instant::now();
    let checker = System::new(two_replicas_bounded(Some(1)))
        .checker()
        .threads(1)
        .target_max_depth(depth)
        .spawn_bfs()
        .join();
    println!(
        "two replicas, one required, up to depth {depth}: {} states, in {:.1?}",
        checker.unique_state_count(),
        started.elapsed()
    );
    checker.assert_no_discovery(AT_MOST_ONCE);
}

/// The shortest trace to a key run twice excused by `why` alone, printed: the step at which the
/// excuse was counted, and the state before it.
fn shortest_excused_at(name: &str, config: Config, why: Excuse) -> (model::Action, model::State) {
    let model = System::new(config.clone());
    let path = shortest_to(name, config, |state| excused_runs(state, why));
    excused_at(&model, &path)
}

/// Replays `path` and answers the step at which its first excuse was counted, and the state
/// before that step.
fn excused_at(model: &System, path: &[model::Action]) -> (model::Action, model::State) {
    let mut state = model.initial();
    for &action in path {
        let next = model.step(&state, action).0;
        if next.ghosts.iter().map(|g| g.excuses).sum::<u8>() > 0 {
            return (action, state);
        }
        state = next;
    }
    panic!("no excuse counted on the trace");
}

/// Store calls that fail, time out, land with their answer lost, land late or twice, with the
/// coordinator's reactions (503 and a background release; an answer and a background completion
/// that keeps the lease, or gives up): no key runs twice but for a process that died or a
/// completion that gave up with its result not stored.
#[test]
fn calls_lost_late_or_sent_twice_run_no_key_twice() {
    every_promise_holds("calls lost, late, sent twice", lossy());
}

/// The durability option, a failover that takes time (announced, promoted while the old master
/// still takes writes, switched to server by server, the old master demoted), a store call that
/// fails or lands twice, and a connection replaced under a server between a write and its `WAIT`.
#[test]
fn with_the_durability_option_a_slow_failover_reconnects_and_lost_calls_run_no_key_twice() {
    every_promise_holds(
        "durability option, slow failover, reconnect, lost call",
        replicated_and_lossy(),
    );
}

/// Scopes through lapses and a failover: no client is ever answered another scope's record.
#[test]
fn scopes_hold_through_lapses_and_a_failover() {
    every_promise_holds(
        "two scopes, a lease lapsing under a live owner",
        two_scopes_lapsing(),
    );
    // Without the durability option, to keep the states few: a completed record may be lost
    // with the replica's lag there, so (b)'s "never changed" is not promised.
    let checker = checked("two scopes, a failover", two_scopes_through_a_failover(), None);
    for held in [AT_MOST_ONCE, ANSWERS_AGREE, OWN_RECORD] {
        checker.assert_no_discovery(held);
    }
    liveness("two scopes, a failover", two_scopes_through_a_failover());
}

/// Without the durability option the fence still keeps the old master's writes after the
/// promotion from running a key twice: every second run is one the promoted replica's missing
/// record explains (asynchronous replication, the documented limit), and clients agree but
/// for those. A completed record can be lost with the replica's lag, so (b)'s "never changed" is
/// not promised here.
#[test]
fn without_the_durability_option_a_failover_runs_a_key_twice_only_for_what_the_replica_lacked() {
    let checker = checked("asynchronous failover, fenced", failover(false), None);
    for held in [AT_MOST_ONCE, ANSWERS_AGREE, OWN_RECORD] {
        checker.assert_no_discovery(held);
    }
    // (d) in the long configuration only, as for the durability option's failover: in the
    // bounded one it would be among the check's longest tests; (d) through a failover without
    // the durability option is checked in the bounded check by the failovers back and forth.
    if long() {
        liveness("asynchronous failover, fenced", failover(false));
    }
}

/// README's limit: a lease that runs out while its owner is alive (cut off from the store, or
/// its thread blocked) lets a second server run the key. The fence still holds: the first
/// server's completion is refused, the completed record never changes, every replay agrees.
#[test]
fn limit_a_lease_that_lapses_under_a_live_owner_runs_a_key_twice() {
    let checker = checked("a lease may lapse under a live owner", lapsing(), None);
    checker.assert_properties();
    let path = shortest_to("a lease lapsed under a live owner", lapsing_bounded(), |state| {
        excused_runs(state, Excuse::LapsedUnderLiveOwner)
    });
    assert!(path
        .iter()
        .any(|action| matches!(action, model::Action::Expire { .. })));
}

/// README's limit: without the durability option, a failover to a replica that lacks an
/// acknowledged claim or completion runs the key again; so does a claim or completion the old
/// master takes after the promotion, from a server whose store has not heard the failover
/// announced yet (it hears at a step of its own), lost with the old master's demotion.
#[test]
fn limit_an_asynchronous_failover_runs_a_key_twice() {
    let model = System::new(failover_bounded(false));
    let path = shortest_to("asynchronous failover", failover_bounded(false), |state| {
        excused_runs(
            state,
            Excuse::LostByAsyncFailover {
                after_promotion: false,
            },
        )
    });
    assert_eq!(excused_at(&model, &path).0, model::Action::Promote);
    let why = Excuse::LostByAsyncFailover {
        after_promotion: true,
    };
    let (excused_by, state) = shortest_excused_at(
        "asynchronous failover, written on the old master unheard",
        failover_bounded(false),
        why,
    );
    let server = match excused_by {
        model::Action::Serve { server, .. }
        | model::Action::Complete { server, .. }
        | model::Action::CompleteAgain { server, .. } => server,
        other => panic!("excused at {other:?}, not at a write"),
    };
    assert!(System::unheard_on_the_old_master(&state, &state.servers[usize::from(server)]).is_some());
}

/// docs/guarantees.md's limit: a failover longer than the lease left (the owner's renewals held
/// at the fence, or sent to the old master before its store heard the failover announced) lets
/// the claim expire, and a retry runs the key again. (The shortest trace lets it expire on the
/// old master before the promotion, where a server that has not heard yet claims it.)
#[test]
fn limit_a_failover_longer_than_the_lease_runs_a_key_twice() {
    let path = shortest_to("a claim expires in a failover", failover_bounded(true), |state| {
        excused_runs(state, Excuse::LapsedInFailover)
    });
    let announced = (path.iter()).position(|action| matches!(action, model::Action::Announce { .. }));
    let lapsed = (path.iter()).position(|action| matches!(action, model::Action::Expire { .. }));
    assert!(
        matches!((announced, lapsed), (Some(announced), Some(lapsed)) if announced < lapsed),
        "the lease did not lapse in a failover"
    );
}

/// Issue 36: a sentinel's announcement that reaches a server once it is no longer news (its
/// failover over, or, in the long configuration, overtaken by the next) is ignored, and no key
/// runs twice. A lapse under a fence is excused only while a failover is under way for its
/// server: a fence raised again over a store on the right master would show here as a key run
/// twice with nothing to excuse it (see the next tests).
#[test]
fn a_late_announcement_of_a_failover_over_or_overtaken_runs_no_key_twice() {
    let config = late_announcement();
    let name = format!("late announcement, {} failover(s)", config.failovers);
    every_promise_holds(&name, config);
}

/// Failovers back and forth (A to B, B to A; `MODEL_CHECK=long`: and A to B again), each
/// beginning once the sentinels are done with the last, perhaps before every server followed
/// it: a server overtaken follows the next, and a key runs twice only for what the promoted
/// replica lacked (no durability option here: (b)'s "never changed" is not promised).
#[test]
fn failovers_back_and_forth_overtaking_one_another_run_no_key_twice() {
    let config = back_and_forth(if long() { 3 } else { 2 });
    let name = format!("{} failovers back and forth", config.failovers);
    let checker = checked(&name, config.clone(), None);
    for held in [AT_MOST_ONCE, ANSWERS_AGREE, OWN_RECORD] {
        checker.assert_no_discovery(held);
    }
    liveness(&name, config);
}

/// Replays `path` and returns, for the first lapse of a live owner's lease (an `Expire` of a
/// record whose holder is alive), whether a failover was under way then and whether the
/// holder's fence was one standing over no failover.
fn first_live_lapse(model: &System, path: &[model::Action]) -> Option<(bool, bool)> {
    let mut state = model.initial();
    for &action in path {
        if let model::Action::Expire { node, slot } = action {
            let owner = state.nodes[usize::from(node)].records[usize::from(slot)].map(|rec| rec.owner);
            let holder =
                (state.servers.iter()).find(|server| owner.is_some() && server.phase.token() == owner);
            if let Some(holder) = holder {
                return Some((state.window.is_some(), holder.fenced && holder.stale_fence));
            }
        }
        state = model.step(&state, action).0;
    }
    None
}

/// The watch acting on announcements no longer news (before issue 36's fix: no `confirmed_at`,
/// no `ROLE` check, no `attempted`): a late switch raises a server's fence again over a store
/// already on the right master, its owner's renewals are held, the lease lapses with no
/// failover under way, and another server runs the key again. The broad excuse of before (any
/// lapse under a fence) would have excused it, as the history run's double runs were.
#[test]
fn a_watch_acting_on_late_announcements_runs_a_key_twice() {
    let config = Config {
        mutation: Some(Mutation::ActsOnLateAnnouncement),
        ..late_announcement_bounded()
    };
    let path = shortest_to("a watch acting on late announcements", config.clone(), |state| {
        !at_most_once(state)
    });
    assert!(path
        .iter()
        .any(|action| matches!(action, model::Action::Late { .. })));
    assert_eq!(
        first_live_lapse(&System::new(config), &path),
        Some((false, true)),
        "the lease lapsed under a fence raised again after the failover"
    );
}

/// The watch keeping the switch it followed when a later failover overtakes it (before
/// `63f29b0`): A to B followed, B to A overtaken, then A to B, of the same text as the switch
/// followed, is ignored as a duplicate; the fence raised for it stands over a store on the new
/// master, and a lease lapsing under it lets another server run the key again.
#[test]
fn a_watch_ignoring_a_switch_back_as_a_duplicate_runs_a_key_twice() {
    let config = Config {
        mutation: Some(Mutation::DuplicateSwitchIgnored),
        ..back_and_forth(3)
    };
    let path = shortest_to(
        "a watch ignoring a switch back as a duplicate",
        config.clone(),
        |state| !at_most_once(state),
    );
    let announced = path
        .iter()
        .filter(|action| matches!(action, model::Action::Announce { .. }))
        .count();
    assert_eq!(announced, 3, "A to B, B to A, A to B");
    let (_, stale) = first_live_lapse(&System::new(config), &path).expect("a lease lapsed");
    assert!(stale, "the lease lapsed under the fence of a switch ignored");
}

/// The limit of a background completion that gives up (the store unreachable for a lease):
/// the key runs again, and the excuse is used only when the result was not stored.
#[test]
fn limit_a_completion_given_up_runs_a_key_twice() {
    let path = shortest_to("a completion given up", lossy_bounded(), |state| {
        excused_runs(state, Excuse::GaveUp)
    });
    assert!(path
        .iter()
        .any(|action| matches!(action, model::Action::GiveUp { .. })));
}

/// Protocol and machinery bugs put into the model: each breaks the property that guards against
/// it (in the bounded configurations, also under `MODEL_CHECK=long`: each stops at its first
/// trace).
#[test]
fn protocol_bugs_are_caught() {
    let cases = [
        (Mutation::ClaimNotAtomic, one_key_bounded(), AT_MOST_ONCE),
        (
            Mutation::CompleteNotOwnerChecked,
            lapsing_bounded(),
            NEVER_CHANGED,
        ),
        (Mutation::ScopeNotInDigest, two_scopes_bounded(), OWN_RECORD),
        (
            Mutation::ClaimNotAcknowledged,
            failover_bounded(true),
            AT_MOST_ONCE,
        ),
        (
            Mutation::NoBackgroundCompletion,
            failover_bounded(true),
            AT_MOST_ONCE,
        ),
        (Mutation::ReleaseNotOwnerChecked, lossy_bounded(), AT_MOST_ONCE),
        // The Sentinel watch without its fence: a server still on the old master claims there
        // after the promotion, while the owner renews on the new one.
        (Mutation::NoFence, failover_bounded(false), AT_MOST_ONCE),
        // A store restarted just before a failover, taking claims before it listens to the
        // sentinels (found by tests/history.rs).
        (
            Mutation::ClaimsBeforeListening,
            failover_bounded(false),
            AT_MOST_ONCE,
        ),
        // A `WAIT` on a replaced connection answering for writes it never saw.
        (
            Mutation::WaitOnAnotherConnection,
            replicated_and_lossy_bounded(),
            AT_MOST_ONCE,
        ),
    ];
    for (mutation, config, property) in cases {
        let config = Config {
            mutation: Some(mutation),
            ..config
        };
        let checker = checked(&format!("{mutation:?}"), config, Some(property));
        found(&checker, property);
    }
}

/// A bug that leaves a client retrying forever breaks (d): a completed record claimed with
/// another payload answered "in flight" instead of a mismatch.
#[test]
fn a_client_left_retrying_forever_is_caught() {
    let config = Config {
        mutation: Some(Mutation::MismatchAnsweredInFlight),
        ..two_scopes_bounded()
    };
    let path = done_reachable_from_everywhere(&System::new(config.clone()))
        .expect_err("a state from which the client that changed its payload is never answered");
    println!(
        "(d) broken by MismatchAnsweredInFlight:\n{}",
        trace(&System::new(config), &path)
    );
}

/// README's limit "a process that dies", shortest: the handler ran, its server died before the
/// completion, the lease ran out, and a retry runs the key again.
#[test]
fn limit_a_process_that_dies_runs_its_key_again() {
    let path = shortest_to(RUN_AGAIN_AFTER_A_DEATH, one_key_bounded(), |state| {
        excused_runs(state, Excuse::Died)
    });
    assert!(path
        .iter()
        .any(|action| matches!(action, model::Action::Crash { .. })));
}

/// A crash after the completion was durable excuses nothing: with the durability option, a
/// server that dies while waiting for the acknowledgement of a completion the replica already
/// has leaves a key that is never run again (the properties hold with no excuse there), and the
/// shortest run again after a crash needs the crash before the replica had the result.
#[test]
fn a_crash_after_the_result_is_durable_excuses_no_run() {
    let model = System::new(failover_bounded(true));
    let path =
        shortest(&model, |state| excused_runs(state, Excuse::Died)).expect("a run again after a crash");
    println!(
        "durability option, a run again after a crash:\n{}",
        trace(&model, &path)
    );
    // Replay the trace: at the crash, the replica did not hold the crashed server's result.
    let mut state = model.initial();
    for &action in &path {
        if let model::Action::Crash { server } = action {
            let phase = state.servers[usize::from(server)].phase;
            let replica_has_it = matches!(
                (phase, state.nodes[1].records[0]),
                (
                    model::system::Phase::AwaitCompleteAck { token, payload, .. }
                    | model::system::Phase::Completing { token, payload, .. },
                    Some(model::store::Rec { owner, state: model::store::RecState::Completed(done), .. })
                ) if owner == token && done == payload
            );
            assert!(
                !replica_has_it,
                "a crash after the result was durable was excused"
            );
        }
        state = model.step(&state, action).0;
    }
}
