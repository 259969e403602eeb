//! A mixture of experts' step statistics: the tokens each block routed to each expert and the
//! auxiliary loss's share, counted by the backward into the workspace that ran it (once per
//! trained microbatch: not for a recomputed forward, not for validation) and taken after the step.

use super::MoeArgs;

/// The figures of the microbatches a workspace trained since they were last taken.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertStats {
    /// Tokens each block sent to each expert (`[layer][expert]`, global expert ids).
    pub load: Vec<Vec<u64>>,
    /// This rank's share of `coef · Σ_blocks Σ_sequences L_b` (a sequence spread over TP and CP
    /// ranks adds `1 / (tp · cp)` on each); None without an auxiliary loss.
    pub aux_loss: Option<f64>,
}

impl ExpertStats {
    /// Zero counts for a model of `n_layers` blocks routing as `moe` says.
    pub fn zeros(moe: &MoeArgs, n_layers: usize) -> Self {
        ExpertStats {
            load: vec![vec![0; moe.router.num_experts]; n_layers],
            aux_loss: moe.aux_loss_coef.map(|_| 0.0),
        }
    }

    /// Adds the rows block `l` routed to each expert (`load[e]`).
    pub fn count_load(&mut self, l: usize, load: &[usize]) {
        for (total, &rows) in self.load[l].iter_mut().zip(load) {
            *total += rows as u64;
        }
    }

    /// Adds `other`'s figures (another workspace of the same model).
    pub fn add(&mut self, other: &ExpertStats) {
        for (mine, theirs) in self.load.iter_mut().zip(&other.load) {
            for (a, b) in mine.iter_mut().zip(theirs) {
                *a += b;
            }
        }
        if let (Some(a), Some(b)) = (self.aux_loss.as_mut(), other.aux_loss) {
            *a += b;
        }
    }

    /// These figures, with the counts left at zero.
    pub fn take(&mut self) -> ExpertStats {
        let zero = ExpertStats {
            load: self.load.iter().map(|l| vec![0; l.len()]).collect(),
            aux_loss: self.aux_loss.map(|_| 0.0),
        };
        std::mem::replace(self, zero)
    }
}
