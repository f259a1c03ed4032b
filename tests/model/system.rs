//! The whole protocol: clients that retry a key, server instances that claim, renew, run,
//! complete, release and crash at any step, and a store of one to three nodes (a master and one
//! or two replicas, each fed by an asynchronous replication step of its own) whose failover
//! takes time.
//!
//! Servers follow `Coordinator::begin` and `Claim` (src/coordinator/mod.rs, claim.rs) as the HTTP
//! layer drives them (src/http/service.rs): one claim, then run, then complete (or release if the
//! handler fails), renewing the lease meanwhile; a lost claim is not completed (`Claim::is_lost`),
//! and the client gets the handler's answer whatever the completion said.
//!
//! What the machinery does around the protocol is modelled too, each step naming its code:
//! - a store call may fail before it lands, land with its answer lost, land late (a command
//!   held in a frozen connection) or land twice (fred sending it again after a reconnect); the
//!   server meets a timeout, and reacts as the coordinator does: a claim that failed is answered
//!   503 and released in the background (three attempts), a completion that failed is answered
//!   and carried on in the background, renewing its lease, until it lands, finds the claim lost,
//!   or gives up when its lease ends (the store unreachable for a lease);
//! - a connection may be replaced under a server at any step (the heartbeat, a drop), and the
//!   durability option's `WAIT` then counts the new connection's writes, not the old one's;
//! - a failover takes time: the sentinels announce it, and each server's store hears the
//!   announcement at a step of its own, before or after the promotion and the demotion (seen
//!   77 to 293 ms after it was sent), raising its fence there (claims refused, other writes
//!   held); until then it writes where it is, on the old master; a replica is promoted while
//!   the old master still takes writes, each server switches to the new master on its own (and
//!   lowers its fence there; a switch, or a restarted store's first look, counts as hearing),
//!   the old master is demoted, losing what it took since the promotion, and with two replicas
//!   the one not promoted follows the new master, losing what it had beyond it;
//! - the fence counts its raises (`Fence::raised_since`): a claim or completion waiting for
//!   its `WAIT` remembers whether its server's fence was raised since it went out, and such an
//!   answer is not trusted (the claim released, 503; the completion written again), since the
//!   write may have landed on the old master after the promotion, acknowledged there by a
//!   replica not promoted;
//! - failovers overlap: once the sentinels are done with one, the next may begin before every
//!   server has followed it (those overtaken follow the later one), and a sentinel's
//!   announcement of a failover over or overtaken may reach a server late, which the watch
//!   ignores; a fence that stands once no failover is under way for its server excuses no
//!   lapse under it.

use std::fmt;

use stateright::{Model, Property};

use super::store::{Mutation, Node, Outcome, Payload, Rec, RecState, Token};

/// The bounds and options of one check.
#[derive(Clone, Debug)]
pub struct Config {
    /// Each record's (scope, key): two records may share a key in different scopes.
    pub records: Vec<(u8, u8)>,
    /// Each client's (record, fingerprint): clients of one record with different
    /// fingerprints stand for a retry with a different payload.
    pub clients: Vec<(u8, u8)>,
    pub servers: u8,
    /// How many server crashes may happen in a run (each at any step of a request).
    pub crashes: u8,
    /// How many handler failures (a panic, an error: the key is released) may happen.
    pub failures: u8,
    /// How many times a lease may lapse under a live owner that could renew it (a partition, a
    /// blocked thread: README's limit). Leases of dead owners always may, and so may a live
    /// owner's that cannot reach the node (held at a fence, or pointed at another node).
    pub live_lapses: u8,
    /// How many failovers may happen (each promotes a replica, losing what it lacks).
    pub failovers: u8,
    /// The durability option: claims and completions wait for replicas (`WAIT`).
    pub replica_acks: bool,
    /// How many replicas the master has when there are any (a failover or the durability
    /// option): 1 or 2. With two, each lags on its own and a failover may promote either.
    pub replicas: u8,
    /// With the durability option, how many replicas a `WAIT` must count
    /// (`ReplicaAcks::new(n)`); `None`: every replica, as docs/guarantees.md requires.
    pub acks: Option<u8>,
    /// How many times a client may hang up on a request in progress (and retry).
    pub hang_ups: u8,
    /// How many store calls may fail, time out, lose their answer, land late or land twice.
    pub call_faults: u8,
    /// How many times a server's connection may be replaced under it (heartbeat, drop).
    pub reconnects: u8,
    /// How many background completions may give up (the store unreachable for a whole lease).
    pub give_ups: u8,
    /// How many sentinels' announcements may reach a server late: of the last failover, once
    /// it is over or overtaken by the next (a slow link to one sentinel, announcements queued
    /// behind others).
    pub late_announcements: u8,
    pub mutation: Option<Mutation>,
}

impl Config {
    /// One store node, no fault of the machinery: what the bounded configurations start from.
    pub fn quiet(records: Vec<(u8, u8)>, clients: Vec<(u8, u8)>) -> Self {
        Config {
            records,
            clients,
            servers: 2,
            crashes: 0,
            failures: 0,
            live_lapses: 0,
            failovers: 0,
            replica_acks: false,
            replicas: 1,
            acks: None,
            hang_ups: 0,
            call_faults: 0,
            reconnects: 0,
            give_ups: 0,
            late_announcements: 0,
            mutation: None,
        }
    }

    fn has_replica(&self) -> bool {
        self.failovers > 0 || self.replica_acks
    }

    /// How many store nodes there are: the master and its replicas.
    fn nodes(&self) -> usize {
        if self.has_replica() {
            1 + usize::from(self.replicas)
        } else {
            1
        }
    }

    /// How many replicas a `WAIT` must count to acknowledge a write.
    fn acks_required(&self) -> usize {
        usize::from(self.acks.unwrap_or(self.replicas))
    }

    fn fenced_on_announcement(&self) -> bool {
        self.mutation != Some(Mutation::NoFence)
    }

    /// The store slot (digest) of record `r`.
    pub fn slot(&self, r: u8) -> usize {
        let (scope, key) = self.records[usize::from(r)];
        if self.mutation == Some(Mutation::ScopeNotInDigest) {
            let first = self.records.iter().position(|&(_, k)| k == key);
            return first.unwrap_or(usize::from(r));
        }
        let _ = scope;
        usize::from(r)
    }

    fn record_of(&self, client: u8) -> u8 {
        self.clients[usize::from(client)].0
    }

    fn fingerprint_of(&self, client: u8) -> u8 {
        self.clients[usize::from(client)].1
    }
}

/// What a client was finally told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    Result(Payload),
    Mismatch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Client {
    /// About to send (or retry) its request.
    Ready,
    /// Its request is with this server.
    Waiting(u8),
    Done(Answer),
}

/// Where a server is in one request. `client` is whom it answers (if still waiting for it).
/// `moved`: the connection the write went out on was replaced since (a reconnect, a switch to
/// a new master), so a `WAIT` now counts another connection's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    /// [`Mutation::ClaimNotAtomic`]: read no record, about to write one.
    Reading {
        client: u8,
        token: Token,
    },
    /// Durability option: the claim landed on the master; waiting for the replica (`WAIT`).
    /// `raised`: the server's fence was raised since the claim went out (the fence's count
    /// moved: `Fence::raised_since`), so an answer, however many replicas it counts, is not
    /// trusted.
    AwaitClaimAck {
        client: u8,
        token: Token,
        moved: bool,
        raised: bool,
    },
    /// The claim is held; the handler has not finished. `lost`: a renewal found it gone.
    Claimed {
        client: u8,
        token: Token,
        lost: bool,
    },
    /// The handler ran to its end (its effect happened); not completed yet.
    Ran {
        client: u8,
        token: Token,
        payload: Payload,
        lost: bool,
    },
    /// Durability option: the completion landed on the master, not yet acknowledged by the
    /// replica; the client waits for the `WAIT`. `moved`, `raised`: as for
    /// [`Phase::AwaitClaimAck`].
    AwaitCompleteAck {
        client: u8,
        token: Token,
        payload: Payload,
        moved: bool,
        raised: bool,
    },
    /// The client was answered; the completion goes on in the background, keeping the claim's
    /// lease (`Claim::complete_in_background`, src/coordinator/claim.rs; with the durability
    /// option `keep_completing`, src/store/redis/replica_acks.rs), until it is stored (and, with
    /// the durability option, acknowledged), finds the claim lost, or gives up. `raised`: a
    /// raise since its last write, which its `WAIT`'s answer cannot outweigh: it is written
    /// again first.
    Completing {
        token: Token,
        payload: Payload,
        moved: bool,
        raised: bool,
    },
}

impl Phase {
    /// The owner token of the request in this phase, if it holds one.
    pub fn token(&self) -> Option<Token> {
        match *self {
            Phase::Idle => None,
            Phase::Reading { token, .. }
            | Phase::AwaitClaimAck { token, .. }
            | Phase::Claimed { token, .. }
            | Phase::Ran { token, .. }
            | Phase::AwaitCompleteAck { token, .. }
            | Phase::Completing { token, .. } => Some(token),
        }
    }

    fn client(&self) -> Option<u8> {
        match *self {
            Phase::Idle | Phase::Completing { .. } => None,
            Phase::Reading { client, .. }
            | Phase::AwaitClaimAck { client, .. }
            | Phase::Claimed { client, .. }
            | Phase::Ran { client, .. }
            | Phase::AwaitCompleteAck { client, .. } => Some(client),
        }
    }

    /// The result of a handler that ran, while its completion is not settled.
    fn result(&self) -> Option<(Token, Payload)> {
        match *self {
            Phase::Ran { token, payload, .. }
            | Phase::AwaitCompleteAck { token, payload, .. }
            | Phase::Completing { token, payload, .. } => Some((token, payload)),
            _ => None,
        }
    }

    /// What a phase waiting for its write's `WAIT` knows of that write: whether its connection
    /// was replaced since (`moved`), and whether its server's fence was raised since (`raised`).
    fn waiting_write(&mut self) -> Option<(&mut bool, &mut bool)> {
        match self {
            Phase::AwaitClaimAck { moved, raised, .. }
            | Phase::AwaitCompleteAck { moved, raised, .. }
            | Phase::Completing { moved, raised, .. } => Some((moved, raised)),
            _ => None,
        }
    }

    /// The connection this phase's write went out on was replaced.
    fn move_connection(&mut self) {
        if let Some((moved, _)) = self.waiting_write() {
            *moved = true;
        }
    }

    /// The server's fence was raised (its count moved) while this phase's write was on its way
    /// or waiting for its answer.
    fn fence_raised(&mut self) {
        if let Some((_, raised)) = self.waiting_write() {
            *raised = true;
        }
    }
}

/// A release the coordinator carries on in the background after a claim or a release failed in
/// transit (`PendingClaim`'s drop, `Settings::release_in_background`, src/coordinator/): up to
/// three attempts (`RELEASE_RETRY_DELAYS_MS`), each of which may find nothing to release yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Releasing {
    pub record: u8,
    pub token: Token,
    pub attempts_left: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Server {
    pub phase: Phase,
    /// The record the current request is for.
    pub record: u8,
    /// The node its connections are on.
    pub node: u8,
    /// It heard a failover announced and holds its writes (refuses claims) until it is on the
    /// new master.
    pub fenced: bool,
    /// The sentinels announced a failover its store listens for, and the store has not heard
    /// it yet (`Hear`): it writes where it is, on the old master, which takes writes until its
    /// demotion.
    pub unheard: bool,
    /// Background releases under way (sorted, so equal sets are equal states).
    pub releasing: Vec<Releasing>,
    /// Its store listens to the sentinels: false from a restart until its subscriptions are
    /// made (a failover announced meanwhile goes unheard), and it takes no claim until then.
    pub listening: bool,
    /// Its fence stands though no failover is under way for it: raised by an announcement no
    /// longer news ([`Mutation::ActsOnLateAnnouncement`]), or kept over a switch taken for one
    /// followed before ([`Mutation::DuplicateSwitchIgnored`]). A lease that lapses under it is
    /// no limit's doing: nothing excuses what follows. The code as it is never raises one.
    pub stale_fence: bool,
    /// [`Mutation::DuplicateSwitchIgnored`] only: the last switch (old master, new master) it
    /// followed. Kept nowhere else, so that no other configuration has more states for it.
    pub followed: Option<(u8, u8)>,
}

impl Server {
    /// Raises its fence (`Watcher::raise`, `Fence::raise`, src/store/redis/sentinel/): claims
    /// refused, other writes held, and the fence's count moved under the write on its way, if
    /// any.
    fn raise_fence(&mut self) {
        self.fenced = true;
        self.stale_fence = false;
        self.phase.fence_raised();
    }
}

/// A store call on its way: it lands on `node` at a later step, or never.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InTransit {
    pub node: u8,
    pub record: u8,
    pub op: Op,
}

/// A store call, without its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Claim { fingerprint: u8, owner: Token },
    Complete { owner: Token, payload: Payload },
    Release { owner: Token },
    Renew { owner: Token },
}

/// How a store call goes.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// It lands and is answered.
    None,
    /// It never lands; the caller times out.
    Dropped,
    /// It lands; its answer is lost and the caller times out.
    AnswerLost,
    /// It lands later (held in a frozen connection); the caller times out.
    Late,
    /// It lands and is answered, and a copy sent again lands later.
    Twice,
}

impl Fault {
    fn lands_now(self) -> bool {
        matches!(self, Fault::None | Fault::AnswerLost | Fault::Twice)
    }

    fn answered(self) -> bool {
        matches!(self, Fault::None | Fault::Twice)
    }

    fn lands_later(self) -> bool {
        matches!(self, Fault::Late | Fault::Twice)
    }
}

/// Why a run after the first of a record is not a broken promise: each names a limit
/// docs/guarantees.md documents, and each excuses one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Excuse {
    /// A process died after its handler ran, before its result was durable.
    Died,
    /// A background completion gave up: the store was unreachable for a whole lease.
    GaveUp,
    /// A lease lapsed under a live owner that could have renewed it (a partition, a blocked
    /// thread).
    LapsedUnderLiveOwner,
    /// A lease lapsed while its owner's renewals were held at a fence raised for a failover
    /// still under way for it (not one that stands over a failover already over: see
    /// [`Server::stale_fence`]), or went to the old master, its store not having heard the
    /// failover announced yet: a failover longer than the lease left.
    LapsedInFailover,
    /// Without the durability option: the promoted replica lacked the claim or the completion,
    /// or (`after_promotion`) the old master took it after the promotion, from a server whose
    /// store had not heard the failover announced, and loses it with its demotion.
    LostByAsyncFailover { after_promotion: bool },
    /// With the durability option requiring fewer replicas than there are
    /// (`ReplicaAcks::new(n)`, n below the replica count): the replica promoted lacks a claim
    /// or completion a `WAIT` acknowledged, because it was not among those the `WAIT` counted,
    /// or (`after_promotion`) because the `WAIT` was answered on the old master after the
    /// promotion, by the replica not promoted, before its server's store heard the failover
    /// announced (an answer after that is not trusted).
    FewerAcksThanReplicas { after_promotion: bool },
}

/// What the properties read, per record, beside the protocol's own state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// Handler runs that reached their end (their effect happened): no cap.
    pub runs: u8,
    /// Limits met that may each let the key run once more (see [`Excuse`]).
    pub excuses: u8,
    /// The last excuse met, for the traces.
    pub last_excuse: Option<Excuse>,
    /// The runs whose payload some client was answered (directly or replayed), as bits.
    pub answered_runs: u32,
    /// The completion the store acknowledged (the durability option: once the replica had it).
    pub acknowledged: Option<Payload>,
    /// A replay was answered.
    pub replayed: bool,
    /// A completed record on a master was changed in place (owner or payload), or an
    /// acknowledged completion is no longer on the master.
    pub completed_changed: bool,
}

impl Ghost {
    fn excuse(&mut self, why: Excuse) {
        self.excuses = self.excuses.saturating_add(1);
        self.last_excuse = Some(why);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    pub crashes: u8,
    pub failures: u8,
    pub live_lapses: u8,
    pub failovers: u8,
    pub hang_ups: u8,
    pub call_faults: u8,
    pub reconnects: u8,
    pub give_ups: u8,
    pub late_announcements: u8,
}

/// A failover under way: `to` is being promoted over `from`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    pub from: u8,
    pub to: u8,
    /// `to` takes writes (and so does `from`, until it is demoted).
    pub promoted: bool,
    /// `from` is a replica of `to` now, with `to`'s records.
    pub demoted: bool,
    /// The records (bits) whose loss this failover excused already: a claim and its
    /// completion lost in one failover are one result lost, and excuse one run.
    pub excused: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Each node's records; `follows[n]` is the master node `n` replicates (`None`: a master).
    pub nodes: Vec<Node>,
    pub follows: Vec<Option<u8>>,
    pub window: Option<Window>,
    /// The last failover over or overtaken (old master, new master): what a late announcement
    /// names.
    pub previous: Option<(u8, u8)>,
    pub servers: Vec<Server>,
    pub clients: Vec<Client>,
    /// Store calls on their way (sorted).
    pub in_transit: Vec<InTransit>,
    pub ghosts: Vec<Ghost>,
    /// A client was answered with a payload computed for another record (key or scope).
    pub foreign_answer: bool,
    pub budget: Budget,
}

impl State {
    /// The node whose records are the store's from now on: the master, or the one being
    /// promoted.
    pub fn master(&self) -> u8 {
        match self.window {
            Some(window) => window.to,
            None => self.follows.iter().position(Option::is_none).unwrap_or(0) as u8,
        }
    }

    fn takes_writes(&self, node: u8) -> bool {
        self.follows[usize::from(node)].is_none()
    }
}

/// A step of the model. Each names the code that takes it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Server takes client's request and claims its key: `Coordinator::begin`
    /// (src/coordinator/mod.rs) calling `Store::claim` ([`Node::claim`]). At a fence it is
    /// refused at once (503, no call). A claim that times out is answered 503 and a release is
    /// queued behind it (`PendingClaim`).
    Serve { server: u8, client: u8, fault: Fault },
    /// [`Mutation::ClaimNotAtomic`]'s write.
    ClaimWrite { server: u8 },
    /// Durability option: the replica has the claim: `RedisStore::claim_acknowledged`'s
    /// `waiter.wait` answered enough, and the name read behind the `WAIT` is its connection's
    /// (src/store/redis/acknowledged.rs, replica_acks.rs). If the server's fence was raised
    /// since the claim went out (`fence_raised_since`), the answer is not trusted: the claim is
    /// released and answered 503, as [`Action::ClaimNotAcked`] does.
    ClaimAcked { server: u8 },
    /// Durability option: `WAIT` timed out, or ran on another connection than the claim:
    /// `claim_acknowledged` runs release.lua and answers `StoreError::Unavailable` (503).
    ClaimNotAcked { server: u8 },
    /// The lease renewal: `renew_until_lost` (src/coordinator/claim.rs) calling `Store::renew`
    /// ([`Node::renew`]); a `false` sets `ClaimFlags::lost`, an error changes nothing.
    Renew { server: u8, fault: Fault },
    /// The handler runs to its end: its effect happens.
    Run { server: u8 },
    /// The handler fails before any effect: `Claim::release` (or `Claim`'s `Drop` after a
    /// panic) calling `Store::release` ([`Node::release`]); the client retries. A release that
    /// fails is retried in the background.
    Fail { server: u8, fault: Fault },
    /// `Claim::complete` (src/coordinator/claim.rs): nothing written if a renewal found the
    /// claim lost, else `Store::complete` ([`Node::complete`]); the layer answers the handler's
    /// response whatever it says (src/http/service.rs). A first attempt that fails is answered
    /// and carried on in the background.
    Complete { server: u8, fault: Fault },
    /// Durability option: the replica has the completion (`complete_then_wait`'s `WAIT` and the
    /// name behind it, src/store/redis/acknowledged.rs); the client is answered. If the server's
    /// fence was raised since the completion went out, `complete_once_acknowledged` does not
    /// trust the answer: the client is answered all the same and the completion is written
    /// again in the background (`keep_completing`), once the fence is down.
    CompleteAcked { server: u8 },
    /// Durability option: the wait timed out or ran on another connection: `complete_acknowledged`
    /// answers (the client gets its response) and its task keeps completing.
    CompleteTimedOut { server: u8 },
    /// The background completion tries again on the node the server is on
    /// (`complete_until_lease_ends`; `keep_completing`): stored (and acknowledged) ends it,
    /// `false` is the claim lost (`GaveUp::Lost`).
    CompleteAgain { server: u8, fault: Fault },
    /// The background completion gives up as the lease ends, the store unreachable all along:
    /// reported (`CompletionFailed`), the key left to its lease.
    GiveUp { server: u8 },
    /// A background release attempt (`Settings::release_in_background`).
    ReleaseAgain { server: u8, index: u8, fault: Fault },
    /// The server process dies (`kill -9`) at any step: what it held is left to its lease, its
    /// calls on their way may still land, its background tasks die with it.
    Crash { server: u8 },
    /// A connection of the server is replaced (the heartbeat's, fred's reconnect).
    Reconnect { server: u8 },
    /// A restarted server's store has made its subscriptions to the sentinels and asked them
    /// whether a failover is under way (raising its fence if one is): `start_listening`. It
    /// counts as hearing the failover under way.
    Listen { server: u8 },
    /// The client gives up on its request and may send it again; the server goes on (a dropped
    /// response future does not cancel the handler).
    HangUp { client: u8 },
    /// A store call on its way lands.
    Land { index: u8 },
    /// A lease runs out (abstract time): [`Node::expire`], on a master node.
    Expire { node: u8, slot: u8 },
    /// Asynchronous replication of one record to a replica (Redis's replication stream).
    Replicate { node: u8, slot: u8 },
    /// The sentinels announce a failover (`+failover-state-send-slaveof-noone`) of replica `to`,
    /// any replica of the master (the sentinels pick by replication offsets they may have read
    /// seconds earlier). Each server whose store listens hears it at a step of its own
    /// ([`Action::Hear`]), before or after the promotion (which follows about 100 ms later) and
    /// the demotion: a store was seen to hear it 77 to 293 ms after it was sent. (With two
    /// replicas, the first failover's replica is named node 1 once announced: see
    /// `System::name_alike_replicas_in_order`.)
    Announce { to: u8 },
    /// A server's store hears the failover announced: `Watcher::on_event`'s `Promoting` arm
    /// raises its fence (src/store/redis/sentinel/watcher.rs, `Fence::raise`: claims refused,
    /// writes held, the fence's count moved under the writes on their way). Until then it
    /// writes where it is. [`Mutation::NoFence`]: hearing raises nothing.
    Hear { server: u8 },
    /// The replica takes writes; the old master still does too, until it is demoted.
    Promote,
    /// A server follows `+switch-master`: its connections move to the new master, confirmed by
    /// `ROLE`, and its fence comes down. A server the failover overtook (it had not followed the
    /// one before) follows this one, wherever it is. One that had not heard the failover
    /// announced hears it so: its fence is raised first (`on_event`'s `Switched` arm, with no
    /// fence up), moving the count, then lowered.
    Switch { server: u8 },
    /// A sentinel's announcement of the last failover reaches a server late: the failover is
    /// over, or overtaken by the next. The watch ignores it (`Watcher::on_announcement`,
    /// `on_event`, src/store/redis/sentinel/watcher.rs): a switch received before the sentinels
    /// last answered that no failover is under way (`confirmed_at`), one whose new master
    /// answers `ROLE` as a replica, one already tried (`attempted`) or followed (`followed`).
    /// [`Mutation::ActsOnLateAnnouncement`] acts on it. (A late switch to a master since killed,
    /// whose `ROLE` proves nothing, is ignored as already tried: `attempted` outlives the fence,
    /// `stale_announcements_heard_with_the_switch_back_are_not_acted_on_again`,
    /// tests/redis_sentinel.rs.) Left out, where the code does not ignore it: a late promotion,
    /// which is always acted on: its fence stands until a look lowers it (below), or, where a
    /// sentinel does not answer, 2 × `failover-timeout` + 5 s; the model has no time, so a
    /// lease lapsing under it would show as a key run twice that no limit excuses, where the
    /// code leaves it to the lease-lapse limit.
    Late { server: u8 },
    /// The watch's look, once a second (`Watcher::look`, `try_lower`): a server whose fence
    /// stands though no failover is under way goes to the master the sentinels name and lowers
    /// it. The code's condition is that every sentinel (those the URL names, and those their
    /// lists name, each asked at the address it announces: `every_sentinel_answered_since`)
    /// answered after the fence rose that it fails nothing over; only a failover's leader
    /// shows one, from before it announces the promotion until its switch or abort, so that is
    /// the model's "no failover window open" (a failover begins with `Announce`; the leader's
    /// flag before it only makes the code stricter). Only the mutations leave such a fence.
    Look { server: u8 },
    /// A replica of the old master that was not promoted is made a replica of the new one
    /// (`+slave-reconf-sent`) and takes its records: what it had beyond them is lost (a full
    /// resynchronisation; a partial one ends the same, the new master's stream being the
    /// one kept).
    Follow { node: u8 },
    /// The old master becomes a replica of the new one and takes its records: what it took
    /// since the promotion is lost.
    Demote,
}

impl fmt::Debug for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::None => Ok(()),
            Fault::Dropped => write!(f, " [call dropped]"),
            Fault::AnswerLost => write!(f, " [answer lost]"),
            Fault::Late => write!(f, " [call held: lands later]"),
            Fault::Twice => write!(f, " [lands twice]"),
        }
    }
}

impl fmt::Debug for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Serve {
                server,
                client,
                fault,
            } => write!(f, "S{server} claims for C{client}{fault:?}"),
            Action::ClaimWrite { server } => write!(f, "S{server} writes its claim"),
            Action::ClaimAcked { server } => write!(f, "S{server} claim acked"),
            Action::ClaimNotAcked { server } => write!(f, "S{server} claim not acked: release, 503"),
            Action::Renew { server, fault } => write!(f, "S{server} renews{fault:?}"),
            Action::Run { server } => write!(f, "S{server} runs the handler"),
            Action::Fail { server, fault } => write!(f, "S{server} handler fails: release{fault:?}"),
            Action::Complete { server, fault } => write!(f, "S{server} completes{fault:?}"),
            Action::CompleteAcked { server } => write!(f, "S{server} completion acked"),
            Action::CompleteTimedOut { server } => {
                write!(
                    f,
                    "S{server} completion not acked: answers, completes in the background"
                )
            }
            Action::CompleteAgain { server, fault } => write!(f, "S{server} completes again{fault:?}"),
            Action::GiveUp { server } => write!(f, "S{server} gives the completion up"),
            Action::ReleaseAgain { server, index, fault } => {
                write!(f, "S{server} background release #{index}{fault:?}")
            }
            Action::Crash { server } => write!(f, "S{server} crashes"),
            Action::Reconnect { server } => write!(f, "S{server} connection replaced"),
            Action::Listen { server } => write!(f, "S{server} listens to the sentinels"),
            Action::HangUp { client } => write!(f, "C{client} hangs up"),
            Action::Land { index } => write!(f, "a call on its way lands (#{index})"),
            Action::Expire { node, slot } => write!(f, "lease of record {slot} runs out on node {node}"),
            Action::Replicate { node, slot } => write!(f, "replicate record {slot} to node {node}"),
            Action::Announce { to } => write!(f, "FAILOVER announced, of node {to}"),
            Action::Hear { server } => write!(f, "S{server} hears the failover announced"),
            Action::Promote => write!(f, "FAILOVER: replica promoted"),
            Action::Switch { server } => write!(f, "S{server} switches to the new master"),
            Action::Late { server } => write!(f, "S{server} hears the last failover's announcement late"),
            Action::Look { server } => {
                write!(f, "S{server} looks: goes to the master named, lowers its fence")
            }
            Action::Follow { node } => write!(f, "FAILOVER: node {node} replicates the new master"),
            Action::Demote => write!(f, "FAILOVER: old master demoted"),
        }
    }
}

/// A store call a step made on a node, and what it answered: what `tests/model_conformance.rs`
/// replays against the real stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Claim {
        record: u8,
        fingerprint: u8,
        owner: Token,
        answer: Outcome,
    },
    Complete {
        record: u8,
        owner: Token,
        payload: Payload,
        answer: bool,
    },
    Release {
        record: u8,
        owner: Token,
        answer: bool,
    },
    Renew {
        record: u8,
        owner: Token,
        answer: bool,
    },
    Expire {
        record: u8,
    },
}

/// The model: a [`Config`] checked by stateright.
#[derive(Clone, Debug)]
pub struct System {
    pub config: Config,
}

impl System {
    pub fn new(config: Config) -> Self {
        Self { config }
    }

    fn slots(&self) -> usize {
        self.config.records.len()
    }

    pub fn initial(&self) -> State {
        let c = &self.config;
        let nodes = c.nodes();
        State {
            nodes: vec![Node::new(self.slots()); nodes],
            follows: (0..nodes).map(|n| (n > 0).then_some(0)).collect(),
            window: None,
            previous: None,
            servers: vec![
                Server {
                    phase: Phase::Idle,
                    record: 0,
                    node: 0,
                    fenced: false,
                    unheard: false,
                    releasing: Vec::new(),
                    listening: true,
                    stale_fence: false,
                    followed: None,
                };
                usize::from(c.servers)
            ],
            clients: vec![Client::Ready; c.clients.len()],
            in_transit: Vec::new(),
            ghosts: vec![Ghost::default(); c.records.len()],
            foreign_answer: false,
            budget: Budget {
                crashes: c.crashes,
                failures: c.failures,
                live_lapses: c.live_lapses,
                failovers: c.failovers,
                hang_ups: c.hang_ups,
                call_faults: c.call_faults,
                reconnects: c.reconnects,
                give_ups: c.give_ups,
                late_announcements: c.late_announcements,
            },
        }
    }

    /// A token of server `s` that no record, call or server holds: as good as a new one
    /// (`OwnerToken::generate`), since tokens are only ever compared, and the smallest such
    /// keeps the state space finite.
    fn fresh_token(state: &State, s: u8) -> Token {
        let stored = state
            .nodes
            .iter()
            .flat_map(|node| node.records.iter().flatten().map(|rec| rec.owner));
        let held = state.servers.iter().filter_map(|server| server.phase.token());
        let releasing = state
            .servers
            .iter()
            .flat_map(|server| server.releasing.iter().map(|r| r.token));
        let sent = state.in_transit.iter().map(|call| match call.op {
            Op::Claim { owner, .. }
            | Op::Complete { owner, .. }
            | Op::Release { owner }
            | Op::Renew { owner } => owner,
        });
        let used: Vec<Token> = stored
            .chain(held)
            .chain(releasing)
            .chain(sent)
            .filter(|token| token.server == s)
            .collect();
        let n = (0..)
            .find(|n| !used.iter().any(|token| token.n == *n))
            .unwrap_or(0);
        Token { server: s, n }
    }

    /// The live server that holds `token`, if any (a lease of a dead owner may always run out).
    fn holder(state: &State, token: Token) -> Option<&Server> {
        state
            .servers
            .iter()
            .find(|server| server.phase.token() == Some(token))
    }

    /// Whether server `s` can write now: not held at a fence, and on a node that takes writes
    /// (on a demoted one its writes are refused `READONLY` until it switches).
    fn can_write(state: &State, s: usize) -> bool {
        let server = &state.servers[s];
        !server.fenced && state.takes_writes(server.node)
    }

    /// Whether server `s` takes a claim now: it can write, and its store listens to the
    /// sentinels (`Fence::until_listening`, src/store/redis/sentinel_watch.rs).
    fn can_claim(&self, state: &State, s: usize) -> bool {
        Self::can_write(state, s)
            && (state.servers[s].listening || self.config.mutation == Some(Mutation::ClaimsBeforeListening))
    }

    fn trusts_answers_after_raise(&self) -> bool {
        self.config.mutation == Some(Mutation::TrustsAnswersAfterRaise)
    }

    /// The faults a call may meet now.
    fn faults(state: &State) -> &'static [Fault] {
        const NONE: [Fault; 1] = [Fault::None];
        const ALL: [Fault; 5] = [
            Fault::None,
            Fault::Dropped,
            Fault::AnswerLost,
            Fault::Late,
            Fault::Twice,
        ];
        if state.budget.call_faults > 0 {
            &ALL
        } else {
            &NONE
        }
    }

    /// Every action possible in `state`.
    pub fn possible(&self, state: &State, actions: &mut Vec<Action>) {
        let c = &self.config;
        let faults = Self::faults(state);
        for (s, server) in state.servers.iter().enumerate() {
            let server_id = s as u8;
            let writes = Self::can_write(state, s);
            let claims = self.can_claim(state, s);
            match server.phase {
                // At a fence a claim is answered 503 at once, with no call, and on a demoted
                // node it is refused (`READONLY`, 503): the client is left as it was, so the
                // model has no step for either.
                Phase::Idle if claims => {
                    for (client, status) in state.clients.iter().enumerate() {
                        if *status == Client::Ready {
                            for &fault in faults {
                                actions.push(Action::Serve {
                                    server: server_id,
                                    client: client as u8,
                                    fault,
                                });
                            }
                        }
                    }
                }
                Phase::Idle => {}
                Phase::Reading { .. } => actions.push(Action::ClaimWrite { server: server_id }),
                Phase::AwaitClaimAck { token, moved, .. } => {
                    if self.acknowledged(state, s, token, None, moved) {
                        actions.push(Action::ClaimAcked { server: server_id });
                    }
                    if writes {
                        actions.push(Action::ClaimNotAcked { server: server_id });
                    }
                }
                Phase::Claimed { lost, .. } => {
                    if !lost && writes {
                        for &fault in faults {
                            actions.push(Action::Renew {
                                server: server_id,
                                fault,
                            });
                        }
                    }
                    actions.push(Action::Run { server: server_id });
                    if state.budget.failures > 0 && writes {
                        for &fault in faults {
                            actions.push(Action::Fail {
                                server: server_id,
                                fault,
                            });
                        }
                    }
                }
                Phase::Ran { lost, .. } => {
                    if !lost && writes {
                        for &fault in faults {
                            actions.push(Action::Renew {
                                server: server_id,
                                fault,
                            });
                        }
                    }
                    // A lost claim answers without a call; otherwise the completion waits for
                    // the fence to come down (`until_store_takes_writes`).
                    if lost {
                        actions.push(Action::Complete {
                            server: server_id,
                            fault: Fault::None,
                        });
                    } else if writes {
                        for &fault in faults {
                            actions.push(Action::Complete {
                                server: server_id,
                                fault,
                            });
                        }
                    }
                }
                Phase::AwaitCompleteAck {
                    token,
                    payload,
                    moved,
                    ..
                } => {
                    if self.acknowledged(state, s, token, Some(payload), moved) {
                        actions.push(Action::CompleteAcked { server: server_id });
                    }
                    actions.push(Action::CompleteTimedOut { server: server_id });
                }
                Phase::Completing {
                    token,
                    payload,
                    moved,
                    raised,
                } => {
                    if writes {
                        for &fault in faults {
                            actions.push(Action::CompleteAgain {
                                server: server_id,
                                fault,
                            });
                        }
                    }
                    // Durability option: a completion stored, waiting for its acknowledgement
                    // (one answered after a raise is not trusted: it waits to be written again).
                    if c.replica_acks
                        && (!raised || self.trusts_answers_after_raise())
                        && self.acknowledged(state, s, token, Some(payload), moved)
                    {
                        actions.push(Action::CompleteAcked { server: server_id });
                    }
                    if state.budget.give_ups > 0 {
                        actions.push(Action::GiveUp { server: server_id });
                    }
                }
            }
            if writes {
                for index in 0..server.releasing.len() {
                    for &fault in faults {
                        actions.push(Action::ReleaseAgain {
                            server: server_id,
                            index: index as u8,
                            fault,
                        });
                    }
                }
            }
            if (server.phase != Phase::Idle || !server.releasing.is_empty()) && state.budget.crashes > 0 {
                actions.push(Action::Crash { server: server_id });
            }
            if state.budget.reconnects > 0
                && matches!(
                    server.phase,
                    Phase::AwaitClaimAck { moved: false, .. }
                        | Phase::AwaitCompleteAck { moved: false, .. }
                        | Phase::Completing { moved: false, .. }
                )
            {
                actions.push(Action::Reconnect { server: server_id });
            }
            if state.window.is_some() && server.unheard {
                actions.push(Action::Hear { server: server_id });
            }
            if let Some(window) = state.window {
                // A server on the new master may still be fenced: overtaken, it never left it
                // (a failover back to the master it was on). One that ignored this switch
                // (a mutation) stays so.
                if window.promoted && (server.node != window.to || (server.fenced && !server.stale_fence)) {
                    actions.push(Action::Switch { server: server_id });
                }
            }
            if state.previous.is_some() && state.budget.late_announcements > 0 {
                actions.push(Action::Late { server: server_id });
            }
            if server.stale_fence && state.window.is_none() {
                actions.push(Action::Look { server: server_id });
            }
            if !server.listening {
                actions.push(Action::Listen { server: server_id });
            }
        }
        if state.budget.hang_ups > 0 {
            for (client, status) in state.clients.iter().enumerate() {
                if matches!(status, Client::Waiting(_)) {
                    actions.push(Action::HangUp { client: client as u8 });
                }
            }
        }
        for index in 0..state.in_transit.len() {
            actions.push(Action::Land { index: index as u8 });
        }
        for (n, node) in state.nodes.iter().enumerate() {
            if !state.takes_writes(n as u8) {
                continue;
            }
            for (slot, rec) in node.records.iter().enumerate() {
                if let Some(Rec {
                    owner,
                    state: RecState::InFlight,
                    ..
                }) = rec
                {
                    if self.may_expire(state, n as u8, *owner).is_some() {
                        actions.push(Action::Expire {
                            node: n as u8,
                            slot: slot as u8,
                        });
                    }
                }
            }
        }
        for (n, follows) in state.follows.iter().enumerate() {
            if let Some(master) = follows {
                for slot in 0..self.slots() {
                    if state.nodes[n].records[slot] != state.nodes[usize::from(*master)].records[slot] {
                        actions.push(Action::Replicate {
                            node: n as u8,
                            slot: slot as u8,
                        });
                    }
                }
            }
        }
        // The next failover may begin once the sentinels are done with the last (the old master
        // demoted, every replica following the new one), before every server has followed it.
        let sentinels_done = |window: Window| window.demoted && !state.follows.contains(&Some(window.from));
        match state.window {
            Some(window) if !sentinels_done(window) => {
                if !window.promoted {
                    actions.push(Action::Promote);
                } else if !window.demoted {
                    actions.push(Action::Demote);
                }
            }
            _ if state.budget.failovers > 0 => {
                let master = state.master();
                for to in 0..state.nodes.len() as u8 {
                    if state.follows[usize::from(to)] == Some(master) {
                        actions.push(Action::Announce { to });
                    }
                }
            }
            _ => {}
        }
        if let Some(Window {
            promoted: true, from, ..
        }) = state.window
        {
            for node in 0..state.nodes.len() as u8 {
                if state.follows[usize::from(node)] == Some(from) {
                    actions.push(Action::Follow { node });
                }
            }
        }
    }

    /// Whether an in-flight record of `owner` on `node` may run out now, and which limit that
    /// is: `Some(None)` for an owner that is dead or cannot reach the node to renew (no limit:
    /// its lease is all that holds the key), `Some(Some(excuse))` for a live owner.
    fn may_expire(&self, state: &State, node: u8, owner: Token) -> Option<Option<Excuse>> {
        let Some(holder) = Self::holder(state, owner) else {
            return Some(None);
        };
        let held = holder.fenced || (holder.node == node && !state.takes_writes(holder.node));
        // Its store has not heard the failover announced: its renewals go to the old master.
        let renews_on_the_old_master = holder.unheard && holder.node != node;
        if (held || renews_on_the_old_master) && Self::failover_under_way_for(state, holder) {
            // Its renewals are held at the fence, or go to the master being replaced: a
            // failover longer than the lease left.
            return Some(Some(Excuse::LapsedInFailover));
        }
        if held || holder.node != node {
            // Held at a fence that stands over no failover (no limit: what follows is a bug),
            // or its renewals go to the other master (no fence): this copy is left to its lease.
            return Some(None);
        }
        (state.budget.live_lapses > 0).then_some(Some(Excuse::LapsedUnderLiveOwner))
    }

    /// Whether a failover is under way for `server`: the sentinels are failing the master over,
    /// or it has not followed the failover yet (both are a window open), and its fence was
    /// raised for that (not by an announcement no longer news, nor kept over a switch ignored).
    fn failover_under_way_for(state: &State, server: &Server) -> bool {
        state.window.is_some() && !server.stale_fence
    }

    /// Whether a `WAIT` of server `s` answers that as many replicas as it requires (of the node
    /// the server is on) have `token`'s record (in flight, or completed with `payload`). The
    /// name behind the `WAIT` proves the `WAIT` ran on the connection that wrote it; with
    /// [`Mutation::WaitOnAnotherConnection`], a `WAIT` on a replaced connection counts that
    /// connection's writes (none), so every replica attached, and answers enough at once if
    /// there are as many as it requires.
    fn acknowledged(
        &self,
        state: &State,
        s: usize,
        token: Token,
        payload: Option<Payload>,
        moved: bool,
    ) -> bool {
        let server = &state.servers[s];
        let record = server.record;
        let slot = self.config.slot(record);
        let replicas = (0..state.nodes.len()).filter(|&n| state.follows[n] == Some(server.node));
        let required = self.config.acks_required();
        // Redis refuses a `WAIT` on a replica ("WAIT cannot be used with replica instances"):
        // with two replicas, the one not promoted may still follow a demoted master.
        if !state.takes_writes(server.node) {
            return false;
        }
        if moved {
            return self.config.mutation == Some(Mutation::WaitOnAnotherConnection)
                && replicas.count() >= required;
        }
        let holds = |n: &usize| holds(&state.nodes[*n], slot, token, payload);
        holds(&usize::from(server.node)) && replicas.filter(holds).count() >= required
    }

    /// Whether `token`'s result `payload` can no longer be lost: without the durability option,
    /// completed on the master (a failover may still lose it: that limit is counted at the
    /// promotion); with it, completed on every node a failover could promote, that is every
    /// node but an old master promoted over and not yet demoted, and its replicas not yet
    /// following the new master (their records are replaced by the new master's then).
    fn durable(&self, state: &State, record: u8, token: Token, payload: Payload) -> bool {
        let slot = self.config.slot(record);
        if !self.config.replica_acks {
            return holds(
                &state.nodes[usize::from(state.master())],
                slot,
                token,
                Some(payload),
            );
        }
        let replaced = |n: usize| match state.window {
            Some(Window {
                promoted: true,
                demoted,
                from,
                ..
            }) => (n == usize::from(from) && !demoted) || state.follows[n] == Some(from),
            _ => false,
        };
        (0..state.nodes.len())
            .filter(|&n| !replaced(n))
            .all(|n| holds(&state.nodes[n], slot, token, Some(payload)))
    }

    /// Tells `client` (if it still waits for `server`) `answer`, or to retry (`None`).
    fn answer(&self, state: &mut State, server: u8, client: u8, answer: Option<Answer>, replay: bool) {
        let c = &self.config;
        let record = c.record_of(client);
        let status = &mut state.clients[usize::from(client)];
        if *status != Client::Waiting(server) {
            return;
        }
        *status = match answer {
            Some(answer) => Client::Done(answer),
            None => Client::Ready,
        };
        if let Some(Answer::Result(payload)) = answer {
            if payload.record != record {
                state.foreign_answer = true;
            }
            let ghost = &mut state.ghosts[usize::from(record)];
            ghost.answered_runs |= 1 << payload.run.min(31);
            ghost.replayed |= replay;
        }
    }

    /// Notes that the store acknowledged `payload` as `record`'s result.
    fn acknowledge(state: &mut State, record: u8, payload: Payload) {
        let ghost = &mut state.ghosts[usize::from(record)];
        if ghost.acknowledged.is_some_and(|stored| stored != payload) {
            ghost.completed_changed = true;
        }
        ghost.acknowledged.get_or_insert(payload);
    }

    /// Applies `op` for `record` on `node`: the answer and the call it was.
    fn apply(&self, state: &mut State, node: u8, record: u8, op: Op) -> Call {
        let c = &self.config;
        let slot = c.slot(record);
        let mutation = c.mutation;
        let n = &mut state.nodes[usize::from(node)];
        match op {
            Op::Claim { fingerprint, owner } => Call::Claim {
                record,
                fingerprint,
                owner,
                answer: n.claim(slot, fingerprint, owner, mutation),
            },
            Op::Complete { owner, payload } => Call::Complete {
                record,
                owner,
                payload,
                answer: n.complete(slot, owner, payload, mutation),
            },
            Op::Release { owner } => Call::Release {
                record,
                owner,
                answer: n.release(slot, owner, mutation),
            },
            Op::Renew { owner } => Call::Renew {
                record,
                owner,
                answer: n.renew(slot, owner),
            },
        }
    }

    /// Server `s` sends `op` with `fault`: the call that landed now, if any, and its answer if
    /// the server got it.
    fn send(
        &self,
        state: &mut State,
        s: u8,
        record: u8,
        op: Op,
        fault: Fault,
    ) -> (Option<Call>, Option<Call>) {
        if fault != Fault::None {
            state.budget.call_faults -= 1;
        }
        let node = state.servers[usize::from(s)].node;
        if fault.lands_later() {
            state.in_transit.push(InTransit { node, record, op });
            state.in_transit.sort();
        }
        if !fault.lands_now() {
            return (None, None);
        }
        let call = self.apply(state, node, record, op);
        (Some(call), fault.answered().then_some(call))
    }

    fn queue_release(state: &mut State, s: u8, record: u8, token: Token) {
        let releasing = &mut state.servers[usize::from(s)].releasing;
        releasing.push(Releasing {
            record,
            token,
            attempts_left: 3,
        });
        releasing.sort();
    }

    /// What a claim's outcome makes of a request (for outcomes other than `Claimed`).
    fn settle_claim(&self, state: &mut State, s: u8, client: u8, outcome: Outcome) {
        match outcome {
            Outcome::Claimed => unreachable!("handled by the caller"),
            Outcome::Completed(payload) => self.answer(state, s, client, Some(Answer::Result(payload)), true),
            Outcome::InFlight => self.answer(state, s, client, None, false),
            Outcome::Mismatch => self.answer(state, s, client, Some(Answer::Mismatch), false),
        }
        state.servers[usize::from(s)].phase = Phase::Idle;
    }

    /// After a claim landed for `client` with `token`.
    fn claimed(&self, state: &mut State, s: u8, client: u8, token: Token) {
        let acknowledged = self.config.mutation != Some(Mutation::ClaimNotAcknowledged);
        state.servers[usize::from(s)].phase = if self.config.replica_acks && acknowledged {
            Phase::AwaitClaimAck {
                client,
                token,
                moved: false,
                raised: false,
            }
        } else {
            Phase::Claimed {
                client,
                token,
                lost: false,
            }
        };
    }

    /// A claim not to run on: `claim_acknowledged` releases it on the claim's connection and
    /// answers 503. Answers the release's call.
    fn refuse_unacknowledged_claim(
        &self,
        state: &mut State,
        s: u8,
        client: u8,
        token: Token,
    ) -> Option<Call> {
        let record = state.servers[usize::from(s)].record;
        let released = self
            .send(state, s, record, Op::Release { owner: token }, Fault::None)
            .0;
        self.answer(state, s, client, None, false);
        state.servers[usize::from(s)].phase = Phase::Idle;
        released
    }

    /// The failover under way if `server`'s store has not heard it and `server` is on its old
    /// master, promoted over and not demoted yet: what it writes there is lost with the demotion.
    pub fn unheard_on_the_old_master(state: &State, server: &Server) -> Option<Window> {
        state.window.filter(|window| {
            window.promoted && !window.demoted && server.unheard && server.node == window.from
        })
    }

    /// Excuses one more run of record `r` for a result the failover under way loses, unless
    /// this failover excused a loss of `r` already: a claim and its completion lost in one
    /// failover are one result lost, and the key runs once more for it, not twice.
    fn excuse_lost_in_failover(state: &mut State, r: u8, why: Excuse) {
        let Some(window) = &mut state.window else {
            return;
        };
        if window.excused & (1 << r) == 0 {
            window.excused |= 1 << r;
            state.ghosts[usize::from(r)].excuse(why);
        }
    }

    /// [`Self::excuse_lost_in_failover`] for every record at `slot`.
    fn excuse_lost_at(&self, state: &mut State, slot: usize, why: Excuse) {
        for r in 0..self.config.records.len() as u8 {
            if self.config.slot(r) == slot {
                Self::excuse_lost_in_failover(state, r, why);
            }
        }
    }

    /// Without the durability option: a claim or a completion that server `s`, whose store has
    /// not heard the failover announced, writes on the old master after the promotion is lost
    /// with the old master's demotion (the new master takes no writes from it), the limit of
    /// asynchronous replication. Only a write that changed a record counts (a copy sent again,
    /// finding its own record, writes nothing), and only its server's own sends, whose answers
    /// it trusts: a call held in a frozen connection that lands late was answered as timed out.
    fn excuse_what_the_old_master_will_lose(&self, last: &State, state: &mut State, action: Action) {
        if self.config.replica_acks {
            return;
        }
        let s = match action {
            Action::Serve { server, .. }
            | Action::ClaimWrite { server }
            | Action::Complete { server, .. }
            | Action::CompleteAgain { server, .. } => server,
            _ => return,
        };
        let Some(Window { from, .. }) = Self::unheard_on_the_old_master(state, &last.servers[usize::from(s)])
        else {
            return;
        };
        let from = usize::from(from);
        for slot in 0..self.slots() {
            if last.nodes[from].records[slot] != state.nodes[from].records[slot] {
                let why = Excuse::LostByAsyncFailover {
                    after_promotion: true,
                };
                self.excuse_lost_at(state, slot, why);
            }
        }
    }

    /// Durability option: server `s` trusts a `WAIT` that acknowledged `token`'s claim (or its
    /// completion with `payload`). On the old master after the promotion, before its store
    /// heard the failover announced, that `WAIT` was answered by a replica not promoted, and
    /// the result is lost with the demotion if the replica promoted lacks it: the limit of
    /// `ReplicaAcks::new(n)` with n below the replica count. (With every replica required no
    /// such `WAIT` answers enough: the replica promoted no longer counts; the property
    /// [`FEWER_ACKS_ONLY_IF_FEWER_REQUIRED`] checks it.)
    fn excuse_acknowledged_before_heard(
        &self,
        state: &mut State,
        s: u8,
        token: Token,
        payload: Option<Payload>,
    ) {
        let server = &state.servers[usize::from(s)];
        let Some(Window { to, .. }) = Self::unheard_on_the_old_master(state, server) else {
            return;
        };
        let slot = self.config.slot(server.record);
        let promoted = &state.nodes[usize::from(to)];
        let kept = match payload {
            None => promoted.records[slot].is_some_and(|rec| rec.owner == token),
            Some(payload) => holds(promoted, slot, token, Some(payload)),
        };
        if !kept {
            let why = Excuse::FewerAcksThanReplicas {
                after_promotion: true,
            };
            self.excuse_lost_at(state, slot, why);
        }
    }

    /// Durability option, at the promotion of `to` over `from`: whether record `r`'s claim or
    /// completion on `from` was acknowledged by a `WAIT` that `to` did not answer, and `to`
    /// lacks it: enough replicas but `to` hold it for the `WAIT` to have counted them alone,
    /// and it is trusted (a claim whose server is past its `WAIT`, or the completion
    /// acknowledged). With every replica required, the replicas but `to` are too few.
    fn acknowledged_without(&self, state: &State, r: u8, from: u8, to: u8) -> bool {
        let slot = self.config.slot(r);
        let Some(rec) = state.nodes[usize::from(from)].records[slot] else {
            return false;
        };
        let enough_hold = |held: &dyn Fn(&Rec) -> bool| {
            (0..state.nodes.len())
                .filter(|&n| n != usize::from(to) && state.follows[n] == Some(from))
                .filter(|&n| state.nodes[n].records[slot].as_ref().is_some_and(held))
                .count()
                >= self.config.acks_required()
        };
        let promoted = state.nodes[usize::from(to)].records[slot];
        let completion_acknowledged = matches!(
            rec.state,
            RecState::Completed(payload) if state.ghosts[usize::from(r)].acknowledged == Some(payload)
        );
        let claim_acknowledged = state.servers.iter().any(|server| {
            matches!(
                server.phase,
                Phase::Claimed { token, .. }
                    | Phase::Ran { token, .. }
                    | Phase::AwaitCompleteAck { token, .. }
                    | Phase::Completing { token, .. }
                    if token == rec.owner
            )
        });
        let completion_lost =
            completion_acknowledged && promoted != Some(rec) && enough_hold(&|held: &Rec| *held == rec);
        let claim_lost = claim_acknowledged
            && promoted.map(|kept| kept.owner) != Some(rec.owner)
            && enough_hold(&|held: &Rec| held.owner == rec.owner);
        completion_lost || claim_lost
    }

    /// The client is answered with the handler's result and the server goes on completing in
    /// the background. `raised`: the server's fence was raised since the completion went out,
    /// so its `WAIT`'s answer is not to be trusted.
    fn answer_and_complete_in_background(
        &self,
        state: &mut State,
        s: u8,
        client: u8,
        (token, payload): (Token, Payload),
        raised: bool,
    ) {
        self.answer(state, s, client, Some(Answer::Result(payload)), false);
        state.servers[usize::from(s)].phase =
            if self.config.mutation == Some(Mutation::NoBackgroundCompletion) {
                Phase::Idle
            } else {
                Phase::Completing {
                    token,
                    payload,
                    moved: false,
                    raised,
                }
            };
    }

    /// The state after `action`, and the store call that landed, if any.
    pub fn step(&self, last: &State, action: Action) -> (State, Option<Call>) {
        let c = &self.config;
        let mut state = last.clone();
        let mut landed = None;
        match action {
            Action::Serve {
                server: s,
                client,
                fault,
            } => {
                let record = c.record_of(client);
                let (slot, fingerprint) = (c.slot(record), c.fingerprint_of(client));
                state.servers[usize::from(s)].record = record;
                state.clients[usize::from(client)] = Client::Waiting(s);
                let token = Self::fresh_token(&state, s);
                if c.mutation == Some(Mutation::ClaimNotAtomic) && fault == Fault::None {
                    let node = usize::from(state.servers[usize::from(s)].node);
                    match state.nodes[node].claim_read(slot, fingerprint, token) {
                        Some(outcome) => self.settle_claim(&mut state, s, client, outcome),
                        None => state.servers[usize::from(s)].phase = Phase::Reading { client, token },
                    }
                } else {
                    let (call, answer) = self.send(
                        &mut state,
                        s,
                        record,
                        Op::Claim {
                            fingerprint,
                            owner: token,
                        },
                        fault,
                    );
                    landed = call;
                    match answer {
                        Some(Call::Claim {
                            answer: Outcome::Claimed,
                            ..
                        }) => self.claimed(&mut state, s, client, token),
                        Some(Call::Claim { answer, .. }) => self.settle_claim(&mut state, s, client, answer),
                        _ => {
                            // Timed out: 503, and a release queued behind the claim.
                            self.answer(&mut state, s, client, None, false);
                            Self::queue_release(&mut state, s, record, token);
                        }
                    }
                }
            }
            Action::ClaimWrite { server: s } => {
                if let Phase::Reading { client, token } = state.servers[usize::from(s)].phase {
                    let server = &state.servers[usize::from(s)];
                    let (record, node) = (server.record, usize::from(server.node));
                    state.nodes[node].claim_write(c.slot(record), c.fingerprint_of(client), token);
                    self.claimed(&mut state, s, client, token);
                }
            }
            Action::ClaimAcked { server: s } => {
                if let Phase::AwaitClaimAck {
                    client,
                    token,
                    raised,
                    ..
                } = state.servers[usize::from(s)].phase
                {
                    if raised && !self.trusts_answers_after_raise() {
                        // Acknowledged, perhaps by a replica of a master being replaced.
                        landed = self.refuse_unacknowledged_claim(&mut state, s, client, token);
                    } else {
                        self.excuse_acknowledged_before_heard(&mut state, s, token, None);
                        state.servers[usize::from(s)].phase = Phase::Claimed {
                            client,
                            token,
                            lost: false,
                        };
                    }
                }
            }
            Action::ClaimNotAcked { server: s } => {
                if let Phase::AwaitClaimAck { client, token, .. } = state.servers[usize::from(s)].phase {
                    landed = self.refuse_unacknowledged_claim(&mut state, s, client, token);
                }
            }
            Action::Renew { server: s, fault } => {
                let record = state.servers[usize::from(s)].record;
                if let Phase::Claimed { token, .. } | Phase::Ran { token, .. } =
                    state.servers[usize::from(s)].phase
                {
                    let (call, answer) = self.send(&mut state, s, record, Op::Renew { owner: token }, fault);
                    landed = call;
                    if let Some(Call::Renew { answer: false, .. }) = answer {
                        if let Phase::Claimed { lost, .. } | Phase::Ran { lost, .. } =
                            &mut state.servers[usize::from(s)].phase
                        {
                            *lost = true;
                        }
                    }
                }
            }
            Action::Run { server: s } => {
                let server = &mut state.servers[usize::from(s)];
                if let Phase::Claimed { client, token, lost } = server.phase {
                    let ghost = &mut state.ghosts[usize::from(server.record)];
                    let payload = Payload {
                        record: server.record,
                        run: ghost.runs,
                    };
                    ghost.runs = ghost.runs.saturating_add(1);
                    server.phase = Phase::Ran {
                        client,
                        token,
                        payload,
                        lost,
                    };
                }
            }
            Action::Fail { server: s, fault } => {
                if let Phase::Claimed { client, token, .. } = state.servers[usize::from(s)].phase {
                    state.budget.failures -= 1;
                    let record = state.servers[usize::from(s)].record;
                    let (call, answer) =
                        self.send(&mut state, s, record, Op::Release { owner: token }, fault);
                    landed = call;
                    if answer.is_none() {
                        Self::queue_release(&mut state, s, record, token);
                    }
                    self.answer(&mut state, s, client, None, false);
                    state.servers[usize::from(s)].phase = Phase::Idle;
                }
            }
            Action::Complete { server: s, fault } => {
                let record = state.servers[usize::from(s)].record;
                if let Phase::Ran {
                    client,
                    token,
                    payload,
                    lost,
                } = state.servers[usize::from(s)].phase
                {
                    if lost {
                        // `Claim::complete` on a lost claim writes nothing (`ClaimLost`).
                        self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                        state.servers[usize::from(s)].phase = Phase::Idle;
                    } else {
                        let (call, answer) = self.send(
                            &mut state,
                            s,
                            record,
                            Op::Complete {
                                owner: token,
                                payload,
                            },
                            fault,
                        );
                        landed = call;
                        match answer {
                            Some(Call::Complete { answer: true, .. }) if c.replica_acks => {
                                state.servers[usize::from(s)].phase = Phase::AwaitCompleteAck {
                                    client,
                                    token,
                                    payload,
                                    moved: false,
                                    raised: false,
                                };
                            }
                            Some(Call::Complete { answer, .. }) => {
                                if answer {
                                    Self::acknowledge(&mut state, record, payload);
                                }
                                self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                                state.servers[usize::from(s)].phase = Phase::Idle;
                            }
                            _ => self.answer_and_complete_in_background(
                                &mut state,
                                s,
                                client,
                                (token, payload),
                                false,
                            ),
                        }
                    }
                }
            }
            Action::CompleteAcked { server: s } => {
                let record = state.servers[usize::from(s)].record;
                let trusts_any = self.trusts_answers_after_raise();
                match state.servers[usize::from(s)].phase {
                    // `complete_once_acknowledged`: acknowledged or not, perhaps on a master
                    // being replaced; answered, and written again on the new master.
                    Phase::AwaitCompleteAck {
                        client,
                        token,
                        payload,
                        raised: true,
                        ..
                    } if !trusts_any => {
                        self.answer_and_complete_in_background(&mut state, s, client, (token, payload), true);
                    }
                    Phase::AwaitCompleteAck {
                        client,
                        token,
                        payload,
                        ..
                    } => {
                        self.excuse_acknowledged_before_heard(&mut state, s, token, Some(payload));
                        Self::acknowledge(&mut state, record, payload);
                        self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                        state.servers[usize::from(s)].phase = Phase::Idle;
                    }
                    // Not offered: it waits to be written again (`keep_completing`).
                    Phase::Completing { raised: true, .. } if !trusts_any => {}
                    Phase::Completing { token, payload, .. } => {
                        self.excuse_acknowledged_before_heard(&mut state, s, token, Some(payload));
                        Self::acknowledge(&mut state, record, payload);
                        state.servers[usize::from(s)].phase = Phase::Idle;
                    }
                    _ => {}
                }
            }
            Action::CompleteTimedOut { server: s } => {
                if let Phase::AwaitCompleteAck {
                    client,
                    token,
                    payload,
                    raised,
                    ..
                } = state.servers[usize::from(s)].phase
                {
                    // The same attempt goes on in the background: a raise since its write still
                    // counts against its `WAIT`'s answer.
                    self.answer_and_complete_in_background(&mut state, s, client, (token, payload), raised);
                }
            }
            Action::CompleteAgain { server: s, fault } => {
                let record = state.servers[usize::from(s)].record;
                if let Phase::Completing { token, payload, .. } = state.servers[usize::from(s)].phase {
                    let (call, answer) = self.send(
                        &mut state,
                        s,
                        record,
                        Op::Complete {
                            owner: token,
                            payload,
                        },
                        fault,
                    );
                    landed = call;
                    match answer {
                        // Stored: done, or (durability option) waiting for its acknowledgement
                        // on the connection that wrote it.
                        Some(Call::Complete { answer: true, .. }) => {
                            if c.replica_acks {
                                state.servers[usize::from(s)].phase = Phase::Completing {
                                    token,
                                    payload,
                                    moved: false,
                                    raised: false,
                                };
                            } else {
                                Self::acknowledge(&mut state, record, payload);
                                state.servers[usize::from(s)].phase = Phase::Idle;
                            }
                        }
                        // `GaveUp::Lost`: the claim is gone; reported to reconciliation.
                        Some(Call::Complete { answer: false, .. }) => {
                            state.servers[usize::from(s)].phase = Phase::Idle;
                        }
                        _ => {}
                    }
                }
            }
            Action::GiveUp { server: s } => {
                let record = state.servers[usize::from(s)].record;
                if let Some((token, payload)) = state.servers[usize::from(s)].phase.result() {
                    state.budget.give_ups -= 1;
                    if !self.durable(&state, record, token, payload) {
                        state.ghosts[usize::from(record)].excuse(Excuse::GaveUp);
                    }
                    state.servers[usize::from(s)].phase = Phase::Idle;
                }
            }
            Action::ReleaseAgain {
                server: s,
                index,
                fault,
            } => {
                let task = state.servers[usize::from(s)].releasing[usize::from(index)];
                let (call, answer) = self.send(
                    &mut state,
                    s,
                    task.record,
                    Op::Release { owner: task.token },
                    fault,
                );
                landed = call;
                let releasing = &mut state.servers[usize::from(s)].releasing;
                match answer {
                    Some(Call::Release { answer: true, .. }) => {
                        releasing.remove(usize::from(index));
                    }
                    _ if task.attempts_left <= 1 => {
                        releasing.remove(usize::from(index));
                    }
                    _ => releasing[usize::from(index)].attempts_left -= 1,
                }
                releasing.sort();
            }
            Action::Crash { server: s } => {
                state.budget.crashes -= 1;
                let server = state.servers[usize::from(s)].clone();
                if let Some((token, payload)) = server.phase.result() {
                    if !self.durable(&state, server.record, token, payload) {
                        state.ghosts[usize::from(server.record)].excuse(Excuse::Died);
                    }
                }
                if let Some(client) = server.phase.client() {
                    self.answer(&mut state, s, client, None, false);
                }
                let restarted = &mut state.servers[usize::from(s)];
                restarted.phase = Phase::Idle;
                restarted.releasing.clear();
                // A new process: its store's subscriptions to the sentinels are not made yet,
                // and an announcement on its way to the old one is lost with it (`Listen` asks
                // the sentinels instead).
                restarted.listening = !c.has_replica();
                restarted.unheard = false;
            }
            Action::Listen { server: s } => {
                let failing_over = state
                    .window
                    .is_some_and(|window| state.servers[usize::from(s)].node != window.to);
                let server = &mut state.servers[usize::from(s)];
                server.listening = true;
                if failing_over && c.fenced_on_announcement() {
                    server.raise_fence();
                }
            }
            Action::Reconnect { server: s } => {
                state.budget.reconnects -= 1;
                state.servers[usize::from(s)].phase.move_connection();
            }
            Action::HangUp { client } => {
                state.budget.hang_ups -= 1;
                state.clients[usize::from(client)] = Client::Ready;
            }
            Action::Land { index } => {
                let call = state.in_transit.remove(usize::from(index));
                // A call that reaches a node no longer a master is refused (`READONLY`).
                if state.takes_writes(call.node) {
                    landed = Some(self.apply(&mut state, call.node, call.record, call.op));
                }
            }
            Action::Expire { node, slot } => {
                if let Some(Rec { owner, .. }) = state.nodes[usize::from(node)].records[usize::from(slot)] {
                    if let Some(Some(excuse)) = self.may_expire(&state, node, owner) {
                        if excuse == Excuse::LapsedUnderLiveOwner {
                            state.budget.live_lapses -= 1;
                        }
                        for r in 0..c.records.len() as u8 {
                            if c.slot(r) == usize::from(slot) {
                                state.ghosts[usize::from(r)].excuse(excuse);
                            }
                        }
                    }
                }
                state.nodes[usize::from(node)].expire(usize::from(slot));
                let record = (0..c.records.len() as u8)
                    .find(|&r| c.slot(r) == usize::from(slot))
                    .unwrap_or(0);
                landed = Some(Call::Expire { record });
            }
            Action::Replicate { node, slot } => {
                let (node, slot) = (usize::from(node), usize::from(slot));
                if let Some(master) = state.follows[node] {
                    state.nodes[node].records[slot] = state.nodes[usize::from(master)].records[slot];
                }
            }
            Action::Announce { to } => {
                state.budget.failovers -= 1;
                let from = state.master();
                // Overtaken: the sentinels were done with it, some server had not followed it.
                if let Some(overtaken) = state.window {
                    state.previous = Some((overtaken.from, overtaken.to));
                }
                state.window = Some(Window {
                    from,
                    to,
                    promoted: false,
                    demoted: false,
                    excused: 0,
                });
                // A store that does not listen yet misses the announcement.
                for server in state.servers.iter_mut().filter(|server| server.listening) {
                    server.unheard = true;
                }
            }
            Action::Hear { server: s } => {
                let server = &mut state.servers[usize::from(s)];
                server.unheard = false;
                if c.fenced_on_announcement() {
                    server.raise_fence();
                }
            }
            Action::Promote => {
                if let Some(window) = &mut state.window {
                    window.promoted = true;
                    state.follows[usize::from(window.to)] = None;
                }
                // What the promoted replica lacks is lost: without the durability option that
                // is the documented limit, and each record lost excuses one run; with it, so is
                // an acknowledged record lacked where fewer replicas are required than run.
                if let Some(Window { from, to, .. }) = state.window {
                    for r in 0..c.records.len() as u8 {
                        let slot = c.slot(r);
                        let (old, new) = (
                            state.nodes[usize::from(from)].records[slot],
                            state.nodes[usize::from(to)].records[slot],
                        );
                        if !c.replica_acks && old.is_some() && old != new {
                            let why = Excuse::LostByAsyncFailover {
                                after_promotion: false,
                            };
                            Self::excuse_lost_in_failover(&mut state, r, why);
                        }
                        if c.replica_acks && self.acknowledged_without(&state, r, from, to) {
                            let why = Excuse::FewerAcksThanReplicas {
                                after_promotion: false,
                            };
                            Self::excuse_lost_in_failover(&mut state, r, why);
                        }
                    }
                }
            }
            Action::Switch { server: s } => {
                if let Some(window) = state.window {
                    let switch = (window.from, window.to);
                    let duplicates_ignored = c.mutation == Some(Mutation::DuplicateSwitchIgnored);
                    let server = &mut state.servers[usize::from(s)];
                    if duplicates_ignored && server.followed == Some(switch) {
                        // Taken for the switch followed before: not followed, and the fence,
                        // raised for this failover (if heard), stands over a store on the new
                        // master.
                        server.stale_fence = server.fenced;
                    } else {
                        // Not heard before: the fence is raised first, then lowered.
                        if !server.fenced && c.fenced_on_announcement() {
                            server.phase.fence_raised();
                        }
                        server.unheard = false;
                        if server.node != window.to {
                            server.node = window.to;
                            server.phase.move_connection();
                        }
                        server.fenced = false;
                        server.stale_fence = false;
                        if duplicates_ignored {
                            server.followed = Some(switch);
                        }
                    }
                }
            }
            Action::Late { server: s } => {
                state.budget.late_announcements -= 1;
                if let (Some((_, named)), Some(Mutation::ActsOnLateAnnouncement)) =
                    (state.previous, c.mutation)
                {
                    // The watch without its rules: the fence raised again, and the store sent
                    // to the master the announcement names (a replica by now if overtaken).
                    let server = &mut state.servers[usize::from(s)];
                    if !server.fenced {
                        server.raise_fence();
                        server.stale_fence = true;
                    }
                    if server.node != named {
                        server.node = named;
                        server.phase.move_connection();
                    }
                }
            }
            Action::Look { server: s } => {
                let master = state.master();
                let server = &mut state.servers[usize::from(s)];
                if server.node != master {
                    server.node = master;
                    server.phase.move_connection();
                }
                server.fenced = false;
                server.stale_fence = false;
            }
            Action::Follow { node } => {
                if let Some(window) = state.window {
                    state.follows[usize::from(node)] = Some(window.to);
                    state.nodes[usize::from(node)] = state.nodes[usize::from(window.to)].clone();
                }
            }
            Action::Demote => {
                if let Some(window) = &mut state.window {
                    window.demoted = true;
                    let (from, to) = (usize::from(window.from), usize::from(window.to));
                    state.follows[from] = Some(window.to);
                    state.nodes[from] = state.nodes[to].clone();
                    // A store on the old master that has not heard yet can do nothing there
                    // now that it is a replica (writes refused `READONLY`, `WAIT` refused) but
                    // hear or switch, and a fence raised changes none of its steps: it is
                    // taken to hear now, which spares the model the states of both orders.
                    for server in &mut state.servers {
                        if server.unheard && usize::from(server.node) == from {
                            server.unheard = false;
                            if c.fenced_on_announcement() {
                                server.raise_fence();
                            }
                        }
                    }
                }
            }
        }
        self.excuse_what_the_old_master_will_lose(last, &mut state, action);
        // The failover ends once every server is on the new master, the old one is demoted, and
        // every replica follows the new one.
        if let Some(window) = state.window {
            if window.demoted
                && (state.servers.iter())
                    .all(|server| server.node == window.to && (!server.fenced || server.stale_fence))
                && !state.follows.contains(&Some(window.from))
            {
                state.previous = Some((window.from, window.to));
                state.window = None;
                // An announcement of it that reaches a store now is a late one (`Late`).
                for server in &mut state.servers {
                    server.unheard = false;
                }
            }
        }
        self.check_completed_records(last, &mut state, action);
        self.forget_raises_that_cannot_matter(&mut state);
        Self::name_alike_replicas_in_order(&mut state, action);
        (state, landed)
    }

    /// Two replicas differ only by their records until the first failover picks one: every
    /// server and call is on the master, and each step treats the two alike. So a state and its
    /// mirror (the replicas' records swapped) have mirrored futures, and the model keeps one:
    /// until the first announcement the replicas are named in the order of their records, and
    /// the one it promotes is named node 1 (`Announce { to: 2 }` swaps them). Properties never
    /// name a node, so the check is the same, with about half the states.
    fn name_alike_replicas_in_order(state: &mut State, action: Action) {
        if state.nodes.len() != 3 || state.previous.is_some() {
            return;
        }
        let swap = match state.window {
            None => state.nodes[2] < state.nodes[1],
            Some(Window { to: 2, .. }) => matches!(action, Action::Announce { .. }),
            Some(_) => false,
        };
        if swap {
            state.nodes.swap(1, 2);
            if let Some(window) = &mut state.window {
                window.to = 1;
            }
        }
    }

    /// A raise since a write matters only to a `WAIT` that may still answer for it: none
    /// without the durability option, and none on a connection replaced since (but
    /// [`Mutation::WaitOnAnotherConnection`]'s). Forgotten there, so that equal futures are one
    /// state.
    fn forget_raises_that_cannot_matter(&self, state: &mut State) {
        let waits_elsewhere = self.config.mutation == Some(Mutation::WaitOnAnotherConnection);
        for server in &mut state.servers {
            if let Some((moved, raised)) = server.phase.waiting_write() {
                if !self.config.replica_acks || (*moved && !waits_elsewhere) {
                    *raised = false;
                }
            }
        }
    }

    /// A completed record on a master is never changed in place by a store call, and an
    /// acknowledged completion stays on the master (a failover that loses it is caught here too).
    fn check_completed_records(&self, last: &State, state: &mut State, action: Action) {
        let c = &self.config;
        for n in 0..state.nodes.len() {
            if !last.takes_writes(n as u8) || !state.takes_writes(n as u8) {
                continue;
            }
            for (slot, (before, after)) in last.nodes[n]
                .records
                .iter()
                .zip(&state.nodes[n].records)
                .enumerate()
            {
                if let Some(
                    done @ Rec {
                        state: RecState::Completed(_),
                        ..
                    },
                ) = before
                {
                    if *after != Some(*done) {
                        for r in 0..c.records.len() {
                            if c.slot(r as u8) == slot {
                                state.ghosts[r].completed_changed = true;
                            }
                        }
                    }
                }
            }
        }
        let _ = action;
        // The master clients write to: the old one until the promotion.
        let master = usize::from(match state.window {
            Some(Window {
                promoted: false,
                from,
                ..
            }) => from,
            _ => state.master(),
        });
        for r in 0..c.records.len() {
            if let Some(payload) = state.ghosts[r].acknowledged {
                let here = state.nodes[master].records[c.slot(r as u8)].map(|rec| rec.state);
                if here != Some(RecState::Completed(payload)) {
                    state.ghosts[r].completed_changed = true;
                }
            }
        }
    }

    /// Whether every client has its final answer.
    pub fn all_done(state: &State) -> bool {
        state
            .clients
            .iter()
            .all(|client| matches!(client, Client::Done(_)))
    }
}

/// Whether `node` has `token`'s record at `slot` (in flight, or completed with `payload`).
fn holds(node: &Node, slot: usize, token: Token, payload: Option<Payload>) -> bool {
    match (node.records[slot], payload) {
        (
            Some(Rec {
                owner,
                state: RecState::InFlight,
                ..
            }),
            None,
        ) => owner == token,
        (
            Some(Rec {
                owner,
                state: RecState::Completed(done),
                ..
            }),
            Some(payload),
        ) => owner == token && done == payload,
        _ => false,
    }
}

pub const AT_MOST_ONCE: &str = "(a) a key runs at most once, but once more for each limit met";
pub const NEVER_CHANGED: &str = "(b) a completed record is never replaced or changed";
pub const ANSWERS_AGREE: &str = "(b) every client of a key gets the same result, but a limit met";
pub const OWN_RECORD: &str = "(c) no client is answered with another key's or scope's record";
pub const RUN_AGAIN_AFTER_A_DEATH: &str = "a process that dies: its key runs again";
pub const EVENTUALLY_DONE: &str = "(d) every client is answered (stateright's weak eventually)";
pub const FEWER_ACKS_ONLY_IF_FEWER_REQUIRED: &str =
    "(a) an acknowledged result is lost by a failover only where fewer replicas are required than run";

/// [`FEWER_ACKS_ONLY_IF_FEWER_REQUIRED`]: the limit of `ReplicaAcks::new(n)` with n below the
/// replica count is met in no other configuration (each state after an excuse shows it as the
/// last one met).
pub fn fewer_acks_only_if_fewer_required(config: &Config, state: &State) -> bool {
    let fewer_required = config.replica_acks && config.acks_required() < usize::from(config.replicas);
    fewer_required
        || !(state.ghosts.iter())
            .any(|ghost| matches!(ghost.last_excuse, Some(Excuse::FewerAcksThanReplicas { .. })))
}

/// (a): each run after a key's first is excused by a limit met (see [`Excuse`]).
pub fn at_most_once(state: &State) -> bool {
    state
        .ghosts
        .iter()
        .all(|ghost| ghost.runs <= ghost.excuses.saturating_add(1))
}

/// (b): the results clients of a key were answered (directly or replayed) are one, but one
/// more for each limit met.
pub fn answers_agree(state: &State) -> bool {
    state
        .ghosts
        .iter()
        .all(|ghost| ghost.answered_runs.count_ones() <= u32::from(ghost.excuses) + 1)
}

impl Model for System {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.possible(state, actions);
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        Some(self.step(last, action).0)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(AT_MOST_ONCE, |_, state: &State| at_most_once(state)),
            Property::always(NEVER_CHANGED, |_, state: &State| {
                state.ghosts.iter().all(|ghost| !ghost.completed_changed)
            }),
            Property::always(ANSWERS_AGREE, |_, state: &State| answers_agree(state)),
            Property::always(OWN_RECORD, |_, state: &State| !state.foreign_answer),
            Property::always(
                FEWER_ACKS_ONLY_IF_FEWER_REQUIRED,
                |model: &System, state: &State| fewer_acks_only_if_fewer_required(&model.config, state),
            ),
            Property::eventually(EVENTUALLY_DONE, |_, state: &State| System::all_done(state)),
            // README's limit, found as an example: a crash between the handler's end and the
            // completion, then the lease runs out and a retry runs the key again.
            Property::sometimes(RUN_AGAIN_AFTER_A_DEATH, |_, state: &State| {
                state
                    .ghosts
                    .iter()
                    .any(|ghost| ghost.runs >= 2 && ghost.last_excuse == Some(Excuse::Died))
            }),
            Property::sometimes("a key runs and is replayed", |_, state: &State| {
                state.ghosts.iter().any(|ghost| ghost.replayed)
            }),
            Property::sometimes("every client is answered", |_, state: &State| {
                System::all_done(state)
            }),
        ]
    }
}
