//! FSDP as the walk's parameter hooks: when each block's parameters are gathered, freed and
//! reduce-scattered over a pass (FSDP2's per-module hooks), on the shards `Fsdp` holds.

use anyhow::{anyhow, Result};

use super::stage_pairs::StagePairs;
use super::Fsdp;
use crate::backend::Backend;
use crate::memory_timeline::Category;
use crate::model::{ParamDtype, ParamSet};
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
/// With bf16 mixed precision the blocks' gathered weights are held as bf16 pairs for the pass and
/// unpacked while their block computes (`StagePairs`).
pub struct ShardedParams<B: Backend> {
    pub fsdp: Fsdp<B>,
    pub full: ParamSet<B>,
    pub grads: ParamSet<B>,
    pub per_pass: bool,
    pass: Option<ShardedPass>,
    stage_pairs: StagePairs<B>,
}

/// The pass in progress.
struct ShardedPass {
    kind: PassKind,
    blocks: Vec<Vec<usize>>,
    /// Whether each block's parameters are freed after its forward and gathered again.
    regather: Vec<bool>,
    /// Under a pipeline: every parameter gathered for the pass, as the parameters outside the
    /// blocks and each block's (`held_units`).
    held: Vec<Vec<usize>>,
}

impl<B: Backend> ShardedParams<B> {
    pub fn new(fsdp: Fsdp<B>, full: ParamSet<B>, grads: ParamSet<B>, per_pass: bool) -> Self {
        ShardedParams {
            fsdp,
            full,
            grads,
            per_pass,
            pass: None,
            stage_pairs: StagePairs::new(0),
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

    /// Under a pipeline: the parameters this rank holds, as those outside the blocks and each
    /// block's (none empty).
    fn held_units(&self, blocks: &[Vec<usize>]) -> Vec<Vec<usize>> {
        let numel = &self.fsdp.numel;
        let held = |ids: &mut dyn Iterator<Item = usize>| -> Vec<usize> {
            ids.filter(|&i| numel[i] > 0).collect()
        };
        let mut in_block = vec![false; numel.len()];
        blocks.iter().flatten().for_each(|&i| in_block[i] = true);
        let outside = held(&mut (0..numel.len()).filter(|&i| !in_block[i]));
        std::iter::once(outside)
            .chain(blocks.iter().map(|b| held(&mut b.iter().copied())))
            .filter(|ids| !ids.is_empty())
            .collect()
    }

    /// Under a pipeline: the stage's parameters gathered a unit at a time (`held_units`, the
    /// next one's gather in flight); with bf16 mixed precision each block's packed into
    /// `stage_pairs` as it arrives, so no more than two blocks exist in f32 at once.
    fn gather_stage(&mut self, be: &B, units: &[Vec<usize>], blocks: &[Vec<usize>]) -> Result<()> {
        let pack = self.fsdp.param_dtype == ParamDtype::BFloat16;
        self.stage_pairs = StagePairs::new(self.full.bufs.len());
        if let Some(first) = units.first() {
            self.fsdp.submit_gather(be, first)?;
        }
        for (k, ids) in units.iter().enumerate() {
            if let Some(next) = units.get(k + 1) {
                self.fsdp.submit_gather(be, next)?;
            }
            self.fsdp.wait_gather(be, &mut self.full, ids)?;
            let in_block = blocks.iter().any(|b| b.contains(&ids[0]));
            if pack && in_block {
                let fsdp = &self.fsdp;
                let packable = |i| !fsdp.gathers_in_float8(i);
                self.stage_pairs.pack(be, &mut self.full, ids, packable);
            }
        }
        Ok(())
    }

    /// Under a pipeline: block `l`'s weights unpacked from the stage's bf16 pairs (`lend`), or
    /// freed again after it ran.
    fn stage_block(&mut self, be: &B, l: usize, lend: bool) -> Result<()> {
        let block = self.pass()?.blocks[l].clone();
        match lend {
            true => self
                .stage_pairs
                .lend(be, &mut self.full, &block, &self.fsdp.numel),
            false => self.stage_pairs.take_back(be, &mut self.full, &block),
        }
        Ok(())
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
            pass.held = self.held_units(blocks);
            self.gather_stage(be, &pass.held, blocks)?;
            if kind.has_backward() {
                for ids in &pass.held {
                    self.fsdp.zeros(be, &mut self.grads, ids);
                }
            }
        }
        self.pass = Some(pass);
        Ok(())
    }

    fn before_forward(&mut self, be: &B, unit: Unit) -> Result<()> {
        if self.per_pass {
            return match unit {
                Unit::Block(l) => self.stage_block(be, l, true),
                _ => Ok(()),
            };
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
            return match unit {
                Unit::Block(l) => self.stage_block(be, l, false),
                _ => Ok(()),
            };
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
            return self.stage_block(be, l, true);
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
            return match unit {
                Unit::Block(l) => self.stage_block(be, l, false),
                _ => Ok(()),
            };
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
            self.stage_pairs.free(&self.fsdp.numel);
            if pass.kind.has_backward() {
                complete(&mut self.grads)?;
                // A unit at a time, so only a few units' packed gradients exist at once.
                for ids in &pass.held {
                    self.fsdp.submit_reduce_scatter(be, &mut self.grads, ids)?;
                    self.fsdp.complete_down_to_limit(be, &mut self.full)?;
                }
                self.fsdp.drain(be, &mut self.full)?;
            }
            for ids in &pass.held {
                self.release(be, ids);
            }
        }
        self.fsdp.failed = false;
        Ok(())
    }
}
