//! Where a rank's weights and gradients live, as the walk's parameter hooks: whole sets (one
//! process, or DDP summing each block's gradients across ranks) or FSDP/HSDP shards
//! (`fsdp::ShardedParams`). The step asks the state for its hooks and never which one it is.

use anyhow::Result;

use super::ddp::Ddp;
use super::fsdp::ShardedParams;
use super::walk::{ParamHooks, PassKind, Unit};
use crate::backend::Backend;
use crate::model::params::LayerIds;
use crate::model::ParamSet;

/// The whole (tensor-parallel rank's) model: one process, or DDP with `ddp`.
pub struct WholeParams<B: Backend> {
    pub params: ParamSet<B>,
    pub grads: ParamSet<B>,
    /// With bf16 mixed precision, the rounded set the forward and backward compute with.
    pub bf16_copy: Option<ParamSet<B>>,
    pub ddp: Option<Ddp<B>>,
    /// DDP sums each block's gradients as soon as they are final in the last microbatch's
    /// backward (false under a pipeline: every gradient at once after the step's last microbatch).
    pub ddp_per_block: bool,
    /// The pass in progress: whether DDP reduces during it, and each block's parameters.
    reducing: bool,
    blocks: Vec<Vec<usize>>,
}

impl<B: Backend> WholeParams<B> {
    pub fn new(
        params: ParamSet<B>,
        grads: ParamSet<B>,
        bf16_copy: Option<ParamSet<B>>,
        ddp: Option<Ddp<B>>,
    ) -> Self {
        WholeParams {
            params,
            grads,
            bf16_copy,
            ddp,
            ddp_per_block: true,
            reducing: false,
            blocks: Vec::new(),
        }
    }

    /// Rounds the bf16 compute copy from the master weights.
    fn refresh_copy(&mut self, be: &B) {
        if let Some(c) = self.bf16_copy.as_mut() {
            c.refresh_bf16_copy(be, &self.params);
        }
    }
}

impl<B: Backend> ParamHooks<B> for WholeParams<B> {
    fn sets(&mut self) -> (&ParamSet<B>, &mut ParamSet<B>) {
        let compute = self.bf16_copy.as_ref().unwrap_or(&self.params);
        (compute, &mut self.grads)
    }

    fn begin_pass(&mut self, be: &B, pass: PassKind, blocks: &[Vec<usize>]) -> Result<()> {
        self.reducing = match pass {
            PassKind::Train {
                last_microbatch, ..
            } => self.ddp.is_some() && self.ddp_per_block && last_microbatch,
            PassKind::LossOnly | PassKind::LastLogits => {
                self.refresh_copy(be);
                false
            }
        };
        if self.reducing && self.blocks.is_empty() {
            self.blocks = blocks.to_vec();
        }
        Ok(())
    }

    fn after_backward(&mut self, be: &B, unit: Unit) -> Result<()> {
        if let (Unit::Block(l), true, Some(ddp)) = (unit, self.reducing, self.ddp.as_mut()) {
            ddp.block_done(be, &self.blocks[l], &mut self.grads)?;
        }
        Ok(())
    }
}

/// Where this rank's weights and gradients live (one per rank, built once: the variants' sizes
/// do not matter).
#[allow(clippy::large_enum_variant)]
pub enum ParamState<B: Backend> {
    Whole(WholeParams<B>),
    Sharded(ShardedParams<B>),
}

impl<B: Backend> ParamState<B> {
    /// The walk's hooks.
    pub fn hooks(&mut self) -> &mut dyn ParamHooks<B> {
        match self {
            ParamState::Whole(w) => w,
            ParamState::Sharded(s) => s,
        }
    }

    /// Before a step's first microbatch: gradients zeroed, the bf16 compute copy rounded.
    pub fn begin_step(&mut self, be: &B) {
        match self {
            ParamState::Whole(w) => {
                w.refresh_copy(be);
                w.grads.zero(be);
            }
            ParamState::Sharded(s) => s.fsdp.grad_shards.zero(be),
        }
    }

    /// After a step's last microbatch: whole gradients completed by `complete` (a pipeline's tied
    /// embedding) and summed over DDP's ranks (`blocks`: those already summed per block). FSDP
    /// hands its gradients on after each pass.
    pub fn finish_step(
        &mut self,
        be: &B,
        blocks: &[LayerIds],
        complete: &dyn Fn(&mut ParamSet<B>) -> Result<()>,
    ) -> Result<()> {
        let ParamState::Whole(w) = self else {
            return Ok(());
        };
        complete(&mut w.grads)?;
        if let Some(d) = w.ddp.as_mut() {
            let covered = if w.ddp_per_block { blocks } else { &[] };
            d.finish(be, &mut w.grads, covered)?;
        }
        Ok(())
    }

    /// Frees every whole tensor `keep` rejects (a pipeline rank's other stages).
    pub fn keep_only(&mut self, be: &B, keep: impl Fn(&str) -> bool) {
        if let ParamState::Whole(w) = self {
            w.params.keep_only(be, &keep);
            w.grads.keep_only(be, &keep);
            if let Some(c) = w.bf16_copy.as_mut() {
                c.keep_only(be, &keep);
            }
        }
    }

    /// The step's gradients as the optimizer reads them (FSDP: this rank's shards).
    pub fn grads(&self) -> &ParamSet<B> {
        match self {
            ParamState::Whole(w) => &w.grads,
            ParamState::Sharded(s) => &s.fsdp.grad_shards,
        }
    }

    pub fn grads_mut(&mut self) -> &mut ParamSet<B> {
        match self {
            ParamState::Whole(w) => &mut w.grads,
            ParamState::Sharded(s) => &mut s.fsdp.grad_shards,
        }
    }

    /// This rank's master weights (FSDP: its shards) with their gradients, for the optimizer
    /// (which changes the weights: FSDP's float8 scales are agreed again before their next use).
    pub fn weights_and_grads(&mut self) -> (&mut ParamSet<B>, &ParamSet<B>) {
        match self {
            ParamState::Whole(w) => (&mut w.params, &w.grads),
            ParamState::Sharded(s) => {
                s.fsdp.weights_changed();
                (&mut s.fsdp.shards, &s.fsdp.grad_shards)
            }
        }
    }

    /// The flat range of parameter `i` (its tensor-parallel part, flattened) this rank holds:
    /// all of it, or under FSDP its shard's.
    pub fn held_range(&self, be: &B, i: usize) -> (usize, usize) {
        match self {
            ParamState::Whole(w) => (0, be.len(&w.params.bufs[i])),
            ParamState::Sharded(s) => s.fsdp.held_range(i),
        }
    }

    /// Bytes FSDP's parameter all-gathers received on this rank since the last call; None
    /// without FSDP.
    pub fn take_gathered_bytes(&mut self) -> Option<u64> {
        match self {
            ParamState::Whole(_) => None,
            ParamState::Sharded(s) => Some(s.fsdp.take_gathered_bytes()),
        }
    }
}
