//! A rank composed from the config and its place in the mesh, once, before the first step: the
//! model in this rank's tensor-parallel shapes, its weights laid out for data parallelism (whole,
//! DDP or FSDP/HSDP shards, freshly initialised or resumed), the optimizer, the walk with its workspaces, and the
//! memory estimate that refused the layout if it could not fit. `titan train` and
//! `titan bench train` both build their ranks here, so a benchmark measures the layout training runs.
//!
//! Also where a process learns its place: per device, its distribution with the road its
//! collectives take (`RankPlace`, `launch::device_groups`).

use anyhow::{bail, Result};

use super::fit::RankSizing;
use super::memory::{DeviceSizing, MemoryEstimate};
use super::muon::NewtonSchulz;
use super::optimizer::Optimizer;
use super::place::MeshPlace;
use super::start::{start_state, Resumed, StartInputs, StartState};
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::config::Config;
use crate::launch::device_groups;
use crate::launch::Distributed;
use crate::memory_timeline;
use crate::model::activation_checkpoint::AcMode;
use crate::model::float8_convert::Float8Conversion;
use crate::model::params::TpSharding;
use crate::model::{Decoder, LocalShapes, ModelArgs, ParamDtype, ReduceDtype};
use crate::parallel::cp::RotateMethod;
use crate::parallel::fsdp::{ExpertShards, Float8Gather, ReshardPolicy, ShardedParams};
use crate::parallel::layout::{ParamState, RankLayout, WholeParams};
use crate::parallel::muon_exchange::{ExchangeInputs, MuonExchange, Piece};
use crate::parallel::parallelize::{
    check_expert_degree, local_shapes, parallelize_layout, parallelize_model, MeshGroups,
    ParallelOptions, WalkShape,
};
use crate::parallel::pipeline::plan::{PipelineOptions, PipelinePlan};

/// This process's place in the job and what its device can do.
pub struct RankPlace {
    /// None in one process.
    pub dist: Option<Distributed>,
    /// What carries the collectives of the groups with a device communicator (NCCL), None
    /// when every collective goes through the host.
    pub device_collectives: Option<&'static str>,
    /// Ranks (this one included) sharing the memory the memory check compares with: the host's,
    /// or this rank's GPU.
    pub ranks_sharing_memory: usize,
}

impl RankPlace {
    /// A CPU rank: collectives through the host (or `TITAN_DEVICE_COLLECTIVES=host`'s device
    /// road, `device_groups::for_cpu`).
    pub fn cpu(cfg: &Config) -> Result<Self> {
        let dist = Distributed::from_env(cfg)?;
        let road = device_groups::for_cpu(dist.as_ref(), uses_muon(cfg))?;
        let ranks_sharing_memory = dist.as_ref().map_or(1, |d| d.local_world_size);
        Ok(RankPlace {
            dist,
            device_collectives: road.carrier,
            ranks_sharing_memory,
        })
    }

    /// A CUDA rank: NCCL when every rank has a GPU of its own (see `device_groups::for_cuda`).
    pub fn cuda(cfg: &Config, be: &CudaBackend, quiet: bool) -> Result<Self> {
        let dist = Distributed::from_env(cfg)?;
        let road = device_groups::for_cuda(dist.as_ref(), be, (quiet, uses_muon(cfg)))?;
        Ok(RankPlace {
            dist,
            device_collectives: road.carrier,
            ranks_sharing_memory: road.ranks_on_my_gpu,
        })
    }
}

/// Whether the job's optimizer is Muon (its exchange crosses the group of every rank).
fn uses_muon(cfg: &Config) -> bool {
    cfg.optimizer.name == "Muon"
}

/// A rank ready to train.
pub struct ComposedRank<B: Backend> {
    pub args: ModelArgs,
    /// This rank's tensor-parallel shapes.
    pub local: LocalShapes,
    pub layout: RankLayout<B>,
    pub opt: Optimizer<B>,
    /// The memory estimate per rank the layout was checked against.
    pub estimate: MemoryEstimate,
    /// Micro-batches per step, and the global batch (sequences per step).
    pub accum: usize,
    pub global_batch: usize,
    /// Set when the run resumed from a checkpoint.
    pub resumed: Option<Resumed>,
    /// What carries the collectives on the device (NCCL), None when they go through the host.
    pub device_collectives: Option<&'static str>,
}

/// What `[parallelism]` asks of the model's crossings.
fn parallel_options(cfg: &Config, plan: &RankPlan) -> Result<ParallelOptions> {
    let p = &cfg.parallelism;
    Ok(ParallelOptions {
        loss_parallel: !p.disable_loss_parallel,
        async_tp: p.enable_async_tensor_parallel,
        rotate: RotateMethod::parse(&p.context_parallel_rotate_method)?,
        global_batch: plan.global_batch,
        float8: plan.float8.clone(),
        documents: cfg.model.attn_mask_type == "block_causal",
    })
}

/// The pipeline `[parallelism]` asks for over the `pp` group, if any.
fn pipeline_plan(
    cfg: &Config,
    args: &ModelArgs,
    groups: &MeshGroups,
) -> Result<Option<PipelinePlan>> {
    let Some(group) = groups.pp.clone() else {
        return Ok(None);
    };
    let p = &cfg.parallelism;
    let options = PipelineOptions {
        pipeline_parallel_schedule: &p.pipeline_parallel_schedule,
        pipeline_parallel_schedule_csv: &p.pipeline_parallel_schedule_csv,
        pipeline_parallel_microbatch_size: p.pipeline_parallel_microbatch_size,
        pipeline_parallel_layers_per_stage: p.pipeline_parallel_layers_per_stage,
        pipeline_parallel_split_points: &p.pipeline_parallel_split_points,
        local_batch_size: cfg.training.local_batch_size,
    };
    Ok(Some(PipelinePlan::new(&options, args, group)?))
}

/// The checks of how the batch splits that only the shapes can make: the sequence-parallel
/// shards of a (micro)batch, async TP's row copies, the global batch over the data-parallel
/// ranks. Returns the microbatches per step (gradient accumulation) and the global batch.
fn check_batch(
    be: &dyn DeviceSizing,
    cfg: &Config,
    local: &LocalShapes,
    dp_size: usize,
    pipeline: Option<&PipelinePlan>,
) -> Result<(usize, usize)> {
    let t = &cfg.training;
    let (batch, seq) = (t.local_batch_size, t.seq_len);
    let local_tokens = batch * local.local_seq(seq);
    if !local_tokens.is_multiple_of(local.tp) {
        bail!("[training] local_batch_size {batch} × seq_len {seq} / context_parallel_degree {} = {local_tokens} tokens do not split into tensor_parallel_degree {} equal sequence-parallel shards; make their product a multiple of it", local.cp, local.tp);
    }
    // Async TP copies chunks of rows into and out of the activations; a device keeping some of
    // them in bf16 alone has no f32 rows to copy.
    if cfg.parallelism.enable_async_tensor_parallel
        && local.tp > 1
        && be.bf16_activation_f32_bytes() < 4
    {
        bail!("[parallelism] enable_async_tensor_parallel = true with bfloat16 activations kept in bf16 alone on this GPU is not supported yet: set TITAN_CUDA_BF16_COPIES=off (f32 activations with bf16 copies off), use [training] mixed_precision_param = \"float32\" or \"tfloat32\", or turn async TP off");
    }
    let global_batch = cfg.global_batch_size_for(dp_size);
    if !global_batch.is_multiple_of(batch * dp_size) {
        bail!("[training] global_batch_size = {global_batch} is not a multiple of local_batch_size {batch} × data-parallel degree {dp_size}");
    }
    if let Some(p) = pipeline {
        let tokens = p.microbatch_rows * local.local_seq(seq);
        if !tokens.is_multiple_of(local.tp) {
            bail!("[parallelism] pipeline_parallel_microbatch_size {} × seq_len {seq} / context_parallel_degree {} = {tokens} tokens per microbatch do not split into tensor_parallel_degree {} equal sequence-parallel shards; make their product a multiple of it", p.microbatch_rows, local.cp, local.tp);
        }
    }
    Ok((global_batch / (batch * dp_size), global_batch))
}

/// What the config and this rank's place decide before anything is allocated: the shapes, the
/// mesh groups, the pipeline, the batch split and the memory estimate the layout was checked
/// against (`titan plan` reads the same for each layout it weighs).
pub struct RankPlan {
    pub args: ModelArgs,
    local: LocalShapes,
    groups: MeshGroups,
    pub pipeline: Option<PipelinePlan>,
    /// Microbatches per step (gradient accumulation) and the global batch.
    pub accum: usize,
    global_batch: usize,
    /// FSDP/HSDP shards the parameters (else they stay whole, with DDP over `dp` ranks).
    fsdp: bool,
    param_dtype: ParamDtype,
    pub reduce_dtype: ReduceDtype,
    reshard: ReshardPolicy,
    ac: AcMode,
    pub estimate: MemoryEstimate,
    /// The linears `[model] converters` made float8.
    pub float8: Float8Conversion,
}

impl RankPlan {
    /// Every check the config alone can make, and the memory estimate (with the activation
    /// checkpointing that would fit suggested when it does not).
    fn check(
        be: &dyn DeviceSizing,
        cfg: &Config,
        place: MeshPlace,
        ranks_sharing_memory: usize,
    ) -> Result<Self> {
        Self::build(be, cfg, place, Some(ranks_sharing_memory))
    }

    /// The plan of the rank at `place` with its estimate, not checked against any memory
    /// (`titan plan` compares it with the planned device's).
    pub fn sized(be: &dyn DeviceSizing, cfg: &Config, place: MeshPlace) -> Result<Self> {
        Self::build(be, cfg, place, None)
    }

    /// The plan; with `ranks_sharing_memory`, its estimate checked against the free memory.
    fn build(
        be: &dyn DeviceSizing,
        cfg: &Config,
        place: MeshPlace,
        ranks_sharing_memory: Option<usize>,
    ) -> Result<Self> {
        let args = cfg.model_args()?;
        let (batch, seq) = (cfg.training.local_batch_size, cfg.training.seq_len);
        let MeshPlace {
            groups,
            dp_size,
            fsdp_shard,
            rank,
        } = place;
        let fsdp = fsdp_shard.is_some();
        let local = local_shapes(&args, &groups)?;
        check_expert_degree(cfg.parallelism.expert_parallel_degree, &groups)?;
        let pipeline = pipeline_plan(cfg, &args, &groups)?;
        let (accum, global_batch) = check_batch(be, cfg, &local, dp_size, pipeline.as_ref())?;
        let param_dtype = ParamDtype::from_config(&cfg.training.mixed_precision_param);
        let reduce_dtype = ReduceDtype::from_config(&cfg.training.mixed_precision_reduce);
        let reshard = ReshardPolicy::parse(&cfg.parallelism.fsdp_reshard_after_forward)
            .expect("validated with the config");
        let ac = cfg.activation_checkpoint.mode()?;
        let (linears, experts) = (cfg.float8_linears()?, cfg.float8_experts()?);
        let mut float8 = match &linears {
            Some(options) => Float8Conversion::plan(&args, options)?,
            None if experts.is_some() => Float8Conversion::no_linears(&args),
            None => Float8Conversion::default(),
        };
        if let Some((recipe, fqns)) = experts {
            float8 = float8.with_experts(&args, recipe, fqns);
        }
        if cfg.fsdp_float8_all_gather().is_some() {
            float8 = float8.with_fsdp_float8_all_gather(fsdp);
        }
        let float8 = float8.for_tensor_parallel(&args, local.tp)?;
        let sizing = RankSizing {
            be,
            cfg,
            args: &args,
            local: &local,
            batch,
            seq,
            pipeline: pipeline.as_ref(),
            rotate: RotateMethod::parse(&cfg.parallelism.context_parallel_rotate_method)?,
            param_dtype,
            fsdp_shard,
            reshard,
            ranks_sharing_memory: ranks_sharing_memory.unwrap_or(1),
            rank,
            float8: float8.converted() > 0,
            float8_head: float8.head().is_some(),
        };
        let estimate = match ranks_sharing_memory {
            Some(_) => sizing.check_or_suggest(ac)?,
            None => sizing.estimate(&sizing.plan_of(ac)),
        };
        Ok(RankPlan {
            args,
            local,
            groups,
            pipeline,
            accum,
            global_batch,
            fsdp,
            param_dtype,
            reduce_dtype,
            reshard,
            ac,
            estimate,
            float8,
        })
    }
}

/// The layout `[parallelism]` asks for, on `be`, for this rank, composed by `parallelize`
/// (tensor → context → expert parallel shape the model; activation checkpointing and FSDP/DDP
/// lay out the rest) with the weights loaded or initialised in between. Everything the config
/// alone decides is checked, and the memory estimate, before anything is allocated.
pub fn compose_rank<B: Backend>(
    be: &B,
    cfg: &Config,
    place: &RankPlace,
) -> Result<ComposedRank<B>> {
    let dist = place.dist.as_ref();
    let plan = RankPlan::check(be, cfg, MeshPlace::of(dist), place.ranks_sharing_memory)?;
    let (seq, options) = (cfg.training.seq_len, parallel_options(cfg, &plan)?);
    let mut model = parallelize_model(be, &plan.args, seq, &plan.groups, options)?;
    let (state, mut opt, resumed) = param_state(be, cfg, dist, &plan, &mut model)?;
    let walk_shape = WalkShape {
        batch: cfg.training.local_batch_size,
        seq,
        plan: &plan
            .param_dtype
            .activation_plan(plan.ac, plan.args.n_layers),
        timeout: std::time::Duration::from_secs(cfg.comm.train_timeout_seconds),
    };
    let layout = parallelize_layout(be, model, state, &plan.groups, plan.pipeline, walk_shape)?;
    if let Some(p) = &layout.pipeline {
        opt.keep_only(be, |name| p.holds(name));
    }
    if let Some(d) = dist.filter(|d| d.world > 1 && cfg.optimizer.name == "Muon") {
        opt.set_exchange(muon_exchange(be, d, &layout, &opt)?);
    }
    for (category, bytes) in plan.estimate.by_category(plan.fsdp, false) {
        memory_timeline::set(category, bytes);
    }
    Ok(ComposedRank {
        args: plan.args,
        local: plan.local,
        layout,
        opt,
        estimate: plan.estimate,
        accum: plan.accum,
        global_batch: plan.global_batch,
        resumed,
        device_collectives: place.device_collectives,
    })
}

/// Distributed Muon's plan (collective over the job): the piece of each of its matrices this
/// rank holds, its tensor-parallel part and, under FSDP, its shard's range.
fn muon_exchange<B: Backend>(
    be: &B,
    dist: &Distributed,
    layout: &RankLayout<B>,
    opt: &Optimizer<B>,
) -> Result<MuonExchange> {
    let names = &layout.grads().names;
    let (tp_rank, tp_parts) = dist
        .groups
        .tp
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.size()));
    let slots = opt
        .muon_slots(be, layout.grads())
        .into_iter()
        .map(|i| {
            let (lo, hi) = layout.state.held_range(be, i);
            let split = match tp_parts {
                1 => TpSharding::Replicated,
                _ => TpSharding::of(&names[i]),
            };
            let piece = Piece {
                matrix: i,
                split,
                tp_rank,
                tp_parts,
                lo,
                hi,
            };
            ((hi > lo).then_some(piece), be.len(&layout.grads().bufs[i]))
        })
        .collect();
    let ns = NewtonSchulz::of(&opt.cfg);
    MuonExchange::new(ExchangeInputs {
        group: dist.groups.all.clone(),
        slots,
        shapes: opt.muon_shapes(),
        names,
        cost: &|rows, cols| ns.flops(rows, cols),
    })
}

/// The model's parameters, gradients and optimizer, initialised or resumed, laid out whole (with
/// DDP across data-parallel ranks) or as FSDP/HSDP shards; and the checkpoint resumed from. A
/// model started from a Hugging Face DeepSeek-V3 routes with its routing bias.
fn param_state<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&Distributed>,
    plan: &RankPlan,
    model: &mut Decoder<B>,
) -> Result<(ParamState<B>, Optimizer<B>, Option<Resumed>)> {
    let expert_shards = dist
        .and_then(|d| d.groups.expert_shard.clone())
        .map(|group| ExpertShards {
            group,
            replicate: dist.and_then(|d| d.groups.expert_replicate.clone()),
        });
    let pipeline = plan.pipeline.as_ref();
    let held = |name: &str| pipeline.is_none_or(|p| p.holds(name));
    let holder = |name: &str| pipeline.map_or(0, |p| p.holder(name));
    let start = start_state(
        be,
        StartInputs {
            cfg,
            model,
            dist,
            fsdp: plan.fsdp,
            experts: expert_shards,
            reshard: plan.reshard,
            param_dtype: plan.param_dtype,
            reduce_dtype: plan.reduce_dtype,
            held: pipeline
                .is_some()
                .then_some(&held as &(dyn Fn(&str) -> bool + Sync)),
            holder: pipeline
                .is_some()
                .then_some(&holder as &(dyn Fn(&str) -> usize + Sync)),
        },
    )?;
    let StartState {
        params,
        grads,
        opt,
        fsdp,
        resumed,
        initial_expert_bias,
    } = start;
    if let Some(bias) = initial_expert_bias {
        model.set_expert_bias(be, &bias)?;
    }
    // bf16 mixed precision without FSDP: a compute copy of the parameters, rounded each step (FSDP
    // rounds while it packs its all-gathers instead).
    let state = match fsdp {
        Some(mut fsdp) => {
            if let Some(precompute) = cfg.fsdp_float8_all_gather() {
                let weights = plan.float8.gathered_weights(&model.ids);
                let tp = dist
                    .and_then(|d| d.groups.tp.clone())
                    .filter(|g| g.size() > 1);
                let n = model.param_specs().len();
                fsdp.gather_in_float8(Float8Gather::new(n, &weights, tp, precompute));
            }
            ParamState::Sharded(ShardedParams::new(fsdp, params, grads, false))
        }
        None => {
            let dp_size = dist.map_or(1, |d| d.groups.dp.size());
            let ddp = dist
                .filter(|_| !plan.fsdp && dp_size > 1)
                .map(|d| crate::parallel::ddp::Ddp::new(d.groups.dp.clone(), plan.reduce_dtype));
            let bf16 = plan.param_dtype == ParamDtype::BFloat16;
            let blocks = model.ids.layers.iter().map(|l| l.all()).collect();
            ParamState::Whole(WholeParams::new(be, (params, grads), bf16, ddp, blocks))
        }
    };
    Ok((state, opt, resumed))
}
