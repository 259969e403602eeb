//! The looped schedules, where rank `r` holds stages `r, r + p, r + 2p, …`: `Interleaved1F1B`,
//! `InterleavedZeroBubble` and `LoopedBFS`, each generated as PyTorch defines its order (tested
//! action for action against PyTorch's dumps).
//!
//! The interleaved two send microbatches through the ranks in rounds: `max(1, m / p)` rounds of
//! `m / rounds` microbatches each (so `m` must divide into them), each round going through every
//! local stage before the next round starts. A rank runs a warm-up of forwards, then one forward
//! and one backward in turn, then the backwards left. Zero bubble splits each backward into its
//! input half (`I`) and weight half (`W`): the warm-up is one forward shorter per hop from the
//! last rank (not two), and from rank `r`'s `r`-th backward on each backward is followed by the
//! oldest waiting weight half, the rest at the end.

use anyhow::{bail, Result};

use super::actions::{act, Action, Work};
use super::rank_actions::RankActions;

/// Microbatches per round for `m` microbatches on `p` ranks.
pub(super) fn microbatches_per_round(name: &str, p: usize, m: usize) -> Result<usize> {
    let rounds = (m / p).max(1);
    if !m.is_multiple_of(rounds) {
        bail!("{name} sends microbatches through the ranks in {rounds} rounds of equal size (at least {p}, the pipeline degree, each): {m} microbatches do not divide into {rounds}");
    }
    Ok(m / rounds)
}

/// Interleaved 1F1B (`zero_bubble` false) or Interleaved zero bubble on rank `r` of `p`, with `v`
/// stages per rank, `m` microbatches in rounds of `round` (see the module doc).
pub(super) fn interleaved(
    r: usize,
    p: usize,
    v: usize,
    m: usize,
    round: usize,
    zero_bubble: bool,
) -> Vec<Action> {
    let total = v * m;
    // The k-th forward walks the local stages round by round; the k-th backward walks them back.
    let forward_stage = |k: usize| (k / round % v) * p + r;
    let backward_stage = |k: usize| (v - 1 - k / round % v) * p + r;
    let hops = p - 1 - r;
    let warmup = ((v - 1) * round + if zero_bubble { hops } else { 2 * hops }).min(total);
    let mut x = RankActions::new();
    for k in 0..warmup {
        x.forward(forward_stage(k));
    }
    for k in 0..total {
        if warmup + k < total {
            x.forward(forward_stage(warmup + k));
        }
        x.backward(backward_stage(k), zero_bubble);
        if zero_bubble && k >= r {
            x.weight();
        }
    }
    x.remaining_weights();
    x.list
}

/// Looped BFS on rank `r` of `p` with `v` stages per rank: every microbatch's forward through each
/// local stage in turn, then the backwards, the deepest stage first and the last microbatch first.
pub(super) fn looped_bfs(r: usize, p: usize, v: usize, m: usize) -> Vec<Action> {
    let stages: Vec<usize> = (0..v).map(|i| i * p + r).collect();
    let forwards = stages
        .iter()
        .flat_map(|&s| (0..m).map(move |mb| act(s, Work::Forward, mb)));
    let backwards = stages
        .iter()
        .rev()
        .flat_map(|&s| (0..m).rev().map(move |mb| act(s, Work::Backward, mb)));
    forwards.chain(backwards).collect()
}
