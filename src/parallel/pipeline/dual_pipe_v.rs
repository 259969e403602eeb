//! DualPipeV's action order (`--parallelism.pipeline_parallel_schedule DualPipeV`): DeepSeek's
//! DualPipe folded onto a V, generated phase by phase as DeepSeek and PyTorch define it, so it is
//! PyTorch's order action for action (tested against its dump) and has its bubble.

use super::actions::Action;
use super::rank_actions::RankActions;

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
    x.remaining_weights();
    x.list
}
