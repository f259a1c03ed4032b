//! What stateright does not do for us: liveness under fairness, and short traces.
//!
//! stateright's `eventually` is checked on acyclic paths only (a path closing a cycle counts as
//! neither success nor failure), and it has no fairness. Retries make cycles (a client told
//! "in flight" asks again), so liveness is checked here instead, as "from every reachable state,
//! a state where every client has its answer is reachable" (AG EF done): in a finite state
//! space, every execution that is strongly fair to the protocol's steps (one that passes a state
//! infinitely often takes each of its steps infinitely often) then reaches that state.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::hash::{BuildHasherDefault, DefaultHasher, Hash, Hasher};

use stateright::Model;

use super::system::{Action, State, System};

/// The size of an exhaustive exploration.
#[derive(Debug, Clone, Copy)]
pub struct Explored {
    pub states: usize,
    pub transitions: usize,
}

/// A state's 128-bit fingerprint: what [`done_reachable_from_everywhere`] keeps of it. A state
/// is about 0.7 kB, so keeping every state took more memory than this machine has for the long
/// configurations' tens of millions (stateright's own checker keeps 64-bit fingerprints too).
/// Two states sharing a fingerprint would merge silently; among 10^8 states that happens with a
/// probability of about 10^-23.
fn fingerprint(state: &State) -> u128 {
    let (mut low, mut high) = (DefaultHasher::new(), DefaultHasher::new());
    high.write_u8(1); // Another function of the state than `low`'s.
    state.hash(&mut low);
    state.hash(&mut high);
    u128::from(high.finish()) << 64 | u128::from(low.finish())
}

/// Hashes a fingerprint by taking its bits: it is a hash already.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only fingerprints are hashed here");
    }
    fn write_u128(&mut self, fingerprint: u128) {
        self.0 = fingerprint as u64;
    }
}

/// Checks AG EF `System::all_done` over every reachable state. `Err` holds a path to a state from
/// which no state with every client answered can be reached.
///
/// Keeps a fingerprint, a parent and the edges of each state, not the state itself: the states
/// are explored breadth first (only the frontier is held whole), then the states that can reach
/// one where all are done are marked backwards over the edges.
pub fn done_reachable_from_everywhere(model: &System) -> Result<Explored, Vec<Action>> {
    let mut ids: HashMap<u128, u32, BuildHasherDefault<Prehashed>> = HashMap::default();
    let mut parents: Vec<Option<(u32, Action)>> = Vec::new();
    let mut done: Vec<bool> = Vec::new();
    let mut edges: Vec<(u32, u32)> = Vec::new();
    let mut queue = VecDeque::new();
    let mut discovered = |state: State, parent: Option<(u32, Action)>, queue: &mut VecDeque<_>| {
        let id = u32::try_from(parents.len()).expect("fewer than 2^32 states");
        parents.push(parent);
        done.push(System::all_done(&state));
        queue.push_back((id, state));
        id
    };
    for init in model.init_states() {
        if let std::collections::hash_map::Entry::Vacant(entry) = ids.entry(fingerprint(&init)) {
            entry.insert(discovered(init, None, &mut queue));
        }
    }
    let mut actions = Vec::new();
    while let Some((id, state)) = queue.pop_front() {
        actions.clear();
        model.actions(&state, &mut actions);
        for &action in &actions {
            let Some(next) = model.next_state(&state, action) else {
                continue;
            };
            let next_id = *ids
                .entry(fingerprint(&next))
                .or_insert_with(|| discovered(next, Some((id, action)), &mut queue));
            edges.push((id, next_id));
        }
    }
    let states = parents.len();
    let transitions = edges.len();
    // Each state's predecessors, in one array indexed by where each state's run begins.
    let mut starts = vec![0u32; states + 1];
    for &(_, to) in &edges {
        starts[to as usize + 1] += 1;
    }
    for i in 0..states {
        starts[i + 1] += starts[i];
    }
    let mut filled = starts.clone();
    let mut predecessors = vec![0u32; transitions];
    for (from, to) in edges {
        predecessors[filled[to as usize] as usize] = from;
        filled[to as usize] += 1;
    }
    drop(filled);
    // Backwards from every state where all are done.
    let mut reaches = done;
    let mut back: VecDeque<u32> = (0..states as u32).filter(|&i| reaches[i as usize]).collect();
    while let Some(id) = back.pop_front() {
        let (from, to) = (starts[id as usize] as usize, starts[id as usize + 1] as usize);
        for &before in &predecessors[from..to] {
            if !reaches[before as usize] {
                reaches[before as usize] = true;
                back.push_back(before);
            }
        }
    }
    if let Some(stuck) = reaches.iter().position(|&r| !r) {
        let mut path = Vec::new();
        let mut at = stuck as u32;
        while let Some((before, action)) = parents[at as usize] {
            path.push(action);
            at = before;
        }
        path.reverse();
        return Err(path);
    }
    Ok(Explored { states, transitions })
}

/// A state in one line: each node's role and records, each server's phase, each client's
/// status.
pub fn short(state: &State) -> String {
    use super::store::{Node, RecState};
    use super::system::{Answer, Client, Phase};
    let node = |node: &Node| {
        node.records
            .iter()
            .map(|rec| match rec {
                None => "-".to_string(),
                Some(rec) => match rec.state {
                    RecState::InFlight => format!("F(S{}#{})", rec.owner.server, rec.owner.n),
                    RecState::Completed(p) => format!("C(r{}run{})", p.record, p.run),
                },
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    // The fence's count moved since the write went out: its answer is not trusted.
    let raised_since = |raised: bool| if raised { " (fence raised since)" } else { "" };
    let mut line = String::new();
    for (n, records) in state.nodes.iter().enumerate() {
        let role = match state.follows[n] {
            None => "master".to_string(),
            Some(m) => format!("replica of {m}"),
        };
        line += &format!("n{n} {role}[{}] ", node(records));
    }
    if let Some(window) = state.window {
        line += &format!("(failing over, n{} to n{}) ", window.from, window.to);
    }
    for (s, server) in state.servers.iter().enumerate() {
        let phase = match server.phase {
            Phase::Idle => "idle".to_string(),
            Phase::Reading { client, .. } => format!("C{client} read"),
            Phase::AwaitClaimAck { client, raised, .. } => {
                format!("C{client} awaits claim ack{}", raised_since(raised))
            }
            Phase::Claimed { client, lost, .. } => {
                format!("C{client} claimed{}", if lost { " LOST" } else { "" })
            }
            Phase::Ran { client, lost, .. } => format!("C{client} ran{}", if lost { " LOST" } else { "" }),
            Phase::AwaitCompleteAck { client, raised, .. } => {
                format!("C{client} awaits completion ack{}", raised_since(raised))
            }
            Phase::Completing { raised, .. } => {
                format!("completing in the background{}", raised_since(raised))
            }
        };
        let fence = match (server.fenced, server.listening) {
            (true, _) if server.stale_fence => " fenced (no failover under way)",
            (true, _) => " fenced",
            (false, false) => " deaf",
            (false, true) => "",
        };
        let unheard = if server.unheard { " (failover unheard)" } else { "" };
        let releasing = if server.releasing.is_empty() {
            String::new()
        } else {
            format!(" +{} release(s)", server.releasing.len())
        };
        line += &format!(" S{s}@n{}:{phase}{fence}{unheard}{releasing}", server.node);
    }
    for (c, client) in state.clients.iter().enumerate() {
        let status = match client {
            Client::Ready => "ready".to_string(),
            Client::Waiting(s) => format!("at S{s}"),
            Client::Done(Answer::Result(p)) => format!("got r{}run{}", p.record, p.run),
            Client::Done(Answer::Mismatch) => "mismatch".to_string(),
        };
        line += &format!(" C{c}:{status}");
    }
    if !state.in_transit.is_empty() {
        line += &format!(" {} call(s) on their way", state.in_transit.len());
    }
    let runs: Vec<String> = state
        .ghosts
        .iter()
        .map(|g| match g.last_excuse {
            Some(why) => format!("{} (excused {}: {why:?})", g.runs, g.excuses),
            None => g.runs.to_string(),
        })
        .collect();
    line + &format!(" runs[{}]", runs.join(", "))
}

/// A trace, one step a line: the action, then the state it led to.
pub fn trace(model: &System, actions: &[Action]) -> String {
    let mut state = model.initial();
    let mut out = format!("   {}\n", short(&state));
    for (i, &action) in actions.iter().enumerate() {
        state = model.step(&state, action).0;
        out += &format!("{:>2}. {action:?}\n      => {}\n", i + 1, short(&state));
    }
    out
}

/// The shortest trace to a state where `shows` holds, if any state reachable holds it.
pub fn shortest(model: &System, shows: impl Fn(&State) -> bool) -> Option<Vec<Action>> {
    let mut parents: HashMap<State, Option<(State, Action)>> = HashMap::new();
    let mut queue = VecDeque::new();
    for init in model.init_states() {
        parents.insert(init.clone(), None);
        queue.push_back(init);
    }
    let mut actions = Vec::new();
    while let Some(state) = queue.pop_front() {
        if shows(&state) {
            let mut path = Vec::new();
            let mut at = state;
            while let Some(Some((before, action))) = parents.get(&at) {
                path.push(*action);
                at = before.clone();
            }
            path.reverse();
            return Some(path);
        }
        actions.clear();
        model.actions(&state, &mut actions);
        for &action in &actions {
            if let Some(next) = model.next_state(&state, action) {
                if !parents.contains_key(&next) {
                    parents.insert(next.clone(), Some((state.clone(), action)));
                    queue.push_back(next);
                }
            }
        }
    }
    None
}
