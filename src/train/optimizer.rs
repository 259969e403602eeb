//! AdamW over a parameter set: fp32 moments laid out like the parameters, one fused multi-tensor
//! kernel call for the whole set, and global-norm gradient clipping folded into it.

use crate::backend::{AdamWStep, Backend};
use crate::config::OptimizerConfig;
use crate::model::ParamSet;

pub struct AdamW<B: Backend> {
    pub exp_avg: ParamSet<B>,
    pub exp_avg_sq: ParamSet<B>,
    pub cfg: OptimizerConfig,
}

impl<B: Backend> AdamW<B> {
    /// Frees the moments of every tensor `keep` rejects (`ParamSet::keep_only`).
    pub fn keep_only(&mut self, be: &B, keep: impl Fn(&str) -> bool) {
        self.exp_avg.keep_only(be, &keep);
        self.exp_avg_sq.keep_only(be, &keep);
    }

    pub fn new(be: &B, specs: &[(String, Vec<usize>)], cfg: OptimizerConfig) -> Self {
        AdamW {
            exp_avg: ParamSet::zeros(be, specs),
            exp_avg_sq: ParamSet::zeros(be, specs),
            cfg,
        }
    }

    /// One update at `lr`; `step` is 1-based (bias correction). Each gradient is multiplied by
    /// `grad_scale` (the clipping factor, `clip_factor`) as it is read; the gradients are unchanged.
    pub fn step(
        &mut self,
        be: &B,
        params: &mut ParamSet<B>,
        grads: &ParamSet<B>,
        lr: f64,
        step: u64,
        grad_scale: f32,
    ) {
        let hp = AdamWStep {
            lr: lr as f32,
            beta1: self.cfg.beta1 as f32,
            beta2: self.cfg.beta2 as f32,
            eps: self.cfg.eps as f32,
            weight_decay: self.cfg.weight_decay as f32,
            step,
            grad_scale,
        };
        // A frozen weight (LoRA's base) has neither gradient nor moments: the step skips it.
        let frozen = |i: usize| be.len(&grads.bufs[i]) == 0 && be.len(&params.bufs[i]) > 0;
        if !(0..params.len()).any(frozen) {
            be.adamw_step_all(
                &mut params.bufs,
                &grads.bufs,
                &mut self.exp_avg.bufs,
                &mut self.exp_avg_sq.bufs,
                hp,
            );
            return;
        }
        for i in (0..params.len()).filter(|&i| be.len(&grads.bufs[i]) > 0) {
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
    be.sum_squares_all(&grads.bufs).sqrt()
}

/// The factor that brings the gradients' global norm down to `max_norm` when it is above (PyTorch's
/// `clip_grad_norm_`), else 1; AdamW applies it as it reads each gradient.
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    if max_norm > 0.0 && norm > max_norm {
        (max_norm / (norm + 1e-6)) as f32
    } else {
        1.0
    }
}
