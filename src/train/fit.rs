//! Whether a rank's layout fits its memory, decided before anything is allocated: the estimate
//! for an activation-checkpointing plan (`estimate_rank`), the check against the device's or the
//! host's free memory, and, when it does not fit, the checkpointing mode that would make it fit
//! (`check_or_suggest`).

use anyhow::{bail, Result};

use super::memory::{check_fits, gib, DeviceSizing, MemoryEstimate, MuonSizing};
use crate::config::Config;
use crate::memory_timeline;
use crate::model::activation_checkpoint::{AcMode, ActivationPlan};
use crate::model::decoder::{workspace_floats, WorkspaceFloats};
use crate::model::{LocalShapes, ModelArgs, ParamDtype};
use crate::parallel::cp::RotateMethod;
use crate::parallel::fsdp::ReshardPolicy;
use crate::parallel::pipeline::plan::PipelinePlan;

/// What a rank's memory estimate depends on.
pub struct RankSizing<'a> {
    pub be: &'a dyn DeviceSizing,
    pub cfg: &'a Config,
    pub args: &'a ModelArgs,
    pub local: &'a LocalShapes,
    pub batch: usize,
    pub seq: usize,
    pub pipeline: Option<&'a PipelinePlan>,
    pub rotate: RotateMethod,
    pub param_dtype: ParamDtype,
    /// FSDP's shard degree (`dp_shard × cp`), None without FSDP.
    pub fsdp_shard: Option<usize>,
    pub reshard: ReshardPolicy,
    /// Ranks (this one included) sharing the memory compared with.
    pub ranks_sharing_memory: usize,
    pub rank: usize,
    /// Whether some linears compute in float8 (their cast copies are scratch).
    pub float8: bool,
    /// Whether the output head computes in float8 (its whole logits, their gradient and casts
    /// are scratch, beside the fused loss's chunk the backend's scratch counts).
    pub float8_head: bool,
}

impl RankSizing<'_> {
    /// What the blocks keep under `ac`, the residual stream stored as the parameters compute.
    pub fn plan_of(&self, ac: AcMode) -> ActivationPlan {
        self.param_dtype.activation_plan(ac, self.args.n_layers)
    }

    /// The estimate per rank when the blocks keep what `plan` says.
    pub fn estimate(&self, plan: &ActivationPlan) -> MemoryEstimate {
        let (args, local, batch, seq) = (self.args, self.local, self.batch, self.seq);
        // A pipeline runs its kernels on one microbatch at a time.
        let rows = self.pipeline.map_or(batch, |p| p.microbatch_rows);
        let mut e = MemoryEstimate::new(args, local, batch, seq, plan)
            .with_backend_scratch(self.be, local, rows, seq, plan);
        e.scratch += crate::parallel::cp::scratch_bytes(local, rows, seq, self.rotate);
        if self.float8 {
            let codes = self.be.keeps_float8_codes();
            let tokens = rows * local.local_seq(seq);
            let blocks = float8_cast_scratch_bytes(local, tokens, codes);
            // Under a pipeline only the last stage's ranks run the head (`norm` is its weight).
            let runs_head = self.pipeline.is_none_or(|p| p.holds("norm.weight"));
            let head = match self.float8_head && runs_head {
                true => float8_head_scratch_bytes(local, tokens, codes),
                false => 0,
            };
            // The blocks' casts are dropped before the head runs.
            e.scratch += blocks.max(head);
        }
        if self.param_dtype == ParamDtype::BFloat16 && self.fsdp_shard.is_none() {
            let held = self.pipeline.map_or(1.0, |p| p.held_fraction(args, local));
            e = e.with_compute_copy(self.be, (args, local), held);
        }
        e = match (self.pipeline, self.fsdp_shard) {
            (Some(p), shard) => {
                let floats =
                    WorkspaceFloats::pipelined(local, (rows, seq), &p.plan(plan), p.workspaces());
                e = e
                    .pipelined(p.held_fraction(args, local), shard)
                    .with_workspaces(self.be, floats);
                // Weights gathered as float8 codes stay as gathered (`StagePairs`).
                let pairs = self.param_dtype == ParamDtype::BFloat16
                    && shard.is_some()
                    && self.cfg.fsdp_float8_all_gather().is_none();
                match pairs {
                    true => e.with_stage_pairs((args, local), p.held_block_params(args, local)),
                    false => e,
                }
            }
            (None, Some(shard)) => e.sharded(
                args,
                local,
                shard,
                self.reshard.blocks_gathered(args.n_layers),
                crate::parallel::fsdp::REDUCE_SCATTER_BLOCKS,
            ),
            (None, None) => e,
        };
        if let Some(p) = self.pipeline {
            e.activations += p.deferred_bytes(local, seq);
        }
        if self.cfg.optimizer.name == "Muon" {
            let shard = self.fsdp_shard.unwrap_or(1);
            let replicas = self.cfg.parallelism.data_parallel_replicate_degree.max(1);
            let holders = shard * replicas * local.tp;
            let muon = MuonSizing {
                held: self.pipeline.map_or(1.0, |p| p.held_fraction(args, local)),
                holders,
                shard,
                exchanged: holders > 1 || self.pipeline.is_some(),
            };
            e = e.with_muon(args, local, muon);
        }
        if self.cfg.optimizer.state_dtype == "bfloat16" {
            e.optimizer = e.optimizer.div_ceil(2); // two bf16 values to a word
        }
        // Validation at a shape of its own (and always on a pipeline rank) has a workspace of
        // its own, keeping no activations past each block (`train::validate`).
        let (vb, vs) = self.cfg.validation_shape();
        if self.cfg.validation.enable && ((vb, vs) != (batch, seq) || self.pipeline.is_some()) {
            let forward_only = self.plan_of(AcMode::Full);
            e.activations += workspace_floats(local, vb, vs, &forward_only) as u64 * 4;
        }
        e
    }

    /// The estimate of mode `ac`, checked against the free memory; when it does not fit, an
    /// error that names the checkpointing mode that would (per-op first: it recomputes least).
    pub fn check_or_suggest(&self, ac: AcMode) -> Result<MemoryEstimate> {
        let estimate = self.estimate(&self.plan_of(ac));
        let what = format!(
            "model flavor {} at local_batch_size {} × seq_len {} (activation checkpointing: {})",
            self.cfg.model.flavor,
            self.batch,
            self.seq,
            ac.describe()
        );
        let free = self.be.device_free_memory();
        let fits = |e: &MemoryEstimate| check_fits(e, &what, free, self.ranks_sharing_memory);
        let Err(too_big) = fits(&estimate) else {
            return Ok(estimate);
        };
        snapshot_refused(self.cfg, self.rank, &estimate, self.fsdp_shard.is_some());
        let suggestion = [
            (
                AcMode::Op,
                "mode = \"selective\", selective_ac_option = \"op\"",
            ),
            (AcMode::Full, "mode = \"full\""),
        ]
        .into_iter()
        .filter(|(mode, _)| *mode != ac && *mode != AcMode::None)
        .map(|(mode, keys)| (self.estimate(&self.plan_of(mode)), keys))
        .find(|(e, _)| e.total() < estimate.total() && fits(e).is_ok());
        match suggestion {
            Some((smaller, keys)) => bail!(
                "{too_big:#}\n[activation_checkpoint] {keys} would make it fit (about {:.1} GiB{})",
                gib(smaller.total()),
                if self.ranks_sharing_memory > 1 {
                    " per rank"
                } else {
                    ""
                }
            ),
            None => Err(too_big),
        }
    }
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
        errln!("warning: rank {rank}: memory snapshot not written: {e:#}");
    }
}

/// Bytes a float8 output head holds at once over `tokens` rows of this rank's shapes, at its
/// backward: the logits' gradient, its two casts (per row for `dX`, per column for `dW`), the
/// cast input and weight, all f32, and with `codes` a byte of code a value and a reciprocal
/// scale a row or column besides.
fn float8_head_scratch_bytes(local: &LocalShapes, tokens: usize, codes: bool) -> u64 {
    let logits = tokens * local.vocab;
    let values = (3 * logits + tokens * local.dim + local.vocab * local.dim) as u64;
    let scales = (3 * (tokens + local.vocab) + local.dim) as u64;
    match codes {
        true => 4 * values + (values - logits as u64) + 4 * scales,
        false => 4 * values,
    }
}

/// Bytes of the cast operand copies a float8 layer holds at once, over `tokens` rows of this
/// rank's shapes (the memory estimate's kernel scratch): the column-parallel backward's, the
/// most, holds each projection's cast output gradient, the shared cast input and a cast weight
/// (f32: the casts keep their dequantised values in f32), and with `codes` (float8 GEMMs on a
/// GPU) one byte of code a value and one f32 reciprocal scale a row or column besides.
fn float8_cast_scratch_bytes(local: &LocalShapes, tokens: usize, codes: bool) -> u64 {
    let ffn = local.max_ffn();
    let widest = local.dim.max(ffn).max(local.q_dim());
    let projections = 3;
    let largest_weight = local.dim * ffn.max(local.q_dim());
    let values = ((projections + 1) * tokens * widest + largest_weight) as u64;
    let scales = ((projections + 2) * tokens.max(widest)) as u64;
    match codes {
        true => 5 * values + 4 * scales,
        false => 4 * values,
    }
}
