//! DualPipeV's action order (`--parallelism.pipeline_parallel_schedule DualPipeV`): DeepSeek's
//! DualPipe folded onto a V, generated phase by phase as DeepSeek and PyTorch define it, so it is
//! PyTorch's order action for action (tested against its dump) and has its bubble.

use std::collections::{HashMap, VecDeque};

use super::actions::{act, Action, Work};

/// A rank's actions as they are appended: each stage's next forward and backward microbatch,
/// and the input-gradient halves whose weight gradients wait (oldest first).
struct RankActions {
    list: Vec<Action>,
    next_forward: HashMap<usize, usize>,
    next_backward: HashMap<usize, usize>,
    weights_waiting: VecDeque<(usize, usize)>,
}

impl RankActions {
    fn new() -> Self {
        RankActions {
            list: Vec::new(),
            next_forward: HashMap::new(),
            next_backward: HashMap::new(),
            weights_waiting: Default::default(),
        }
    }

    fn forward(&mut self, stage: usize) {
        let mb = self.next_forward.entry(stage).or_default();
        self.list.push(act(stage, Work::Forward, *mb));
        *mb += 1;
    }

    /// The next backward of `stage`, whole, or its input half (`split`) with the weight half
    /// left waiting.
    fn backward(&mut self, stage: usize, split: bool) {
        let mb = self.next_backward.entry(stage).or_default();
        let work = if split {
            self.weights_waiting.push_back((stage, *mb));
            Work::BackwardInput
        } else {
            Work::Backward
        };
        self.list.push(act(stage, work, *mb));
        *mb += 1;
    }

    /// The oldest waiting weight gradient, if any.
    fn weight(&mut self) {
        if let Some((stage, mb)) = self.weights_waiting.pop_front() {
            self.list.push(act(stage, Work::BackwardWeight, mb));
        }
    }
}

/// DualPipeV (DeepSeek's DualPipe cut in half onto a V) on rank `r` of `p`, `m ≥ 2p` microbatches,
/// in its eight phases. The rank holds stage `r` (`a`, on the way down) and stage `2p − 1 − r`
/// (`b`, on the way back up):
/// 1. `2(p − r − 1)` forwards of `a`; 2. `r + 1` pairs of forwards of `a` and `b`;
/// 3. `p − r − 1` times: `b`'s input gradient, a waiting weight gradient, a forward of `b`;
/// 4. the steady phase, `m − 2p + r + 1` times: a forward of `a` with a backward of `b`, then a
///    forward of `b` with a backward of `a` (the pairs DualPipe overlaps; titan runs each pair's
///    two actions in turn);
/// 5. `p − r − 1` times: a backward of `b`, then a forward of `b` with a backward of `a`;
/// 6. `r + 1` backwards of `b` and `a` in turn, split into input and weight halves from the
///    middle on (zero bubble for the second half);
/// 7. `p − r − 1` times: a waiting weight gradient, then a backward of `a`;
/// 8. the weight gradients still waiting.
pub(super) fn dual_pipe_v(r: usize, p: usize, m: usize) -> Vec<Action> {
    let (a, b) = (r, 2 * p - 1 - r);
    let mut x = RankActions::new();
    let drain = p - r - 1;
    for _ in 0..2 * drain {
        x.forward(a);
    }
    for _ in 0..=r {
        x.forward(a);
        x.forward(b);
    }
    for _ in 0..drain {
        x.backward(b, true);
        x.weight();
        x.forward(b);
    }
    for _ in 0..m + r + 1 - 2 * p {
        x.forward(a);
        x.backward(b, false);
        x.forward(b);
        x.backward(a, false);
    }
    for _ in 0..drain {
        x.backward(b, false);
        x.forward(b);
        x.backward(a, false);
    }
    // Phase 6: the split starts half-way, with `b`'s backward on odd ranks, `a`'s on even ones.
    let mut split = false;
    let middle = r.div_ceil(2);
    for i in 0..=r {
        split |= i == middle && !r.is_multiple_of(2);
        x.backward(b, split);
        split |= i == middle && r.is_multiple_of(2);
        x.backward(a, split);
    }
    for _ in 0..drain {
        x.weight();
        x.backward(a, split);
    }
    while !x.weights_waiting.is_empty() {
        x.weight();
    }
    x.list
}
