//! DDP: every data-parallel rank holds the whole model; gradients are summed across ranks (the loss
//! is already normalised by the global number of targets, so the sum is the gradient of the global
//! mean loss), after which every rank takes the same optimizer step.
//!
//! Two gradient reducers (`GradReducer`):
//! - `DdpReducer`, for any backend over the CPU transport: gradients travel in buckets, one per
//!   transformer block. As soon as the backward has finished a block (on the last micro-batch of a
//!   step) its gradients are copied to the host into a bucket and handed to a communication thread,
//!   which all-reduces it while the backward goes on with the blocks below. The remaining
//!   parameters (embeddings, final norm, output) form the last bucket. The thread is the group's
//!   only user while buckets are in flight.
//! - `DeviceGradReducer`, when the group carries a device communicator (`comm::device_group`; NCCL's
//!   on CUDA when every rank has its own GPU): the same buckets summed in place on the devices, one
//!   call per block started as soon as the backward has queued that block's gradients, running on
//!   the communication stream while the compute stream goes on with the blocks below (no host
//!   copies; with NCCL not yet run with more than one rank: see `comm::nccl`).
//!
//! `Ddp::new` takes the one its group offers.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use anyhow::{anyhow, Result};

use crate::backend::Backend;
use crate::comm::device_group::{device_of, DeviceGroup, Pending};
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::params::LayerIds;
use crate::model::{ParamSet, ReduceDtype};

/// A bucket: the parameter indices it covers and their gradients, concatenated.
struct Bucket {
    ids: Vec<usize>,
    data: Vec<f32>,
}

pub struct DdpReducer {
    to_comm: Option<Sender<Bucket>>,
    from_comm: Receiver<Result<Bucket>>,
    in_flight: usize,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl DdpReducer {
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        let (to_comm, jobs) = channel::<Bucket>();
        let (done, from_comm) = channel();
        let worker = std::thread::Builder::new()
            .name("titan-ddp-comm".into())
            .spawn(move || {
                for mut b in jobs {
                    let r = group.all_reduce(&mut b.data, ReduceOp::Sum).map(|_| b);
                    // After a failure the group is unusable: report it and take no more work.
                    let failed = r.is_err();
                    if done.send(r).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawn the DDP communication thread");
        DdpReducer {
            to_comm: Some(to_comm),
            from_comm,
            in_flight: 0,
            worker: Some(worker),
        }
    }

    fn submit<B: Backend>(&mut self, be: &B, ids: Vec<usize>, grads: &ParamSet<B>) -> Result<()> {
        // Frozen weights (LoRA's base) have no gradient: on every rank alike, so the buckets agree.
        let ids: Vec<usize> = ids
            .into_iter()
            .filter(|&i| be.len(&grads.bufs[i]) > 0)
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let mut data = Vec::new();
        for &i in &ids {
            data.extend_from_slice(&be.download(&grads.bufs[i]));
        }
        self.to_comm
            .as_ref()
            .ok_or_else(|| anyhow!("DDP communication thread is gone"))?
            .send(Bucket { ids, data })
            .map_err(|_| anyhow!("DDP communication thread stopped"))?;
        self.in_flight += 1;
        Ok(())
    }
}

/// The parameters of `n` that no block of `block_ids` holds (embeddings, final norm, output).
fn not_in_blocks(n: usize, block_ids: &[LayerIds]) -> Vec<usize> {
    let mut covered = vec![false; n];
    block_ids
        .iter()
        .flat_map(|l| l.all())
        .for_each(|i| covered[i] = true);
    (0..n).filter(|&i| !covered[i]).collect()
}

/// Sums a step's gradients across the data-parallel ranks: told when each block's gradients are
/// final (on the last micro-batch), then `finish` leaves every gradient summed.
pub trait GradReducer<B: Backend> {
    /// A block's gradients (`ids`) are final: their sum over the group may start.
    fn block_done(&mut self, be: &B, ids: &[usize], grads: &mut ParamSet<B>) -> Result<()>;
    /// Sums what no `block_done` covered and waits for every sum.
    fn finish(&mut self, be: &B, grads: &mut ParamSet<B>, block_ids: &[LayerIds]) -> Result<()>;
}

impl<B: Backend> GradReducer<B> for DdpReducer {
    fn block_done(&mut self, be: &B, ids: &[usize], grads: &mut ParamSet<B>) -> Result<()> {
        self.submit(be, ids.to_vec(), grads)
    }

    /// Reduces the parameters no block hook covered, waits for every bucket and writes the summed
    /// gradients back.
    fn finish(&mut self, be: &B, grads: &mut ParamSet<B>, block_ids: &[LayerIds]) -> Result<()> {
        let rest = not_in_blocks(grads.len(), block_ids);
        self.submit(be, rest, grads)?;
        let mut first_err = None;
        while self.in_flight > 0 {
            let r = self
                .from_comm
                .recv()
                .map_err(|_| anyhow!("DDP communication thread stopped"))?;
            self.in_flight -= 1;
            match r {
                Ok(b) => {
                    let mut at = 0;
                    for i in b.ids {
                        let n = be.len(&grads.bufs[i]);
                        grads.bufs[i] = be.upload(&b.data[at..at + n]);
                        at += n;
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// DDP's gradient sum on the devices, a block at a time during the backward.
pub struct DeviceGradReducer<B: Backend> {
    group: Arc<dyn DeviceGroup<B>>,
    /// The sums started this step, oldest first.
    in_flight: Vec<Pending>,
    /// Which gradients a started sum covers (indexed like the parameters).
    started: Vec<bool>,
}

impl<B: Backend> DeviceGradReducer<B> {
    pub fn new(group: Arc<dyn DeviceGroup<B>>) -> Self {
        DeviceGradReducer {
            group,
            in_flight: Vec::new(),
            started: Vec::new(),
        }
    }

    /// Starts summing the gradients `ids` (one call); they must not be written until `finish`,
    /// which the backward guarantees for a finished block.
    fn start(&mut self, be: &B, grads: &mut ParamSet<B>, ids: &[usize]) -> Result<()> {
        let bufs = grads
            .bufs
            .iter_mut()
            .enumerate()
            .filter(|(i, b)| ids.contains(i) && be.len(b) > 0)
            .map(|(_, b)| b)
            .collect();
        let f = self.group.start_all_reduce_each(be, bufs)?;
        self.in_flight.push(f);
        self.started.resize(grads.len(), false);
        for &i in ids {
            self.started[i] = true;
        }
        Ok(())
    }
}

impl<B: Backend> GradReducer<B> for DeviceGradReducer<B> {
    fn block_done(&mut self, be: &B, ids: &[usize], grads: &mut ParamSet<B>) -> Result<()> {
        self.start(be, grads, ids)
    }

    /// Starts the sum of every gradient no block hook covered (embeddings, final norm, output),
    /// then waits for all of them.
    fn finish(&mut self, be: &B, grads: &mut ParamSet<B>, _block_ids: &[LayerIds]) -> Result<()> {
        self.started.resize(grads.len(), false);
        let rest: Vec<usize> = (0..grads.len()).filter(|&i| !self.started[i]).collect();
        let started = if rest.is_empty() {
            Ok(())
        } else {
            self.start(be, grads, &rest)
        };
        self.started.iter_mut().for_each(|s| *s = false);
        // Every started sum is waited for (after a failure they end at once: the communicator is
        // aborted), and the first error is the one reported.
        let mut first_err = started.err();
        for f in self.in_flight.drain(..) {
            if let Err(e) = self.group.wait(f) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl<B: Backend> Drop for DeviceGradReducer<B> {
    /// Sums still in flight mean the run is ending on an error: the communicator is aborted, as
    /// NCCL's `ncclCommDestroy` could wait for them forever.
    fn drop(&mut self) {
        if !self.in_flight.is_empty() {
            self.group.abort();
        }
    }
}

impl Drop for DdpReducer {
    fn drop(&mut self) {
        self.to_comm = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A data-parallel group (the CPU transport, for the loss and target counts) with its gradient
/// reducer.
pub struct Ddp<B: Backend> {
    pub group: Arc<dyn ProcessGroup>,
    reducer: Box<dyn GradReducer<B>>,
    /// fp32, or gradients rounded to bf16 before and after their sum (`mixed_precision_reduce`).
    reduce_dtype: ReduceDtype,
}

impl<B: Backend> Ddp<B> {
    /// Gradients summed in place on the device communicator `group` carries, or through the
    /// host transport in buckets.
    pub fn new(group: Arc<dyn ProcessGroup>, reduce_dtype: ReduceDtype) -> Self {
        let reducer: Box<dyn GradReducer<B>> = match device_of::<B>(group.as_ref()) {
            Some(device) => Box::new(DeviceGradReducer::new(device)),
            None => Box::new(DdpReducer::new(group.clone())),
        };
        Ddp {
            reducer,
            group,
            reduce_dtype,
        }
    }

    /// A block's gradients (`ids`) are final: their sum starts (see `GradReducer`).
    pub fn block_done(&mut self, be: &B, ids: &[usize], grads: &mut ParamSet<B>) -> Result<()> {
        self.round(be, grads, ids);
        self.reducer.block_done(be, ids, grads)
    }

    /// Rounds the gradients `ids` to bf16 when reductions are in bf16.
    fn round(&self, be: &B, grads: &mut ParamSet<B>, ids: &[usize]) {
        let (bufs, dtype) = (&mut grads.bufs, self.reduce_dtype);
        dtype.round(
            be,
            bufs.iter_mut()
                .enumerate()
                .filter(|(i, _)| ids.contains(i))
                .map(|(_, b)| b),
        );
    }

    /// Sums what no `block_done` covered and waits for every sum (see `GradReducer`).
    pub fn finish(
        &mut self,
        be: &B,
        grads: &mut ParamSet<B>,
        block_ids: &[LayerIds],
    ) -> Result<()> {
        self.round(be, grads, &not_in_blocks(grads.len(), block_ids));
        self.reducer.finish(be, grads, block_ids)?;
        self.reduce_dtype.round(be, grads.bufs.iter_mut());
        Ok(())
    }
}
