//! A rank's layout, composed once from the mesh (`parallelize`), and the operations one training
//! step needs of it whatever the layout: walk the micro-batches' forward and backward (`walk`),
//! finish the gradients, take their global norm, update.
//!
//! - Tensor parallel lives in the model (`Decoder::tensor_parallel`: its shapes and its group's
//!   crossings); here only the gradients of the weights every TP rank holds whole (the norms,
//!   a mixture of experts' router and routed experts), whose parts come from each rank's token
//!   rows, are summed over the group once per step, packed into one all-reduce.
//! - Data parallel is either whole weights on every rank (`ParamState::Whole`: one process, or DDP
//!   summing gradients across ranks) or FSDP/HSDP shards (`ParamState::Sharded`).
//!
//! The trainer calls these and never asks which layout runs.

use std::sync::Arc;

use anyhow::Result;

pub use super::param_state::{ParamState, WholeParams};
use super::pipeline::rank::PipelineRank;
use super::walk::{PassKind, Walk};
use crate::backend::Backend;
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::moe::stats::ExpertFigures;
use crate::model::params::TpSharding;
use crate::model::{Decoder, ParamSet, Workspace};

/// A mixture-of-experts model's figures of a step, summed over the job.
pub struct MoeStepStats {
    /// Tokens each block sent to each expert (`[layer][expert]`).
    pub load: Vec<Vec<u64>>,
    /// The auxiliary loss (`router_aux_loss_coef`), when the model has one.
    pub aux_loss: Option<f64>,
}

/// One rank's model and layout.
pub struct RankLayout<B: Backend> {
    pub model: Decoder<B>,
    pub state: ParamState<B>,
    /// The rank's action list with its workspaces (one stage, or its pipeline schedule).
    pub walk: Walk<B>,
    /// The ranks that split the batch (`dp_replicate × dp_shard`): loss sums and target counts
    /// are summed over them. None in one process.
    batch_group: Option<Arc<dyn ProcessGroup>>,
    /// The tensor-parallel group, when its degree is above 1.
    tp_group: Option<Arc<dyn ProcessGroup>>,
    /// Whether each parameter is replicated over the tensor-parallel group.
    tp_replicated: Vec<bool>,
    /// This rank's pipeline stages, when the pipeline degree is above 1: the loss and the
    /// gradient norm are then summed over the pipeline ranks.
    pub pipeline: Option<PipelineRank>,
}

/// A rank's parts, for `RankLayout::new`.
pub struct LayoutParts<B: Backend> {
    pub model: Decoder<B>,
    pub state: ParamState<B>,
    pub walk: Walk<B>,
    pub batch_group: Option<Arc<dyn ProcessGroup>>,
    pub tp_group: Option<Arc<dyn ProcessGroup>>,
    pub pipeline: Option<PipelineRank>,
}

impl<B: Backend> RankLayout<B> {
    pub fn new(parts: LayoutParts<B>) -> Self {
        let LayoutParts {
            model,
            mut state,
            walk,
            batch_group,
            tp_group,
            pipeline,
        } = parts;
        let tp_replicated = model
            .param_specs()
            .iter()
            .map(|(name, _)| TpSharding::of(name) == TpSharding::Replicated)
            .collect();
        // Under a pipeline FSDP gathers a stage's weights for the whole pass, and DDP sums every
        // gradient after the step's last microbatch.
        match &mut state {
            ParamState::Whole(w) => w.ddp_per_block = pipeline.is_none(),
            ParamState::Sharded(s) => s.per_pass = pipeline.is_some(),
        }
        RankLayout {
            model,
            state,
            walk,
            batch_group,
            tp_group: tp_group.filter(|g| g.size() > 1),
            tp_replicated,
            pipeline,
        }
    }

    /// Positions of each whole sequence of the training batches.
    pub fn seq(&self) -> usize {
        self.walk.seq
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
    pub fn forward_backward(&mut self, be: &B, micro: &[Vec<u32>], grad_scale: f32) -> Result<f64> {
        let (model, pipeline) = (&self.model, self.pipeline.as_ref());
        // A tied embedding's two stages sum their gradients of it before the gradients leave
        // the working set.
        let complete = |grads: &mut ParamSet<B>| match pipeline {
            Some(p) => p.sum_tied_grad(be, model, grads),
            None => Ok(()),
        };
        self.state.begin_step(be);
        let mut loss_sum = 0.0;
        for (m, tokens) in micro.iter().enumerate() {
            let pass = PassKind::Train {
                grad_scale,
                last_microbatch: m + 1 == micro.len(),
            };
            let hooks = self.state.hooks();
            loss_sum += self
                .walk
                .forward_backward(be, model, hooks, tokens, pass, &complete)?;
        }
        self.state.finish_step(be, &model.ids.layers, &complete)?;
        // Only the last stage computes the loss.
        if let Some(pipe) = pipeline {
            loss_sum = all_reduce_sum_f64(pipe.group(), loss_sum)?;
        }
        self.sum_replicated_grads(be)?;
        Ok(loss_sum)
    }

    /// The gradients of the weights every tensor-parallel rank holds whole (norms, a mixture of
    /// experts' router and experts), each rank's from its own token rows, summed over the group in
    /// one packed all-reduce (a MoE block has three per expert, mostly small).
    fn sum_replicated_grads(&mut self, be: &B) -> Result<()> {
        if self.tp_group.is_none() {
            return Ok(());
        }
        let grads = self.state.grads_mut();
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
        Ok(())
    }

    /// This rank's sum of token losses and their count over `batches`, without gradients
    /// (validation), under the same layout as training, in `ws` (None: the training workspace,
    /// when the shapes are the same).
    pub fn loss(
        &mut self,
        be: &B,
        mut ws: Option<&mut Workspace<B>>,
        batches: &[Vec<u32>],
    ) -> Result<(f64, u64)> {
        let (mut sum, mut count) = (0.0, 0);
        for tokens in batches {
            let hooks = self.state.hooks();
            let ws = ws.as_deref_mut();
            let (s, c) = self.walk.loss(be, &self.model, hooks, ws, tokens)?;
            sum += s;
            count += c;
        }
        // Only the last stage computes the loss.
        if let Some(p) = &self.pipeline {
            sum = all_reduce_sum_f64(p.group(), sum)?;
            count = all_reduce_sum_f64(p.group(), count as f64)?.round() as u64;
        }
        Ok((sum, count))
    }

    /// Tokens each mixture-of-experts block sent to each expert since the last call, and the
    /// auxiliary loss, summed over the job (every rank calls this together: the ranks that split the batch and the sequences, the
    /// tensor-parallel ranks, each routing its own rows, and the pipeline's, each holding its own
    /// blocks' counts). None for a dense model.
    pub fn moe_step_stats(&mut self, be: &B) -> Result<Option<MoeStepStats>> {
        let Some(ExpertFigures {
            load,
            aux_loss: aux,
        }) = self.walk.take_expert_stats(be)
        else {
            return Ok(None);
        };
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
        self.state.grads()
    }

    /// The global L2 norm of the gradients: each tensor-parallel part and each FSDP shard counted
    /// once, the weights every TP rank holds whole counted once, HSDP's replicas once.
    pub fn grad_norm(&self, be: &B) -> Result<f64> {
        let grads = self.grads();
        let shard_group = match &self.state {
            ParamState::Sharded(s) => Some(s.fsdp.shard_group()),
            ParamState::Whole(_) => None,
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
        self.state.weights_and_grads()
    }

    /// Every pipeline rank's measured bubble since the last call (`Walk::take_bubble`),
    /// gathered over the pipeline group (all its ranks call this together); `None` without a
    /// pipeline.
    pub fn pipeline_bubbles(&mut self) -> Result<Option<Vec<f64>>> {
        let Some(pipe) = self.pipeline.as_ref() else {
            return Ok(None);
        };
        let mine = [self.walk.take_bubble().unwrap_or(0.0) as f32];
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
