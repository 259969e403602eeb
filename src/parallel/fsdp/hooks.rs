//! FSDP as the walk's parameter hooks: when each block's parameters are gathered, freed and
//! reduce-scattered over a pass (FSDP2's per-module hooks), on the shards `Fsdp` holds.

use anyhow::{anyhow, Result};

use super::Fsdp;
use crate::backend::Backend;
use crate::memory_timeline::Category;
use crate::model::ParamSet;
use crate::parallel::walk::{ParamHooks, PassKind, Unit};

/// FSDP as the walk's parameter hooks (`walk::ParamHooks`): this rank's shards in `fsdp`, and the
/// working sets `full` and `grads` whose tensors exist only while a unit computes.
///
/// Without a pipeline each block is a unit (FSDP2): its parameters are all-gathered before its
/// forward, the next block's gather started first so it runs during this one's compute, and freed
/// after it when the `ReshardPolicy` says so (then gathered again, one block ahead, before its
/// backward); right after its backward its gradients are reduce-scattered into this rank's shards
/// and the full tensors freed. The parameters outside blocks are gathered with the embedding and
/// reduce-scattered after the embedding's backward.
///
/// Under a pipeline (`per_pass`) every parameter this rank holds is gathered for the whole pass
/// over its microbatches and reduce-scattered once after it, as TorchTitan keeps a stage's
/// parameters gathered between microbatches: regathering them for each would multiply the traffic.
pub struct ShardedParams<B: Backend> {
    pub fsdp: Fsdp<B>,
    pub full: ParamSet<B>,
    pub grads: ParamSet<B>,
    pub per_pass: bool,
    pass: Option<ShardedPass>,
}

/// The pass in progress.
struct ShardedPass {
    kind: PassKind,
    blocks: Vec<Vec<usize>>,
    /// Whether each block's parameters are freed after its forward and gathered again.
    regather: Vec<bool>,
    /// Under a pipeline: every parameter gathered for the pass.
    held: Vec<usize>,
}

impl<B: Backend> ShardedParams<B> {
    pub fn new(fsdp: Fsdp<B>, full: ParamSet<B>, grads: ParamSet<B>, per_pass: bool) -> Self {
        ShardedParams {
            fsdp,
            full,
            grads,
            per_pass,
            pass: None,
        }
    }

    fn pass(&self) -> Result<&ShardedPass> {
        self.pass
            .as_ref()
            .ok_or_else(|| anyhow!("FSDP: a unit ran outside a pass (a titan bug)"))
    }

    /// Whether this is a per-block pass, and block `l`'s parameters with whether they are
    /// gathered again before the backward.
    fn block(&self, l: usize) -> Result<Option<(Vec<usize>, bool)>> {
        let pass = self.pass()?;
        Ok((!self.per_pass).then(|| (pass.blocks[l].clone(), pass.regather[l])))
    }

    fn release(&mut self, be: &B, ids: &[usize]) {
        Fsdp::release(be, &mut self.full, ids, Category::GatheredBlocks);
    }
}

impl<B: Backend> ParamHooks<B> for ShardedParams<B> {
    fn sets(&mut self) -> (&ParamSet<B>, &mut ParamSet<B>) {
        (&self.full, &mut self.grads)
    }

    fn begin_pass(&mut self, be: &B, kind: PassKind, blocks: &[Vec<usize>]) -> Result<()> {
        if self.fsdp.failed {
            return Err(anyhow!(
                "FSDP: an earlier step failed part-way; its collectives cannot be resumed"
            ));
        }
        // Cleared by `end_pass`: a pass that stops part-way may leave collectives in the queue
        // and gradients half-added.
        self.fsdp.failed = true;
        self.fsdp.prepare_float8_scales(be)?;
        let n = blocks.len();
        let policy = self.fsdp.reshard_after_forward;
        let mut pass = ShardedPass {
            kind,
            blocks: blocks.to_vec(),
            regather: (0..n).map(|l| policy.reshard(l, n)).collect(),
            held: Vec::new(),
        };
        if self.per_pass {
            pass.held = self.fsdp.gather_held(be, &mut self.full)?;
            if kind.has_backward() {
                self.fsdp.zeros(be, &mut self.grads, &pass.held);
            }
        }
        self.pass = Some(pass);
        Ok(())
    }

    fn before_forward(&mut self, be: &B, unit: Unit) -> Result<()> {
        if self.per_pass {
            return Ok(());
        }
        let non_block = self.fsdp.non_block.clone();
        match unit {
            Unit::Embedding => {
                let first = self.pass()?.blocks.first().cloned();
                self.fsdp.submit_gather(be, &non_block)?;
                if let Some(first) = first {
                    self.fsdp.submit_gather(be, &first)?;
                }
                self.fsdp.wait_gather(be, &mut self.full, &non_block)
            }
            Unit::Block(l) => {
                if let Some(next) = self.pass()?.blocks.get(l + 1).cloned() {
                    self.fsdp.submit_gather(be, &next)?;
                }
                let block = self.pass()?.blocks[l].clone();
                self.fsdp.wait_gather(be, &mut self.full, &block)
            }
            Unit::Head => {
                if self.pass()?.kind.has_backward() {
                    self.fsdp.zeros(be, &mut self.grads, &non_block);
                }
                Ok(())
            }
        }
    }

    fn after_forward(&mut self, be: &B, unit: Unit) -> Result<()> {
        if self.per_pass {
            return Ok(());
        }
        let loss_only = !self.pass()?.kind.has_backward();
        match unit {
            Unit::Block(l) => {
                if let Some((block, regather)) = self.block(l)? {
                    if regather || loss_only {
                        self.release(be, &block);
                    }
                }
            }
            Unit::Head if loss_only => {
                let non_block = self.fsdp.non_block.clone();
                self.release(be, &non_block);
            }
            Unit::Head | Unit::Embedding => {}
        }
        Ok(())
    }

    fn before_backward(&mut self, be: &B, unit: Unit) -> Result<()> {
        let Unit::Block(l) = unit else {
            return Ok(());
        };
        let Some((block, regather)) = self.block(l)? else {
            return Ok(());
        };
        let pass = self.pass()?;
        let last = pass.blocks.len() - 1;
        let previous = (l >= 1 && pass.regather[l - 1]).then(|| pass.blocks[l - 1].clone());
        // The last block's backward follows its forward at once: its gather was not prefetched.
        if l == last && regather {
            self.fsdp.submit_gather(be, &block)?;
        }
        if let Some(previous) = previous {
            self.fsdp.submit_gather(be, &previous)?;
        }
        if regather {
            self.fsdp.wait_gather(be, &mut self.full, &block)?;
        }
        self.fsdp.zeros(be, &mut self.grads, &block);
        Ok(())
    }

    fn after_backward(&mut self, be: &B, unit: Unit) -> Result<()> {
        if self.per_pass {
            return Ok(());
        }
        let ids = match unit {
            Unit::Block(l) => self.pass()?.blocks[l].clone(),
            Unit::Embedding => self.fsdp.non_block.clone(),
            Unit::Head => return Ok(()),
        };
        self.fsdp.submit_reduce_scatter(be, &mut self.grads, &ids)?;
        if unit == Unit::Embedding {
            // The pass's last collectives.
            self.fsdp.drain(be, &mut self.full)?;
            self.release(be, &ids);
            return Ok(());
        }
        self.release(be, &ids);
        self.fsdp.complete_down_to_limit(be, &mut self.full)
    }

    fn end_pass(
        &mut self,
        be: &B,
        complete: &dyn Fn(&mut ParamSet<B>) -> Result<()>,
    ) -> Result<()> {
        let pass = self
            .pass
            .take()
            .ok_or_else(|| anyhow!("FSDP: a pass ended that did not begin (a titan bug)"))?;
        if self.per_pass {
            if pass.kind.has_backward() {
                complete(&mut self.grads)?;
                self.fsdp
                    .submit_reduce_scatter(be, &mut self.grads, &pass.held)?;
                self.fsdp.drain(be, &mut self.full)?;
            }
            self.release(be, &pass.held);
        }
        self.fsdp.failed = false;
        Ok(())
    }
}
