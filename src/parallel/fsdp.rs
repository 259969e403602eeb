//! FSDP: parameters, gradients and AdamW state sharded across the data-parallel ranks.
//!
//! Sharding unit: each parameter separately, flattened and zero-padded to a multiple of the group
//! size, rank `r` owning elements `[r·c, (r+1)·c)` (FSDP2's per-parameter dim-0 sharding, flattened).
//! Per-parameter shards keep checkpoints and the optimizer parameter-shaped; a block's shards are
//! packed into one buffer for each collective, so communication is still one call per block.
//!
//! A step runs the model's stages with the collectives in between: the parameters outside blocks
//! are gathered first; each block's parameters are all-gathered before its forward (and, when
//! the `ReshardPolicy` says so, freed after it and gathered again before its backward); right after a
//! block's backward its gradients are reduce-scattered into this rank's gradient shard and the full
//! buffers are freed. Reduce-scatter sums in fp32; the loss is normalised by the global number of
//! targets, so the summed shards are the gradient of the global mean loss.
//!
//! HSDP: with `dp_replicate > 1` the shards are replicated, and each reduce-scattered gradient shard
//! is then all-reduced across the replicas.
//!
//! Not yet: prefetching the next block's gather on a communication thread, and checkpoints
//! written shard by shard (today the full state is gathered and rank 0 writes it, which lets any
//! layout resume it).

use std::sync::Arc;

use anyhow::Result;

use crate::backend::{Backend, LossSum};
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::{Llama, ParamSet, Workspace};

pub struct Fsdp<B: Backend> {
    group: Arc<dyn ProcessGroup>,
    /// HSDP: the replicas of this shard, whose gradient shards are all-reduced.
    replicate: Option<Arc<dyn ProcessGroup>>,
    /// This rank's shard of every parameter (`[shard_len]` each).
    pub shards: ParamSet<B>,
    pub grad_shards: ParamSet<B>,
    numel: Vec<usize>,
    shard_len: Vec<usize>,
    /// Parameters outside the transformer blocks (embeddings, final norm, output).
    non_block: Vec<usize>,
    reshard_after_forward: ReshardPolicy,
}

/// When a block's gathered parameters are freed after its forward (TorchTitan's choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReshardPolicy {
    /// Every block but the last, whose backward comes right after its forward.
    Default,
    Always,
    /// Keep them until the block's backward: one gather per block per step instead of two.
    Never,
}

impl ReshardPolicy {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "default" => Some(ReshardPolicy::Default),
            "always" => Some(ReshardPolicy::Always),
            "never" => Some(ReshardPolicy::Never),
            _ => None,
        }
    }

    fn reshard(self, block: usize, n_blocks: usize) -> bool {
        match self {
            ReshardPolicy::Default => block + 1 < n_blocks,
            ReshardPolicy::Always => true,
            ReshardPolicy::Never => false,
        }
    }
}

impl<B: Backend> Fsdp<B> {
    /// Shards `full` (identical on every rank) across `group`.
    pub fn new(
        be: &B,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
        model: &Llama<B>,
        full: &ParamSet<B>,
        reshard_after_forward: ReshardPolicy,
    ) -> Self {
        let size = group.size();
        let numel: Vec<usize> = full.shapes.iter().map(|s| s.iter().product()).collect();
        let shard_len: Vec<usize> = numel.iter().map(|n| n.div_ceil(size)).collect();
        let specs: Vec<(String, Vec<usize>)> = full
            .names
            .iter()
            .zip(&shard_len)
            .map(|(n, c)| (n.clone(), vec![*c]))
            .collect();
        let mut in_block = vec![false; full.len()];
        for l in &model.ids.layers {
            for i in l.all() {
                in_block[i] = true;
            }
        }
        let mut f = Fsdp {
            shards: ParamSet::zeros(be, &specs),
            grad_shards: ParamSet::zeros(be, &specs),
            numel,
            shard_len,
            non_block: (0..full.len()).filter(|&i| !in_block[i]).collect(),
            reshard_after_forward,
            group,
            replicate,
        };
        f.shards = f.shard_of(be, full);
        f
    }

    /// The group the parameters are sharded over.
    pub fn shard_group(&self) -> &dyn ProcessGroup {
        self.group.as_ref()
    }

    pub fn shard_specs(&self) -> Vec<(String, Vec<usize>)> {
        self.shards
            .names
            .iter()
            .zip(&self.shard_len)
            .map(|(n, c)| (n.clone(), vec![*c]))
            .collect()
    }

    /// This rank's shards of a full, parameter-shaped set (weights or optimizer moments).
    pub fn shard_of(&self, be: &B, full: &ParamSet<B>) -> ParamSet<B> {
        let rank = self.group.rank();
        let mut out = ParamSet::zeros(be, &self.shard_specs());
        for i in 0..full.len() {
            let c = self.shard_len[i];
            let data = be.download(&full.bufs[i]);
            let mut shard = vec![0.0f32; c];
            let lo = (rank * c).min(data.len());
            let hi = ((rank + 1) * c).min(data.len());
            shard[..hi - lo].copy_from_slice(&data[lo..hi]);
            out.bufs[i] = be.upload(&shard);
        }
        out
    }

    /// All-gathers the shards `ids` of `shards` into full buffers of `full`.
    /// All-gathers the shards `ids` of `shards` into full buffers of `full`, in one collective: the
    /// shards are packed back to back, and rank `r`'s part of the result unpacks into each tensor's
    /// `[r·c, (r+1)·c)`.
    fn gather_into(&self, be: &B, shards: &ParamSet<B>, full: &mut ParamSet<B>, ids: &[usize]) -> Result<()> {
        let size = self.group.size();
        let packed_len: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
        let mut mine = Vec::with_capacity(packed_len);
        for &i in ids {
            mine.extend_from_slice(&be.download(&shards.bufs[i]));
        }
        let mut all = vec![0.0f32; packed_len * size];
        self.group.all_gather(&mine, &mut all)?;
        let mut offset = 0;
        for &i in ids {
            let c = self.shard_len[i];
            let mut t = vec![0.0f32; c * size];
            for r in 0..size {
                t[r * c..(r + 1) * c].copy_from_slice(&all[r * packed_len + offset..r * packed_len + offset + c]);
            }
            t.truncate(self.numel[i]);
            full.bufs[i] = be.upload(&t);
            offset += c;
        }
        Ok(())
    }

    /// Full tensors of a sharded set, on every rank (checkpoints).
    pub fn gather_full(
        &self,
        be: &B,
        shards: &ParamSet<B>,
        full_specs: &[(String, Vec<usize>)],
    ) -> Result<ParamSet<B>> {
        let mut full = ParamSet::zeros(be, full_specs);
        let all: Vec<usize> = (0..full.len()).collect();
        self.gather_into(be, shards, &mut full, &all)?;
        Ok(full)
    }

    fn release(be: &B, set: &mut ParamSet<B>, ids: &[usize]) {
        for &i in ids {
            set.bufs[i] = be.zeros(0);
        }
    }

    fn zeros(&self, be: &B, set: &mut ParamSet<B>, ids: &[usize]) {
        for &i in ids {
            set.bufs[i] = be.zeros(self.numel[i]);
        }
    }

    /// Reduce-scatters the full gradients `ids` and adds them into this rank's gradient shards.
    /// Reduce-scatters the full gradients `ids` (one collective: rank `r`'s segment packs every
    /// tensor's `[r·c, (r+1)·c)`) and adds them into this rank's gradient shards.
    fn reduce_grads(&mut self, be: &B, grads: &mut ParamSet<B>, ids: &[usize]) -> Result<()> {
        let size = self.group.size();
        let packed_len: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
        let mut packed = vec![0.0f32; packed_len * size];
        let mut offset = 0;
        for &i in ids {
            let c = self.shard_len[i];
            let g = be.download(&grads.bufs[i]);
            for r in 0..size {
                let lo = (r * c).min(g.len());
                let hi = ((r + 1) * c).min(g.len());
                packed[r * packed_len + offset..r * packed_len + offset + (hi - lo)].copy_from_slice(&g[lo..hi]);
            }
            offset += c;
        }
        let mut mine = vec![0.0f32; packed_len];
        self.group.reduce_scatter(&packed, &mut mine, ReduceOp::Sum)?;
        if let Some(r) = &self.replicate {
            r.all_reduce(&mut mine, ReduceOp::Sum)?;
        }
        let mut offset = 0;
        for &i in ids {
            let c = self.shard_len[i];
            let mut acc = be.download(&self.grad_shards.bufs[i]);
            acc.iter_mut().zip(&mine[offset..offset + c]).for_each(|(a, m)| *a += m);
            self.grad_shards.bufs[i] = be.upload(&acc);
            offset += c;
        }
        Self::release(be, grads, ids);
        Ok(())
    }

    /// One micro-batch: forward and backward with gathers and reduce-scatters around each block;
    /// gradients are added into `grad_shards`. `full` and `grads` are working sets whose buffers exist
    /// only while a stage needs them.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward(
        &mut self,
        be: &B,
        model: &Llama<B>,
        full: &mut ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        grad_scale: f32,
    ) -> Result<LossSum> {
        model.load_tokens(ws, tokens)?;
        let non_block = self.non_block.clone();
        self.gather_into(be, &self.shards, full, &non_block)?;
        model.embed_forward(be, full, ws);
        let n_blocks = model.ids.layers.len();
        for (l, layer) in model.ids.layers.iter().enumerate() {
            let ids = layer.all();
            self.gather_into(be, &self.shards, full, &ids)?;
            model.block_forward(be, full, ws, l);
            if self.reshard_after_forward.reshard(l, n_blocks) {
                Self::release(be, full, &ids);
            }
        }
        self.zeros(be, grads, &non_block);
        let loss = model.head_forward_backward(be, full, grads, ws, grad_scale);
        for (l, layer) in model.ids.layers.iter().enumerate().rev() {
            let ids = layer.all();
            if self.reshard_after_forward.reshard(l, n_blocks) {
                self.gather_into(be, &self.shards, full, &ids)?;
            }
            self.zeros(be, grads, &ids);
            model.block_backward(be, full, grads, ws, l);
            self.reduce_grads(be, grads, &ids)?;
            Self::release(be, full, &ids);
        }
        model.embed_backward(be, grads, ws);
        self.reduce_grads(be, grads, &non_block)?;
        Self::release(be, full, &non_block);
        Ok(loss)
    }
}
