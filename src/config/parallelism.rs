//! `[parallelism]`: the mesh degrees (data, tensor, pipeline, context, expert) and each
//! dimension's options (FSDP resharding, loss parallel, async TP, the pipeline schedule and
//! split, the context-parallel rotation); with its checks, including those that read the
//! training's and validation's batch and sequence sizes.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    pub data_parallel_replicate_degree: usize,
    /// -1 fills what the other degrees leave of the world size.
    pub data_parallel_shard_degree: i64,
    pub tensor_parallel_degree: usize,
    pub pipeline_parallel_degree: usize,
    pub context_parallel_degree: usize,
    /// Context parallelism: how the ranks exchange keys and values, `allgather` (all at once,
    /// TorchTitan's default) or `alltoall` (rotated around the ring, peer to peer).
    pub context_parallel_rotate_method: String,
    /// Mixture of experts: ranks the experts are split over (TorchTitan's `expert_parallel_degree`),
    /// borrowed from `dp_shard × cp`; tokens travel to their experts' ranks by all-to-all.
    pub expert_parallel_degree: usize,
    /// FSDP: free a block's gathered parameters after its forward (`default`, `always`) or keep them
    /// until its backward (`never`).
    pub fsdp_reshard_after_forward: String,
    /// With tensor parallelism: compute the cross-entropy from the gathered logits instead of over
    /// the vocabulary shards (same loss; more traffic).
    pub disable_loss_parallel: bool,
    /// With tensor parallelism: overlap the sequence-parallel all-gathers and reduce-scatters with
    /// the GEMMs next to them, in chunks.
    pub enable_async_tensor_parallel: bool,
    /// Pipeline parallelism: the schedule (`parallel::pipeline::schedule::SCHEDULE_NAMES`).
    pub pipeline_parallel_schedule: String,
    /// A custom schedule in TorchTitan's CSV format (overrides `pipeline_parallel_schedule`).
    pub pipeline_parallel_schedule_csv: String,
    /// Sequences per microbatch: the local batch is cut into local_batch_size / this microbatches.
    pub pipeline_parallel_microbatch_size: usize,
    /// Units (blocks; the embedding and the output count as one each) per stage; -1: the
    /// schedule's stages per rank, balanced.
    pub pipeline_parallel_layers_per_stage: i64,
    /// The blocks that start stages 1, 2, … (`layers.N`); empty: balanced. A list, or one string
    /// of comma-separated names (`--parallelism.pipeline_parallel_split_points layers.2,layers.4`).
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub pipeline_parallel_split_points: Vec<String>,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        ParallelismConfig {
            data_parallel_replicate_degree: 1,
            data_parallel_shard_degree: -1,
            tensor_parallel_degree: 1,
            pipeline_parallel_degree: 1,
            context_parallel_degree: 1,
            context_parallel_rotate_method: "allgather".into(),
            expert_parallel_degree: 1,
            fsdp_reshard_after_forward: "default".into(),
            disable_loss_parallel: false,
            enable_async_tensor_parallel: false,
            pipeline_parallel_schedule: "1F1B".into(),
            pipeline_parallel_schedule_csv: String::new(),
            pipeline_parallel_microbatch_size: 1,
            pipeline_parallel_layers_per_stage: -1,
            pipeline_parallel_split_points: Vec::new(),
        }
    }
}

impl Config {
    pub(super) fn validate_parallelism(&self) -> Result<()> {
        let p = &self.parallelism;
        for (key, degree) in [
            ("tensor_parallel_degree", p.tensor_parallel_degree),
            ("pipeline_parallel_degree", p.pipeline_parallel_degree),
            ("context_parallel_degree", p.context_parallel_degree),
            ("expert_parallel_degree", p.expert_parallel_degree),
        ] {
            if degree == 0 {
                bail!("[parallelism] {key} must be at least 1");
            }
        }
        if p.context_parallel_degree > 1 {
            self.validate_context_parallel()?;
        }
        if p.pipeline_parallel_degree > 1 {
            self.validate_pipeline_parallel()?;
        }
        if !["default", "always", "never"].contains(&p.fsdp_reshard_after_forward.as_str()) {
            bail!("[parallelism] fsdp_reshard_after_forward = `{}` is not known (accepted: default, always, never)", p.fsdp_reshard_after_forward);
        }
        Ok(())
    }

    /// The rotation method, and sequences (training's, and validation's when on) that split into
    /// two chunks per context-parallel rank.
    fn validate_context_parallel(&self) -> Result<()> {
        let p = &self.parallelism;
        let cp = p.context_parallel_degree;
        crate::parallel::cp::RotateMethod::parse(&p.context_parallel_rotate_method)?;
        for (section, seq) in [
            ("training", self.training.seq_len),
            ("validation", self.validation_shape().1),
        ] {
            if section == "validation" && !self.validation.enable {
                continue;
            }
            if !seq.is_multiple_of(2 * cp) {
                bail!("[{section}] seq_len = {seq} does not split into 2 × context_parallel_degree = {} equal chunks (each rank holds two, head and tail, for balanced causal attention); make it a multiple of {}", 2 * cp, 2 * cp);
            }
        }
        Ok(())
    }

    /// The schedule's name (unless a CSV schedule replaces it) and a microbatch size that divides
    /// the local batch.
    fn validate_pipeline_parallel(&self) -> Result<()> {
        let p = &self.parallelism;
        if p.pipeline_parallel_schedule_csv.is_empty() {
            crate::parallel::pipeline::schedule::ScheduleKind::parse(
                &p.pipeline_parallel_schedule,
            )?;
        }
        let mb = p.pipeline_parallel_microbatch_size;
        if mb == 0 || !self.training.local_batch_size.is_multiple_of(mb) {
            bail!("[parallelism] pipeline_parallel_microbatch_size = {mb} must divide [training] local_batch_size = {} (microbatches = local batch / microbatch size)", self.training.local_batch_size);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn a_zero_degree_is_refused_naming_its_key() {
        for key in [
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "expert_parallel_degree",
        ] {
            let args = [format!("--parallelism.{key}"), "0".to_string()];
            let e = Config::load(None, &args).unwrap_err().to_string();
            assert!(
                e.contains(&format!("[parallelism] {key} must be at least 1")),
                "{e}"
            );
        }
    }
}
