//! A mixture of experts' step statistics: the tokens each block routed to each expert and the
//! auxiliary loss's share, counted by the backward into the workspace that ran it (once per
//! trained microbatch: not for a recomputed forward, not for validation) and taken after the step.
//!
//! The counts stay where the backend keeps the dispatch order (`Backend::moe_count_load`), and
//! each block's per-sequence auxiliary losses where the backend computed them: a block's forward
//! and backward never wait for them; they come to the host together, in one copy, when taken.

use super::MoeArgs;
use crate::backend::Backend;

/// The figures of the microbatches a workspace trained since they were last taken.
pub struct ExpertStats<B: Backend> {
    /// Tokens each block sent to each expert (`[layer, expert]`, global expert ids; f32 counts,
    /// exact to 2^24 per expert and step), on the backend.
    counts: B::Buf,
    experts: usize,
    /// Each trained block's `L_b` (`(buffer, offset, sequences)`: the block's own balance
    /// buffer, kept until taken) and its weight in this rank's share of `coef · Σ_blocks
    /// Σ_sequences L_b`, in the order the backward ran them; None without an auxiliary loss.
    aux: Option<Vec<(KeptLosses<B>, AuxWeight)>>,
}

/// A block's per-sequence `L_b`: its balance buffer, their offset in it, how many.
type KeptLosses<B> = (<B as Backend>::Buf, usize, usize);

/// How a block's `Σ_b L_b` enters the step's auxiliary loss: `coef · Σ_b L_b / sequences /
/// share` (a sequence spread over TP and CP ranks adds `1 / (tp · cp)` on each).
#[derive(Debug, Clone, Copy)]
pub struct AuxWeight {
    pub coef: f64,
    pub sequences: f64,
    pub share: f64,
}

/// `ExpertStats` taken to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertFigures {
    /// Tokens each block sent to each expert (`[layer][expert]`).
    pub load: Vec<Vec<u64>>,
    /// This rank's share of the auxiliary loss; None without one.
    pub aux_loss: Option<f64>,
}

impl<B: Backend> ExpertStats<B> {
    /// Zero counts for a model of `n_layers` blocks routing as `moe` says.
    pub fn zeros(be: &B, moe: &MoeArgs, n_layers: usize) -> Self {
        let experts = moe.router.num_experts;
        ExpertStats {
            counts: be.zeros(n_layers * experts),
            experts,
            aux: moe.aux_loss_coef.map(|_| Vec::new()),
        }
    }

    /// Adds the rows block `l` routed to each expert (the dispatch order's `offsets`, `[experts
    /// + 1]`, u32 bits).
    pub fn count_load(&mut self, be: &B, l: usize, offsets: &B::Buf) {
        be.moe_count_load(&mut self.counts, offsets, l * self.experts);
    }

    /// Keeps a block's per-sequence `L_b` (`values`: its buffer, offset, sequences) for the
    /// step's auxiliary loss, weighted by `weight`; summed when taken.
    pub fn add_aux(&mut self, values: (B::Buf, usize, usize), weight: AuxWeight) {
        if let Some(aux) = self.aux.as_mut() {
            aux.push((values, weight));
        }
    }

    /// These figures on the host (one download of the counts and every kept `L_b` together),
    /// with the counts left at zero.
    pub fn take(&mut self, be: &B) -> ExpertFigures {
        let kept = self.aux.as_mut().map(std::mem::take).unwrap_or_default();
        let counted = be.len(&self.counts);
        let mut all = be.uninit(counted + kept.iter().map(|((_, _, n), _)| n).sum::<usize>());
        be.copy_into_at(&mut all, 0, &self.counts);
        let mut at = counted;
        for ((v, offset, n), _) in &kept {
            be.copy_range(&mut all, at, v, *offset, *n);
            at += n;
        }
        let host = be.download_owned(all);
        be.fill(&mut self.counts, 0.0);
        let (counts, mut values) = host.split_at(counted);
        let load = counts
            .chunks(self.experts.max(1))
            .map(|l| l.iter().map(|&c| c as u64).collect())
            .collect();
        let aux_loss = self.aux.as_ref().map(|_| {
            let mut total = 0.0f64;
            for ((_, _, n), w) in &kept {
                let (block, rest) = values.split_at(*n);
                values = rest;
                let value: f64 = block.iter().map(|&v| v as f64).sum();
                total += w.coef * value / w.sequences / w.share;
            }
            total
        });
        ExpertFigures { load, aux_loss }
    }
}

impl ExpertFigures {
    /// Adds `other`'s figures (another workspace of the same model).
    pub fn add(&mut self, other: &ExpertFigures) {
        for (mine, theirs) in self.load.iter_mut().zip(&other.load) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        if let (Some(a), Some(b)) = (self.aux_loss.as_mut(), other.aux_loss) {
            *a += b;
        }
    }
}
