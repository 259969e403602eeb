//! A pipeline rank's part of the layout, decided from the config before anything is allocated:
//! the schedule (by name or from a CSV file), the cut into stages, the microbatches, which
//! parameters this rank holds and how many workspaces it needs; then the running
//! `PipelineRank` with the walk running its schedule.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::rank::{holder, holds, PipelineRank};
use super::schedule::{generate, Schedule, ScheduleKind};
use super::stage::StageSplit;
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::model::activation_checkpoint::ActivationPlan;
use crate::model::{LocalShapes, ModelArgs};
use crate::parallel::walk::{PipelineParts, Walk};

/// A pipeline rank's layout, before allocation.
pub struct PipelinePlan {
    pub schedule: Schedule,
    pub split: StageSplit,
    pub group: Arc<dyn ProcessGroup>,
    pub microbatch_rows: usize,
    workspaces: usize,
    /// The output projection is the embedding (1B/3B): the first and last stages both hold it.
    pub tied: bool,
}

/// The pipeline keys of `[parallelism]` (TorchTitan's names), and the local batch it cuts.
pub struct PipelineOptions<'a> {
    pub pipeline_parallel_schedule: &'a str,
    pub pipeline_parallel_schedule_csv: &'a str,
    pub pipeline_parallel_microbatch_size: usize,
    pub pipeline_parallel_layers_per_stage: i64,
    pub pipeline_parallel_split_points: &'a [String],
    pub local_batch_size: usize,
}

impl PipelinePlan {
    /// The pipeline `p` asks for over `group` (the `pp` ranks), checked: what titan's pipeline
    /// does not combine with yet is refused here, saying so.
    pub fn new(
        p: &PipelineOptions<'_>,
        args: &ModelArgs,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        let pp = group.size();
        let rows = p.local_batch_size;
        let microbatch_rows = p.pipeline_parallel_microbatch_size;
        let microbatches = rows / microbatch_rows;
        let n_layers = args.n_layers;
        let fixed_split = if !p.pipeline_parallel_split_points.is_empty() {
            Some(StageSplit::at_split_points(
                n_layers,
                p.pipeline_parallel_split_points,
            )?)
        } else if p.pipeline_parallel_layers_per_stage > 0 {
            Some(StageSplit::layers_per_stage(
                n_layers,
                p.pipeline_parallel_layers_per_stage as usize,
            )?)
        } else {
            None
        };
        let per_rank = |stages: usize| -> Result<usize> {
            if !stages.is_multiple_of(pp) {
                bail!("[parallelism] {stages} pipeline stages do not spread evenly over pipeline_parallel_degree = {pp} ranks (split points or layers per stage decide the stages)");
            }
            Ok(stages / pp)
        };
        let schedule = if !p.pipeline_parallel_schedule_csv.is_empty() {
            let path = p.pipeline_parallel_schedule_csv;
            let text = std::fs::read_to_string(path).with_context(|| {
                format!("[parallelism] pipeline_parallel_schedule_csv: cannot read {path}")
            })?;
            let s = Schedule::from_csv(&text, path)?;
            if s.ranks() != pp {
                bail!("[parallelism] pipeline_parallel_schedule_csv {path} has {} ranks (lines) but pipeline_parallel_degree is {pp}", s.ranks());
            }
            if s.microbatches != microbatches {
                bail!("[parallelism] pipeline_parallel_schedule_csv {path} runs {} microbatches but local_batch_size {rows} / pipeline_parallel_microbatch_size {microbatch_rows} makes {microbatches}", s.microbatches);
            }
            s
        } else {
            let kind = ScheduleKind::parse(p.pipeline_parallel_schedule)?;
            let asked = fixed_split
                .as_ref()
                .map(|s| per_rank(s.len()))
                .transpose()?;
            let v = kind.stages_per_rank(asked)?;
            generate(kind, pp, v, microbatches).with_context(|| {
                format!("[parallelism] pipeline_parallel_schedule = {}", kind.name())
            })?
        };
        let split = match fixed_split {
            Some(s) if s.len() != schedule.stages() => bail!(
                "[parallelism] the split into {} stages does not match schedule {}'s {} stages",
                s.len(),
                schedule.name,
                schedule.stages()
            ),
            Some(s) => s,
            None => StageSplit::balanced(n_layers, schedule.stages())?,
        };
        let workspaces = schedule.microbatch_lifetimes(group.rank()).1;
        Ok(PipelinePlan {
            schedule,
            split,
            group,
            microbatch_rows,
            workspaces,
            tied: args.tied_embeddings,
        })
    }

    /// Bytes of the weight gradients a zero-bubble schedule leaves deferred on this rank at most:
    /// each deferred block keeps copies of its seven projections' inputs and output gradients
    /// over a microbatch's `tokens` (`parallel_linear::DeferredWeightGrad`).
    pub fn deferred_bytes(&self, local: &LocalShapes, seq: usize) -> u64 {
        let split = &self.split;
        let blocks = self
            .schedule
            .max_deferred_blocks(self.group.rank(), |s| split.stages[s].blocks.len());
        let tokens = (self.microbatch_rows * local.local_seq(seq)) as u64;
        let (d, f, q, kv) = (
            local.dim as u64,
            local.max_ffn() as u64,
            local.q_dim() as u64,
            local.kv_dim() as u64,
        );
        // w2: act (f) and its output gradient (d); w1, w3: the normed input (d) and gradient (f)
        // each; wo: attention's output (q) and gradient (d); wq, wk, wv: the normed input (d)
        // each and gradients (q, kv, kv).
        let per_token = (f + d) + 2 * (d + f) + (q + d) + 3 * d + q + 2 * kv;
        blocks as u64 * tokens * per_token * 4
    }

    /// Workspaces this rank keeps: the most microbatches it holds at once.
    pub fn workspaces(&self) -> usize {
        self.workspaces
    }

    pub fn holds(&self, name: &str) -> bool {
        holds(
            &self.schedule,
            &self.split,
            self.tied,
            self.group.rank(),
            name,
        )
    }

    /// The first pipeline rank holding parameter `name` (its checkpoint part).
    pub fn holder(&self, name: &str) -> usize {
        holder(&self.schedule, &self.split, self.tied, name)
    }

    /// The blocks this rank runs keep what `plan` says; the others nothing.
    pub fn plan(&self, plan: &ActivationPlan) -> ActivationPlan {
        let mine: Vec<usize> = self
            .schedule
            .stages_of(self.group.rank())
            .into_iter()
            .flat_map(|s| self.split.stages[s].blocks.clone())
            .collect();
        plan.only(|l| mine.contains(&l))
    }

    /// The share of the (tensor-parallel rank's) parameters this rank holds.
    pub fn held_fraction(&self, args: &ModelArgs, local: &LocalShapes) -> f64 {
        let specs = crate::model::params::local_param_specs(args, local.tp);
        let numel = |s: &(String, Vec<usize>)| s.1.iter().product::<usize>() as f64;
        let all: f64 = specs.iter().map(numel).sum();
        let held: f64 = specs.iter().filter(|s| self.holds(&s.0)).map(numel).sum();
        held / all.max(1.0)
    }

    /// Values of the blocks' parameters this rank holds (of the tensor-parallel rank's shapes).
    pub fn held_block_params(&self, args: &ModelArgs, local: &LocalShapes) -> u64 {
        crate::model::params::local_param_specs(args, local.tp)
            .iter()
            .filter(|(name, _)| name.starts_with("layers.") && self.holds(name))
            .map(|(_, shape)| shape.iter().product::<usize>() as u64)
            .sum()
    }

    /// The pipeline rank and the walk running its schedule, with its workspaces allocated.
    pub fn build<B: Backend>(
        self,
        be: &B,
        local: &LocalShapes,
        seq: usize,
        plan: &ActivationPlan,
        timeout: Duration,
    ) -> Result<(PipelineRank, Walk<B>)> {
        let parts = PipelineParts {
            schedule: self.schedule.clone(),
            split: self.split.clone(),
            group: self.group.clone(),
            microbatch_rows: self.microbatch_rows,
            seq,
            timeout,
        };
        let walk = Walk::pipelined(be, parts, local, plan)?;
        let rank = PipelineRank::new(
            self.schedule,
            self.split,
            self.group,
            self.microbatch_rows,
            self.tied,
        );
        Ok((rank, walk))
    }
}
