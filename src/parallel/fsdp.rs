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
//! Mixed precision (`ParamDtype::BFloat16`): the gathers for forward and backward carry the shards
//! rounded to bf16, two values per f32 word (half the bytes), so the blocks compute with bf16
//! weights; shards, gradients, their reduce-scatter and AdamW stay fp32. Checkpoint gathers are fp32.
//!
//! HSDP: with `dp_replicate > 1` the shards are replicated, and each reduce-scattered gradient shard
//! is then all-reduced across the replicas.
//!
//! Two ways to run the collectives:
//! - Host (the default): shards and gradients are packed on the host, and every collective of a
//!   step runs on one communication thread in submission order over the CPU transport: the next
//!   block's gather is submitted before the current block computes, and a block's reduce-scatter
//!   proceeds while the block below it computes.
//! - Buffers (`BufferComm`): packing and unpacking are backend ops on device buffers, and the
//!   collectives take those buffers whole: NCCL on GPUs (`comm::nccl`), or through the host for
//!   checking this path on the CPU (`TITAN_FSDP_COLLECTIVES=buffers`), where it gives the host
//!   path's bits. The collectives are started in the same order, and on GPUs they run on NCCL's
//!   stream while the compute stream goes on: the next block's gather during this block's
//!   forward, a block's reduce-scatter during the backward of the block below.
//!
//! Either way at most `MAX_IN_FLIGHT` collectives are left running after a block's backward, so the
//! packed gradients waiting for their reduce-scatter never add up to more than a few blocks' worth.
//!
//! Checkpoints: each rank writes its own shards (`checkpoint::sharded`).

use std::sync::Arc;

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};

use anyhow::{anyhow, Result};

use crate::backend::{Backend, LossSum};
use crate::comm::buffers::{BufferCollectives, Issued};
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::{Llama, ParamDtype, ParamSet, Workspace};

/// Work for the communication thread: packed shards to all-gather, or packed gradients to
/// reduce-scatter (and, for HSDP, all-reduce across replicas).
enum Job {
    Gather(Vec<f32>),
    ReduceScatter(Vec<f32>),
}

/// What the main thread expects back, in submission order.
enum Pending {
    Gather(Vec<usize>),
    ReduceScatter(Vec<usize>),
}

/// The thread that runs every collective of a step in submission order, so that the next block's
/// gather and the previous block's reduce-scatter proceed while the current block computes.
struct CommThread {
    to_comm: Option<Sender<Job>>,
    from_comm: Receiver<Result<Vec<f32>>>,
    pending: VecDeque<Pending>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl CommThread {
    fn new(group: Arc<dyn ProcessGroup>, replicate: Option<Arc<dyn ProcessGroup>>) -> Self {
        let (to_comm, jobs) = channel::<Job>();
        let (done, from_comm) = channel();
        let worker = std::thread::Builder::new()
            .name("titan-fsdp-comm".into())
            .spawn(move || {
                let size = group.size();
                for job in jobs {
                    let r = match job {
                        Job::Gather(mine) => {
                            let mut all = vec![0.0f32; mine.len() * size];
                            group.all_gather(&mine, &mut all).map(|_| all)
                        }
                        Job::ReduceScatter(packed) => {
                            let mut mine = vec![0.0f32; packed.len() / size];
                            group
                                .reduce_scatter(&packed, &mut mine, ReduceOp::Sum)
                                .and_then(|_| match &replicate {
                                    Some(r) => r.all_reduce(&mut mine, ReduceOp::Sum).map(|_| mine),
                                    None => Ok(mine),
                                })
                        }
                    };
                    // After a failure the group is unusable: report it and take no more work.
                    let failed = r.is_err();
                    if done.send(r).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawn the FSDP communication thread");
        CommThread {
            to_comm: Some(to_comm),
            from_comm,
            pending: VecDeque::new(),
            worker: Some(worker),
        }
    }

    fn submit(&mut self, job: Job, pending: Pending) -> Result<()> {
        self.to_comm
            .as_ref()
            .ok_or_else(|| anyhow!("FSDP communication thread is gone"))?
            .send(job)
            .map_err(|_| anyhow!("FSDP communication thread stopped"))?;
        self.pending.push_back(pending);
        Ok(())
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.to_comm = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// FSDP's collectives on backend buffers: over the shard group and, for HSDP, the replicas.
pub struct BufferComm<B: Backend> {
    pub shard: Box<dyn BufferCollectives<B>>,
    pub replicate: Option<Box<dyn BufferCollectives<B>>>,
}

/// A collective started on the buffer path, completed in submission order. Each holds its input
/// so that the buffer lives until the collective is done with it (see `comm::buffers`).
enum BufferPending<B: Backend> {
    /// Gathers the packed shards of `ids` (as bf16 pairs when `pairs`) into `gathered`.
    Gather {
        ids: Vec<usize>,
        pairs: bool,
        _packed: B::Buf,
        gathered: B::Buf,
        issued: Issued,
    },
    /// Reduce-scatters the packed gradients of `ids` into `mine` (this rank's summed shards),
    /// then for HSDP sums `mine` across the replicas.
    ReduceScatter {
        ids: Vec<usize>,
        _packed: B::Buf,
        mine: B::Buf,
        issued: Issued,
        replicated: Option<Issued>,
    },
}

/// Collectives left running after a block's backward (see the module doc).
const MAX_IN_FLIGHT: usize = 2;

/// How a step's collectives run (see the module doc).
enum Collectives<B: Backend> {
    /// On the host, by the communication thread.
    Host(CommThread),
    /// On backend buffers, with the collectives issued and not yet completed.
    Buffers(BufferComm<B>, VecDeque<BufferPending<B>>),
}

pub struct Fsdp<B: Backend> {
    comm: Collectives<B>,
    group: Arc<dyn ProcessGroup>,
    /// This rank's shard of every parameter (`[shard_len]` each).
    pub shards: ParamSet<B>,
    pub grad_shards: ParamSet<B>,
    numel: Vec<usize>,
    shard_len: Vec<usize>,
    /// Parameters outside the transformer blocks (embeddings, final norm, output).
    non_block: Vec<usize>,
    reshard_after_forward: ReshardPolicy,
    /// What the forward and backward's gathers carry: fp32, or bf16 (half the bytes).
    param_dtype: ParamDtype,
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
    /// Shards `full` (identical on every rank) across `group`. With `buffers` the step's
    /// collectives run on backend buffers through it; else on the host over `group` and
    /// `replicate` (which also serve checkpoints and the gradient norm either way).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &B,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
        buffers: Option<BufferComm<B>>,
        model: &Llama<B>,
        full: &ParamSet<B>,
        reshard_after_forward: ReshardPolicy,
        param_dtype: ParamDtype,
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
        let comm = match buffers {
            Some(b) => Collectives::Buffers(b, VecDeque::new()),
            None => Collectives::Host(CommThread::new(group.clone(), replicate.clone())),
        };
        let mut f = Fsdp {
            comm,
            shards: ParamSet::zeros(be, &specs),
            grad_shards: ParamSet::zeros(be, &specs),
            numel,
            shard_len,
            non_block: (0..full.len()).filter(|&i| !in_block[i]).collect(),
            reshard_after_forward,
            param_dtype,
            group,
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

    /// The shards `ids` of `shards`, packed back to back (one collective per block). In bf16 two
    /// values share each f32 word of the buffer: the all-gather only moves bytes.
    fn pack_shards(
        &self,
        be: &B,
        shards: &ParamSet<B>,
        ids: &[usize],
        dtype: ParamDtype,
    ) -> Vec<f32> {
        let values = ids.iter().map(|&i| self.shard_len[i]).sum();
        let mut packed = Vec::with_capacity(values);
        for &i in ids {
            packed.extend_from_slice(&be.download(&shards.bufs[i]));
        }
        match dtype {
            ParamDtype::Float32 => packed,
            ParamDtype::BFloat16 => crate::tensor::pack_bf16_pairs(&packed),
        }
    }

    /// Unpacks an all-gather of packed shards: rank `r`'s part fills each tensor's `[r·c, (r+1)·c)`.
    fn unpack_gathered(
        &self,
        be: &B,
        all: &[f32],
        full: &mut ParamSet<B>,
        ids: &[usize],
        dtype: ParamDtype,
    ) {
        let size = self.group.size();
        let words = all.len() / size;
        let value = |part: &[f32], at: usize| -> f32 {
            match dtype {
                ParamDtype::Float32 => part[at],
                ParamDtype::BFloat16 => crate::tensor::bf16_pair_value(part, at),
            }
        };
        let mut offset = 0;
        for &i in ids {
            let c = self.shard_len[i];
            let mut t = vec![0.0f32; c * size];
            for r in 0..size {
                let part = &all[r * words..(r + 1) * words];
                for (j, v) in t[r * c..(r + 1) * c].iter_mut().enumerate() {
                    *v = value(part, offset + j);
                }
            }
            t.truncate(self.numel[i]);
            full.bufs[i] = be.upload(&t);
            offset += c;
        }
    }

    /// All-gathers the shards `ids` of `shards` into full buffers of `full`, on this thread.
    fn gather_into(
        &self,
        be: &B,
        shards: &ParamSet<B>,
        full: &mut ParamSet<B>,
        ids: &[usize],
    ) -> Result<()> {
        let mine = self.pack_shards(be, shards, ids, ParamDtype::Float32);
        let mut all = vec![0.0f32; mine.len() * self.group.size()];
        self.group.all_gather(&mine, &mut all)?;
        self.unpack_gathered(be, &all, full, ids, ParamDtype::Float32);
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
    fn submit_gather(&mut self, be: &B, ids: &[usize]) -> Result<()> {
        if let Collectives::Buffers(comm, pending) = &mut self.comm {
            let words: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
            let mut packed = be.zeros(words);
            let mut at = 0;
            for &i in ids {
                be.copy_range(&mut packed, at, &self.shards.bufs[i], 0, self.shard_len[i]);
                at += self.shard_len[i];
            }
            // bf16 parameters travel as bf16 pairs (half the bytes), as on the host path.
            let pairs = self.param_dtype == ParamDtype::BFloat16;
            if pairs {
                let mut paired = be.zeros(words.div_ceil(2));
                be.pack_bf16_pairs(&mut paired, &packed);
                packed = paired;
            }
            let mut gathered = be.zeros(be.len(&packed) * comm.shard.size());
            let issued = comm.shard.all_gather(be, &packed, &mut gathered)?;
            pending.push_back(BufferPending::Gather {
                ids: ids.to_vec(),
                pairs,
                _packed: packed,
                gathered,
                issued,
            });
            return Ok(());
        }
        let mine = self.pack_shards(be, &self.shards, ids, self.param_dtype);
        self.host_thread()
            .submit(Job::Gather(mine), Pending::Gather(ids.to_vec()))
    }

    /// The communication thread, on the host path (callers have handled the buffer path).
    fn host_thread(&mut self) -> &mut CommThread {
        match &mut self.comm {
            Collectives::Host(thread) => thread,
            Collectives::Buffers(..) => unreachable!("FSDP's host path on the buffer path"),
        }
    }

    /// How many collectives are still to be completed.
    fn in_flight(&self) -> usize {
        match &self.comm {
            Collectives::Host(thread) => thread.pending.len(),
            Collectives::Buffers(_, pending) => pending.len(),
        }
    }

    fn submit_reduce_scatter(
        &mut self,
        be: &B,
        grads: &mut ParamSet<B>,
        ids: &[usize],
    ) -> Result<()> {
        let size = self.group.size();
        let packed_len: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
        if let Collectives::Buffers(comm, pending) = &mut self.comm {
            // Rank r's chunk holds each tensor's elements [r·c, (r+1)·c), zero past its end.
            let mut packed = be.zeros(packed_len * size);
            let mut offset = 0;
            for &i in ids {
                let (c, g) = (self.shard_len[i], &grads.bufs[i]);
                let n = be.len(g);
                for r in 0..size {
                    let (lo, hi) = ((r * c).min(n), ((r + 1) * c).min(n));
                    if hi > lo {
                        be.copy_range(&mut packed, r * packed_len + offset, g, lo, hi - lo);
                    }
                }
                offset += c;
            }
            Self::release(be, grads, ids);
            let mut mine = be.zeros(packed_len);
            let issued = comm.shard.reduce_scatter_sum(be, &packed, &mut mine)?;
            // Runs after the reduce-scatter (collectives run in the order they start).
            let replicated = match &comm.replicate {
                Some(replicas) => Some(replicas.all_reduce_sum(be, &mut mine)?),
                None => None,
            };
            pending.push_back(BufferPending::ReduceScatter {
                ids: ids.to_vec(),
                _packed: packed,
                mine,
                issued,
                replicated,
            });
            return Ok(());
        }
        let mut packed = vec![0.0f32; packed_len * size];
        let mut offset = 0;
        for &i in ids {
            let c = self.shard_len[i];
            let g = be.download(&grads.bufs[i]);
            for r in 0..size {
                let lo = (r * c).min(g.len());
                let hi = ((r + 1) * c).min(g.len());
                packed[r * packed_len + offset..r * packed_len + offset + (hi - lo)]
                    .copy_from_slice(&g[lo..hi]);
            }
            offset += c;
        }
        Self::release(be, grads, ids);
        self.host_thread().submit(
            Job::ReduceScatter(packed),
            Pending::ReduceScatter(ids.to_vec()),
        )
    }

    /// Completes the oldest collective: unpacks a gather into `full` or adds reduced gradients into
    /// the shards. Returns the ids of a completed gather.
    fn complete_next(&mut self, be: &B, full: &mut ParamSet<B>) -> Result<Option<Vec<usize>>> {
        if matches!(self.comm, Collectives::Buffers(..)) {
            return self.complete_next_buffer(be, full);
        }
        let comm = self.host_thread();
        let pending = comm
            .pending
            .pop_front()
            .ok_or_else(|| anyhow!("FSDP: no collective in flight"))?;
        let data = comm
            .from_comm
            .recv()
            .map_err(|_| anyhow!("FSDP communication thread stopped"))??;
        match pending {
            Pending::Gather(ids) => {
                self.unpack_gathered(be, &data, full, &ids, self.param_dtype);
                Ok(Some(ids))
            }
            Pending::ReduceScatter(ids) => {
                let mut offset = 0;
                for &i in &ids {
                    let c = self.shard_len[i];
                    let mut acc = be.download(&self.grad_shards.bufs[i]);
                    acc.iter_mut()
                        .zip(&data[offset..offset + c])
                        .for_each(|(a, m)| *a += m);
                    self.grad_shards.bufs[i] = be.upload(&acc);
                    offset += c;
                }
                Ok(None)
            }
        }
    }

    /// `complete_next` on the buffer path: unpacks a gather into full tensors, or adds a reduced
    /// gradient shard into this rank's shards.
    fn complete_next_buffer(
        &mut self,
        be: &B,
        full: &mut ParamSet<B>,
    ) -> Result<Option<Vec<usize>>> {
        let size = self.group.size();
        let Collectives::Buffers(comm, pending) = &mut self.comm else {
            unreachable!("FSDP's buffer path on the host path")
        };
        match pending
            .pop_front()
            .ok_or_else(|| anyhow!("FSDP: no collective in flight"))?
        {
            BufferPending::Gather {
                ids,
                pairs,
                _packed,
                gathered,
                issued,
            } => {
                comm.shard.wait(be, issued)?;
                let all = if pairs {
                    // Each rank's part unpacks to an even number of values.
                    let mut all = be.zeros(be.len(&gathered) * 2);
                    be.unpack_bf16_pairs(&mut all, &gathered);
                    all
                } else {
                    gathered
                };
                let words = be.len(&all) / size;
                let mut offset = 0;
                for &i in &ids {
                    let (c, numel) = (self.shard_len[i], self.numel[i]);
                    let mut t = be.zeros(numel);
                    for r in 0..size {
                        let lo = r * c;
                        if lo >= numel {
                            break;
                        }
                        be.copy_range(&mut t, lo, &all, r * words + offset, c.min(numel - lo));
                    }
                    full.bufs[i] = t;
                    offset += c;
                }
                Ok(Some(ids))
            }
            BufferPending::ReduceScatter {
                ids,
                _packed,
                mine,
                issued,
                replicated,
            } => {
                comm.shard.wait(be, issued)?;
                if let (Some(replicas), Some(issued)) = (&comm.replicate, replicated) {
                    replicas.wait(be, issued)?;
                }
                let mut offset = 0;
                for &i in &ids {
                    let c = self.shard_len[i];
                    be.add_range(&mut self.grad_shards.bufs[i], 0, &mine, offset, c);
                    offset += c;
                }
                Ok(None)
            }
        }
    }

    /// Completes the oldest reduce-scatters until at most `MAX_IN_FLIGHT` collectives are running
    /// (a gather is left for `wait_gather`, which looks for it in the queue).
    fn complete_down_to_limit(&mut self, be: &B, full: &mut ParamSet<B>) -> Result<()> {
        while self.in_flight() > MAX_IN_FLIGHT && self.oldest_is_reduce_scatter() {
            self.complete_next(be, full)?;
        }
        Ok(())
    }

    fn oldest_is_reduce_scatter(&self) -> bool {
        match &self.comm {
            Collectives::Host(thread) => {
                matches!(thread.pending.front(), Some(Pending::ReduceScatter(_)))
            }
            Collectives::Buffers(_, pending) => {
                matches!(pending.front(), Some(BufferPending::ReduceScatter { .. }))
            }
        }
    }

    /// Completes collectives in order until the gather of `ids` is done.
    fn wait_gather(&mut self, be: &B, full: &mut ParamSet<B>, ids: &[usize]) -> Result<()> {
        loop {
            if let Some(done) = self.complete_next(be, full)? {
                if done == ids {
                    return Ok(());
                }
            }
        }
    }

    /// One micro-batch: forward and backward with the collectives around each block running on the
    /// communication thread, one block ahead (prefetched gathers) or behind (reduce-scatters).
    /// Gradients are added into `grad_shards`. `full` and `grads` are working sets whose buffers
    /// exist only while a stage needs them.
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
        let blocks: Vec<[usize; 9]> = model.ids.layers.iter().map(|l| l.all()).collect();
        let n = blocks.len();
        let non_block = self.non_block.clone();
        let regather = |l: usize| self.reshard_after_forward.reshard(l, n);
        let regather: Vec<bool> = (0..n).map(regather).collect();
        self.submit_gather(be, &non_block)?;
        if n > 0 {
            self.submit_gather(be, &blocks[0])?;
        }
        self.wait_gather(be, full, &non_block)?;
        model.embed_forward(be, full, ws);
        for l in 0..n {
            if l + 1 < n {
                self.submit_gather(be, &blocks[l + 1])?;
            }
            self.wait_gather(be, full, &blocks[l])?;
            model.block_forward(be, full, ws, l);
            if regather[l] {
                Self::release(be, full, &blocks[l]);
            }
        }
        self.zeros(be, grads, &non_block);
        let loss = model.head_forward_backward(be, full, grads, ws, grad_scale);
        if n > 0 && regather[n - 1] {
            self.submit_gather(be, &blocks[n - 1])?;
        }
        for l in (0..n).rev() {
            if l >= 1 && regather[l - 1] {
                self.submit_gather(be, &blocks[l - 1])?;
            }
            if regather[l] {
                self.wait_gather(be, full, &blocks[l])?;
            }
            self.zeros(be, grads, &blocks[l]);
            model.block_backward(be, full, grads, ws, l);
            self.submit_reduce_scatter(be, grads, &blocks[l])?;
            Self::release(be, full, &blocks[l]);
            self.complete_down_to_limit(be, full)?;
        }
        model.embed_backward(be, grads, ws);
        self.submit_reduce_scatter(be, grads, &non_block)?;
        while self.in_flight() > 0 {
            self.complete_next(be, full)?;
        }
        Self::release(be, full, &non_block);
        Ok(loss)
    }
}
