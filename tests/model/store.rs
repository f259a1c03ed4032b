//! The store as the model sees it: one node's records, and the transitions every store of the
//! crate implements. Time is abstract: a lease lasts until a lease-expiry step removes its record,
//! and retention outlasts the model's runs (a completed record never expires here).
//!
//! Each transition names the code that implements it, on every store: the Lua scripts in
//! `scripts/`, the native claim in `src/store/redis/commands.rs`, the SQL in
//! `src/store/postgres/sql.rs`, and `src/store/memory.rs`. `tests/model_conformance.rs` replays
//! the model's traces against those stores through the `Store` trait and compares the answers.

/// An owner token: the server that made it and a number no record or server holds when it is
/// made (see `System::fresh_token`), so it is unique as `OwnerToken::generate`'s are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token {
    pub server: u8,
    pub n: u8,
}

/// What a handler returned: the record it ran for and which run of that record it was, so a
/// payload answered for another record, or a second run's, shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Payload {
    pub record: u8,
    pub run: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RecState {
    InFlight,
    Completed(Payload),
}

/// A record: its owner, the request's fingerprint (a small number standing for the SHA-256),
/// and its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rec {
    pub owner: Token,
    pub fingerprint: u8,
    pub state: RecState,
}

/// What a claim answers (`ClaimOutcome`, without the lease left, which abstract time lacks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Claimed,
    Completed(Payload),
    InFlight,
    Mismatch,
}

/// Protocol bugs the checker must catch, each a change to one transition below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// `complete` writes whatever record is there, in flight or completed, whoever owns it:
    /// complete.lua without its `GETRANGE` comparison of the head.
    CompleteNotOwnerChecked,
    /// The claim reads, then writes in a second step (`GET`, then `SET` without `NX`): the
    /// check-then-act race of IdempotentAPI #23.
    ClaimNotAtomic,
    /// The record's address ignores the scope (`RecordKey::digest` of the key alone).
    ScopeNotInDigest,
    /// `release` deletes whatever record is there: release.lua without its owner check.
    ReleaseNotOwnerChecked,
    /// Durability option: the handler runs as soon as the claim lands on the primary, without
    /// waiting for the replica (`RedisStore::claim_acknowledged` without its `WAIT`).
    ClaimNotAcknowledged,
    /// A completed record claimed with another fingerprint is answered "in flight" (409, retry)
    /// instead of a mismatch: a client that changed its payload retries forever.
    MismatchAnsweredInFlight,
    /// Durability option: a completion the replica did not acknowledge in time is answered and
    /// then forgotten (`complete_acknowledged` without its background `keep_completing`).
    NoBackgroundCompletion,
    /// A failover announced raises no fence: servers keep claiming and writing on the old
    /// master after the replica is promoted, until each switches (the Sentinel watch without
    /// `+failover-state-send-slaveof-noone`'s fence, as before issue 35).
    NoFence,
    /// Durability option: a `WAIT` sent on a connection that replaced the one that wrote
    /// counts that connection's writes (none), and answers enough at once (a `WAIT` fred sent
    /// again after a reconnect, without the name check behind it).
    WaitOnAnotherConnection,
    /// A store takes claims before it listens to the sentinels (as before issue 36): one
    /// restarted just before a failover misses its announcement and claims on the old master.
    ClaimsBeforeListening,
    /// The Sentinel watch acts on an announcement that is no longer news (as before issue 36's
    /// fix, without `confirmed_at`, the `ROLE` check and `attempted`): a late switch of a
    /// failover over or overtaken raises the server's fence again and sends it to the master
    /// the switch named, holding its owners' renewals over a store on the right master.
    ActsOnLateAnnouncement,
    /// The Sentinel watch keeps the switch it followed when a later failover overtakes it (as
    /// before `63f29b0`), so a failover back to that master and then to the same node again
    /// (A to B, B to A overtaken, A to B) is taken for the switch followed before and not
    /// followed: the fence stands over a store on the new master.
    DuplicateSwitchIgnored,
    /// Durability option: a claim or completion whose `WAIT` answered enough is trusted though
    /// its server's fence was raised since the write went out (`RedisStore::claim_acknowledged`
    /// and `complete_once_acknowledged` without `fence_raised_since`, as before the fence
    /// counted its raises): the write may have landed on the old master after the promotion,
    /// acknowledged there by the replica not promoted, and be lost with the demotion.
    TrustsAnswersAfterRaise,
}

/// One node's records, by slot (a record key's digest; see `System::slot`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node {
    pub records: Vec<Option<Rec>>,
}

impl Node {
    pub fn new(slots: usize) -> Self {
        Self {
            records: vec![None; slots],
        }
    }

    /// The claim, one atomic step: creates the record in flight for `owner` if there is none
    /// (or an expired one); re-sent by its own owner, answers `Claimed` again (and renews the
    /// lease); otherwise answers what is there, a different fingerprint first.
    ///
    /// Redis: `SET <key> <in-flight record> NX PX <lease> GET` (`Command::SetIfAbsent`, in
    /// `RedisStore::set_if_absent`, src/store/redis/commands.rs), the record it hands back read
    /// by `RedisStore::found`; PostgreSQL: the `claim` statement of src/store/postgres/sql.rs
    /// (`INSERT … ON CONFLICT (key) DO UPDATE … WHERE r.expires_at <= statement_timestamp() OR
    /// (r.owner = excluded.owner AND r.state = 'F')`, with the `live` CTE for the answer);
    /// memory: `Store::claim` for `MemoryStore` under its one lock.
    pub fn claim(
        &mut self,
        slot: usize,
        fingerprint: u8,
        owner: Token,
        mutation: Option<Mutation>,
    ) -> Outcome {
        match self.records[slot] {
            None => {
                self.records[slot] = Some(Rec {
                    owner,
                    fingerprint,
                    state: RecState::InFlight,
                });
                Outcome::Claimed
            }
            Some(rec) => Self::found(rec, fingerprint, Some(owner), mutation),
        }
    }

    /// What a claim finds in an existing record (`RedisStore::found`; the `live` CTE's row in
    /// PostgreSQL; the `Some(entry)` arm in `MemoryStore::claim`).
    pub fn found(rec: Rec, fingerprint: u8, owner: Option<Token>, mutation: Option<Mutation>) -> Outcome {
        match rec.state {
            RecState::InFlight if Some(rec.owner) == owner => Outcome::Claimed,
            RecState::Completed(_)
                if rec.fingerprint != fingerprint && mutation == Some(Mutation::MismatchAnsweredInFlight) =>
            {
                Outcome::InFlight
            }
            _ if rec.fingerprint != fingerprint => Outcome::Mismatch,
            RecState::InFlight => Outcome::InFlight,
            RecState::Completed(payload) => Outcome::Completed(payload),
        }
    }

    /// The first half of [`Mutation::ClaimNotAtomic`]'s claim: a read. `None` when there is no
    /// record, so the second half writes.
    pub fn claim_read(&self, slot: usize, fingerprint: u8, owner: Token) -> Option<Outcome> {
        self.records[slot].map(|rec| Self::found(rec, fingerprint, Some(owner), None))
    }

    /// The second half of [`Mutation::ClaimNotAtomic`]'s claim: a `SET` without `NX`.
    pub fn claim_write(&mut self, slot: usize, fingerprint: u8, owner: Token) {
        self.records[slot] = Some(Rec {
            owner,
            fingerprint,
            state: RecState::InFlight,
        });
    }

    /// Completes `owner`'s claim with `payload`: `true` if the record is now completed by
    /// `owner` (also when it already was: a completion sent twice succeeds twice, and leaves the
    /// stored payload as it was), `false` if `owner` does not hold it (lease ran out, or taken
    /// over): the newer owner's record is never overwritten.
    ///
    /// Redis: scripts/complete.lua (`GETRANGE` of the in-flight record, its head and state
    /// checked, one `SET … PX` of the completed record, `SPUBLISH` if a request waits for it),
    /// run by `Store::complete` for `RedisStore`; PostgreSQL: the
    /// `complete` statement (`UPDATE … WHERE key = $1 AND owner = $2 AND state = 'F' AND
    /// expires_at > statement_timestamp()`, and the `seen` sub-select for a completion sent
    /// twice); memory: `Store::complete` for `MemoryStore`.
    pub fn complete(
        &mut self,
        slot: usize,
        owner: Token,
        payload: Payload,
        mutation: Option<Mutation>,
    ) -> bool {
        let Some(rec) = &mut self.records[slot] else {
            return false;
        };
        if mutation == Some(Mutation::CompleteNotOwnerChecked) {
            rec.owner = owner;
            rec.state = RecState::Completed(payload);
            return true;
        }
        match rec.state {
            RecState::InFlight if rec.owner == owner => {
                rec.state = RecState::Completed(payload);
                true
            }
            RecState::Completed(_) => rec.owner == owner,
            RecState::InFlight => false,
        }
    }

    /// Deletes `owner`'s in-flight claim; `false` if `owner` does not hold one (a completed
    /// record is never released, even by its owner).
    ///
    /// Redis: scripts/release.lua (`GETRANGE`, compare with head .. 'F', `DEL`); PostgreSQL:
    /// the `release` statement (`DELETE … WHERE key = $1 AND owner = $2 AND state = 'F' AND
    /// expires_at > statement_timestamp()`); memory: `Store::release` for `MemoryStore`.
    pub fn release(&mut self, slot: usize, owner: Token, mutation: Option<Mutation>) -> bool {
        match self.records[slot] {
            Some(rec) if mutation == Some(Mutation::ReleaseNotOwnerChecked) => {
                let _ = rec;
                self.records[slot] = None;
                true
            }
            Some(Rec {
                owner: holder,
                state: RecState::InFlight,
                ..
            }) if holder == owner => {
                self.records[slot] = None;
                true
            }
            _ => false,
        }
    }

    /// Whether `owner` still holds its in-flight claim, which a renewal extends; `false` (the
    /// claim is lost) otherwise. Abstract time: the extension itself changes nothing here, a
    /// live owner's lease lasting until a lease-expiry step the model allows.
    ///
    /// Redis: scripts/renew.lua (`GETRANGE`, compare, `SETRANGE` of the deadline, `PEXPIRE`);
    /// PostgreSQL: the `renew` statement (`UPDATE … SET expires_at = statement_timestamp() +
    /// $3 WHERE key = $1 AND owner = $2 AND state = 'F' AND expires_at >
    /// statement_timestamp()`); memory: `Store::renew` for `MemoryStore`.
    pub fn renew(&self, slot: usize, owner: Token) -> bool {
        matches!(
            self.records[slot],
            Some(Rec { owner: holder, state: RecState::InFlight, .. }) if holder == owner
        )
    }

    /// A lease runs out: the in-flight record is gone. Redis: the key's `PX`/`PEXPIRE` TTL;
    /// PostgreSQL: every statement's `expires_at > statement_timestamp()` (a row past it is
    /// absent whether or not the sweep has deleted it), and the claim's `ON CONFLICT … WHERE
    /// r.expires_at <= statement_timestamp()` taking it over; memory: `Records::live` dropping
    /// an entry past its `expires_at`.
    pub fn expire(&mut self, slot: usize) {
        if matches!(
            self.records[slot],
            Some(Rec {
                state: RecState::InFlight,
                ..
            })
        ) {
            self.records[slot] = None;
        }
    }
}
