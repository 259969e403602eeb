//! What a mixture-of-experts layer needs from its expert-parallel group, as an interface.
//!
//! Expert parallelism splits every MoE layer's routed experts over the group: rank `r` of `ep`
//! holds experts `r·E/ep .. (r+1)·E/ep` (`LocalShapes::local_experts`). Each rank routes its own
//! tokens, then sends every dispatched row to the rank of its expert and gets the expert's output
//! back: two all-to-alls of uneven sizes per layer and direction, the counts exchanged first
//! (`moe::dispatch` does the bookkeeping). Everything else of the block is per token and runs on
//! the rank's own tokens unchanged. The implementation over a real group is `parallel::ep`; with
//! one rank (`SingleRank`, `single_rank.rs`) the rows stay where they are.

use anyhow::Result;

use crate::backend::Backend;

pub trait ExpertParallelOps<B: Backend>: Send + Sync {
    /// Ranks in the group (1: no expert parallelism).
    fn degree(&self) -> usize;

    /// This rank's place in the group.
    fn rank(&self) -> usize;

    /// Every rank's rows per expert: this rank sends `counts[e]` rows to global expert `e`.
    /// Returns, for each rank `s` of the group, how many rows it sends to each of this rank's
    /// experts (`[s][local expert]`).
    fn exchange_counts(&self, counts: &[usize]) -> Result<Vec<Vec<usize>>>;

    /// Sends `rows` (`[Σ send, width]`), `send[p]` consecutive ones to rank `p`, and returns the
    /// rows received, `recv[p]` from rank `p`, in rank order.
    fn all_to_all_rows(
        &self,
        be: &B,
        rows: B::Buf,
        send: &[usize],
        recv: &[usize],
        width: usize,
    ) -> Result<B::Buf>;

    /// Seconds this rank has spent in the row all-to-alls since the group was made (waiting for
    /// its peers included; 0 for one rank).
    fn exchange_seconds(&self) -> f64 {
        0.0
    }
}
