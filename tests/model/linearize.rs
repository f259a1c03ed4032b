//! Linearisability of concurrent calls on one record against [`Node`]'s transitions: calls
//! issued at once may land in any order, so a store's answers are accepted when some order of
//! the calls, applied one at a time to the model's node, gives exactly those answers
//! (`tests/model_conformance.rs` races real stores with it).

use super::store::{Node, Outcome, Payload, Token};

/// One call of a concurrent round on record (slot) 0, or a lease running out meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Claim {
        fingerprint: u8,
        owner: Token,
    },
    Complete {
        owner: Token,
        payload: Payload,
    },
    Release {
        owner: Token,
    },
    Renew {
        owner: Token,
    },
    /// The record's lease runs out: no answer, but it may fall anywhere among the others.
    Expire,
}

/// What a call answered; `None` for [`Op::Expire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Claim(Outcome),
    Flag(bool),
}

/// Applies `op` to `node`'s record 0, as the store would, one call at a time.
pub fn apply(node: &mut Node, op: Op) -> Option<Answer> {
    match op {
        Op::Claim { fingerprint, owner } => Some(Answer::Claim(node.claim(0, fingerprint, owner, None))),
        Op::Complete { owner, payload } => Some(Answer::Flag(node.complete(0, owner, payload, None))),
        Op::Release { owner } => Some(Answer::Flag(node.release(0, owner, None))),
        Op::Renew { owner } => Some(Answer::Flag(node.renew(0, owner))),
        Op::Expire => {
            node.expire(0);
            None
        }
    }
}

/// The answers `ops` get applied to `start` in the order `order` (indexes into `ops`), by
/// position in `ops`.
pub fn answers_in_order(start: &Node, ops: &[Op], order: &[usize]) -> Vec<Option<Answer>> {
    let mut node = start.clone();
    let mut answers = vec![None; ops.len()];
    for &i in order {
        answers[i] = apply(&mut node, ops[i]);
    }
    answers
}

/// The orders of `ops` (as indexes) in which applying them to `start` one at a time gives
/// `accepts`-matching answers: `accepts(i, answer)` says whether call `i`'s real answer is the
/// model's `answer`. Empty when no order explains the answers. Enumerates every permutation,
/// so rounds stay small (6 calls: 720 orders).
pub fn explaining_orders(
    start: &Node,
    ops: &[Op],
    accepts: impl Fn(usize, Option<Answer>) -> bool,
) -> Vec<Vec<usize>> {
    let mut found = Vec::new();
    let mut order: Vec<usize> = (0..ops.len()).collect();
    permute(&mut order, 0, &mut |order| {
        let answers = answers_in_order(start, ops, order);
        if answers.iter().enumerate().all(|(i, answer)| accepts(i, *answer)) {
            found.push(order.to_vec());
        }
    });
    found
}

/// Calls `visit` with every permutation of `items[from..]` (Heap's method would do as well;
/// swapping in place keeps it allocation-free).
fn permute(items: &mut [usize], from: usize, visit: &mut impl FnMut(&[usize])) {
    if from == items.len() {
        visit(items);
        return;
    }
    for i in from..items.len() {
        items.swap(from, i);
        permute(items, from + 1, visit);
        items.swap(from, i);
    }
}
