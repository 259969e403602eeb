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
//! The collectives go through a `CollectiveQueue` (`comm::queue`): started as soon as their input
//! is packed and finished in order, so the next block's gather runs during this block's forward
//! and a block's reduce-scatter during the backward of the block below. Packing and unpacking are
//! backend ops (`copy_rows` moves a tensor's chunks for every rank at once; `copy_range`,
//! `add_range`, the bf16 pair packing), so the same code runs with the
//! CPU transport's queue (a communication thread; any backend) and with NCCL's (on GPUs). At most
//! `MAX_IN_FLIGHT` collectives are left running after a block's backward, so the packed gradients
//! waiting for their reduce-scatter never add up to more than a few blocks' worth.
//!
//! Mixed precision (`ParamDtype::BFloat16`): the gathers for forward and backward carry the shards
//! rounded to bf16, two values per f32 word (half the bytes), so the blocks compute with bf16
//! weights; shards, gradients, their reduce-scatter and AdamW stay fp32.
//!
//! Float8 all-gather (`enable_fsdp_float8_all_gather`, tensorwise float8 linears): those weights
//! travel as e4m3 codes with the whole weight's scale, a quarter of the bytes, and arrive cast as
//! the linear would cast them (`float8`).
//!
//! HSDP: with `dp_replicate > 1` the shards are replicated, and each reduce-scattered gradient shard
//! is then all-reduced across the replicas (by the queue).
//!
//! Expert parallelism: a rank holds only its experts, and the ranks holding the same experts
//! (`dp_shard × cp / ep` of them) shard those: each tensor has its shard group (`ShardGroup`, the
//! experts' second one with a queue of its own), and a block's collectives are one per group.
//!
//! Checkpoints: each rank writes its own shards (`checkpoint::sharded`).

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::{anyhow, Result};

use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::comm::queue::{queue_over, CollectiveQueue};
use crate::memory_timeline::{self, Category};
use crate::model::{Decoder, ParamDtype, ParamSet, ReduceDtype};

mod float8;
mod hooks;
mod stage_pairs;

pub use float8::Float8Gather;
pub use hooks::ShardedParams;

/// How a gather's shards travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    F32,
    /// Rounded to bf16, two to a word (bf16 mixed precision).
    Bf16Pairs,
    /// float8 codes, four to a word (`float8`).
    Float8,
}

/// A gather in the queue: the packed shards of `ids`, as `encoding` says, from every rank of
/// shard group `group`; `packed_bytes`, the size of its packed input, a communication buffer
/// until it finishes.
struct StartedGather {
    group: usize,
    ids: Vec<usize>,
    encoding: Encoding,
    packed_bytes: i64,
}

/// A collective in the queues, in the order they were started: what its output becomes, and the
/// shard group whose queue runs it.
enum Pending {
    Gather(StartedGather),
    /// This rank's summed gradient shards of `ids`, packed.
    ReduceScatter {
        group: usize,
        ids: Vec<usize>,
        packed_bytes: i64,
    },
}

/// Ranks a set of tensors is sharded over, and the queue their collectives run on.
struct ShardGroup<B: Backend> {
    group: Arc<dyn ProcessGroup>,
    queue: Box<dyn CollectiveQueue<B>>,
}

/// Expert parallelism's second shard group: the ranks holding the same experts, over which the
/// experts this rank holds are sharded (`DeviceMesh::expert_groups`), and under HSDP their
/// replica group (its own connections: its queue runs beside the other).
pub struct ExpertShards {
    pub group: Arc<dyn ProcessGroup>,
    pub replicate: Option<Arc<dyn ProcessGroup>>,
}

/// What a rank starts one parameter-shaped tensor (weights or an AdamW moment) from: its full
/// values, which are cut here, or, read from a checkpoint written by the same layout, this rank's
/// shard as it was saved.
pub enum StartValues {
    Full(Vec<f32>),
    Shard(Vec<f32>),
}

/// Collectives left running after a block's backward (see the module doc).
const MAX_IN_FLIGHT: usize = 2;

/// Blocks' worth of packed gradients a rank holds at most for its reduce-scatters: those left in
/// flight and the one being packed (for the memory estimate).
pub const REDUCE_SCATTER_BLOCKS: usize = MAX_IN_FLIGHT + 1;

pub struct Fsdp<B: Backend> {
    /// The shard groups: every parameter's, and under expert parallelism the experts' second.
    groups: Vec<ShardGroup<B>>,
    /// Each parameter's shard group.
    group_of: Vec<usize>,
    pending: VecDeque<Pending>,
    /// A step failed part-way: collectives may be left in the queue and gradients half-added, so
    /// no further step runs.
    failed: bool,
    /// This rank's shard of every parameter (`[shard_len]` each).
    pub shards: ParamSet<B>,
    pub grad_shards: ParamSet<B>,
    numel: Vec<usize>,
    shard_len: Vec<usize>,
    /// Parameters outside the transformer blocks (embeddings, final norm, output).
    non_block: Vec<usize>,
    /// Whether each parameter trains: a frozen one (LoRA's base) is gathered like any other but
    /// has no gradient (no working gradient, no reduce-scatter, no gradient shard) nor moments.
    trainable: Vec<bool>,
    reshard_after_forward: ReshardPolicy,
    /// What the forward and backward's gathers carry: fp32, or bf16 (half the bytes).
    param_dtype: ParamDtype,
    /// What the gradients' reduce-scatters carry: fp32, or values rounded to bf16 before and
    /// after (`mixed_precision_reduce`).
    reduce_dtype: ReduceDtype,
    /// The weights gathered as float8 codes, and their scales (None: every weight as above).
    float8: Option<Float8Gather>,
    /// Bytes this rank's parameter all-gathers received since the last `take_gathered_bytes`.
    gathered_bytes: u64,
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

    /// Blocks' worth of gathered parameters a rank holds at most (for the memory estimate): the
    /// block computing and the next one prefetched, plus one for a gather's buffers while it is
    /// unpacked; without resharding, every block stays gathered until its backward.
    pub fn blocks_gathered(self, n_blocks: usize) -> usize {
        match self {
            ReshardPolicy::Never => n_blocks + 1,
            ReshardPolicy::Default | ReshardPolicy::Always => n_blocks.min(2) + 1,
        }
    }
}

impl<B: Backend> Fsdp<B> {
    /// Shards the parameters `specs` across `group`, their values (identical on every rank) given
    /// one tensor at a time by `start`, so that no full tensor ever reaches the device. The
    /// step's collectives run on a queue over `group` and `replicate` (`comm::queue::queue_over`:
    /// their device communicators where they carry them, else the CPU transport); `group` also
    /// serves the gradient norm. Under expert
    /// parallelism the routed experts this rank holds are sharded over `experts.group` instead
    /// (the others are absent: `specs` gives them no values).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        be: &B,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
        experts: Option<ExpertShards>,
        model: &Decoder<B>,
        specs: &[(String, Vec<usize>)],
        start: &(dyn Fn(usize) -> Result<StartValues> + Sync),
        reshard_after_forward: ReshardPolicy,
        (param_dtype, reduce_dtype): (ParamDtype, ReduceDtype),
    ) -> Result<Self> {
        let numel: Vec<usize> = specs.iter().map(|(_, s)| s.iter().product()).collect();
        let group_of: Vec<usize> = specs
            .iter()
            .zip(&numel)
            .map(|((name, _), &n)| {
                let expert = crate::model::params::expert_of(name).is_some();
                usize::from(experts.is_some() && expert && n > 0)
            })
            .collect();
        let sizes = [group.size(), experts.as_ref().map_or(1, |e| e.group.size())];
        let shard_len: Vec<usize> = numel
            .iter()
            .zip(&group_of)
            .map(|(n, &g)| n.div_ceil(sizes[g]))
            .collect();
        let shard_specs: Vec<(String, Vec<usize>)> = specs
            .iter()
            .zip(&shard_len)
            .map(|((n, _), c)| (n.clone(), vec![*c]))
            .collect();
        let mut in_block = vec![false; specs.len()];
        for l in &model.ids.layers {
            for i in l.all() {
                in_block[i] = true;
            }
        }
        let lora = model.args.lora.as_ref();
        let trainable: Vec<bool> = specs
            .iter()
            .map(|(n, _)| crate::model::lora::trainable(lora, n))
            .collect();
        let replicated = replicate.is_some();
        let mut groups = vec![ShardGroup {
            queue: queue_over("FSDP", &group, replicate.as_ref()),
            group: group.clone(),
        }];
        if let Some(e) = experts {
            groups.push(ShardGroup {
                queue: queue_over("FSDP experts", &e.group, e.replicate.as_ref()),
                group: e.group,
            });
        }
        for g in &groups {
            assert!(
                g.queue.shard_size() == g.group.size() && g.queue.replicated() == replicated,
                "FSDP's collective queue spans another mesh than its shards (a titan bug)"
            );
        }
        let mut f = Fsdp {
            groups,
            group_of,
            pending: VecDeque::new(),
            failed: false,
            shards: ParamSet::unallocated(be, &shard_specs),
            grad_shards: ParamSet::zeros_where(be, &shard_specs, |name| {
                crate::model::lora::trainable(lora, name)
            }),
            trainable,
            numel,
            shard_len,
            non_block: (0..specs.len()).filter(|&i| !in_block[i]).collect(),
            reshard_after_forward,
            param_dtype,
            reduce_dtype,
            float8: None,
            gathered_bytes: 0,
        };
        f.shards = f.shard_from(be, start)?;
        Ok(f)
    }

    /// The group the parameters are sharded over (under expert parallelism, the experts' shards
    /// are spread over it too: each is held by one of its ranks).
    pub fn shard_group(&self) -> &dyn ProcessGroup {
        self.groups[0].group.as_ref()
    }

    pub fn shard_specs(&self) -> Vec<(String, Vec<usize>)> {
        self.shards
            .names
            .iter()
            .zip(&self.shard_len)
            .map(|(n, c)| (n.clone(), vec![*c]))
            .collect()
    }

    /// This rank's shards of a parameter-shaped set (weights or optimizer moments) whose host
    /// values `start` gives one tensor at a time: only shards reach the device. The tensors are
    /// drawn or read on all threads (each full tensor lives only while its shard is cut).
    pub fn shard_from(
        &self,
        be: &B,
        start: &(dyn Fn(usize) -> Result<StartValues> + Sync),
    ) -> Result<ParamSet<B>> {
        self.shards_of(be, start, |_| true)
    }

    /// `shard_from` for an optimizer state: only the trainable parameters `kept` accepts have
    /// any (the others' stay unallocated, and `start` is not asked for them).
    pub fn moment_shards_from(
        &self,
        be: &B,
        start: &(dyn Fn(usize) -> Result<StartValues> + Sync),
        kept: impl Fn(usize) -> bool + Sync,
    ) -> Result<ParamSet<B>> {
        let trainable = &self.trainable;
        self.shards_of(be, start, |i| trainable[i] && kept(i))
    }

    /// The flat range `[lo, hi)` of parameter `i` (its tensor-parallel part, flattened) that
    /// this rank's shard holds (empty for a shard of padding alone).
    pub fn held_range(&self, i: usize) -> (usize, usize) {
        let rank = self.groups[self.group_of[i]].group.rank();
        let lo = (rank * self.shard_len[i]).min(self.numel[i]);
        (lo, (lo + self.shard_len[i]).min(self.numel[i]))
    }

    fn shards_of(
        &self,
        be: &B,
        start: &(dyn Fn(usize) -> Result<StartValues> + Sync),
        wanted: impl Fn(usize) -> bool + Sync,
    ) -> Result<ParamSet<B>> {
        use rayon::prelude::*;
        let mut out = ParamSet::unallocated(be, &self.shard_specs());
        let (numel, shard_len, names) = (&self.numel, &self.shard_len, &out.names);
        let ranks: Vec<usize> = self.groups.iter().map(|g| g.group.rank()).collect();
        let (ranks, group_of) = (&ranks, &self.group_of);
        let rank = |i: usize| ranks[group_of[i]];
        let shards: Vec<Option<Vec<f32>>> = (0..out.len())
            .into_par_iter()
            .map(|i| {
                wanted(i)
                    .then(|| cut_shard(start(i)?, numel[i], shard_len[i], rank(i), &names[i]))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        for (buf, shard) in out.bufs.iter_mut().zip(&shards) {
            if let Some(shard) = shard {
                *buf = be.upload(shard);
            }
        }
        Ok(out)
    }

    /// How a tensor of `numel` values splits into the ranks' chunks of `c`: the number of whole
    /// chunks, and the values of the partial one after them (the zero padding is in no tensor).
    fn chunks(numel: usize, c: usize, size: usize) -> (usize, usize) {
        if c == 0 {
            return (0, 0);
        }
        let whole = (numel / c).min(size);
        (whole, (numel - whole * c).min(c))
    }

    /// Frees the full tensors `ids` of `set` (gathered weights or full gradients, `held` in the
    /// memory timeline).
    fn release(be: &B, set: &mut ParamSet<B>, ids: &[usize], held: Category) {
        let bytes: usize = ids.iter().map(|&i| be.len(&set.bufs[i]) * 4).sum();
        memory_timeline::add(held, -(bytes as i64));
        for &i in ids {
            set.bufs[i] = be.zeros(0);
        }
    }

    /// Full gradients `ids`, zeroed (a frozen parameter's stays empty: it gets none).
    fn zeros(&self, be: &B, set: &mut ParamSet<B>, ids: &[usize]) {
        let ids: Vec<usize> = ids.iter().copied().filter(|&i| self.trainable[i]).collect();
        let grown: i64 = ids
            .iter()
            .map(|&i| (self.numel[i] as i64 - be.len(&set.bufs[i]) as i64) * 4)
            .sum();
        memory_timeline::add(Category::Gradients, grown);
        for &i in &ids {
            set.bufs[i] = be.zeros(self.numel[i]);
        }
    }

    /// `ids` split by shard group, in group order (the groups with none left out).
    fn by_group(&self, ids: &[usize]) -> Vec<(usize, Vec<usize>)> {
        (0..self.groups.len())
            .map(|g| {
                let part: Vec<usize> = ids
                    .iter()
                    .copied()
                    .filter(|&i| self.group_of[i] == g)
                    .collect();
                (g, part)
            })
            .filter(|(g, part)| *g == 0 || !part.is_empty())
            .collect()
    }

    /// Starts gathering the tensors `ids` from every rank of their shard groups: one collective
    /// per group.
    fn submit_gather(&mut self, be: &B, ids: &[usize]) -> Result<()> {
        for (group, part) in self.by_group(ids) {
            self.submit_group_gather(be, group, &part)?;
        }
        Ok(())
    }

    /// Starts gathering `ids` (all of shard group `group`): one collective for the weights that
    /// travel as float8 codes, one for the rest.
    fn submit_group_gather(&mut self, be: &B, group: usize, ids: &[usize]) -> Result<()> {
        let (float8, rest): (Vec<usize>, Vec<usize>) =
            ids.iter().partition(|&&i| self.gathers_in_float8(i));
        if !rest.is_empty() || float8.is_empty() {
            let (packed, encoding) = self.pack(be, &rest);
            self.start_gather(be, group, rest, packed, encoding)?;
        }
        if !float8.is_empty() {
            let packed = self.pack_float8(be, &float8)?;
            self.start_gather(be, group, float8, packed, Encoding::Float8)?;
        }
        Ok(())
    }

    /// Bytes this rank's parameter all-gathers received since the last call (the metrics').
    pub fn take_gathered_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.gathered_bytes)
    }

    /// Starts the all-gather of `packed` (the shards of `ids`, as `encoding` says) over shard
    /// group `group`.
    fn start_gather(
        &mut self,
        be: &B,
        group: usize,
        ids: Vec<usize>,
        packed: B::Buf,
        encoding: Encoding,
    ) -> Result<()> {
        let packed_bytes = be.len(&packed) as i64 * 4;
        memory_timeline::add(Category::CommBuffers, packed_bytes);
        self.gathered_bytes += packed_bytes as u64 * self.groups[group].group.size() as u64;
        self.groups[group].queue.start_gather(be, packed)?;
        self.pending.push_back(Pending::Gather(StartedGather {
            group,
            ids,
            encoding,
            packed_bytes,
        }));
        Ok(())
    }

    /// This rank's shards of `ids` back to back, in fp32 or, for bf16 parameters, as bf16 pairs
    /// (half the bytes).
    fn pack(&self, be: &B, ids: &[usize]) -> (B::Buf, Encoding) {
        let words: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
        // Written whole below (as are the other `uninit` buffers of this file).
        let mut packed = be.uninit(words);
        let mut at = 0;
        for &i in ids {
            be.copy_range(&mut packed, at, &self.shards.bufs[i], 0, self.shard_len[i]);
            at += self.shard_len[i];
        }
        if self.param_dtype != ParamDtype::BFloat16 {
            return (packed, Encoding::F32);
        }
        let mut paired = be.uninit(words.div_ceil(2));
        be.pack_bf16_pairs(&mut paired, &packed);
        (paired, Encoding::Bf16Pairs)
    }

    /// Starts the reduce-scatter of the full gradients `ids` over their shard groups (one per
    /// group), freeing them.
    fn submit_reduce_scatter(
        &mut self,
        be: &B,
        grads: &mut ParamSet<B>,
        ids: &[usize],
    ) -> Result<()> {
        // Frozen parameters have no gradient (alike on every rank: the collectives agree), so
        // with some frozen a unit may have nothing to reduce.
        let some_frozen = self.trainable.iter().any(|&t| !t);
        let ids: Vec<usize> = ids.iter().copied().filter(|&i| self.trainable[i]).collect();
        for (group, part) in self.by_group(&ids) {
            if some_frozen && part.is_empty() {
                continue;
            }
            self.submit_group_reduce_scatter(be, grads, group, &part)?;
        }
        Ok(())
    }

    /// Packs the full gradients `ids` (all of shard group `group`) rank chunk by rank chunk, frees
    /// them, and starts their reduce-scatter (which `complete_next` adds into this rank's gradient
    /// shards).
    fn submit_group_reduce_scatter(
        &mut self,
        be: &B,
        grads: &mut ParamSet<B>,
        group: usize,
        ids: &[usize],
    ) -> Result<()> {
        let size = self.groups[group].group.size();
        let packed_len: usize = ids.iter().map(|&i| self.shard_len[i]).sum();
        // Rank r's chunk holds each tensor's elements [r·c, (r+1)·c), zero past its end.
        let mut packed = be.zeros(packed_len * size);
        let mut offset = 0;
        for &i in ids {
            let (c, g) = (self.shard_len[i], &grads.bufs[i]);
            let (whole, rest) = Self::chunks(be.len(g), c, size);
            be.copy_rows(&mut packed, offset, packed_len, g, 0, c, whole, c);
            if rest > 0 {
                be.copy_range(&mut packed, whole * packed_len + offset, g, whole * c, rest);
            }
            offset += c;
        }
        Self::release(be, grads, ids, Category::Gradients);
        self.reduce_dtype.round(be, [&mut packed]);
        let packed_bytes = be.len(&packed) as i64 * 4;
        memory_timeline::add(Category::CommBuffers, packed_bytes);
        self.groups[group].queue.start_reduce_scatter(be, packed)?;
        self.pending.push_back(Pending::ReduceScatter {
            group,
            ids: ids.to_vec(),
            packed_bytes,
        });
        Ok(())
    }

    /// Finishes the oldest collective: unpacks a gather into full tensors of `full`, or adds a
    /// reduced gradient shard into this rank's shards.
    fn complete_next(&mut self, be: &B, full: &mut ParamSet<B>) -> Result<()> {
        let pending = self
            .pending
            .pop_front()
            .ok_or_else(|| anyhow!("FSDP: no collective in flight"))?;
        let group = match &pending {
            Pending::Gather(StartedGather { group, .. }) | Pending::ReduceScatter { group, .. } => {
                *group
            }
        };
        let output = self.groups[group].queue.finish_oldest(be)?;
        match pending {
            Pending::Gather(started) => {
                memory_timeline::add(Category::CommBuffers, -started.packed_bytes);
                match started.encoding {
                    Encoding::F32 => self.unpack_values(be, &started, &output, full, |_| None),
                    Encoding::Bf16Pairs => {
                        // Each rank's part unpacks to an even number of values.
                        let mut all = be.uninit(be.len(&output) * 2);
                        be.unpack_bf16_pairs(&mut all, &output);
                        self.unpack_values(be, &started, &all, full, |_| None);
                    }
                    Encoding::Float8 => self.unpack_float8(be, &started, &output, full)?,
                }
                let gathered: usize = started.ids.iter().map(|&i| self.numel[i] * 4).sum();
                memory_timeline::add(Category::GatheredBlocks, gathered as i64);
                Ok(())
            }
            Pending::ReduceScatter {
                ids, packed_bytes, ..
            } => {
                memory_timeline::add(Category::CommBuffers, -packed_bytes);
                let mut output = output;
                self.reduce_dtype.round(be, [&mut output]);
                let mut offset = 0;
                for &i in &ids {
                    let c = self.shard_len[i];
                    be.add_range(&mut self.grad_shards.bufs[i], 0, &output, offset, c);
                    offset += c;
                }
                Ok(())
            }
        }
    }

    /// The full tensors of a finished gather into `full`, from `all` (every rank's packed
    /// values in rank order, each rank's part holding each tensor's shard back to back,
    /// `segment(i)` values apart where it says so, else the shard's length).
    fn unpack_values(
        &self,
        be: &B,
        started: &StartedGather,
        all: &B::Buf,
        full: &mut ParamSet<B>,
        segment: impl Fn(usize) -> Option<usize>,
    ) {
        let size = self.groups[started.group].group.size();
        let words = be.len(all) / size;
        let mut offset = 0;
        for &i in &started.ids {
            let (c, numel) = (self.shard_len[i], self.numel[i]);
            let mut t = be.uninit(numel);
            let (whole, rest) = Self::chunks(numel, c, size);
            be.copy_rows(&mut t, 0, c, all, offset, words, whole, c);
            if rest > 0 {
                be.copy_range(&mut t, whole * c, all, whole * words + offset, rest);
            }
            full.bufs[i] = t;
            offset += segment(i).unwrap_or(c);
        }
    }

    /// Finishes the oldest reduce-scatters until at most `MAX_IN_FLIGHT` collectives per shard
    /// group are running (a gather is left for `wait_gather`).
    fn complete_down_to_limit(&mut self, be: &B, full: &mut ParamSet<B>) -> Result<()> {
        while self.pending.len() > MAX_IN_FLIGHT * self.groups.len()
            && matches!(self.pending.front(), Some(Pending::ReduceScatter { .. }))
        {
            self.complete_next(be, full)?;
        }
        Ok(())
    }

    /// Finishes every collective in flight.
    fn drain(&mut self, be: &B, full: &mut ParamSet<B>) -> Result<()> {
        while !self.pending.is_empty() {
            self.complete_next(be, full)?;
        }
        Ok(())
    }

    /// Finishes collectives in order until the gathers of `ids` are done.
    fn wait_gather(&mut self, be: &B, full: &mut ParamSet<B>, ids: &[usize]) -> Result<()> {
        let waiting = |p: &Pending| match p {
            Pending::Gather(started) => started.ids.iter().any(|i| ids.contains(i)),
            Pending::ReduceScatter { .. } => false,
        };
        while self.pending.iter().any(waiting) {
            self.complete_next(be, full)?;
        }
        Ok(())
    }
}

/// Rank `rank`'s shard (`c` values, zero past the tensor's end) of tensor `name` of `numel`
/// values, from its start values, checked for length.
fn cut_shard(
    start: StartValues,
    numel: usize,
    c: usize,
    rank: usize,
    name: &str,
) -> Result<Vec<f32>> {
    let (values, have, need, what) = match start {
        StartValues::Full(data) => {
            let mut shard = vec![0.0f32; c];
            let lo = (rank * c).min(data.len());
            let hi = ((rank + 1) * c).min(data.len());
            shard[..hi - lo].copy_from_slice(&data[lo..hi]);
            (shard, data.len(), numel, "values")
        }
        StartValues::Shard(shard) => {
            let len = shard.len();
            (shard, len, c, "values in its shard")
        }
    };
    if have != need {
        return Err(anyhow!(
            "FSDP: `{name}` has {have} {what}, rank {rank} needs {need}"
        ));
    }
    Ok(values)
}
