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
///
/// With bf16 mixed precision the forward and backward compute with a rounded copy
/// (`bf16_copy`). Its parameters outside the blocks (embedding, final norm, output) are rounded
/// once a step and before a pass without a backward; a block's exist only while the block runs:
/// rounded from the masters before its forward and again before its backward, freed after each,
/// as FSDP2 with `reshard_after_forward` holds one block's bf16 parameters at a time. So the copy
/// costs the parameters outside the blocks and one block, not a second model.
pub struct WholeParams<B: Backend> {
    pub params: ParamSet<B>,
    pub grads: ParamSet<B>,
    /// With bf16 mixed precision, the rounded set the forward and backward compute with (a
    /// block's tensors empty while it does not run).
    pub bf16_copy: Option<ParamSet<B>>,
    pub ddp: Option<Ddp<B>>,
    /// DDP sums each block's gradients as soon as they are final in the last microbatch's
    /// backward (false under a pipeline: every gradient at once after the step's last microbatch).
    pub ddp_per_block: bool,
    /// The pass in progress: whether DDP reduces during it.
    reducing: bool,
    /// Each block's parameters, and those outside every block.
    blocks: Vec<Vec<usize>>,
    outside: Vec<usize>,
}

impl<B: Backend> WholeParams<B> {
    /// `blocks[l]`: block `l`'s parameters; `bf16`: compute with a rounded copy.
    pub fn new(
        be: &B,
        (params, grads): (ParamSet<B>, ParamSet<B>),
        bf16: bool,
        ddp: Option<Ddp<B>>,
        blocks: Vec<Vec<usize>>,
    ) -> Self {
        let in_blocks: std::collections::HashSet<usize> =
            blocks.iter().flatten().copied().collect();
        let outside: Vec<usize> = (0..params.bufs.len())
            .filter(|i| !in_blocks.contains(i))
            .collect();
        let bf16_copy = bf16.then(|| ParamSet {
            names: params.names.clone(),
            shapes: params.shapes.clone(),
            bufs: (0..params.bufs.len())
                .map(|i| match in_blocks.contains(&i) {
                    true => be.zeros(0),
                    false => be.zeros(be.len(&params.bufs[i])),
                })
                .collect(),
        });
        WholeParams {
            params,
            grads,
            bf16_copy,
            ddp,
            ddp_per_block: true,
            reducing: false,
            blocks,
            outside,
        }
    }

    /// Rounds the bf16 compute copy of the parameters outside the blocks from the masters.
    fn refresh_copy(&mut self, be: &B) {
        if let Some(c) = self.bf16_copy.as_mut() {
            for &i in &self.outside {
                be.copy_rounded_to_bf16_all(&mut c.bufs[i..=i], &self.params.bufs[i..=i]);
            }
        }
    }

    /// Makes block `l`'s compute copy (rounded from the masters) for its forward or backward.
    fn round_block(&mut self, be: &B, unit: Unit) {
        let (Some(c), Unit::Block(l)) = (self.bf16_copy.as_mut(), unit) else {
            return;
        };
        for &i in &self.blocks[l] {
            c.bufs[i] = be.uninit(be.len(&self.params.bufs[i]));
            be.copy_rounded_to_bf16_all(&mut c.bufs[i..=i], &self.params.bufs[i..=i]);
        }
    }

    /// Frees block `l`'s compute copy.
    fn free_block(&mut self, be: &B, unit: Unit) {
        if let (Some(c), Unit::Block(l)) = (self.bf16_copy.as_mut(), unit) {
            for &i in &self.blocks[l] {
                c.bufs[i] = be.zeros(0);
            }
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
        debug_assert_eq!(self.blocks, blocks, "the walk's blocks are the state's");
        Ok(())
    }

    fn before_forward(&mut self, be: &B, unit: Unit) -> Result<()> {
        self.round_block(be, unit);
        Ok(())
    }

    fn after_forward(&mut self, be: &B, unit: Unit) -> Result<()> {
        self.free_block(be, unit);
        Ok(())
    }

    fn before_backward(&mut self, be: &B, unit: Unit) -> Result<()> {
        self.round_block(be, unit);
        Ok(())
    }

    fn after_backward(&mut self, be: &B, unit: Unit) -> Result<()> {
        self.free_block(be, unit);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::{init_params, Decoder};

    /// Under bf16 a block's compute copy exists from its forward's start to its end (and again
    /// around its backward), rounded from the masters; at most the parameters outside the blocks
    /// and one block are held, what the memory estimate counts.
    #[test]
    fn a_blocks_bf16_copy_lives_while_the_block_runs() {
        let be = CpuBackend::new();
        let args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let model = Decoder::new(&be, args.clone(), 16).unwrap();
        let params = init_params(&be, &args, 3);
        let grads = ParamSet::zeros(&be, &model.param_specs());
        let blocks: Vec<Vec<usize>> = model.ids.layers.iter().map(|l| l.all()).collect();
        let mut w = WholeParams::new(&be, (params, grads), true, None, blocks.clone());
        let held = |w: &WholeParams<CpuBackend>| -> usize {
            w.bf16_copy
                .as_ref()
                .unwrap()
                .bufs
                .iter()
                .map(|b| b.len())
                .sum()
        };
        let lens: Vec<usize> = w.params.bufs.iter().map(|b| b.len()).collect();
        let in_block = |l: usize| blocks[l].iter().map(|&i| lens[i]).sum::<usize>();
        let outside = lens.iter().sum::<usize>() - (0..args.n_layers).map(in_block).sum::<usize>();
        assert_eq!(held(&w), outside);
        w.before_forward(&be, Unit::Block(1)).unwrap();
        assert_eq!(held(&w), outside + in_block(1));
        for &i in &blocks[1] {
            let mut rounded = w.params.bufs[i].clone();
            be.round_to_bf16(&mut rounded);
            assert_eq!(w.bf16_copy.as_ref().unwrap().bufs[i], rounded);
        }
        w.after_forward(&be, Unit::Block(1)).unwrap();
        assert_eq!(held(&w), outside);
        w.before_backward(&be, Unit::Block(0)).unwrap();
        assert_eq!(held(&w), outside + in_block(0));
        w.after_backward(&be, Unit::Block(0)).unwrap();
        assert_eq!(held(&w), outside);
    }
}
