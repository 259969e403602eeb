//! A rank composed from the config and its place in the mesh, once, before the first step: the
//! model in this rank's tensor-parallel shapes, its weights laid out for data parallelism (whole,
//! DDP or FSDP/HSDP shards, freshly initialised or resumed), the optimizer, the walk with its workspaces, and the
//! memory estimate that refused the layout if it could not fit. `titan train` and
//! `titan bench train` both build their ranks here, so a benchmark measures the layout training runs.
//!
//! Also where a process learns its place: its thread count (`init_rank_threads`) and, per device,
//! its distribution with the collectives its device can run (`RankPlace`).

use std::sync::Arc;

use anyhow::{bail, Result};

use super::collectives::{self, DataParallelComm, DeviceComm};
use super::memory::{check_fits, gib, MemoryEstimate};
use super::optimizer::AdamW;
use super::start::{start_state, Resumed, StartState};
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::comm::queue::{CollectiveQueue, HostQueue};
use crate::config::Config;
use crate::launch::Distributed;
use crate::memory_timeline;
use crate::model::activation_checkpoint::{AcMode, ActivationPlan};
use crate::model::llama::workspace_floats;
use crate::model::{Llama, LocalShapes, ModelArgs, ParamDtype, ParamSet, Workspace};
use crate::parallel::cp::{ContextParallelGroup, RotateMethod};
use crate::parallel::ep::ExpertParallelGroup;
use crate::parallel::fsdp::{ExpertShards, ReshardPolicy, ShardedParams};
use crate::parallel::pipeline::plan::PipelinePlan;
use crate::parallel::plan::{LayoutParts, ParamState, RankLayout, WholeParams};
use crate::parallel::tp::TensorParallelGroup;
use crate::parallel::walk::Walk;

/// Sizes rayon's global pool once per process for a job's rank: `[training] threads`, where 0
/// shares the host's cores out among its ranks (each taking every core would oversubscribe them
/// `--nproc` times over), unless RAYON_NUM_THREADS says otherwise.
pub fn init_rank_threads(cfg: &Config) -> Result<()> {
    let rayon_env = std::env::var_os("RAYON_NUM_THREADS").is_some();
    let threads = match (
        cfg.training.threads,
        crate::launch::env::WorkerEnv::detect()?,
    ) {
        (0, Some(env)) if env.local_world_size > 1 && !rayon_env => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / env.local_world_size).max(1)
        }
        (n, _) => n,
    };
    super::trainer::init_threads(threads);
    Ok(())
}

/// This process's place in the job and what its device can do.
pub struct RankPlace<B: Backend> {
    /// None in one process.
    pub dist: Option<Distributed>,
    /// Collectives on the device (NCCL) instead of through the host.
    pub device_comm: DeviceComm<B>,
    /// Ranks (this one included) sharing the memory the memory check compares with: the host's,
    /// or this rank's GPU.
    pub ranks_sharing_memory: usize,
}

impl<B: Backend> RankPlace<B> {
    /// A CPU rank: collectives through the host.
    pub fn cpu(cfg: &Config) -> Result<Self> {
        let dist = Distributed::from_env(cfg)?;
        let device_comm = collectives::for_cpu(dist.as_ref())?;
        let ranks_sharing_memory = dist.as_ref().map_or(1, |d| d.local_world_size);
        Ok(RankPlace {
            dist,
            device_comm,
            ranks_sharing_memory,
        })
    }
}

impl RankPlace<CudaBackend> {
    /// A CUDA rank: NCCL when every rank has a GPU of its own (see `collectives::for_cuda`).
    pub fn cuda(cfg: &Config, be: &CudaBackend, quiet: bool) -> Result<Self> {
        let dist = Distributed::from_env(cfg)?;
        let (device_comm, ranks_sharing_memory) = collectives::for_cuda(dist.as_ref(), be, quiet)?;
        Ok(RankPlace {
            dist,
            device_comm,
            ranks_sharing_memory,
        })
    }
}

/// A rank ready to train.
pub struct ComposedRank<B: Backend> {
    pub args: ModelArgs,
    /// This rank's tensor-parallel shapes.
    pub local: LocalShapes,
    pub layout: RankLayout<B>,
    pub opt: AdamW<B>,
    /// The memory estimate per rank the layout was checked against.
    pub estimate: MemoryEstimate,
    /// Micro-batches per step, and the global batch (sequences per step).
    pub accum: usize,
    pub global_batch: usize,
    /// Set when the run resumed from a checkpoint.
    pub resumed: Option<Resumed>,
    /// Whether the collectives run on the device (NCCL).
    pub collectives_on_device: bool,
}

/// With `[profiling] enable_memory_snapshot`: the categories of a refused estimate, at its peak,
/// in `{snapshot folder}/refused/rank{r}_memory.{json,svg}` (a warning if it cannot be written).
fn snapshot_refused(cfg: &Config, rank: usize, estimate: &MemoryEstimate, sharded: bool) {
    if !cfg.profiling.enable_memory_snapshot {
        return;
    }
    for (category, bytes) in estimate.by_category(sharded, true) {
        memory_timeline::set(category, bytes);
    }
    let dir = cfg
        .dump_folder()
        .join(&cfg.profiling.save_memory_snapshot_folder)
        .join("refused");
    let sample = memory_timeline::now("estimate of the refused run");
    if let Err(e) = memory_timeline::write(&dir, &format!("rank{rank}_memory"), rank, vec![sample])
    {
        eprintln!("warning: rank {rank}: memory snapshot not written: {e:#}");
    }
}

/// The layout `[parallelism]` asks for, on `be`, for this rank (TorchTitan's `parallelize`:
/// tensor parallel shapes the model, then data parallel lays out its weights). Everything the
/// config alone decides is checked before anything is allocated.
pub fn compose_rank<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&Distributed>,
    device_comm: DeviceComm<B>,
    ranks_sharing_memory: usize,
) -> Result<ComposedRank<B>> {
    let args = cfg.model_args()?;
    let t = &cfg.training;
    let (batch, seq) = (t.local_batch_size, t.seq_len);
    let dp_size = dist.map_or(1, |d| d.dp.size());
    let fsdp_mode = dist.is_some_and(|d| d.shard.is_some());
    // Tensor parallel: this rank's shapes (refused here when the model does not split evenly).
    let tp_group = dist.and_then(|d| d.tp.clone());
    let local = match &tp_group {
        Some(g) => LocalShapes::sharded(&args, g.size(), g.rank())?,
        None => LocalShapes::whole(&args),
    };
    // Context parallel: the rank's shard of every sequence.
    let cp_group = dist.and_then(|d| d.cp.clone());
    let local = match &cp_group {
        Some(g) => local.with_context_parallel(g.size(), g.rank()),
        None => local,
    };
    // Expert parallel: the experts this rank computes.
    let ep_degree = cfg.parallelism.expert_parallel_degree;
    let ep_group = dist.and_then(|d| d.ep.clone());
    let local = match &ep_group {
        Some(g) => local.with_expert_parallel(g.size(), g.rank())?,
        None if ep_degree > 1 => bail!("[parallelism] expert_parallel_degree = {ep_degree} needs {ep_degree} ranks of data_parallel_shard_degree × context_parallel_degree; this job runs one process (launch it with --nproc)"),
        None => local,
    };
    let local_tokens = batch * local.local_seq(seq);
    if !local_tokens.is_multiple_of(local.tp) {
        bail!("[training] local_batch_size {batch} × seq_len {seq} / context_parallel_degree {} = {local_tokens} tokens do not split into tensor_parallel_degree {} equal sequence-parallel shards; make their product a multiple of it", local.cp, local.tp);
    }
    let rotate = RotateMethod::parse(&cfg.parallelism.context_parallel_rotate_method)?;
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
    let accum = global_batch / (batch * dp_size);
    let pipeline = match dist.and_then(|d| d.pp.clone()) {
        Some(group) => Some(PipelinePlan::from_config(cfg, &args, group)?),
        None => None,
    };
    if let Some(p) = &pipeline {
        let tokens = p.microbatch_rows * local.local_seq(seq);
        if !tokens.is_multiple_of(local.tp) {
            bail!("[parallelism] pipeline_parallel_microbatch_size {} × seq_len {seq} / context_parallel_degree {} = {tokens} tokens per microbatch do not split into tensor_parallel_degree {} equal sequence-parallel shards; make their product a multiple of it", p.microbatch_rows, local.cp, local.tp);
        }
    }

    let (mut device_reducer, mut device_queue) = match device_comm.data_parallel {
        Some(DataParallelComm::Ddp(r)) => (Some(r), None),
        Some(DataParallelComm::Fsdp(q)) => (None, Some(q)),
        None => (None, None),
    };
    let collectives_on_device = device_reducer.is_some()
        || device_queue.is_some()
        || device_comm.tensor_parallel.is_some()
        || device_comm.context_parallel.is_some()
        || device_comm.expert_shard.is_some();
    let ddp = dist
        .filter(|_| !fsdp_mode && dp_size > 1)
        .map(|d| crate::parallel::ddp::Ddp::new(d.dp.clone(), device_reducer.take()));

    let param_dtype = ParamDtype::from_config(&t.mixed_precision_param);
    let reshard = ReshardPolicy::parse(&cfg.parallelism.fsdp_reshard_after_forward)
        .expect("validated with the config");
    let ac = cfg.activation_checkpoint.mode()?;
    let estimate_with = |plan: &ActivationPlan| {
        let mut e = MemoryEstimate::new(&args, &local, batch, seq, plan)
            .with_backend_scratch(be, &local, batch, seq, plan);
        // Attention runs one pipeline microbatch at a time.
        let rows = pipeline.as_ref().map_or(batch, |p| p.microbatch_rows);
        e.scratch += crate::parallel::cp::scratch_bytes(&local, rows, seq, rotate);
        if param_dtype == ParamDtype::BFloat16 && !fsdp_mode {
            e = e.with_compute_copy(be);
        }
        let fsdp_shard = dist
            .filter(|_| fsdp_mode)
            .map(|d| d.mesh.degree("dp_shard") * d.mesh.degree("cp"));
        e = match (&pipeline, fsdp_shard) {
            (Some(p), shard) => e.pipelined(
                p.held_fraction(&args, &local),
                shard,
                p.workspaces(),
                workspace_floats(&local, p.microbatch_rows, seq, &p.plan(plan)) as u64 * 4,
            ),
            (None, Some(shard)) => e.sharded(
                &args,
                &local,
                shard,
                reshard.blocks_gathered(args.n_layers),
                crate::parallel::fsdp::REDUCE_SCATTER_BLOCKS,
            ),
            (None, None) => e,
        };
        if let Some(p) = &pipeline {
            e.activations += p.deferred_bytes(&local, seq);
        }
        // Validation at a shape of its own (and always on a pipeline rank) has a workspace of
        // its own, keeping no activations past each block (`train::validate`).
        let (vb, vs) = cfg.validation_shape();
        if cfg.validation.enabled && ((vb, vs) != (batch, seq) || pipeline.is_some()) {
            let forward_only = AcMode::Full.plan(args.n_layers);
            e.activations += workspace_floats(&local, vb, vs, &forward_only) as u64 * 4;
        }
        e
    };
    let plan = ac.plan(args.n_layers);
    let estimate = estimate_with(&plan);
    let what = format!(
        "model flavor {} at local_batch_size {batch} × seq_len {seq} (activation checkpointing: {})",
        cfg.model.flavor,
        ac.describe()
    );
    let fits =
        |e: &MemoryEstimate| check_fits(e, &what, be.device_free_memory(), ranks_sharing_memory);
    if let Err(too_big) = fits(&estimate) {
        snapshot_refused(cfg, dist.map_or(0, |d| d.rank), &estimate, fsdp_mode);
        // Would a mode that keeps less make it fit? Per-op first: it recomputes least.
        let suggestion = [
            (
                AcMode::Op,
                "mode = \"selective\", selective_ac_option = \"op\"",
            ),
            (AcMode::Full, "mode = \"full\""),
        ]
        .into_iter()
        .filter(|(mode, _)| *mode != ac && *mode != AcMode::None)
        .map(|(mode, keys)| (estimate_with(&mode.plan(args.n_layers)), keys))
        .find(|(e, _)| e.total() < estimate.total() && fits(e).is_ok());
        match suggestion {
            Some((smaller, keys)) => {
                bail!(
                "{too_big:#}\n[activation_checkpoint] {keys} would make it fit (about {:.1} GiB{})",
                gib(smaller.total()),
                if ranks_sharing_memory > 1 { " per rank" } else { "" }
            )
            }
            None => return Err(too_big),
        }
    }

    let model = match &tp_group {
        Some(g) => {
            let ops =
                TensorParallelGroup::new(g.clone(), device_comm.tensor_parallel, &cfg.parallelism);
            Llama::tensor_parallel(be, args.clone(), seq, local, Arc::new(ops))?
        }
        None => Llama::tensor_parallel(
            be,
            args.clone(),
            seq,
            local,
            Arc::new(crate::model::crossings::single_rank::SingleRank),
        )?,
    };
    let model = match &cp_group {
        Some(g) => {
            // Only `allgather` runs collectives on a queue (`alltoall` rotates through the group).
            let queue = (rotate == RotateMethod::AllGather).then(|| {
                device_comm.context_parallel.unwrap_or_else(|| {
                    Box::new(HostQueue::new("context parallel", g.clone(), None))
                        as Box<dyn CollectiveQueue<B> + Send>
                })
            });
            model.with_context_parallel(Arc::new(ContextParallelGroup::new(
                g.clone(),
                rotate,
                queue,
            )?))
        }
        None => model,
    };
    let model = match &ep_group {
        Some(g) => model.with_expert_parallel(Arc::new(ExpertParallelGroup::new(g.clone()))),
        None => model,
    }
    .with_sequences_per_step(global_batch);
    let expert_shards = dist
        .and_then(|d| d.expert_shard.clone())
        .map(|group| ExpertShards {
            group,
            replicate: dist.and_then(|d| d.expert_replicate.clone()),
            queue: device_comm.expert_shard,
        });
    let specs = model.param_specs();
    let held = |name: &str| pipeline.as_ref().is_none_or(|p| p.holds(name));
    let holder = |name: &str| pipeline.as_ref().map_or(0, |p| p.holder(name));
    let StartState {
        params,
        grads,
        mut opt,
        fsdp,
        resumed,
    } = start_state(
        be,
        cfg,
        &model,
        dist,
        fsdp_mode,
        device_queue.take(),
        expert_shards,
        reshard,
        param_dtype,
        pipeline
            .is_some()
            .then_some(&held as &(dyn Fn(&str) -> bool + Sync)),
        pipeline
            .is_some()
            .then_some(&holder as &(dyn Fn(&str) -> usize + Sync)),
    )?;
    // bf16 mixed precision without FSDP: a compute copy of the parameters, rounded each step (FSDP
    // rounds while it packs its all-gathers instead).
    let mut state = match fsdp {
        Some(fsdp) => ParamState::Sharded(ShardedParams::new(fsdp, params, grads, false)),
        None => {
            let bf16_copy =
                (param_dtype == ParamDtype::BFloat16).then(|| ParamSet::zeros(be, &specs));
            ParamState::Whole(WholeParams::new(params, grads, bf16_copy, ddp))
        }
    };
    // A pipeline rank computes in its own workspaces, one per microbatch it holds.
    let (pipeline, walk) = match pipeline {
        Some(p) => {
            let timeout = std::time::Duration::from_secs(cfg.comm.train_timeout_seconds);
            let (rank, walk) = p.build(be, &local, seq, &plan, timeout)?;
            state.keep_only(be, |name| rank.holds(name));
            opt.keep_only(be, |name| rank.holds(name));
            (Some(rank), walk)
        }
        None => {
            let ws = Workspace::planned(be, &local, batch, seq, plan.clone());
            (None, Walk::one_stage(ws, args.n_layers, seq)?)
        }
    };
    let layout = RankLayout::new(LayoutParts {
        model,
        state,
        walk,
        batch_group: dist.map(|d| d.loss.clone()),
        tp_group,
        pipeline,
    });
    for (category, bytes) in estimate.by_category(fsdp_mode, false) {
        memory_timeline::set(category, bytes);
    }
    Ok(ComposedRank {
        args,
        local,
        layout,
        opt,
        estimate,
        accum,
        global_batch,
        resumed,
        collectives_on_device,
    })
}
