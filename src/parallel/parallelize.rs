//! `parallelize`: a rank's layout composed once from its mesh groups, in TorchTitan's order:
//! tensor parallel → context parallel → expert parallel shape and wire the model
//! (`parallelize_model`); activation checkpointing chooses what each block keeps and the walk
//! gets its workspaces; FSDP/HSDP or DDP lay out the weights (`parallelize_layout`).
//!
//! Between the two the caller (`train::compose`) loads or initialises the weights: a checkpoint
//! is read by a layer above this one. What the config says arrives as `ParallelOptions`, so this
//! layer reads no config file type.

use std::sync::Arc;

use anyhow::{bail, Result};

use super::cp::{ContextParallelGroup, RotateMethod};
use super::ep::ExpertParallelGroup;
use super::layout::{LayoutParts, RankLayout};
use super::param_state::ParamState;
use super::pipeline::plan::PipelinePlan;
use super::tp::TensorParallelGroup;
use super::walk::Walk;
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::model::activation_checkpoint::ActivationPlan;
use crate::model::crossings::single_rank::SingleRank;
use crate::model::float8_convert::Float8Conversion;
use crate::model::{Decoder, LocalShapes, ModelArgs, Workspace};

/// The groups of this rank's mesh that its layout crosses (None: degree 1).
#[derive(Clone, Default)]
pub struct MeshGroups {
    pub tp: Option<Arc<dyn ProcessGroup>>,
    pub cp: Option<Arc<dyn ProcessGroup>>,
    pub ep: Option<Arc<dyn ProcessGroup>>,
    pub pp: Option<Arc<dyn ProcessGroup>>,
    /// The ranks whose loss sums and target counts add up to the step's.
    pub loss: Option<Arc<dyn ProcessGroup>>,
}

/// What `[parallelism]` asks of the model's crossings, and which linears the model converters
/// made float8.
#[derive(Debug, Clone)]
pub struct ParallelOptions {
    /// Cross-entropy over vocabulary shards (false: over gathered logits).
    pub loss_parallel: bool,
    /// Chunked TP collectives overlapping the GEMMs.
    pub async_tp: bool,
    pub rotate: RotateMethod,
    /// Sequences in an optimizer step over the whole job (the MoE auxiliary loss is their mean).
    pub global_batch: usize,
    /// `[model] converters`' float8 linears (none by default).
    pub float8: Float8Conversion,
    /// Block-causal attention over the documents the data marks in each sequence
    /// (`[model] attn_mask_type = "block_causal"`); false: causal over whole sequences.
    pub documents: bool,
}

/// This rank's shapes: its tensor-parallel heads and FFN slice, its context-parallel shard of
/// every sequence, its experts (refused when the model does not split evenly).
pub fn local_shapes(args: &ModelArgs, groups: &MeshGroups) -> Result<LocalShapes> {
    let mut local = match &groups.tp {
        Some(g) => LocalShapes::sharded(args, g.size(), g.rank())?,
        None => LocalShapes::whole(args),
    };
    if let Some(g) = &groups.cp {
        local = local.with_context_parallel(g.size(), g.rank());
    }
    if let Some(g) = &groups.ep {
        local = local.with_expert_parallel(g.size(), g.rank())?;
    }
    Ok(local)
}

/// Model converters → tensor parallel → context parallel → expert parallel: the model in this
/// rank's shapes, crossing its groups (with one rank each crossing is the local op; each takes its
/// collectives from its group: `comm::device_group`).
pub fn parallelize_model<B: Backend>(
    be: &B,
    args: &ModelArgs,
    seq: usize,
    groups: &MeshGroups,
    options: ParallelOptions,
) -> Result<Decoder<B>> {
    let local = local_shapes(args, groups)?;
    let float8 = options.float8;
    let model = match &groups.tp {
        Some(g) => {
            let ops = TensorParallelGroup::new(g.clone(), options.loss_parallel, options.async_tp);
            Decoder::tensor_parallel(be, args.clone(), seq, local, Arc::new(ops))?
        }
        None => Decoder::tensor_parallel(be, args.clone(), seq, local, Arc::new(SingleRank))?,
    }
    .with_float8(float8);
    let model = match &groups.cp {
        Some(g) => {
            let ops = ContextParallelGroup::new(g.clone(), options.rotate);
            model.with_context_parallel(Arc::new(ops))
        }
        None => model,
    };
    let model = match &groups.ep {
        Some(g) => model.with_expert_parallel(Arc::new(ExpertParallelGroup::new(g.clone()))),
        None => model,
    };
    let model = match options.documents {
        true => model.with_documents(),
        false => model,
    };
    Ok(model.with_sequences_per_step(options.global_batch))
}

/// Activation checkpointing → FSDP/DDP → pipeline: the rank's layout around `model`, its blocks
/// keeping what `plan` says in the walk's workspaces (one for `batch` sequences of `seq`, or one
/// per microbatch a pipeline rank holds), its weights in `state`. Returns the layout and, under a
/// pipeline, which parameters this rank holds (for the optimizer's state).
pub fn parallelize_layout<B: Backend>(
    be: &B,
    model: Decoder<B>,
    mut state: ParamState<B>,
    groups: &MeshGroups,
    pipeline: Option<PipelinePlan>,
    walk_shape: WalkShape<'_>,
) -> Result<RankLayout<B>> {
    let WalkShape {
        batch,
        seq,
        plan,
        timeout,
    } = walk_shape;
    let (pipeline, walk) = match pipeline {
        Some(p) => {
            let (rank, walk) = p.build(be, &model.local, seq, plan, timeout)?;
            state.keep_only(be, |name| rank.holds(name));
            (Some(rank), walk)
        }
        None => {
            let ws = Workspace::planned(be, &model.local, batch, seq, plan.clone());
            (None, Walk::one_stage(ws, model.args.n_layers, seq)?)
        }
    };
    Ok(RankLayout::new(LayoutParts {
        model,
        state,
        walk,
        batch_group: groups.loss.clone(),
        tp_group: groups.tp.clone(),
        pipeline,
    }))
}

/// The shape of the walk's workspaces.
pub struct WalkShape<'a> {
    pub batch: usize,
    pub seq: usize,
    /// What each block keeps (activation checkpointing).
    pub plan: &'a ActivationPlan,
    /// How long a pipeline transfer may wait.
    pub timeout: std::time::Duration,
}

/// Refuses an expert-parallel degree that has no group (one process).
pub fn check_expert_degree(ep_degree: usize, groups: &MeshGroups) -> Result<()> {
    if ep_degree > 1 && groups.ep.is_none() {
        bail!("[parallelism] expert_parallel_degree = {ep_degree} needs {ep_degree} ranks of data_parallel_shard_degree × context_parallel_degree; this job runs one process (launch it with --nproc)");
    }
    Ok(())
}
