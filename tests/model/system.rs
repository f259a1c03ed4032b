//! The whole protocol: clients that retry a key, server instances that claim, renew, run,
//! complete, release and crash at any step, and a store (a primary, and a replica fed by an
//! asynchronous replication step) that can fail over and lose what was not replicated.
//!
//! Servers follow `Coordinator::begin` and `Claim` (src/coordinator/mod.rs, claim.rs) as the HTTP
//! layer drives them (src/http/service.rs): one claim, then run, then complete (or release if the
//! handler fails), renewing the lease meanwhile; a lost claim is not completed (`Claim::is_lost`),
//! and the client gets the handler's answer whatever the completion said. With the durability
//! option (`RedisStore::with_replica_acks`, src/store/redis/acknowledged.rs) a claim is run only
//! once the replica has it, and a completion the replica has not acknowledged in time is answered
//! anyway while a background task keeps completing it on whichever node is primary.

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
    /// How many times a lease may lapse under a live owner (a partition, a blocked thread:
    /// README's limit). Leases of dead owners always may.
    pub live_lapses: u8,
    /// How many failovers may happen (each promotes the replica, losing what it lacks).
    pub failovers: u8,
    /// The durability option: claims and completions wait for the replica.
    pub replica_acks: bool,
    /// How many times a client may hang up on a request in progress (and retry).
    pub hang_ups: u8,
    pub mutation: Option<Mutation>,
}

impl Config {
    fn has_replica(&self) -> bool {
        self.failovers > 0 || self.replica_acks
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    /// [`Mutation::ClaimNotAtomic`]: read no record, about to write one.
    Reading {
        client: u8,
        token: Token,
    },
    /// Durability option: the claim landed on the primary; waiting for the replica (`WAIT`).
    AwaitClaimAck {
        client: u8,
        token: Token,
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
    /// Durability option: the completion landed on the primary, not yet acknowledged by the
    /// replica; `client` is `None` once it was answered anyway (the background task goes on).
    AwaitCompleteAck {
        client: Option<u8>,
        token: Token,
        payload: Payload,
    },
}

impl Phase {
    fn token(&self) -> Option<Token> {
        match *self {
            Phase::Idle => None,
            Phase::Reading { token, .. }
            | Phase::AwaitClaimAck { token, .. }
            | Phase::Claimed { token, .. }
            | Phase::Ran { token, .. }
            | Phase::AwaitCompleteAck { token, .. } => Some(token),
        }
    }

    fn client(&self) -> Option<u8> {
        match *self {
            Phase::Idle => None,
            Phase::AwaitCompleteAck { client, .. } => client,
            Phase::Reading { client, .. }
            | Phase::AwaitClaimAck { client, .. }
            | Phase::Claimed { client, .. }
            | Phase::Ran { client, .. } => Some(client),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Server {
    pub phase: Phase,
    /// The record the current request is for.
    pub record: u8,
}

/// What the properties read, per record, beside the protocol's own state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// Handler runs that reached their end (their effect happened).
    pub runs: u8,
    /// Runs whose server crashed before their result was acknowledged stored: "a process that
    /// dies" (README's limit); its key is run again once the lease ends.
    pub orphaned: u8,
    /// The completion the store acknowledged (the durability option: once the replica had it).
    pub acknowledged: Option<Payload>,
    /// The first replay answered to a client.
    pub replayed: Option<Payload>,
    /// Two replays, or a replay and the acknowledged completion, differed.
    pub replays_differ: bool,
    /// A completed record on the primary was changed in place (owner or payload), or an
    /// acknowledged completion is no longer there.
    pub completed_changed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    pub crashes: u8,
    pub failures: u8,
    pub live_lapses: u8,
    pub failovers: u8,
    pub hang_ups: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub primary: Node,
    pub replica: Option<Node>,
    pub servers: Vec<Server>,
    pub clients: Vec<Client>,
    pub ghosts: Vec<Ghost>,
    /// A client was answered with a payload computed for another record (key or scope).
    pub foreign_answer: bool,
    pub budget: Budget,
}

/// A step of the model. Each names the code that takes it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Server takes client's request and claims its key: `Coordinator::begin`
    /// (src/coordinator/mod.rs) calling `Store::claim` ([`Node::claim`]).
    Serve { server: u8, client: u8 },
    /// [`Mutation::ClaimNotAtomic`]'s write.
    ClaimWrite { server: u8 },
    /// Durability option: the replica has the claim: `RedisStore::claim_acknowledged`'s
    /// `waiter.wait` answered enough (`WAIT`, src/store/redis/acknowledged.rs, replica_acks.rs).
    ClaimAcked { server: u8 },
    /// Durability option: `WAIT` timed out: `claim_acknowledged` runs release.lua on its own
    /// connection and answers `StoreError::Unavailable` (503); the client retries.
    ClaimNotAcked { server: u8 },
    /// The lease renewal: `renew_until_lost` (src/coordinator/claim.rs) calling `Store::renew`
    /// ([`Node::renew`]); a `false` sets `ClaimFlags::lost`.
    Renew { server: u8 },
    /// The handler runs to its end: its effect happens.
    Run { server: u8 },
    /// The handler fails before any effect: `Claim::release` (or `Claim`'s `Drop` after a
    /// panic) calling `Store::release` ([`Node::release`]); the client retries.
    Fail { server: u8 },
    /// `Claim::complete` (src/coordinator/claim.rs): nothing written if a renewal found the
    /// claim lost, else `Store::complete` ([`Node::complete`]); the layer answers the handler's
    /// response whatever it says (src/http/service.rs).
    Complete { server: u8 },
    /// Durability option: the replica has the completion (`complete_then_wait`'s `WAIT`,
    /// src/store/redis/acknowledged.rs).
    CompleteAcked { server: u8 },
    /// Durability option: the wait timed out: `complete_acknowledged` answers `Ok(true)` (the
    /// client gets its response) and its task keeps completing.
    CompleteTimedOut { server: u8 },
    /// Durability option: the background task completes again on whichever node is primary
    /// (`keep_completing`, src/store/redis/replica_acks.rs); `false` is `GaveUp::Lost`.
    CompleteAgain { server: u8 },
    /// The server process dies (`kill -9`) at any step: what it held is left to its lease.
    Crash { server: u8 },
    /// The client gives up on its request and may send it again; the server goes on (a dropped
    /// response future does not cancel the handler).
    HangUp { client: u8 },
    /// A lease runs out (abstract time): [`Node::expire`].
    Expire { slot: u8 },
    /// Asynchronous replication of one record to the replica (Redis's replication stream).
    Replicate { slot: u8 },
    /// The replica is promoted (Sentinel, Cluster); what it lacked is lost.
    Failover,
}

impl fmt::Debug for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Serve { server, client } => write!(f, "S{server} claims for C{client}"),
            Action::ClaimWrite { server } => write!(f, "S{server} writes its claim"),
            Action::ClaimAcked { server } => write!(f, "S{server} claim acked"),
            Action::ClaimNotAcked { server } => write!(f, "S{server} claim not acked: release, 503"),
            Action::Renew { server } => write!(f, "S{server} renews"),
            Action::Run { server } => write!(f, "S{server} runs the handler"),
            Action::Fail { server } => write!(f, "S{server} handler fails: release"),
            Action::Complete { server } => write!(f, "S{server} completes"),
            Action::CompleteAcked { server } => write!(f, "S{server} completion acked"),
            Action::CompleteTimedOut { server } => {
                write!(f, "S{server} completion not acked in time: answers")
            }
            Action::CompleteAgain { server } => write!(f, "S{server} completes again"),
            Action::Crash { server } => write!(f, "S{server} crashes"),
            Action::HangUp { client } => write!(f, "C{client} hangs up"),
            Action::Expire { slot } => write!(f, "lease of record {slot} runs out"),
            Action::Replicate { slot } => write!(f, "replicate record {slot}"),
            Action::Failover => write!(f, "FAILOVER"),
        }
    }
}

/// A store call a step makes on the primary, and what the model says it answers: what
/// `tests/model_conformance.rs` replays against the real stores.
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
        State {
            primary: Node::new(self.slots()),
            replica: c.has_replica().then(|| Node::new(self.slots())),
            servers: vec![
                Server {
                    phase: Phase::Idle,
                    record: 0,
                };
                usize::from(c.servers)
            ],
            clients: vec![Client::Ready; c.clients.len()],
            ghosts: vec![Ghost::default(); c.records.len()],
            foreign_answer: false,
            budget: Budget {
                crashes: c.crashes,
                failures: c.failures,
                live_lapses: c.live_lapses,
                failovers: c.failovers,
                hang_ups: c.hang_ups,
            },
        }
    }

    /// A token of server `s` that no record and no server holds: as good as a new one
    /// (`OwnerToken::generate`), since tokens are only ever compared, and the smallest such
    /// keeps the state space finite.
    fn fresh_token(state: &State, s: u8) -> Token {
        let nodes = std::iter::once(&state.primary).chain(&state.replica);
        let stored = nodes.flat_map(|node| node.records.iter().flatten().map(|rec| rec.owner));
        let held = state.servers.iter().filter_map(|server| server.phase.token());
        let used: Vec<Token> = stored.chain(held).filter(|token| token.server == s).collect();
        let n = (0..)
            .find(|n| !used.iter().any(|token| token.n == *n))
            .unwrap_or(0);
        Token { server: s, n }
    }

    /// Whether some live server holds `token` (a lease of a dead owner may always run out).
    fn owner_live(state: &State, token: Token) -> bool {
        state
            .servers
            .iter()
            .any(|server| server.phase.token() == Some(token))
    }

    /// Every action possible in `state`.
    pub fn possible(&self, state: &State, actions: &mut Vec<Action>) {
        let c = &self.config;
        for (s, server) in state.servers.iter().enumerate() {
            let server_id = s as u8;
            match server.phase {
                Phase::Idle => {
                    for (client, status) in state.clients.iter().enumerate() {
                        if *status == Client::Ready {
                            actions.push(Action::Serve {
                                server: server_id,
                                client: client as u8,
                            });
                        }
                    }
                }
                Phase::Reading { .. } => actions.push(Action::ClaimWrite { server: server_id }),
                Phase::AwaitClaimAck { token, .. } => {
                    let slot = c.slot(server.record);
                    if replica_holds(state, slot, token, None) {
                        actions.push(Action::ClaimAcked { server: server_id });
                    }
                    actions.push(Action::ClaimNotAcked { server: server_id });
                }
                Phase::Claimed { lost, .. } => {
                    if !lost {
                        actions.push(Action::Renew { server: server_id });
                    }
                    actions.push(Action::Run { server: server_id });
                    if state.budget.failures > 0 {
                        actions.push(Action::Fail { server: server_id });
                    }
                }
                Phase::Ran { lost, .. } => {
                    if !lost {
                        actions.push(Action::Renew { server: server_id });
                    }
                    actions.push(Action::Complete { server: server_id });
                }
                Phase::AwaitCompleteAck {
                    client,
                    token,
                    payload,
                } => {
                    let slot = c.slot(server.record);
                    if replica_holds(state, slot, token, Some(payload)) {
                        actions.push(Action::CompleteAcked { server: server_id });
                    }
                    if client.is_some() {
                        actions.push(Action::CompleteTimedOut { server: server_id });
                    }
                    let landed = matches!(
                        state.primary.records[slot],
                        Some(Rec { owner, state: RecState::Completed(_), .. }) if owner == token
                    );
                    if !landed {
                        actions.push(Action::CompleteAgain { server: server_id });
                    }
                }
            }
            if server.phase != Phase::Idle && state.budget.crashes > 0 {
                actions.push(Action::Crash { server: server_id });
            }
        }
        if state.budget.hang_ups > 0 {
            for (client, status) in state.clients.iter().enumerate() {
                if matches!(status, Client::Waiting(_)) {
                    actions.push(Action::HangUp { client: client as u8 });
                }
            }
        }
        for (slot, rec) in state.primary.records.iter().enumerate() {
            if let Some(Rec {
                owner,
                state: RecState::InFlight,
                ..
            }) = rec
            {
                if !Self::owner_live(state, *owner) || state.budget.live_lapses > 0 {
                    actions.push(Action::Expire { slot: slot as u8 });
                }
            }
        }
        if let Some(replica) = &state.replica {
            for slot in 0..self.slots() {
                if replica.records[slot] != state.primary.records[slot] {
                    actions.push(Action::Replicate { slot: slot as u8 });
                }
            }
            if state.budget.failovers > 0 {
                actions.push(Action::Failover);
            }
        }
    }

    /// Tells `client` (if it still waits for `server`) `answer`, or to retry (`None`).
    fn answer(&self, state: &mut State, server: u8, client: u8, answer: Option<Answer>, replay: bool) {
        let c = &self.config;
        let record = c.record_of(client);
        if let Some(Answer::Result(payload)) = answer {
            if payload.record != record {
                state.foreign_answer = true;
            }
            if replay {
                let ghost = &mut state.ghosts[usize::from(record)];
                if ghost.replayed.is_some_and(|first| first != payload)
                    || ghost.acknowledged.is_some_and(|stored| stored != payload)
                {
                    ghost.replays_differ = true;
                }
                ghost.replayed.get_or_insert(payload);
            }
        }
        let status = &mut state.clients[usize::from(client)];
        if *status == Client::Waiting(server) {
            *status = match answer {
                Some(answer) => Client::Done(answer),
                None => Client::Ready,
            };
        }
    }

    /// Notes that the store acknowledged `payload` as `record`'s result.
    fn acknowledge(state: &mut State, record: u8, payload: Payload) {
        let ghost = &mut state.ghosts[usize::from(record)];
        if ghost.acknowledged.is_some_and(|stored| stored != payload)
            || ghost.replayed.is_some_and(|first| first != payload)
        {
            ghost.replays_differ = true;
        }
        ghost.acknowledged.get_or_insert(payload);
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
            Phase::AwaitClaimAck { client, token }
        } else {
            Phase::Claimed {
                client,
                token,
                lost: false,
            }
        };
    }

    /// Server `s` releases its claim (`token`) on the primary and tells `client` to retry; the
    /// release call it made.
    fn release(&self, state: &mut State, s: u8, client: u8, token: Token) -> Call {
        let record = state.servers[usize::from(s)].record;
        let answer = (state.primary).release(self.config.slot(record), token, self.config.mutation);
        self.answer(state, s, client, None, false);
        state.servers[usize::from(s)].phase = Phase::Idle;
        Call::Release {
            record,
            owner: token,
            answer,
        }
    }

    /// The state after `action`, and the store call it made on the primary, if any.
    pub fn step(&self, last: &State, action: Action) -> (State, Option<Call>) {
        let c = &self.config;
        let mutation = c.mutation;
        let mut state = last.clone();
        let mut call = None;
        match action {
            Action::Serve { server: s, client } => {
                let record = c.record_of(client);
                let (slot, fingerprint) = (c.slot(record), c.fingerprint_of(client));
                state.servers[usize::from(s)].record = record;
                let token = Self::fresh_token(&state, s);
                state.clients[usize::from(client)] = Client::Waiting(s);
                if mutation == Some(Mutation::ClaimNotAtomic) {
                    match state.primary.claim_read(slot, fingerprint, token) {
                        Some(outcome) => self.settle_claim(&mut state, s, client, outcome),
                        None => state.servers[usize::from(s)].phase = Phase::Reading { client, token },
                    }
                } else {
                    let outcome = state.primary.claim(slot, fingerprint, token, mutation);
                    call = Some(Call::Claim {
                        record,
                        fingerprint,
                        owner: token,
                        answer: outcome,
                    });
                    match outcome {
                        Outcome::Claimed => self.claimed(&mut state, s, client, token),
                        other => self.settle_claim(&mut state, s, client, other),
                    }
                }
            }
            Action::ClaimWrite { server: s } => {
                if let Phase::Reading { client, token } = state.servers[usize::from(s)].phase {
                    let record = state.servers[usize::from(s)].record;
                    state
                        .primary
                        .claim_write(c.slot(record), c.fingerprint_of(client), token);
                    self.claimed(&mut state, s, client, token);
                }
            }
            Action::ClaimAcked { server: s } => {
                if let Phase::AwaitClaimAck { client, token } = state.servers[usize::from(s)].phase {
                    state.servers[usize::from(s)].phase = Phase::Claimed {
                        client,
                        token,
                        lost: false,
                    };
                }
            }
            Action::ClaimNotAcked { server: s } => {
                if let Phase::AwaitClaimAck { client, token } = state.servers[usize::from(s)].phase {
                    call = Some(self.release(&mut state, s, client, token));
                }
            }
            Action::Renew { server: s } => {
                let record = state.servers[usize::from(s)].record;
                let slot = c.slot(record);
                let phase = &mut state.servers[usize::from(s)].phase;
                if let Phase::Claimed { token, lost, .. } | Phase::Ran { token, lost, .. } = phase {
                    let answer = state.primary.renew(slot, *token);
                    call = Some(Call::Renew {
                        record,
                        owner: *token,
                        answer,
                    });
                    *lost |= !answer;
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
                    ghost.runs = ghost.runs.saturating_add(1).min(3);
                    server.phase = Phase::Ran {
                        client,
                        token,
                        payload,
                        lost,
                    };
                }
            }
            Action::Fail { server: s } => {
                if let Phase::Claimed { client, token, .. } = state.servers[usize::from(s)].phase {
                    state.budget.failures -= 1;
                    call = Some(self.release(&mut state, s, client, token));
                }
            }
            Action::Complete { server: s } => {
                let record = state.servers[usize::from(s)].record;
                let slot = c.slot(record);
                if let Phase::Ran {
                    client,
                    token,
                    payload,
                    lost,
                } = state.servers[usize::from(s)].phase
                {
                    // A claim a renewal found lost is not completed (`Claim::complete`).
                    let stored = !lost && {
                        let answer = state.primary.complete(slot, token, payload, mutation);
                        call = Some(Call::Complete {
                            record: state.servers[usize::from(s)].record,
                            owner: token,
                            payload,
                            answer,
                        });
                        answer
                    };
                    if stored && c.replica_acks {
                        state.servers[usize::from(s)].phase = Phase::AwaitCompleteAck {
                            client: Some(client),
                            token,
                            payload,
                        };
                    } else {
                        if stored {
                            Self::acknowledge(&mut state, record, payload);
                        }
                        // The layer answers with the handler's response whatever the completion said.
                        self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                        state.servers[usize::from(s)].phase = Phase::Idle;
                    }
                }
            }
            Action::CompleteAcked { server: s } => {
                let record = state.servers[usize::from(s)].record;
                if let Phase::AwaitCompleteAck { client, payload, .. } = state.servers[usize::from(s)].phase {
                    Self::acknowledge(&mut state, record, payload);
                    if let Some(client) = client {
                        self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                    }
                    state.servers[usize::from(s)].phase = Phase::Idle;
                }
            }
            Action::CompleteTimedOut { server: s } => {
                let phase = state.servers[usize::from(s)].phase;
                if let Phase::AwaitCompleteAck {
                    client: Some(client),
                    token,
                    payload,
                } = phase
                {
                    self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                    state.servers[usize::from(s)].phase =
                        if mutation == Some(Mutation::NoBackgroundCompletion) {
                            Phase::Idle
                        } else {
                            Phase::AwaitCompleteAck {
                                client: None,
                                token,
                                payload,
                            }
                        };
                }
            }
            Action::CompleteAgain { server: s } => {
                let slot = c.slot(state.servers[usize::from(s)].record);
                if let Phase::AwaitCompleteAck {
                    client,
                    token,
                    payload,
                } = state.servers[usize::from(s)].phase
                {
                    let answer = state.primary.complete(slot, token, payload, mutation);
                    call = Some(Call::Complete {
                        record: state.servers[usize::from(s)].record,
                        owner: token,
                        payload,
                        answer,
                    });
                    if !answer {
                        // `GaveUp::Lost`: the claim is gone; reported to reconciliation.
                        if let Some(client) = client {
                            self.answer(&mut state, s, client, Some(Answer::Result(payload)), false);
                        }
                        state.servers[usize::from(s)].phase = Phase::Idle;
                    }
                }
            }
            Action::Crash { server: s } => {
                state.budget.crashes -= 1;
                let server = state.servers[usize::from(s)];
                if matches!(server.phase, Phase::Ran { .. } | Phase::AwaitCompleteAck { .. }) {
                    let ghost = &mut state.ghosts[usize::from(server.record)];
                    ghost.orphaned = ghost.orphaned.saturating_add(1);
                }
                if let Some(client) = server.phase.client() {
                    self.answer(&mut state, s, client, None, false);
                }
                state.servers[usize::from(s)].phase = Phase::Idle;
            }
            Action::HangUp { client } => {
                state.budget.hang_ups -= 1;
                state.clients[usize::from(client)] = Client::Ready;
            }
            Action::Expire { slot } => {
                let slot = usize::from(slot);
                if let Some(Rec { owner, .. }) = state.primary.records[slot] {
                    if Self::owner_live(&state, owner) {
                        state.budget.live_lapses -= 1;
                    }
                }
                state.primary.expire(slot);
                let record = (0..c.records.len() as u8)
                    .find(|&r| c.slot(r) == slot)
                    .unwrap_or(0);
                call = Some(Call::Expire { record });
            }
            Action::Replicate { slot } => {
                let slot = usize::from(slot);
                let record = state.primary.records[slot];
                if let Some(replica) = &mut state.replica {
                    replica.records[slot] = record;
                }
            }
            Action::Failover => {
                state.budget.failovers -= 1;
                if let Some(replica) = state.replica.take() {
                    state.primary = replica.clone();
                    state.replica = Some(replica);
                }
            }
        }
        // A completed record is never changed in place by a store call, and an acknowledged
        // completion stays where it is (a failover that loses it is caught here too).
        for (slot, (before, after)) in last
            .primary
            .records
            .iter()
            .zip(&state.primary.records)
            .enumerate()
        {
            if let Some(
                done @ Rec {
                    state: RecState::Completed(_),
                    ..
                },
            ) = before
            {
                if action != Action::Failover && *after != Some(*done) {
                    for r in 0..c.records.len() {
                        if c.slot(r as u8) == slot {
                            state.ghosts[r].completed_changed = true;
                        }
                    }
                }
            }
        }
        for r in 0..c.records.len() {
            if let Some(payload) = state.ghosts[r].acknowledged {
                let here = state.primary.records[c.slot(r as u8)].map(|rec| rec.state);
                if here != Some(RecState::Completed(payload)) {
                    state.ghosts[r].completed_changed = true;
                }
            }
        }
        (state, call)
    }

    /// Whether every client has its final answer.
    pub fn all_done(state: &State) -> bool {
        state
            .clients
            .iter()
            .all(|client| matches!(client, Client::Done(_)))
    }
}

/// Whether the replica has `token`'s record at `slot` (in flight, or completed with `payload`).
fn replica_holds(state: &State, slot: usize, token: Token, payload: Option<Payload>) -> bool {
    let Some(replica) = &state.replica else {
        return false;
    };
    match (replica.records[slot], payload) {
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

pub const AT_MOST_ONCE: &str = "(a) a key runs at most once";
pub const NEVER_CHANGED: &str = "(b) a completed record is never replaced or changed";
pub const REPLAYS_AGREE: &str = "(b) every replay returns the stored record";
pub const OWN_RECORD: &str = "(c) no client is answered with another key's or scope's record";
pub const RUN_AGAIN_AFTER_A_DEATH: &str = "a process that dies: its key runs again";
pub const EVENTUALLY_DONE: &str = "(d) every client is answered (stateright's weak eventually)";

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
            // Runs of a process that died before its result was acknowledged are not counted:
            // README's limit "a process that dies" (checked on its own in model_check.rs).
            Property::always(AT_MOST_ONCE, |_, state: &State| {
                state
                    .ghosts
                    .iter()
                    .all(|ghost| ghost.runs.saturating_sub(ghost.orphaned) <= 1)
            }),
            Property::always(NEVER_CHANGED, |_, state: &State| {
                state.ghosts.iter().all(|ghost| !ghost.completed_changed)
            }),
            // Unless a process died before its completion was acknowledged (durability option:
            // a replay may be served from the primary before the replica has it).
            Property::always(REPLAYS_AGREE, |_, state: &State| {
                state
                    .ghosts
                    .iter()
                    .all(|ghost| !ghost.replays_differ || ghost.orphaned > 0)
            }),
            Property::always(OWN_RECORD, |_, state: &State| !state.foreign_answer),
            Property::eventually(EVENTUALLY_DONE, |_, state: &State| System::all_done(state)),
            // README's limit, found as an example: a crash between the handler's end and the
            // completion, then the lease runs out and a retry runs the key again.
            Property::sometimes(RUN_AGAIN_AFTER_A_DEATH, |_, state: &State| {
                state
                    .ghosts
                    .iter()
                    .any(|ghost| ghost.runs >= 2 && ghost.orphaned > 0)
            }),
            Property::sometimes("a key runs and is replayed", |_, state: &State| {
                state.ghosts.iter().any(|ghost| ghost.replayed.is_some())
            }),
            Property::sometimes("every client is answered", |_, state: &State| {
                System::all_done(state)
            }),
        ]
    }
}
