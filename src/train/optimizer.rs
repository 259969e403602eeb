//! The optimizer over a parameter set: AdamW (or Adam, `[optimizer] name = "Adam"`: the weight
//! decay as an L2 term of the gradient) with fp32 moments laid out like the parameters, one fused
//! multi-tensor kernel call for the whole set (one per tensor when parameter groups give tensors
//! their own settings, or frozen tensors are skipped), and global-norm gradient clipping folded
//! into it; or Muon (`name = "Muon"`) on the blocks' weight matrices with AdamW on the rest.
//!
//! Muon keeps one state per matrix, its momentum buffer, in the slot AdamW's first moment has
//! (`exp_avg`: so checkpoints, resharding and replica recovery carry it unchanged) and no second
//! moment. Its matrices are orthogonalised whole, each by one rank for all
//! (`parallel::muon_exchange`), or here when one rank holds them all.
//!
//! `[optimizer] state_dtype = "bfloat16"` stores every state rounded to bf16, two values to an
//! f32 word (half the memory): each tensor's state is widened to fp32 for its update and rounded
//! back after, so the arithmetic stays fp32. Checkpoints hold the fp32 values of the bf16 ones.

use anyhow::Result;

use super::muon::{adjusted_lr, momentum_update, Momentum, NewtonSchulz};
use crate::backend::{AdamWStep, Backend, WeightDecay};
use crate::checkpoint::SavedOptimizer;
use crate::comm::group::ProcessGroup;
use crate::config::{muon_updates, OptimizerConfig};
use crate::model::ParamSet;
use crate::parallel::muon_exchange::MuonExchange;

pub struct Optimizer<B: Backend> {
    /// AdamW's first moments; for Muon's matrices, their momentum buffers.
    pub exp_avg: ParamSet<B>,
    /// AdamW's second moments (none for Muon's matrices).
    pub exp_avg_sq: ParamSet<B>,
    pub cfg: OptimizerConfig,
    /// Each tensor's `[[optimizer.param_groups]]` (an index into `cfg.param_groups`; None: the
    /// section's own settings).
    groups: Vec<Option<usize>>,
    /// Each tensor's whole `[rows, cols]` when Muon updates it.
    muon: Vec<Option<[usize; 2]>>,
    /// Where Muon's matrices are orthogonalised when their pieces are spread over ranks (None:
    /// every one here, whole).
    exchange: Option<MuonExchange>,
    /// Newton–Schulz iterations run on this rank since `take_orthogonalized`: matrices, FLOPs.
    orthogonalized: (u64, f64),
    /// With bf16 state: each tensor's fp32 lengths of `exp_avg` and `exp_avg_sq`, whose buffers
    /// hold bf16 pairs (None: fp32 state).
    packed: Option<Vec<[usize; 2]>>,
}

/// Whether `cfg`'s optimizer keeps a second moment for parameter `name` of whole shape `shape`
/// (AdamW's tensors do; Muon's matrices keep only their momentum).
pub fn keeps_second_moment(cfg: &OptimizerConfig, name: &str, shape: &[usize]) -> bool {
    !(cfg.name == "Muon" && muon_updates(name, shape))
}

impl<B: Backend> Optimizer<B> {
    /// Frees the state of every tensor `keep` rejects (`ParamSet::keep_only`).
    pub fn keep_only(&mut self, be: &B, keep: impl Fn(&str) -> bool) {
        self.exp_avg.keep_only(be, &keep);
        self.exp_avg_sq.keep_only(be, &keep);
    }

    /// Zero fp32 state laid out as `specs` (`exp_avg`, `exp_avg_sq`) for the tensors `trains`
    /// accepts (a frozen one has none), without the second moments `cfg`'s optimizer does not
    /// keep; `whole` gives every tensor's whole shape (`param_specs`, in the set's order).
    pub fn zero_state(
        be: &B,
        specs: &[(String, Vec<usize>)],
        whole: &[(String, Vec<usize>)],
        cfg: &OptimizerConfig,
        trains: impl Fn(&str) -> bool,
    ) -> (ParamSet<B>, ParamSet<B>) {
        let second = |i: usize| keeps_second_moment(cfg, &whole[i].0, &whole[i].1);
        let exp_avg = ParamSet::zeros_where(be, specs, &trains);
        let mut exp_avg_sq = ParamSet::zeros_where(be, specs, &trains);
        for i in (0..specs.len()).filter(|&i| !second(i)) {
            exp_avg_sq.bufs[i] = be.zeros(0);
        }
        (exp_avg, exp_avg_sq)
    }

    /// The optimizer with its state given (laid out like the parameters).
    pub fn from_state(
        be: &B,
        exp_avg: ParamSet<B>,
        exp_avg_sq: ParamSet<B>,
        cfg: OptimizerConfig,
        whole: &[(String, Vec<usize>)],
    ) -> Self {
        let groups = exp_avg
            .names
            .iter()
            .map(|name| cfg.group_of(name))
            .collect();
        let muon = whole
            .iter()
            .map(|(name, shape)| {
                (cfg.name == "Muon" && muon_updates(name, shape)).then(|| [shape[0], shape[1]])
            })
            .collect();
        let mut opt = Optimizer {
            exp_avg,
            exp_avg_sq,
            cfg,
            groups,
            muon,
            exchange: None,
            orthogonalized: (0, 0.0),
            packed: None,
        };
        if opt.cfg.state_dtype == "bfloat16" {
            opt.pack_state(be);
        }
        opt
    }

    /// Stores the state as bf16 pairs (`state_dtype = "bfloat16"`).
    fn pack_state(&mut self, be: &B) {
        let lens = (0..self.exp_avg.len())
            .map(|i| {
                [
                    be.len(&self.exp_avg.bufs[i]),
                    be.len(&self.exp_avg_sq.bufs[i]),
                ]
            })
            .collect();
        for set in [&mut self.exp_avg, &mut self.exp_avg_sq] {
            for buf in set.bufs.iter_mut() {
                let mut words = be.zeros(be.len(buf).div_ceil(2));
                be.pack_bf16_pairs(&mut words, buf);
                *buf = words;
            }
        }
        self.packed = Some(lens);
    }

    /// Calls `f` with the state as fp32 sets laid out like the parameters (what checkpoints
    /// hold): the sets themselves, or with bf16 state widened copies.
    pub fn with_f32_state<R>(&self, be: &B, f: impl FnOnce(&ParamSet<B>, &ParamSet<B>) -> R) -> R {
        let Some(lens) = &self.packed else {
            return f(&self.exp_avg, &self.exp_avg_sq);
        };
        let widen = |set: &ParamSet<B>, which: usize| ParamSet {
            names: set.names.clone(),
            shapes: set.shapes.clone(),
            bufs: (0..set.len())
                .map(|i| widened(be, &set.bufs[i], lens[i][which]))
                .collect(),
        };
        f(&widen(&self.exp_avg, 0), &widen(&self.exp_avg_sq, 1))
    }

    /// Runs `update` on tensor `i`'s state in fp32: the buffers themselves, or with bf16 state
    /// widened copies rounded back after.
    fn with_state_of<R>(
        &mut self,
        be: &B,
        i: usize,
        update: impl FnOnce(&mut B::Buf, &mut B::Buf) -> R,
    ) -> R {
        let Some(lens) = &self.packed else {
            return update(&mut self.exp_avg.bufs[i], &mut self.exp_avg_sq.bufs[i]);
        };
        let [m_len, v_len] = lens[i];
        let mut m = widened(be, &self.exp_avg.bufs[i], m_len);
        let mut v = widened(be, &self.exp_avg_sq.bufs[i], v_len);
        let out = update(&mut m, &mut v);
        be.pack_bf16_pairs(&mut self.exp_avg.bufs[i], &m);
        be.pack_bf16_pairs(&mut self.exp_avg_sq.bufs[i], &v);
        out
    }

    /// Muon's matrices spread over ranks: orthogonalised through `exchange`, whose slots are the
    /// tensors `muon_slots` lists.
    pub fn set_exchange(&mut self, exchange: MuonExchange) {
        self.exchange = Some(exchange);
    }

    /// The tensors Muon updates on this rank, in order: Muon's, trained here (a gradient buffer in
    /// `grads`, empty for a frozen tensor or another pipeline rank's).
    pub fn muon_slots(&self, be: &B, grads: &ParamSet<B>) -> Vec<usize> {
        (0..self.muon.len())
            .filter(|&i| self.muon[i].is_some() && be.len(&grads.bufs[i]) > 0)
            .collect()
    }

    /// Each tensor's whole `[rows, cols]` when Muon updates it.
    pub fn muon_shapes(&self) -> &[Option<[usize; 2]>] {
        &self.muon
    }

    /// With Muon, the matrices orthogonalised over the `job`'s ranks (collective; None: one
    /// process) since the last call, and the busiest rank's share of their Newton–Schulz FLOPs.
    pub fn job_orthogonalized(
        &mut self,
        job: Option<&dyn ProcessGroup>,
    ) -> Result<Option<(u64, f64)>> {
        if self.cfg.name != "Muon" {
            return Ok(None);
        }
        let (matrices, flops) = std::mem::take(&mut self.orthogonalized);
        let mine = [matrices as f32, flops as f32];
        let all = match job {
            None => mine.to_vec(),
            Some(group) => {
                let mut all = vec![0f32; 2 * group.size()];
                group.all_gather(&mine, &mut all)?;
                all
            }
        };
        let flops = all.chunks(2).map(|r| r[1] as f64);
        let (total, busiest) = (flops.clone().sum::<f64>(), flops.fold(0.0, f64::max));
        let matrices = all.chunks(2).map(|r| r[0] as u64).sum();
        Ok(Some((matrices, busiest / total.max(f64::MIN_POSITIVE))))
    }

    /// Tensor `i`'s learning rate and weight decay: the section's (`lr` as scheduled), or its
    /// group's, the schedule scaling the group's learning rate as it scales the section's.
    fn lr_and_decay(&self, i: usize, lr: f64) -> (f64, f64) {
        match self.groups[i].map(|g| &self.cfg.param_groups[g]) {
            None => (lr, self.cfg.weight_decay),
            Some(g) => (
                g.lr.map_or(lr, |group_lr| group_lr * lr / self.cfg.lr),
                g.weight_decay.unwrap_or(self.cfg.weight_decay),
            ),
        }
    }

    /// Tensor `i`'s AdamW settings: `base` (the section's, at the scheduled `lr`), or its group's.
    fn settings(&self, i: usize, base: AdamWStep, lr: f64) -> AdamWStep {
        let Some(g) = self.groups[i].map(|g| &self.cfg.param_groups[g]) else {
            return base;
        };
        let [beta1, beta2] = g.betas.unwrap_or([self.cfg.beta1, self.cfg.beta2]);
        let (lr, weight_decay) = self.lr_and_decay(i, lr);
        AdamWStep {
            lr: lr as f32,
            weight_decay: weight_decay as f32,
            beta1: beta1 as f32,
            beta2: beta2 as f32,
            ..base
        }
    }

    /// One update at `lr` (the schedule's, for `[optimizer] lr`); `step` is 1-based (bias
    /// correction). Each gradient is multiplied by `grad_scale` (the clipping factor,
    /// `clip_factor`) as it is read; the gradients are unchanged. Collective over the job with
    /// Muon's matrices spread over ranks.
    pub fn step(
        &mut self,
        be: &B,
        params: &mut ParamSet<B>,
        grads: &ParamSet<B>,
        lr: f64,
        step: u64,
        grad_scale: f32,
    ) -> Result<()> {
        let adamw_lr = match self.cfg.name.as_str() {
            "Muon" => self.cfg.adamw_lr.unwrap_or(self.cfg.lr) * lr / self.cfg.lr,
            _ => lr,
        };
        let hp = AdamWStep {
            lr: adamw_lr as f32,
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
        let muon = self.muon.iter().any(Option::is_some);
        let packed = self.packed.is_some();
        if !grouped && !muon && !packed && !(0..params.len()).any(frozen) {
            be.adamw_step_all(
                &mut params.bufs,
                &grads.bufs,
                &mut self.exp_avg.bufs,
                &mut self.exp_avg_sq.bufs,
                hp,
            );
            return Ok(());
        }
        let adamw = |i: usize| self.muon[i].is_none() && be.len(&grads.bufs[i]) > 0;
        let adamw: Vec<usize> = (0..params.len()).filter(|&i| adamw(i)).collect();
        for i in adamw {
            let hp = self.settings(i, hp, adamw_lr);
            self.with_state_of(be, i, |m, v| {
                be.adamw_step(&mut params.bufs[i], &grads.bufs[i], m, v, hp)
            });
        }
        if muon {
            self.muon_step(be, params, grads, lr, grad_scale)?;
        }
        Ok(())
    }

    /// Muon on its matrices: each piece's momentum advanced, the matrices orthogonalised whole,
    /// then `p ← p·(1 − lr·wd) − adjusted_lr·O` (`torch.optim.Muon`'s order).
    fn muon_step(
        &mut self,
        be: &B,
        params: &mut ParamSet<B>,
        grads: &ParamSet<B>,
        lr: f64,
        grad_scale: f32,
    ) -> Result<()> {
        let slots = self.muon_slots(be, grads);
        let momentum = Momentum {
            momentum: self.cfg.momentum as f32,
            nesterov: self.cfg.nesterov,
            grad_scale,
        };
        let mut updates: Vec<B::Buf> = slots
            .iter()
            .map(|&i| {
                self.with_state_of(be, i, |m, _| {
                    momentum_update(be, m, &grads.bufs[i], momentum)
                })
            })
            .collect();
        let ns = NewtonSchulz::of(&self.cfg);
        let mut done = (0u64, 0f64);
        let mut orthogonalize = |x: &mut B::Buf, rows: usize, cols: usize| {
            ns.orthogonalize(be, x, rows, cols);
            done = (done.0 + 1, done.1 + ns.flops(rows, cols));
        };
        match &self.exchange {
            Some(exchange) => exchange.orthogonalize(be, &mut updates, &mut orthogonalize)?,
            None => {
                for (u, &i) in updates.iter_mut().zip(&slots) {
                    let [rows, cols] = self.muon[i].expect("a Muon slot");
                    orthogonalize(u, rows, cols);
                }
            }
        }
        self.orthogonalized = (
            self.orthogonalized.0 + done.0,
            self.orthogonalized.1 + done.1,
        );
        for (mut update, &i) in updates.into_iter().zip(&slots) {
            let (lr, weight_decay) = self.lr_and_decay(i, lr);
            let [rows, cols] = self.muon[i].expect("a Muon slot");
            be.scale(&mut params.bufs[i], (1.0 - lr * weight_decay) as f32);
            let step = adjusted_lr(lr, &self.cfg.adjust_lr_fn, rows, cols);
            be.scale(&mut update, -(step as f32));
            be.add_assign(&mut params.bufs[i], &update);
        }
        Ok(())
    }
}

/// The `len` fp32 values of bf16 pairs `words`.
fn widened<B: Backend>(be: &B, words: &B::Buf, len: usize) -> B::Buf {
    let mut out = be.zeros(len);
    if len > 0 {
        be.unpack_bf16_pairs(&mut out, words);
    }
    out
}

/// What a checkpoint records of the optimizer its state belongs to.
pub fn saved_optimizer(cfg: &OptimizerConfig) -> SavedOptimizer {
    SavedOptimizer {
        name: cfg.name.clone(),
        param_groups: cfg
            .param_groups
            .iter()
            .map(|g| g.patterns.clone())
            .collect(),
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
