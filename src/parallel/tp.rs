//! Tensor parallelism (Megatron-LM's column- and row-parallel layers with sequence parallelism, and
//! the vocabulary-parallel loss): the collectives behind
//! `model::crossings::tensor::TensorParallelOps` over a real group of ranks.
//!
//! The block in `model::llama` is written once in one rank's shapes and crosses ranks only here:
//! - `gather_rows`: the all-gather of the sequence-parallel token rows before column-parallel
//!   projections (and of the output gradient before a row-parallel backward);
//! - `reduce_scatter_rows`: the reduce-scatter of a row-parallel projection's partial sums back
//!   to row shards (and of a column-parallel input gradient);
//! - `all_reduce_sum`: the gradients of the replicated weights (the norms), whose parts come from
//!   each rank's rows;
//! - `cross_entropy`: the loss over vocabulary shards. Each rank computes the logits of every row
//!   against its vocabulary rows, chunk by chunk; the row maxima are all-reduced (max), then the
//!   sums of exponentials and the target logits (sum), so no rank ever holds a whole row of
//!   logits, and the logits never leave the device. With `disable_loss_parallel` the chunk's logits are all-gathered instead and every
//!   rank computes the softmax over whole rows (TorchTitan's behaviour without loss parallel):
//!   the same loss for more traffic.
//!
//! Async TP (`enable_async_tensor_parallel`) also queues chunks of `gather_rows` and
//! `reduce_scatter_rows` (`start_*`, `finish_oldest`), so that `model::parallel_linear` overlaps
//! each chunk's communication with another chunk's GEMMs.
//!
//! Where the tensors travel: on GPUs whose ranks agreed on NCCL (`launch::device_groups`), the
//! token rows go through a `comm::queue::DeviceQueue` over the group's NCCL communicator, on its
//! communication stream, blocking and async alike, and so does the replicated weights' gradient
//! sum. Otherwise through the host and the CPU transport (`comm::group`): blocking collectives
//! directly, async ones on a `HostQueue`'s thread. The loss's softmax statistics always take the
//! host path (a few floats per row).

use crate::backend::{GemmOutput, GemmShape};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, Result};
use rayon::prelude::*;

use super::amax::all_reduce_amax;
use crate::backend::{Backend, LossSum, VocabShard, IGNORE_INDEX};
use crate::comm::device_group::{all_reduce_on, device_of};
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::comm::queue::{queue_over, CollectiveQueue};
use crate::model::crossings::tensor::{LossGrads, TensorParallelOps};
use crate::model::LocalShapes;

/// Logits a rank holds at once in the loss (rows × its vocabulary shard).
const LOSS_CHUNK_FLOATS: usize = 4 << 20;

/// Chunks async TP cuts a fused collective and its GEMMs into (`model::parallel_linear`).
pub const ASYNC_TP_CHUNKS: usize = 4;

/// A tensor-parallel group of ranks.
pub struct TensorParallelGroup<B: Backend> {
    group: Arc<dyn ProcessGroup>,
    /// Cross-entropy over vocabulary shards (true) or over gathered logits.
    loss_parallel: bool,
    /// The queue of token-row collectives: NCCL's on GPUs (every gather and reduce-scatter of
    /// rows), or for async TP on the host a communication thread over `group`. A host queue is
    /// empty whenever a blocking collective runs (every fused layer finishes what it queued), so
    /// the two never use the group at once.
    queue: Option<Mutex<Box<dyn CollectiveQueue<B> + Send>>>,
    /// Whether `queue` is on the device (then the blocking row collectives use it too).
    queue_on_device: bool,
    async_tp: bool,
    /// Nanoseconds spent waiting on `group` (`exposed_comm_seconds`), and of that in blocking
    /// collectives rather than on the queue.
    waited_ns: AtomicU64,
    plain_ns: AtomicU64,
}

impl<B: Backend> TensorParallelGroup<B> {
    /// The group's operations as `[parallelism]` asks: cross-entropy over vocabulary shards
    /// (`loss_parallel`, unless `disable_loss_parallel`), chunked collectives overlapping the
    /// GEMMs (`async_tp`, `enable_async_tensor_parallel`). The token rows go through the device
    /// communicator `group` carries, when it carries one (NCCL on GPUs).
    pub fn new(group: Arc<dyn ProcessGroup>, loss_parallel: bool, async_tp: bool) -> Self {
        let queue_on_device = device_of::<B>(group.as_ref()).is_some();
        let queue =
            (queue_on_device || async_tp).then(|| queue_over::<B>("tensor parallel", &group, None));
        TensorParallelGroup {
            group,
            loss_parallel,
            queue: queue.map(Mutex::new),
            queue_on_device,
            async_tp,
            waited_ns: AtomicU64::new(0),
            plain_ns: AtomicU64::new(0),
        }
    }

    /// The queue of token-row collectives (asked for only when there is one).
    fn queued(&self) -> Result<std::sync::MutexGuard<'_, Box<dyn CollectiveQueue<B> + Send>>> {
        let queue = self
            .queue
            .as_ref()
            .ok_or_else(|| anyhow!("tensor parallel: no collective queue (a titan bug)"))?;
        Ok(queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Runs `collective`, counting the time it blocks as exposed communication.
    fn waiting<T>(&self, collective: impl FnOnce() -> Result<T>) -> Result<T> {
        let t0 = Instant::now();
        let r = collective();
        let ns = t0.elapsed().as_nanos() as u64;
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        self.plain_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }

    /// Runs a step of the async queue (its host copies, or the wait for a result), counting the
    /// time as exposed communication.
    fn waiting_on_queue<T>(
        &self,
        step: impl FnOnce(&mut dyn CollectiveQueue<B>) -> Result<T>,
    ) -> Result<T> {
        let t0 = Instant::now();
        let r = step(self.queued()?.as_mut());
        self.waited_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Per row of a chunk of `rows` logits (`[rows, vocab]`, this rank's vocabulary shard), with
    /// loss parallel disabled: every rank's shard is gathered, and each row's maximum, sum of
    /// `exp(logit − max)` and target logit taken over the whole row.
    fn gathered_row_statistics(
        &self,
        logits: &[f32],
        targets: &[u32],
        vocab: usize,
    ) -> Result<Vec<(f32, f64, f32)>> {
        let rows = targets.len();
        // Whole rows: every rank's shard, in rank order (= vocabulary order).
        let size = self.group.size();
        let mut all = vec![0.0f32; logits.len() * size];
        self.waiting(|| self.group.all_gather(logits, &mut all))?;
        let shard = |rank: usize, r: usize| &all[(rank * rows + r) * vocab..][..vocab];
        Ok((0..rows)
            .into_par_iter()
            .map(|r| {
                let max = (0..size)
                    .flat_map(|k| shard(k, r).iter())
                    .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let sum = (0..size)
                    .flat_map(|k| shard(k, r).iter())
                    .map(|&x| ((x - max) as f64).exp())
                    .sum();
                let t = targets[r];
                let target = if t == IGNORE_INDEX {
                    0.0
                } else {
                    let t = t as usize;
                    shard(t / vocab, r)[t % vocab]
                };
                (max, sum, target)
            })
            .collect())
    }

    /// The cross-entropy of each row of `logits` (`[rows, shard.vocab]`, this rank's vocabulary
    /// shard) against `targets`, added into `total` in row order; with `want_grad` the logits
    /// become `grad_scale · ∂(sum of losses)/∂logits` = softmax − one-hot(target). Loss parallel
    /// runs the backend's three steps where the logits are, only the row statistics crossing the
    /// group; without it the logits are gathered on the host.
    fn shard_losses(
        &self,
        be: &B,
        logits: &mut B::Buf,
        targets: &[u32],
        shard: VocabShard,
        grad: (f32, bool),
        total: &mut LossSum,
    ) -> Result<()> {
        if !self.loss_parallel {
            let mut host = be.download(logits);
            self.add_gathered_losses(&mut host, targets, shard, grad, total)?;
            if grad.1 {
                *logits = be.upload_owned(host);
            }
            return Ok(());
        }
        let mut max = be.vocab_shard_row_max(logits, shard);
        self.all_reduce_rows(be, &mut max, ReduceOp::Max)?;
        let mut sums = be.vocab_shard_row_sums(logits, &max, targets, shard);
        self.all_reduce_rows(be, &mut sums, ReduceOp::Sum)?;
        be.vocab_shard_loss(logits, (&max, &sums), targets, shard, grad, total);
        Ok(())
    }

    /// Row statistics summed (or maximised) over the group in place: on its device communicator
    /// when it carries one, else through the host.
    fn all_reduce_rows(&self, be: &B, buf: &mut B::Buf, op: ReduceOp) -> Result<()> {
        self.waiting(|| all_reduce_on(be, self.group.as_ref(), buf, op))
    }

    /// `shard_losses` on gathered logits (loss parallel disabled), on the host.
    fn add_gathered_losses(
        &self,
        logits: &mut [f32],
        targets: &[u32],
        VocabShard { vocab, offset }: VocabShard,
        (grad_scale, want_grad): (f32, bool),
        total: &mut LossSum,
    ) -> Result<()> {
        let stats = self.gathered_row_statistics(logits, targets, vocab)?;
        for (&t, &(max, sum, target)) in targets.iter().zip(&stats) {
            if t != IGNORE_INDEX {
                total.sum += sum.ln() + max as f64 - target as f64;
                total.count += 1;
            }
        }
        if !want_grad {
            return Ok(());
        }
        logits
            .par_chunks_mut(vocab)
            .zip(targets.par_iter().zip(stats.par_iter()))
            .for_each(|(row, (&t, &(max, sum, _)))| {
                if t == IGNORE_INDEX {
                    row.fill(0.0);
                    return;
                }
                let scale = grad_scale as f64 / sum;
                for x in row.iter_mut() {
                    *x = (((*x - max) as f64).exp() * scale) as f32;
                }
                let t = t as usize;
                if (offset..offset + vocab).contains(&t) {
                    row[t - offset] -= grad_scale;
                }
            });
        Ok(())
    }
}

impl<B: Backend> TensorParallelOps<B> for TensorParallelGroup<B> {
    fn degree(&self) -> usize {
        self.group.size()
    }

    fn gather_rows(&self, be: &B, local: &B::Buf, full: &mut B::Buf) -> Result<()> {
        if self.queue_on_device {
            // A queued collective holds its input until it finishes: a copy of its own.
            self.start_gather_rows(be, be.copied(local))?;
            *full = self.finish_oldest(be)?;
            return Ok(());
        }
        let mine = be.download(local);
        let mut all = vec![0.0f32; mine.len() * self.group.size()];
        self.waiting(|| self.group.all_gather(&mine, &mut all))?;
        *full = be.upload_owned(all);
        Ok(())
    }

    fn reduce_scatter_rows(&self, be: &B, partial: &B::Buf, local: &mut B::Buf) -> Result<()> {
        if self.queue_on_device {
            // As in `gather_rows`, the queue takes a copy of its own.
            self.start_reduce_scatter_rows(be, be.copied(partial))?;
            *local = self.finish_oldest(be)?;
            return Ok(());
        }
        let all = be.download(partial);
        let mut mine = vec![0.0f32; all.len() / self.group.size()];
        self.waiting(|| self.group.reduce_scatter(&all, &mut mine, ReduceOp::Sum))?;
        *local = be.upload_owned(mine);
        Ok(())
    }

    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<()> {
        self.all_reduce_rows(be, buf, ReduceOp::Sum)
    }

    fn all_reduce_max(&self, amaxes: &mut [f32]) -> Result<()> {
        self.waiting(|| all_reduce_amax(self.group.as_ref(), amaxes))
    }

    fn overlap_chunks(&self) -> usize {
        if self.async_tp && self.queue.is_some() {
            ASYNC_TP_CHUNKS
        } else {
            1
        }
    }

    fn start_gather_rows(&self, be: &B, local: B::Buf) -> Result<()> {
        self.waiting_on_queue(|q| q.start_gather(be, local))
    }

    fn start_reduce_scatter_rows(&self, be: &B, partial: B::Buf) -> Result<()> {
        self.waiting_on_queue(|q| q.start_reduce_scatter(be, partial))
    }

    fn finish_oldest(&self, be: &B) -> Result<B::Buf> {
        self.waiting_on_queue(|q| q.finish_oldest(be))
    }

    fn comm_seconds(&self) -> f64 {
        if self.queue_on_device {
            // NCCL's queue does not time its collectives: report what was waited for.
            return self.exposed_comm_seconds();
        }
        // Plain collectives block (all exposed); a host queue's run on its thread (on a device
        // the time in flight is not measured: NCCL's queue reports none).
        let queued = self.queue.as_ref().map_or(0.0, |q| {
            q.lock()
                .unwrap_or_else(|e| e.into_inner())
                .busy_seconds()
                .unwrap_or(0.0)
        });
        self.plain_ns.load(Ordering::Relaxed) as f64 * 1e-9 + queued
    }

    fn exposed_comm_seconds(&self) -> f64 {
        self.waited_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn cross_entropy(
        &self,
        be: &B,
        h: &B::Buf,
        w: &B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        grad_scale: f32,
        mut grads: LossGrads<'_, B>,
    ) -> Result<LossSum> {
        let (d, vocab) = (shapes.dim, shapes.vocab);
        let shard = VocabShard {
            vocab,
            offset: shapes.vocab_offset,
        };
        let rows = targets.len();
        let chunk = (LOSS_CHUNK_FLOATS / vocab.max(1)).clamp(1, rows.max(1));
        let mut total = LossSum { sum: 0.0, count: 0 };
        let mut h_chunk = be.uninit(chunk * d);
        let mut logits_buf = be.uninit(chunk * vocab);
        let mut dh_chunk = be.uninit(chunk * d);
        for r0 in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - r0);
            let tc = &targets[r0..r0 + n];
            if n < chunk {
                h_chunk = be.uninit(n * d);
                logits_buf = be.uninit(n * vocab);
                dh_chunk = be.uninit(n * d);
            }
            be.copy_range(&mut h_chunk, 0, h, r0 * d, n * d);
            be.logits(&mut logits_buf, &h_chunk, w, n, d, vocab);
            let grad = (grad_scale, grads.is_some());
            self.shard_losses(be, &mut logits_buf, tc, shard, grad, &mut total)?;
            let Some((dh, dw)) = grads.as_mut() else {
                continue;
            };
            let dlogits = &logits_buf;
            be.matmul(
                &mut dh_chunk,
                dlogits,
                w,
                GemmShape::new(n, vocab, d),
                GemmOutput::Overwrite,
            );
            be.add_range(dh, r0 * d, &dh_chunk, 0, n * d);
            // An empty gradient is a frozen output weight (LoRA): none is computed.
            if be.len(dw) > 0 {
                be.matmul(
                    dw,
                    dlogits,
                    &h_chunk,
                    GemmShape::new(vocab, n, d).a_transposed(),
                    GemmOutput::Accumulate,
                );
            }
        }
        Ok(total)
    }

    fn loss_of_logits(
        &self,
        be: &B,
        logits: &mut B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        grad: (f32, bool),
    ) -> Result<LossSum> {
        let mut total = LossSum { sum: 0.0, count: 0 };
        let shard = VocabShard {
            vocab: shapes.vocab,
            offset: shapes.vocab_offset,
        };
        self.shard_losses(be, logits, targets, shard, grad, &mut total)?;
        Ok(total)
    }
}
