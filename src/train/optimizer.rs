//! AdamW over a parameter set: fp32 moments laid out like the parameters, one fused kernel call
//! per tensor, and global-norm gradient clipping.

use crate::backend::{AdamWStep, Backend};
use crate::config::OptimizerConfig;
use crate::model::ParamSet;

pub struct AdamW<B: Backend> {
    pub exp_avg: ParamSet<B>,
    pub exp_avg_sq: ParamSet<B>,
    pub cfg: OptimizerConfig,
}

impl<B: Backend> AdamW<B> {
    pub fn new(be: &B, specs: &[(String, Vec<usize>)], cfg: OptimizerConfig) -> Self {
        AdamW {
            exp_avg: ParamSet::zeros(be, specs),
            exp_avg_sq: ParamSet::zeros(be, specs),
            cfg,
        }
    }

    /// One update at `lr`; `step` is 1-based (bias correction).
    pub fn step(
        &mut self,
        be: &B,
        params: &mut ParamSet<B>,
        grads: &ParamSet<B>,
        lr: f64,
        step: u64,
    ) {
        let hp = AdamWStep {
            lr: lr as f32,
            beta1: self.cfg.beta1 as f32,
            beta2: self.cfg.beta2 as f32,
            eps: self.cfg.eps as f32,
            weight_decay: self.cfg.weight_decay as f32,
            step,
        };
        for i in 0..params.len() {
            be.adamw_step(
                &mut params.bufs[i],
                &grads.bufs[i],
                &mut self.exp_avg.bufs[i],
                &mut self.exp_avg_sq.bufs[i],
                hp,
            );
        }
    }
}

/// The global L2 norm of all gradients (tensors summed in order, so it is deterministic).
pub fn grad_norm<B: Backend>(be: &B, grads: &ParamSet<B>) -> f64 {
    grads
        .bufs
        .iter()
        .map(|g| be.sum_squares(g))
        .sum::<f64>()
        .sqrt()
}

/// Scales gradients so that their global norm is at most `max_norm` (PyTorch's `clip_grad_norm_`).
pub fn clip_grads<B: Backend>(be: &B, grads: &mut ParamSet<B>, norm: f64, max_norm: f64) {
    if max_norm > 0.0 && norm > max_norm {
        let factor = (max_norm / (norm + 1e-6)) as f32;
        for g in &mut grads.bufs {
            be.scale(g, factor);
        }
    }
}
