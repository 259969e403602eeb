//! A mixture of experts' step statistics: the tokens each block routed to each expert and the
//! auxiliary loss's share, counted by the backward into the workspace that ran it (once per
//! trained microbatch: not for a recomputed forward, not for validation) and taken after the step.
//!
//! The counts stay where the backend keeps the dispatch order (`Backend::moe_count_load`): a
//! block's forward and backward never wait for them; they come to the host once, when taken.

use super::MoeArgs;
use crate::backend::Backend;

/// The figures of the microbatches a workspace trained since they were last taken.
pub struct ExpertStats<B: Backend> {
    /// Tokens each block sent to each expert (`[layer, expert]`, global expert ids; f32 counts,
    /// exact to 2^24 per expert and step), on the backend.
    counts: B::Buf,
    experts: usize,
    /// This rank's share of `coef · Σ_blocks Σ_sequences L_b` (a sequence spread over TP and CP
    /// ranks adds `1 / (tp · cp)` on each); None without an auxiliary loss.
    pub aux_loss: Option<f64>,
}

/// `ExpertStats` taken to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertFigures {
    /// Tokens each block sent to each expert (`[layer][expert]`).
    pub load: Vec<Vec<u64>>,
    pub aux_loss: Option<f64>,
}

impl<B: Backend> ExpertStats<B> {
    /// Zero counts for a model of `n_layers` blocks routing as `moe` says.
    pub fn zeros(be: &B, moe: &MoeArgs, n_layers: usize) -> Self {
        let experts = moe.router.num_experts;
        ExpertStats {
            counts: be.zeros(n_layers * experts),
            experts,
            aux_loss: moe.aux_loss_coef.map(|_| 0.0),
        }
    }

    /// Adds the rows block `l` routed to each expert (the dispatch order's `offsets`, `[experts
    /// + 1]`, u32 bits).
    pub fn count_load(&mut self, be: &B, l: usize, offsets: &B::Buf) {
        be.moe_count_load(&mut self.counts, offsets, l * self.experts);
    }

    /// These figures on the host (one download), with the counts left at zero.
    pub fn take(&mut self, be: &B) -> ExpertFigures {
        let counts = be.download(&self.counts);
        be.fill(&mut self.counts, 0.0);
        let load = counts
            .chunks(self.experts.max(1))
            .map(|l| l.iter().map(|&c| c as u64).collect())
            .collect();
        ExpertFigures {
            load,
            aux_loss: self.aux_loss.as_mut().map(std::mem::take),
        }
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
