//! A rank's layout, composed once from the mesh (TorchTitan's `parallelize`: tensor parallel, then
//! data parallel), and the operations one training step needs of it whatever the layout: run the
//! micro-batches' forward and backward, finish the gradients, take their global norm, update.
//!
//! - Tensor parallel lives in the model (`Llama::tensor_parallel`: its shapes and its group's
//!   crossings); here only the gradients of the weights every TP rank holds whole (the norms,
//!   a mixture of experts' router and routed experts), whose parts come from each rank's token
//!   rows, are summed over the group once per step, packed into one all-reduce.
//! - Data parallel is either whole weights on every rank (`ParamState::Whole`: one process, or DDP
//!   summing gradients across ranks) or FSDP/HSDP shards (`ParamState::Sharded`).
//!
//! The trainer calls these and never asks which layout runs.

use std::sync::Arc;

use anyhow::Result;

use super::ddp::Ddp;
use super::fsdp::Fsdp;
use super::pipeline::runtime::PipelineRank;
use crate::backend::Backend;
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::llama::BlockGradHook;
use crate::model::params::TpSharding;
use crate::model::{Llama, ParamSet, Workspace};

/// A mixture-of-experts model's figures of a step, summed over the job.
pub struct MoeStepStats {
    /// Tokens each block sent to each expert (`[layer][expert]`).
    pub load: Vec<Vec<u64>>,
    /// The auxiliary loss (`router_aux_loss_coef`), when the model has one.
    pub aux_loss: Option<f64>,
}

/// Where this rank's weights and gradients live.
pub enum ParamState<B: Backend> {
    /// The whole (tensor-parallel rank's) model: one process, or DDP with `ddp`. With bf16 mixed
    /// precision, `bf16_copy` is the rounded set the forward and backward compute with.
    Whole {
        params: ParamSet<B>,
        grads: ParamSet<B>,
        bf16_copy: Option<ParamSet<B>>,
        ddp: Option<Ddp<B>>,
    },
    /// FSDP/HSDP: this rank's shards in `fsdp`; `full` and `grads` are the working sets whose
    /// tensors exist only while a block computes.
    Sharded {
        fsdp: Fsdp<B>,
        full: ParamSet<B>,
        grads: ParamSet<B>,
    },
}

/// One rank's model and layout.
pub struct RankLayout<B: Backend> {
    pub model: Llama<B>,
    pub state: ParamState<B>,
    /// The ranks that split the batch (`dp_replicate × dp_shard`): loss sums and target counts
    /// are summed over them. None in one process.
    batch_group: Option<Arc<dyn ProcessGroup>>,
    /// The tensor-parallel group, when its degree is above 1.
    tp_group: Option<Arc<dyn ProcessGroup>>,
    /// Whether each parameter is replicated over the tensor-parallel group.
    tp_replicated: Vec<bool>,
    /// This rank's pipeline stages and schedule, when the pipeline degree is above 1: the
    /// micro-batches then run through the schedule, and the loss and the gradient norm are summed
    /// over the pipeline ranks.
    pub pipeline: Option<PipelineRank<B>>,
}

impl<B: Backend> ParamState<B> {
    /// Frees every whole tensor `keep` rejects (a pipeline rank's other stages).
    pub fn keep_only(&mut self, be: &B, keep: impl Fn(&str) -> bool) {
        if let ParamState::Whole {
            params,
            grads,
            bf16_copy,
            ..
        } = self
        {
            params.keep_only(be, &keep);
            grads.keep_only(be, &keep);
            if let Some(c) = bf16_copy {
                c.keep_only(be, &keep);
            }
        }
    }
}

impl<B: Backend> RankLayout<B> {
    pub fn new(
        model: Llama<B>,
        state: ParamState<B>,
        batch_group: Option<Arc<dyn ProcessGroup>>,
        tp_group: Option<Arc<dyn ProcessGroup>>,
        pipeline: Option<PipelineRank<B>>,
    ) -> Self {
        let tp_replicated = model
            .param_specs()
            .iter()
            .map(|(name, _)| TpSharding::of(name) == TpSharding::Replicated)
            .collect();
        RankLayout {
            model,
            state,
            batch_group,
            tp_group: tp_group.filter(|g| g.size() > 1),
            tp_replicated,
            pipeline,
        }
    }

    /// `x` summed over the ranks that split the batch.
    pub fn sum_over_batch(&self, x: f64) -> Result<f64> {
        match &self.batch_group {
            Some(g) => all_reduce_sum_f64(g.as_ref(), x),
            None => Ok(x),
        }
    }

    /// Forward and backward of every micro-batch, gradients accumulated (scaled by `grad_scale`,
    /// 1 / the step's global number of targets) and, once this returns, complete: summed over the
    /// data-parallel ranks and, for replicated weights, over the tensor-parallel group. Returns
    /// this rank's sum of token losses.
    pub fn forward_backward(
        &mut self,
        be: &B,
        ws: &mut Workspace<B>,
        micro: &[Vec<u32>],
        grad_scale: f32,
    ) -> Result<f64> {
        let model = &self.model;
        let mut loss_sum = 0.0;
        match &mut self.state {
            ParamState::Whole {
                params,
                grads,
                bf16_copy,
                ddp,
            } => {
                if let Some(c) = bf16_copy.as_mut() {
                    c.refresh_bf16_copy(be, params);
                }
                grads.zero(be);
                let compute: &ParamSet<B> = bf16_copy.as_ref().unwrap_or(params);
                if let Some(pipe) = self.pipeline.as_mut() {
                    for tokens in micro {
                        loss_sum +=
                            pipe.forward_backward(be, model, compute, grads, tokens, grad_scale)?;
                    }
                    pipe.sum_tied_grad(be, model, grads)?;
                    // DDP sums every gradient of the stages at once after the last microbatch.
                    if let Some(d) = ddp {
                        d.reducer.finish(be, grads, &[])?;
                    }
                } else {
                    for (m, tokens) in micro.iter().enumerate() {
                        // DDP reduces during the last micro-batch's backward (earlier ones
                        // accumulate).
                        let hook: Option<&mut dyn BlockGradHook<B>> = match ddp.as_mut() {
                            Some(d) if m + 1 == micro.len() => Some(d.reducer.as_mut()),
                            _ => None,
                        };
                        loss_sum += model
                            .forward_backward_with(
                                be, compute, grads, ws, tokens, grad_scale, hook,
                            )?
                            .sum;
                    }
                    if let Some(d) = ddp {
                        d.reducer.finish(be, grads, &model.ids.layers)?;
                    }
                }
            }
            ParamState::Sharded { fsdp, full, grads } => {
                fsdp.grad_shards.zero(be);
                for tokens in micro {
                    loss_sum += match self.pipeline.as_mut() {
                        Some(pipe) => fsdp.with_all_gathered(be, full, grads, |full, grads| {
                            let loss =
                                pipe.forward_backward(be, model, full, grads, tokens, grad_scale)?;
                            pipe.sum_tied_grad(be, model, grads)?;
                            Ok(loss)
                        })?,
                        None => {
                            fsdp.forward_backward(be, model, full, grads, ws, tokens, grad_scale)?
                                .sum
                        }
                    };
                }
            }
        }
        // Only the last stage computes the loss.
        if let Some(pipe) = &self.pipeline {
            loss_sum = all_reduce_sum_f64(pipe.group(), loss_sum)?;
        }
        if self.tp_group.is_some() {
            let grads = match &mut self.state {
                ParamState::Whole { grads, .. } => grads,
                ParamState::Sharded { fsdp, .. } => &mut fsdp.grad_shards,
            };
            // One all-reduce for all of them (a MoE block has three per expert, mostly small).
            let ids: Vec<usize> = (0..grads.len())
                .filter(|&i| self.tp_replicated[i] && be.len(&grads.bufs[i]) > 0)
                .collect();
            let total: usize = ids.iter().map(|&i| be.len(&grads.bufs[i])).sum();
            let mut packed = be.uninit(total);
            let mut at = 0;
            for &i in &ids {
                let n = be.len(&grads.bufs[i]);
                be.copy_range(&mut packed, at, &grads.bufs[i], 0, n);
                at += n;
            }
            if total > 0 {
                self.model.tp().all_reduce_sum(be, &mut packed)?;
            }
            at = 0;
            for &i in &ids {
                let n = be.len(&grads.bufs[i]);
                be.copy_range(&mut grads.bufs[i], 0, &packed, at, n);
                at += n;
            }
        }
        Ok(loss_sum)
    }

    /// This rank's sum of token losses and their count over `batches`, without gradients
    /// (validation), under the same layout as training.
    pub fn loss(
        &mut self,
        be: &B,
        ws: &mut Workspace<B>,
        batches: &[Vec<u32>],
    ) -> Result<(f64, u64)> {
        let model = &self.model;
        let pipe = self.pipeline.as_ref();
        let (mut sum, mut count) = (0.0, 0);
        for tokens in batches {
            let (s, c) = match (&mut self.state, pipe) {
                (
                    ParamState::Whole {
                        params, bf16_copy, ..
                    },
                    _,
                ) => {
                    if let Some(c) = bf16_copy.as_mut() {
                        c.refresh_bf16_copy(be, params);
                    }
                    let compute: &ParamSet<B> = bf16_copy.as_ref().unwrap_or(params);
                    match pipe {
                        Some(p) => p.loss(be, model, compute, ws, tokens)?,
                        None => model.loss(be, compute, ws, tokens)?.into(),
                    }
                }
                (ParamState::Sharded { fsdp, full, .. }, Some(p)) => {
                    fsdp.with_weights_gathered(be, full, |full| {
                        p.loss(be, model, full, ws, tokens)
                    })?
                }
                (ParamState::Sharded { fsdp, full, .. }, None) => {
                    fsdp.loss(be, model, full, ws, tokens)?.into()
                }
            };
            sum += s;
            count += c;
        }
        // Only the last stage computes the loss.
        if let Some(p) = pipe {
            sum = all_reduce_sum_f64(p.group(), sum)?;
            count = all_reduce_sum_f64(p.group(), count as f64)?.round() as u64;
        }
        Ok((sum, count))
    }

    /// Tokens each mixture-of-experts block sent to each expert since the last call, and the
    /// auxiliary loss, summed over the job (every rank calls this together: the ranks that split the batch and the sequences, the
    /// tensor-parallel ranks, each routing its own rows, and the pipeline's, each holding its own
    /// blocks' counts). None for a dense model.
    pub fn moe_step_stats(&self) -> Result<Option<MoeStepStats>> {
        let Some(load) = self.model.take_expert_load() else {
            return Ok(None);
        };
        let aux = self.model.take_aux_loss();
        let experts = load.first().map_or(0, Vec::len);
        // Exact in f32 up to 2^24 tokens per expert and step.
        let mut flat: Vec<f32> = load.iter().flatten().map(|&c| c as f32).collect();
        // The auxiliary loss's share rides along (summed likewise: every rank adds its own).
        flat.extend(aux.map(|a| a as f32));
        // Tensor-parallel ranks route their own sequence-parallel rows.
        for g in [
            self.batch_group.as_deref(),
            self.tp_group.as_deref(),
            self.pipeline.as_ref().map(|p| p.group()),
        ]
        .into_iter()
        .flatten()
        {
            g.all_reduce(&mut flat, ReduceOp::Sum)?;
        }
        let aux_loss = aux.map(|_| flat.pop().unwrap_or(0.0) as f64);
        Ok(Some(MoeStepStats {
            load: flat
                .chunks(experts.max(1))
                .map(|l| l.iter().map(|&c| c.round() as u64).collect())
                .collect(),
            aux_loss,
        }))
    }

    /// The step's gradients as the optimizer reads them (FSDP: this rank's shards).
    pub fn grads(&self) -> &ParamSet<B> {
        match &self.state {
            ParamState::Whole { grads, .. } => grads,
            ParamState::Sharded { fsdp, .. } => &fsdp.grad_shards,
        }
    }

    /// The global L2 norm of the gradients: each tensor-parallel part and each FSDP shard counted
    /// once, the weights every TP rank holds whole counted once, HSDP's replicas once.
    pub fn grad_norm(&self, be: &B) -> Result<f64> {
        let grads = self.grads();
        let shard_group = match &self.state {
            ParamState::Sharded { fsdp, .. } => Some(fsdp.shard_group()),
            ParamState::Whole { .. } => None,
        };
        // Each pipeline rank holds its stages' gradients: summed over the pipeline too.
        let pipeline = self.pipeline.as_ref().map(|p| p.group());
        let over_shards = |x: f64| -> Result<f64> {
            let x = shard_group.map_or(Ok(x), |g| all_reduce_sum_f64(g, x))?;
            pipeline.map_or(Ok(x), |g| all_reduce_sum_f64(g, x))
        };
        // A tied embedding's copy on the last stage has the same gradient as the first's.
        let copy = self
            .pipeline
            .as_ref()
            .and_then(|p| p.copy_not_to_count(&self.model));
        let counted = |i: usize| copy != Some(i);
        let Some(tp) = &self.tp_group else {
            let mut sq = be.sum_squares_all(&grads.bufs);
            if let Some(i) = copy {
                // Rounding may leave a hair below zero; a NaN stays a NaN (training must stop).
                sq -= be.sum_squares(&grads.bufs[i]);
                if sq < 0.0 {
                    sq = 0.0;
                }
            }
            return Ok(over_shards(sq)?.sqrt());
        };
        let (mut split, mut replicated) = (0.0, 0.0);
        for (i, (g, &r)) in grads.bufs.iter().zip(&self.tp_replicated).enumerate() {
            if !counted(i) {
                continue;
            }
            let sq = be.sum_squares(g);
            if r {
                replicated += sq;
            } else {
                split += sq;
            }
        }
        // The replicated weights' gradients are equal on every TP rank: counted once.
        let split = all_reduce_sum_f64(tp.as_ref(), over_shards(split)?)?;
        Ok((split + over_shards(replicated)?).sqrt())
    }

    /// This rank's master weights (FSDP: its shards) with their gradients, for the optimizer.
    pub fn weights_and_grads(&mut self) -> (&mut ParamSet<B>, &ParamSet<B>) {
        match &mut self.state {
            ParamState::Whole { params, grads, .. } => (params, grads),
            ParamState::Sharded { fsdp, .. } => (&mut fsdp.shards, &fsdp.grad_shards),
        }
    }

    /// Every pipeline rank's measured bubble since the last call (`PipelineRank::take_bubble`),
    /// gathered over the pipeline group (all its ranks call this together); `None` without a
    /// pipeline.
    pub fn pipeline_bubbles(&mut self) -> Result<Option<Vec<f64>>> {
        let Some(pipe) = self.pipeline.as_mut() else {
            return Ok(None);
        };
        let mine = [pipe.take_bubble().unwrap_or(0.0) as f32];
        let g = pipe.group();
        let mut all = vec![0f32; g.size()];
        g.all_gather(&mine, &mut all)?;
        Ok(Some(all.into_iter().map(f64::from).collect()))
    }

    /// The tensor-parallel group (degree above 1), for gathering whole tensors.
    pub fn tp_group(&self) -> Option<&dyn ProcessGroup> {
        self.tp_group.as_deref()
    }
}

/// Sum of one f64 over a group, carried as two f32 (high part and remainder) so that token counts
/// and loss sums keep ~14 significant digits.
pub fn all_reduce_sum_f64(g: &dyn ProcessGroup, x: f64) -> Result<f64> {
    let hi = x as f32;
    let mut v = [hi, (x - hi as f64) as f32];
    g.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v[0] as f64 + v[1] as f64)
}
