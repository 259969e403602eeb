//! What a pipeline rank is: its schedule, the cut into stages, which parameters it holds (and
//! which checkpoint part records each), the tied embedding's gradient summed over the two stages
//! holding it. Its action list runs in the one walk (`parallel::walk::Walk::pipelined`).

use std::sync::Arc;

use anyhow::Result;

use super::schedule::Schedule;
use super::stage::StageSplit;
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::model::{Decoder, ParamSet};

/// Whether pipeline rank `r` of `schedule` over `split` holds the parameter `name`
/// (`tok_embeddings.*`: the first stage, and the last too when the output is tied to it;
/// `layers.N.*`: block N's stage; `norm.*`, `output.*`: the last stage).
pub fn holds(schedule: &Schedule, split: &StageSplit, tied: bool, r: usize, name: &str) -> bool {
    let mine = schedule.stages_of(r);
    let stages = &split.stages;
    if let Some(rest) = name.strip_prefix("layers.") {
        let block: usize = rest
            .split('.')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(usize::MAX);
        return mine.iter().any(|&s| stages[s].blocks.contains(&block));
    }
    let head = mine.iter().any(|&s| stages[s].head);
    if name.starts_with("tok_embeddings") {
        return mine.iter().any(|&s| stages[s].embedding) || (tied && head);
    }
    head
}

/// The first pipeline rank holding parameter `name`: the part of a checkpoint that records it.
pub fn holder(schedule: &Schedule, split: &StageSplit, tied: bool, name: &str) -> usize {
    (0..schedule.ranks())
        .find(|&r| holds(schedule, split, tied, r, name))
        .unwrap_or(0)
}

/// A pipeline rank: its stages and schedule (the walk runs a copy of the schedule with the
/// workspaces, `Walk::pipelined`).
pub struct PipelineRank {
    pub schedule: Schedule,
    pub split: StageSplit,
    group: Arc<dyn ProcessGroup>,
    /// Rows (sequences) of one microbatch.
    pub microbatch_rows: usize,
    /// The output is tied to the embedding: its gradient is summed over the two stages holding it.
    tied: bool,
    /// Workspaces the walk keeps (one per microbatch held at once).
    workspaces: usize,
}

impl PipelineRank {
    pub fn new(
        schedule: Schedule,
        split: StageSplit,
        group: Arc<dyn ProcessGroup>,
        microbatch_rows: usize,
        tied: bool,
    ) -> Self {
        let workspaces = schedule.microbatch_lifetimes(group.rank()).1;
        PipelineRank {
            schedule,
            split,
            group,
            microbatch_rows,
            tied,
            workspaces,
        }
    }

    pub fn group(&self) -> &dyn ProcessGroup {
        self.group.as_ref()
    }

    /// Whether this rank's stages hold the parameter `name` (`plan::holds`).
    pub fn holds(&self, name: &str) -> bool {
        holds(
            &self.schedule,
            &self.split,
            self.tied,
            self.group.rank(),
            name,
        )
    }

    /// The schedule (name, microbatches, bubble under unit costs) and one line per stage: where
    /// it runs and what it holds.
    pub fn describe(&self) -> String {
        let bubble = self.schedule.unit_bubble().map_or(String::new(), |b| {
            format!(", bubble {b:.3} under unit costs")
        });
        format!(
            "pipeline: {} over {} ranks, {} microbatches of {} sequences{bubble}, up to {} held per rank here\n{}",
            self.schedule.name,
            self.schedule.ranks(),
            self.schedule.microbatches,
            self.microbatch_rows,
            self.workspaces,
            self.split.describe(&self.schedule.placement)
        )
    }

    /// With the output tied to the embedding (held by the first and the last stage): sums the
    /// two stages' gradients of it over the pipeline group, so both hold the whole gradient and
    /// take the same optimizer step (every pipeline rank calls this together, once per gradient).
    pub fn sum_tied_grad<B: Backend>(
        &self,
        be: &B,
        model: &Decoder<B>,
        grads: &mut ParamSet<B>,
    ) -> Result<()> {
        let id = model.ids.tok_embeddings;
        // A frozen embedding (LoRA) has no gradient on any stage.
        if !self.tied || !crate::model::lora::trainable(model.args.lora.as_ref(), &grads.names[id])
        {
            return Ok(());
        }
        let numel: usize = grads.shapes[id].iter().product();
        let here = self.holds(&grads.names[id]);
        let mut v = if here {
            be.download(&grads.bufs[id])
        } else {
            vec![0f32; numel]
        };
        self.group
            .all_reduce(&mut v, crate::comm::group::ReduceOp::Sum)?;
        if here {
            grads.bufs[id] = be.upload(&v);
        }
        Ok(())
    }

    /// The parameter this rank holds as a copy whose gradient the norm must not count again: the
    /// tied embedding on a rank holding the last stage but not the first.
    pub fn copy_not_to_count<B: Backend>(&self, model: &Decoder<B>) -> Option<usize> {
        let first = self.holder("tok_embeddings.weight");
        (self.tied && self.group.rank() != first && self.holds("tok_embeddings.weight"))
            .then_some(model.ids.tok_embeddings)
    }

    /// Whether pipeline rank `r` holds parameter `name`.
    pub fn holds_on(&self, r: usize, name: &str) -> bool {
        holds(&self.schedule, &self.split, self.tied, r, name)
    }

    /// The pipeline rank holding parameter `name` (a checkpoint's part for it).
    pub fn holder(&self, name: &str) -> usize {
        holder(&self.schedule, &self.split, self.tied, name)
    }

    /// Workspaces this rank keeps (one per microbatch held at once).
    pub fn workspaces(&self) -> usize {
        self.workspaces
    }
}
