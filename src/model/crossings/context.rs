//! What a block's attention needs from its context-parallel group, as an interface, and which
//! positions of each sequence a rank holds.
//!
//! Context parallelism splits every sequence over the group. Causal attention makes later
//! positions costlier (a query attends to every key before it), so the split is head-tail
//! balanced, as TorchTitan's: the sequence is cut into `2 × cp` chunks and rank `r` holds chunks
//! `r` and `2·cp − 1 − r`, one cheap and one dear, so every rank does the same work. Everything but
//! attention is per token and runs on the shard unchanged; RoPE rotates each row by its global
//! position; attention is the one crossing (`ContextParallelOps`, implemented with its
//! collectives in `parallel::cp`). With one rank the shard is the whole sequence and attention is
//! the local kernel (`SingleRank`, `single_rank.rs`).

use std::ops::Range;

use anyhow::Result;

use crate::backend::{AttnGrads, AttnInputs, AttnSaved, Backend};

/// The positions of each sequence rank `rank` of a context-parallel group of `degree` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceShard {
    pub degree: usize,
    pub rank: usize,
}

impl SequenceShard {
    /// The global positions of the rank's rows, in the order it holds them: `0..seq` for one
    /// rank, otherwise its head chunk then its tail chunk of `seq / (2 · degree)` positions each.
    pub fn chunks(&self, seq: usize) -> Vec<Range<usize>> {
        Self::chunks_of(self.degree, self.rank, seq)
    }

    /// `chunks` for any rank of the group.
    pub fn chunks_of(degree: usize, rank: usize, seq: usize) -> Vec<Range<usize>> {
        if degree == 1 {
            return std::iter::once(0..seq).collect();
        }
        let c = seq / (2 * degree);
        let tail = 2 * degree - 1 - rank;
        vec![rank * c..(rank + 1) * c, tail * c..(tail + 1) * c]
    }

    /// The global position of each of the rank's rows.
    pub fn positions(&self, seq: usize) -> Vec<usize> {
        self.chunks(seq).into_iter().flatten().collect()
    }
}

pub trait ContextParallelOps<B: Backend>: Send + Sync {
    /// Ranks in the group (1: no context parallelism).
    fn degree(&self) -> usize;

    /// Causal attention of this rank's queries (`x.shape`: its shard, `q_len` positions per
    /// sequence) over every key of their sequences, the other ranks' shards included. Writes `out`
    /// and `lse` as `Backend::attention_forward` does for the rank's rows.
    fn attention_forward(
        &self,
        be: &B,
        out: &mut B::Buf,
        lse: &mut B::Buf,
        x: AttnInputs<'_, B::Buf>,
    ) -> Result<()>;

    /// The backward of `attention_forward`: overwrites `grads.dq`, and `grads.dk`, `grads.dv`
    /// with the gradients of this rank's keys and values summed over every rank's queries.
    fn attention_backward(
        &self,
        be: &B,
        grads: AttnGrads<'_, B::Buf>,
        dout: &B::Buf,
        x: AttnInputs<'_, B::Buf>,
        saved: AttnSaved<'_, B::Buf>,
    ) -> Result<()>;

    /// Seconds this rank has computed attention since the group was made (0 for one rank): the
    /// load balance is the spread of this over the group.
    fn attention_seconds(&self) -> f64 {
        0.0
    }

    /// Sums per-sequence figures over the group, whose ranks hold the other rows of the same
    /// sequences (the MoE auxiliary loss's counts), in place on the backend; nothing to do for
    /// one rank.
    fn sum_over_group(&self, _be: &B, _figures: &mut B::Buf) -> Result<()> {
        Ok(())
    }

    /// Float8 amaxes over the token rows the group splits, the largest over the group, in place
    /// (so a sequence's scales are those of the whole sequence); nothing to do for one rank.
    fn max_amax_over_group(&self, _amaxes: &mut [f32]) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_chunks_cover_the_sequence_once_with_equal_causal_work() {
        let (degree, seq) = (4, 64);
        let mut seen = vec![0; seq];
        let mut work = vec![];
        for rank in 0..degree {
            let shard = SequenceShard { degree, rank };
            let positions = shard.positions(seq);
            assert_eq!(positions.len(), seq / degree);
            for &p in &positions {
                seen[p] += 1;
            }
            // Query at position p attends p + 1 keys.
            work.push(positions.iter().map(|p| p + 1).sum::<usize>());
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
        assert_eq!(SequenceShard::chunks_of(4, 1, 64), vec![8..16, 48..56]);
        let whole = SequenceShard::chunks_of(1, 0, 64);
        assert_eq!((whole.len(), whole[0].clone()), (1, 0..64));
    }
}
