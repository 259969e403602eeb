//! What a block needs from its tensor-parallel group, as an interface: the model is written once in
//! one rank's shapes (`LocalShapes`) and crosses ranks only through these operations. Their
//! implementation over a real group, with its collectives, is `parallel::tp`; `SingleRank`
//! (`single_rank.rs`) is the degree-1 case, where each is the local operation.

use anyhow::Result;

use crate::backend::{Backend, LossSum};
use crate::model::local_shapes::LocalShapes;

/// The gradients a cross-entropy adds into: ∂/∂(its input rows) and ∂/∂(the output projection).
pub type LossGrads<'a, B> = Option<(&'a mut <B as Backend>::Buf, &'a mut <B as Backend>::Buf)>;

pub trait TensorParallelOps<B: Backend>: Send + Sync {
    /// Ranks in the group (1: no tensor parallelism).
    fn degree(&self) -> usize;

    /// Sequence parallel to full: `full` (`[tokens, width]`) receives every rank's `local` rows
    /// (`[tokens / degree, width]`) in rank order.
    fn gather_rows(&self, be: &B, local: &B::Buf, full: &mut B::Buf) -> Result<()>;

    /// Full partial sums to sequence parallel: `local` receives this rank's rows of `partial`
    /// summed over the group.
    fn reduce_scatter_rows(&self, be: &B, partial: &B::Buf, local: &mut B::Buf) -> Result<()>;

    /// `buf` summed over the group, in place (the gradients of replicated weights).
    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<()>;

    /// Each value of `amaxes` the largest over the group, in place: the float8 scales of an
    /// operand split across the group are those of the whole operand (NaN if any rank's is).
    fn all_reduce_max(&self, amaxes: &mut [f32]) -> Result<()>;

    /// Async tensor parallelism: how many chunks a collective fused with its GEMMs is cut into,
    /// so that each chunk's communication overlaps another chunk's GEMMs (`parallel_linear`).
    /// 1: plain TP, which has no queue and never calls the three methods below.
    fn overlap_chunks(&self) -> usize {
        1
    }

    /// Async TP: queues the gathering of every rank's `local` rows (`[rows, width]` each, into
    /// `[degree · rows, width]` in rank order) behind the collectives already in flight.
    fn start_gather_rows(&self, _be: &B, _local: B::Buf) -> Result<()> {
        Err(not_async())
    }

    /// Async TP: queues a reduce-scatter of `partial` (`[degree · rows, width]`): this rank
    /// receives its `[rows, width]` summed over the group.
    fn start_reduce_scatter_rows(&self, _be: &B, _partial: B::Buf) -> Result<()> {
        Err(not_async())
    }

    /// Async TP: waits for the oldest queued collective and returns its output.
    fn finish_oldest(&self, _be: &B) -> Result<B::Buf> {
        Err(not_async())
    }

    /// Seconds the group's communication has run on this rank since the group was made, hidden
    /// or not (with plain TP, all of it is exposed). 0 for one rank.
    fn comm_seconds(&self) -> f64 {
        self.exposed_comm_seconds()
    }

    /// Seconds this rank has spent waiting on the group's communication since the group was
    /// made: the communication no computation hid (exposed). 0 for one rank.
    fn exposed_comm_seconds(&self) -> f64 {
        0.0
    }

    /// Cross-entropy of `logits = h · wᵀ` for every row of `h` (`[rows, dim]`) against
    /// `targets` (global ids), `w` holding this rank's `shapes.vocab` rows of the output
    /// projection. With `grads`, adds `grad_scale · ∂/∂h` (this rank's part: summed over the
    /// group it is the whole) and `grad_scale · ∂/∂w` for its rows. Every rank returns the same sum.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(
        &self,
        be: &B,
        h: &B::Buf,
        w: &B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        grad_scale: f32,
        grads: LossGrads<'_, B>,
    ) -> Result<LossSum>;

    /// Cross-entropy of `logits` (`[rows, shapes.vocab]`, this rank's vocabulary columns of
    /// every row, computed by the caller: a float8 output head) against `targets` (global ids).
    /// With `grad = (grad_scale, true)` the logits become `grad_scale · ∂(sum of losses)/∂logits`
    /// (this rank's columns); with `(_, false)` they are left scratch. Every rank returns the same sum.
    fn loss_of_logits(
        &self,
        be: &B,
        logits: &mut B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        grad: (f32, bool),
    ) -> Result<LossSum>;
}

/// The error of the async-only operations on a group without a queue (a titan bug: callers ask
/// `overlap_chunks` first).
fn not_async() -> anyhow::Error {
    anyhow::anyhow!("this tensor-parallel group is not async (a titan bug: overlap_chunks is 1)")
}
