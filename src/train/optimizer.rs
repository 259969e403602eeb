//! AdamW (or Adam, `[optimizer] name = "Adam"`: the weight decay as an L2 term of the gradient)
//! over a parameter set: fp32 moments laid out like the parameters, one fused multi-tensor
//! kernel call for the whole set (one per tensor when parameter groups give tensors their own
//! settings, or frozen tensors are skipped), and global-norm gradient clipping folded into it.

use crate::backend::{AdamWStep, Backend, WeightDecay};
use crate::config::OptimizerConfig;
use crate::model::ParamSet;

pub struct AdamW<B: Backend> {
    pub exp_avg: ParamSet<B>,
    pub exp_avg_sq: ParamSet<B>,
    pub cfg: OptimizerConfig,
    /// Each tensor's `[[optimizer.param_groups]]` (an index into `cfg.param_groups`; None: the
    /// section's own settings).
    groups: Vec<Option<usize>>,
}

impl<B: Backend> AdamW<B> {
    /// Frees the moments of every tensor `keep` rejects (`ParamSet::keep_only`).
    pub fn keep_only(&mut self, be: &B, keep: impl Fn(&str) -> bool) {
        self.exp_avg.keep_only(be, &keep);
        self.exp_avg_sq.keep_only(be, &keep);
    }

    /// Zero moments for the tensors `trains` accepts (a frozen one has none).
    pub fn new(
        be: &B,
        specs: &[(String, Vec<usize>)],
        cfg: OptimizerConfig,
        trains: impl Fn(&str) -> bool,
    ) -> Self {
        Self::from_moments(
            ParamSet::zeros_where(be, specs, &trains),
            ParamSet::zeros_where(be, specs, &trains),
            cfg,
        )
    }

    /// AdamW with the moments given (laid out like the parameters).
    pub fn from_moments(
        exp_avg: ParamSet<B>,
        exp_avg_sq: ParamSet<B>,
        cfg: OptimizerConfig,
    ) -> Self {
        let groups = exp_avg
            .names
            .iter()
            .map(|name| cfg.group_of(name))
            .collect();
        AdamW {
            exp_avg,
            exp_avg_sq,
            cfg,
            groups,
        }
    }

    /// Tensor `i`'s step settings: `base` (the section's, at the scheduled `lr`), or its group's,
    /// the schedule scaling the group's learning rate as it scales the section's.
    fn settings(&self, i: usize, base: AdamWStep, lr: f64) -> AdamWStep {
        let Some(g) = self.groups[i].map(|g| &self.cfg.param_groups[g]) else {
            return base;
        };
        let [beta1, beta2] = g.betas.unwrap_or([self.cfg.beta1, self.cfg.beta2]);
        AdamWStep {
            lr: g.lr.map_or(lr, |group_lr| group_lr * lr / self.cfg.lr) as f32,
            weight_decay: g.weight_decay.unwrap_or(self.cfg.weight_decay) as f32,
            beta1: beta1 as f32,
            beta2: beta2 as f32,
            ..base
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
            decay: match self.cfg.name.as_str() {
                "Adam" => WeightDecay::L2,
                _ => WeightDecay::Decoupled,
            },
        };
        // A frozen weight (LoRA's base) has neither gradient nor moments: the step skips it.
        let frozen = |i: usize| be.len(&grads.bufs[i]) == 0 && be.len(&params.bufs[i]) > 0;
        let grouped = self.groups.iter().any(Option::is_some);
        if !grouped && !(0..params.len()).any(frozen) {
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
            let hp = self.settings(i, hp, lr);
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
