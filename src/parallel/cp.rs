//! Context parallelism: ring attention over a group of ranks that split every sequence (the
//! collectives behind `model::crossings::context::ContextParallelOps`).
//!
//! Each rank holds a head-tail balanced shard of every sequence (`SequenceShard`: chunks `r` and
//! `2·cp − 1 − r` of `2·cp`), so its queries and its keys are two chunks each. Attention of the
//! rank's queries over the whole sequence is computed block by block, one (query chunk, key chunk)
//! pair at a time, with the local kernel: a key chunk wholly before the query chunk is attended in
//! full (`q_offset` ≥ the chunk length), the chunk on the diagonal causally, and one wholly after
//! is skipped. With documents (block-causal attention) each query chunk carries its queries'
//! document positions, so a block masks what lies before a query's document, and a block no query
//! of the chunk can see is skipped like those after the diagonal. The blocks' outputs are folded together by their log-sum-exp
//! (`Backend::attention_merge`), the online softmax across blocks. The backward runs each block's
//! backward with the merged output and log-sum-exp, so each returns its exact share of dQ, dK, dV.
//!
//! Where the other ranks' keys and values come from (`context_parallel_rotate_method`):
//! - `allgather` (TorchTitan's default): every rank's K and V are all-gathered on the group's queue
//!   while the rank computes its own chunks' blocks; the backward gathers them again and returns
//!   each rank's dK/dV with one reduce-scatter.
//! - `alltoall`: the shards rotate around the ring (each step an all-to-all in which a rank sends
//!   only to the next and receives only from the previous), each transfer overlapping the blocks of
//!   the shard already here; in the backward each shard's dK/dV accumulator travels with it, and
//!   one last step hands it to its owner. A rank holds the shard it computes with and the one
//!   arriving, never all of them.
//!
//! Both take their traffic from the group (`comm::device_group`): the queue is
//! `comm::queue::queue_over`'s, and the ring's shifts run on the group's device communicator
//! (NCCL's sends and receives on GPUs) or, without one, on a scoped thread over the host
//! transport, each with the group's timeout.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, bail, Result};

use crate::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape, Backend};
use crate::comm::device_group::{all_reduce_on, device_of};
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::comm::queue::{queue_over, CollectiveQueue};
use crate::model::crossings::context::{ContextParallelOps, SequenceShard};
use crate::model::LocalShapes;

/// How the ranks exchange their keys and values (`[parallelism] context_parallel_rotate_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotateMethod {
    AllGather,
    AllToAll,
}

impl RotateMethod {
    pub const NAMES: [&'static str; 2] = ["allgather", "alltoall"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "allgather" => Ok(RotateMethod::AllGather),
            "alltoall" => Ok(RotateMethod::AllToAll),
            other => bail!(
                "[parallelism] context_parallel_rotate_method = \"{other}\" is not one titan knows (choose one of {:?})",
                Self::NAMES
            ),
        }
    }
}

/// A context-parallel group of ranks.
pub struct ContextParallelGroup<B: Backend> {
    group: Arc<dyn ProcessGroup>,
    rotate: RotateMethod,
    /// The all-gathers and reduce-scatters of `allgather`.
    queue: Option<Mutex<Box<dyn CollectiveQueue<B> + Send>>>,
    /// Nanoseconds spent in the attention blocks' kernels (`attention_seconds`).
    compute_ns: AtomicU64,
}

/// How a rank's shard lies in a buffer: `batch` sequences of two chunks of `chunk` rows of
/// `width` values each (queries and keys `[batch, 2·chunk, heads·head_dim]`; a log-sum-exp
/// `[batch·heads, 2·chunk]` is the same with width 1).
#[derive(Debug, Clone, Copy)]
struct ShardLayout {
    batch: usize,
    chunk: usize,
    width: usize,
}

impl ShardLayout {
    fn len(&self) -> usize {
        self.batch * 2 * self.chunk * self.width
    }

    fn chunk_len(&self) -> usize {
        self.batch * self.chunk * self.width
    }

    /// Chunk `i` of the shard starting at `offset` of `src`, as `[batch, chunk, width]`.
    fn take<B: Backend>(&self, be: &B, src: &B::Buf, offset: usize, i: usize) -> B::Buf {
        let mut dst = be.uninit(self.chunk_len());
        let run = self.chunk * self.width;
        be.copy_rows(
            &mut dst,
            0,
            run,
            src,
            offset + i * run,
            2 * run,
            self.batch,
            run,
        );
        dst
    }

    /// Writes `x` (`[batch, chunk, width]`) as chunk `i` of the shard starting at `offset` of `dst`.
    fn put<B: Backend>(&self, be: &B, dst: &mut B::Buf, offset: usize, i: usize, x: &B::Buf) {
        let run = self.chunk * self.width;
        be.copy_rows(dst, offset + i * run, 2 * run, x, 0, run, self.batch, run);
    }

    /// Adds `x` (`[batch, chunk, width]`) into chunk `i` of the shard starting at `offset` of `dst`.
    fn add_into<B: Backend>(&self, be: &B, dst: &mut B::Buf, offset: usize, i: usize, x: &B::Buf) {
        let run = self.chunk * self.width;
        for b in 0..self.batch {
            be.add_range(dst, offset + (2 * b + i) * run, x, b * run, run);
        }
    }
}

/// Where one rank's shard of keys and values lies: its own buffers, or a place in a gathered or
/// received buffer (`[k | v]` per rank).
struct KeysValues<'a, B: Backend> {
    keys: &'a B::Buf,
    values: &'a B::Buf,
    keys_at: usize,
    values_at: usize,
}

impl<'a, B: Backend> KeysValues<'a, B> {
    fn own(k: &'a B::Buf, v: &'a B::Buf) -> Self {
        KeysValues {
            keys: k,
            values: v,
            keys_at: 0,
            values_at: 0,
        }
    }

    /// Shard `index` of `[k | v]` shards of `len` values each.
    fn packed(buf: &'a B::Buf, index: usize, len: usize) -> Self {
        KeysValues {
            keys: buf,
            values: buf,
            keys_at: index * 2 * len,
            values_at: index * 2 * len + len,
        }
    }
}

/// The layouts of one attention call's shard: queries (and outputs), keys (and values), and the
/// log-sum-exp.
struct Layouts {
    q: ShardLayout,
    kv: ShardLayout,
    lse: ShardLayout,
}

/// Bytes one context-parallel attention call holds beyond the workspace, for `batch` sequences of
/// `seq` (a pipeline rank: one microbatch's) on a rank of shapes `m`: the chunk copies of its
/// queries, outputs and their gradients, and keys and values with their gradients (every rank's
/// under `allgather`, plus the packed copy sent; two shards at a time under `alltoall`).
pub fn scratch_bytes(m: &LocalShapes, batch: usize, seq: usize, rotate: RotateMethod) -> u64 {
    if m.cp == 1 {
        return 0;
    }
    let tokens = (batch * m.local_seq(seq)) as u64;
    let (q, kv) = (tokens * m.q_dim() as u64, tokens * m.kv_dim() as u64);
    let shards = match rotate {
        RotateMethod::AllGather => 2 * m.cp as u64 + 2,
        RotateMethod::AllToAll => 4,
    };
    4 * (5 * q + shards * 2 * kv)
}

impl<B: Backend> ContextParallelGroup<B> {
    /// The group's attention as `rotate` says; `allgather`'s collectives run on a queue over
    /// `group` (its device communicator where it carries one), made only for it: `alltoall`
    /// rotates through the host transport.
    pub fn new(group: Arc<dyn ProcessGroup>, rotate: RotateMethod) -> Self {
        let queue = (rotate == RotateMethod::AllGather)
            .then(|| queue_over::<B>("context parallel", &group, None));
        ContextParallelGroup {
            group,
            rotate,
            queue: queue.map(Mutex::new),
            compute_ns: AtomicU64::new(0),
        }
    }

    /// The layouts of a call's shard, checking that `k` and `v` hold it.
    fn layouts(&self, s: &AttnShape, be: &B, k: &B::Buf, v: &B::Buf) -> Result<Layouts> {
        if !s.q_len.is_multiple_of(2) || s.q_len != s.kv_len || s.q_offset != 0 {
            bail!("context-parallel attention expects a shard of two equal chunks, got {s:?}");
        }
        let chunk = s.q_len / 2;
        let kv_len = s.batch * s.q_len * s.n_kv_heads * s.head_dim;
        if be.len(k) != kv_len || be.len(v) != kv_len {
            bail!(
                "context parallel: keys and values of {} and {} values, expected {kv_len}",
                be.len(k),
                be.len(v)
            );
        }
        Ok(Layouts {
            q: ShardLayout {
                batch: s.batch,
                chunk,
                width: s.n_heads * s.head_dim,
            },
            kv: ShardLayout {
                batch: s.batch,
                chunk,
                width: s.n_kv_heads * s.head_dim,
            },
            lse: ShardLayout {
                batch: s.batch * s.n_heads,
                chunk,
                width: 1,
            },
        })
    }

    /// The global position of each chunk `rank` holds, for sequences of `seq`.
    fn chunk_starts(&self, rank: usize, seq: usize) -> [usize; 2] {
        let c = SequenceShard::chunks_of(self.group.size(), rank, seq);
        [c[0].start, c[1].start]
    }

    /// The block of a query chunk at `q_pos` against a key chunk at `k_pos` (both `chunk` long),
    /// or None when every key lies after every query.
    fn block(s: &AttnShape, chunk: usize, q_pos: usize, k_pos: usize) -> Option<AttnShape> {
        (k_pos <= q_pos).then(|| AttnShape {
            batch: s.batch,
            q_len: chunk,
            kv_len: chunk,
            kv_capacity: chunk,
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.head_dim,
            q_offset: q_pos - k_pos,
        })
    }

    /// `[k | v]` in one buffer, so that one transfer carries both.
    fn pack(be: &B, k: &B::Buf, v: &B::Buf) -> B::Buf {
        let len = be.len(k);
        let mut packed = be.uninit(2 * len);
        be.copy_into_at(&mut packed, 0, k);
        be.copy_into_at(&mut packed, len, v);
        packed
    }

    /// The ring's counts: this rank's part goes to the next rank, the previous rank's arrives.
    fn ring_counts(&self, len: usize) -> (Vec<usize>, Vec<usize>) {
        let (n, r) = (self.group.size(), self.group.rank());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut send_counts = vec![0; n];
        let mut recv_counts = vec![0; n];
        send_counts[next] = len;
        recv_counts[prev] = len;
        (send_counts, recv_counts)
    }

    /// Sends `data` to the next rank of the ring and returns what the previous one sent.
    fn shift(&self, be: &B, data: B::Buf) -> Result<B::Buf> {
        Ok(self.shift_during(be, data, || ())?.0)
    }

    /// `shift` of `data` while `compute` runs: on the group's device communicator when it carries
    /// one (started before, waited for after), else on a scoped thread over the host transport.
    fn shift_during<T>(
        &self,
        be: &B,
        data: B::Buf,
        compute: impl FnOnce() -> T,
    ) -> Result<(B::Buf, T)> {
        let len = be.len(&data);
        let (send_counts, recv_counts) = self.ring_counts(len);
        if let Some(device) = device_of::<B>(self.group.as_ref()) {
            let mut received = be.uninit(len);
            let pending =
                device.start_all_to_all(be, &data, &send_counts, &mut received, &recv_counts)?;
            let out = compute();
            device.wait(pending)?;
            return Ok((received, out));
        }
        let host = be.download_owned(data);
        let (received, out) = std::thread::scope(|sc| {
            let transfer = sc.spawn(|| {
                let mut received = vec![0.0; len];
                self.group
                    .all_to_all(&host, &send_counts, &mut received, &recv_counts)
                    .map(|_| received)
            });
            let out = compute();
            let received = transfer
                .join()
                .unwrap_or_else(|_| Err(anyhow!("context parallel: ring transfer panicked")));
            (received, out)
        });
        Ok((be.upload_owned(received?), out))
    }

    /// For each key chunk of shard `owner` (at `kv`) that some query chunk of this rank sees:
    /// `f(key chunk, its keys, its values, [(query chunk, block shape)])`, its time counted as
    /// attention's. Blocks wholly above the causal diagonal, or wholly before every query's
    /// document or window (`masks`: each query chunk's), are skipped, not computed and masked.
    fn each_key_chunk(
        &self,
        be: &B,
        (s, masks): (&AttnShape, &[AttnMask<'_>; 2]),
        lay: &Layouts,
        owner: usize,
        kv: KeysValues<'_, B>,
        mut f: impl FnMut(usize, &B::Buf, &B::Buf, Vec<(usize, AttnShape)>),
    ) {
        self.timed(|| {
            let seq = s.q_len * self.group.size();
            let mine = self.chunk_starts(self.group.rank(), seq);
            for (i, k_pos) in self.chunk_starts(owner, seq).into_iter().enumerate() {
                let blocks: Vec<(usize, AttnShape)> = (0..2)
                    .filter_map(|j| {
                        let block = Self::block(s, lay.q.chunk, mine[j], k_pos)?;
                        sees_any(&masks[j], &block).then_some((j, block))
                    })
                    .collect();
                if blocks.is_empty() {
                    continue;
                }
                let keys = lay.kv.take(be, kv.keys, kv.keys_at, i);
                let values = lay.kv.take(be, kv.values, kv.values_at, i);
                f(i, &keys, &values, blocks);
            }
        })
    }

    fn queue(&self) -> Result<std::sync::MutexGuard<'_, Box<dyn CollectiveQueue<B> + Send>>> {
        self.queue
            .as_ref()
            .ok_or_else(|| anyhow!("context parallel: no queue for allgather (a titan bug)"))?
            .lock()
            .map_err(|_| anyhow!("context parallel: queue lock poisoned"))
    }

    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = f();
        self.compute_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

/// Whether some query of a block sees some key of it. A sequence's first query sees the earliest
/// key of any of its queries (first keys never move back from query to query).
fn sees_any(mask: &AttnMask, block: &AttnShape) -> bool {
    mask.is_causal() || (0..block.batch).any(|b| mask.first_key(block, b, 0) < block.kv_len)
}

/// Each query chunk's document positions (`[batch, chunk]`), taken from the shard's
/// (`[batch, 2·chunk]`: every sequence's head chunk, then its tail chunk).
struct ChunkPositions([Option<Vec<u32>>; 2]);

impl ChunkPositions {
    fn of(mask: &AttnMask, lay: &Layouts) -> Self {
        let (batch, chunk) = (lay.q.batch, lay.q.chunk);
        ChunkPositions([0, 1].map(|j| {
            mask.positions.map(|p| {
                (0..batch)
                    .flat_map(|b| &p[(2 * b + j) * chunk..(2 * b + j + 1) * chunk])
                    .copied()
                    .collect()
            })
        }))
    }

    /// Each query chunk's mask: its positions, the call's window.
    fn masks(&self, mask: &AttnMask) -> [AttnMask<'_>; 2] {
        [0, 1].map(|j| AttnMask {
            positions: self.0[j].as_deref(),
            window: mask.window,
        })
    }
}

impl<B: Backend> ContextParallelOps<B> for ContextParallelGroup<B> {
    fn degree(&self) -> usize {
        self.group.size()
    }

    fn sum_over_group(&self, be: &B, figures: &mut B::Buf) -> Result<()> {
        all_reduce_on(be, self.group.as_ref(), figures, ReduceOp::Sum)
    }

    fn max_amax_over_group(&self, amaxes: &mut [f32]) -> Result<()> {
        super::amax::all_reduce_amax(self.group.as_ref(), amaxes)
    }

    fn attention_forward(
        &self,
        be: &B,
        out: &mut B::Buf,
        lse: &mut B::Buf,
        x: AttnInputs<'_, B::Buf>,
    ) -> Result<()> {
        let _span = crate::trace::span("context parallel", "ring attention forward");
        let (q, k, v, s) = (x.q, x.k, x.v, x.shape);
        let lay = self.layouts(&s, be, k, v)?;
        let (n, r) = (self.group.size(), self.group.rank());
        let queries = [lay.q.take(be, q, 0, 0), lay.q.take(be, q, 0, 1)];
        let positions = ChunkPositions::of(&x.mask, &lay);
        let masks = positions.masks(&x.mask);
        let kv_len = lay.kv.len();
        // Per query chunk, the output and log-sum-exp over the key blocks seen so far.
        let mut acc: [Option<(B::Buf, B::Buf)>; 2] = [None, None];
        let mut attend = |owner: usize, kv: KeysValues<'_, B>| {
            self.each_key_chunk(
                be,
                (&s, &masks),
                &lay,
                owner,
                kv,
                |_, keys, values, blocks| {
                    for (j, shape) in blocks {
                        let mut o = be.uninit(lay.q.chunk_len());
                        let mut l = be.uninit(lay.lse.chunk_len());
                        let block = AttnInputs {
                            mask: masks[j],
                            ..AttnInputs::causal(&queries[j], keys, values, shape)
                        };
                        be.attention_forward(&mut o, &mut l, block);
                        match &mut acc[j] {
                            None => acc[j] = Some((o, l)),
                            Some((ao, al)) => be.attention_merge(ao, al, &o, &l, shape),
                        }
                    }
                },
            )
        };
        match self.rotate {
            RotateMethod::AllGather => {
                let mut queue = self.queue()?;
                queue.start_gather(be, Self::pack(be, k, v))?;
                attend(r, KeysValues::own(k, v));
                let all = queue.finish_oldest(be)?;
                for owner in (0..n).filter(|&o| o != r) {
                    attend(owner, KeysValues::packed(&all, owner, kv_len));
                }
            }
            RotateMethod::AllToAll => {
                // The shard here moves on to the next rank while this one computes with it.
                let (mut here, ()) = self.shift_during(be, Self::pack(be, k, v), || {
                    attend(r, KeysValues::own(k, v))
                })?;
                for t in 1..n {
                    let owner = (r + n - t) % n;
                    if t + 1 < n {
                        let (next, ()) = self.shift_during(be, be.copied(&here), || {
                            attend(owner, KeysValues::packed(&here, 0, kv_len))
                        })?;
                        here = next;
                    } else {
                        attend(owner, KeysValues::packed(&here, 0, kv_len));
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            let (o, l) = a
                .as_ref()
                .expect("every query chunk sees its own diagonal block");
            lay.q.put(be, out, 0, j, o);
            lay.lse.put(be, lse, 0, j, l);
        }
        Ok(())
    }

    fn attention_backward(
        &self,
        be: &B,
        grads: AttnGrads<'_, B::Buf>,
        dout: &B::Buf,
        x: AttnInputs<'_, B::Buf>,
        saved: AttnSaved<'_, B::Buf>,
    ) -> Result<()> {
        let _span = crate::trace::span("context parallel", "ring attention backward");
        let AttnGrads { dq, dk, dv } = grads;
        let (q, k, v, s) = (x.q, x.k, x.v, x.shape);
        let AttnSaved { out, lse } = saved;
        let lay = self.layouts(&s, be, k, v)?;
        let (n, r) = (self.group.size(), self.group.rank());
        let of = |x: &B::Buf, l: &ShardLayout| [l.take(be, x, 0, 0), l.take(be, x, 0, 1)];
        let (queries, douts, outs, lses) = (
            of(q, &lay.q),
            of(dout, &lay.q),
            of(out, &lay.q),
            of(lse, &lay.lse),
        );
        let mut dqs = [be.zeros(lay.q.chunk_len()), be.zeros(lay.q.chunk_len())];
        let positions = ChunkPositions::of(&x.mask, &lay);
        let masks = positions.masks(&x.mask);
        let kv_len = lay.kv.len();
        // Adds the gradients of shard `owner`'s keys and values (`kv`) from this
        // rank's queries into `grad` (`[dk | dv]` of that shard at `grad_offset`).
        let mut attend =
            |owner: usize, kv: KeysValues<'_, B>, grad: &mut B::Buf, grad_offset: usize| {
                self.each_key_chunk(
                    be,
                    (&s, &masks),
                    &lay,
                    owner,
                    kv,
                    |i, keys, values, blocks| {
                        let mut dq_block = be.uninit(lay.q.chunk_len());
                        let mut dk_block = be.uninit(lay.kv.chunk_len());
                        let mut dv_block = be.uninit(lay.kv.chunk_len());
                        for (j, shape) in blocks {
                            let block_grads = AttnGrads {
                                dq: &mut dq_block,
                                dk: &mut dk_block,
                                dv: &mut dv_block,
                            };
                            let block = AttnInputs {
                                mask: masks[j],
                                ..AttnInputs::causal(&queries[j], keys, values, shape)
                            };
                            let saved = AttnSaved {
                                out: &outs[j],
                                lse: &lses[j],
                            };
                            be.attention_backward(block_grads, &douts[j], block, saved);
                            be.add_assign(&mut dqs[j], &dq_block);
                            lay.kv.add_into(be, grad, grad_offset, i, &dk_block);
                            lay.kv
                                .add_into(be, grad, grad_offset + kv_len, i, &dv_block);
                        }
                    },
                )
            };
        // This rank's `[dk | dv]`, summed over every rank's queries.
        let summed = match self.rotate {
            RotateMethod::AllGather => {
                let mut queue = self.queue()?;
                queue.start_gather(be, Self::pack(be, k, v))?;
                let mut grads = be.zeros(n * 2 * kv_len);
                attend(r, KeysValues::own(k, v), &mut grads, r * 2 * kv_len);
                let all = queue.finish_oldest(be)?;
                for owner in (0..n).filter(|&o| o != r) {
                    let kv = KeysValues::packed(&all, owner, kv_len);
                    attend(owner, kv, &mut grads, owner * 2 * kv_len);
                }
                drop(all);
                queue.start_reduce_scatter(be, grads)?;
                queue.finish_oldest(be)?
            }
            RotateMethod::AllToAll => {
                // The shard here and its gradient so far travel the ring together; the keys and
                // values move on while this rank computes, the gradient once it has added to it.
                let mut grad = be.zeros(2 * kv_len);
                let (mut here, ()) = self.shift_during(be, Self::pack(be, k, v), || {
                    attend(r, KeysValues::own(k, v), &mut grad, 0)
                })?;
                grad = self.shift(be, grad)?;
                for t in 1..n {
                    let owner = (r + n - t) % n;
                    if t + 1 < n {
                        let (next, ()) = self.shift_during(be, be.copied(&here), || {
                            attend(owner, KeysValues::packed(&here, 0, kv_len), &mut grad, 0)
                        })?;
                        here = next;
                    } else {
                        attend(owner, KeysValues::packed(&here, 0, kv_len), &mut grad, 0);
                    }
                    grad = self.shift(be, grad)?;
                }
                grad
            }
        };
        be.copy_range(dk, 0, &summed, 0, kv_len);
        be.copy_range(dv, 0, &summed, kv_len, kv_len);
        for (j, d) in dqs.iter().enumerate() {
            lay.q.put(be, dq, 0, j, d);
        }
        Ok(())
    }

    fn attention_seconds(&self) -> f64 {
        self.compute_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }
}
