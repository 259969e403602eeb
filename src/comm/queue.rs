//! Queued collectives on backend buffers: an all-gather over a group, and a reduce-scatter over it
//! followed, for HSDP, by an all-reduce of the result across the replicas. They are started as
//! soon as their input is ready and finished in the order they were started, so that they run
//! while the caller computes. Sharded data parallelism (FSDP, HSDP) gathers its weights and
//! reduce-scatters its gradients through one; async tensor parallelism its chunks of token rows.
//!
//! Two queues, one interface (their users know only `CollectiveQueue`, and get one from the
//! group they cross: `queue_over`):
//! - `HostQueue`, for any backend: each input is copied to the host and handed to a communication
//!   thread, which runs the collectives in order over the CPU transport; finishing one waits for
//!   the thread's result and uploads it.
//! - `DeviceQueue`, over the device communicator attached to the group (`device_group`; NCCL's
//!   stream on GPUs), each queue entry holding its input and output until it is finished.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use anyhow::{anyhow, Result};

use super::device_group::{device_of, DeviceGroup, Pending};
use super::group::{ProcessGroup, ReduceOp};
use crate::backend::Backend;

pub trait CollectiveQueue<B: Backend> {
    /// Ranks in the shard group.
    fn shard_size(&self) -> usize;
    /// Starts gathering every shard rank's `input`, in rank order, into one buffer of
    /// `shard_size × len(input)` values.
    fn start_gather(&mut self, be: &B, input: B::Buf) -> Result<()>;
    /// Starts a reduce-scatter of `input` (`shard_size` equal chunks): this rank's chunk summed
    /// over the shard group, then, for HSDP, across the replicas.
    fn start_reduce_scatter(&mut self, be: &B, input: B::Buf) -> Result<()>;
    /// Waits for the oldest collective not yet finished and returns its output.
    fn finish_oldest(&mut self, be: &B) -> Result<B::Buf>;
    /// Whether reduce-scatters are also summed across replicas (HSDP).
    fn replicated(&self) -> bool;
    /// Seconds the queue's collectives have been running, where the queue measures it.
    fn busy_seconds(&self) -> Option<f64> {
        None
    }
}

/// Work for the communication thread.
enum Job {
    Gather(Vec<f32>),
    ReduceScatter(Vec<f32>),
}

/// The collectives over the CPU transport, run by one thread in the order they were started.
pub struct HostQueue {
    /// Who uses the queue, for its thread's name and its errors ("FSDP", "tensor parallel").
    user: &'static str,
    shard_size: usize,
    replicated: bool,
    to_comm: Option<Sender<Job>>,
    from_comm: Receiver<Result<Vec<f32>>>,
    in_flight: usize,
    worker: Option<std::thread::JoinHandle<()>>,
    /// Nanoseconds the thread has spent running collectives (`busy_seconds`).
    busy_ns: Arc<AtomicU64>,
}

impl HostQueue {
    /// A queue for `user` over `shard` (and, for HSDP's reduce-scatters, `replicate`).
    pub fn new(
        user: &'static str,
        shard: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
    ) -> Self {
        let shard_size = shard.size();
        let replicated = replicate.is_some();
        let (to_comm, jobs) = channel::<Job>();
        let (done, from_comm) = channel();
        let busy_ns = Arc::new(AtomicU64::new(0));
        let busy = busy_ns.clone();
        let worker = std::thread::Builder::new()
            .name(format!(
                "titan-{}-comm",
                user.replace(' ', "-").to_lowercase()
            ))
            .spawn(move || {
                for job in jobs {
                    let t0 = std::time::Instant::now();
                    let r = match job {
                        Job::Gather(mine) => {
                            let mut all = vec![0.0f32; mine.len() * shard_size];
                            shard.all_gather(&mine, &mut all).map(|_| all)
                        }
                        Job::ReduceScatter(packed) => {
                            let mut mine = vec![0.0f32; packed.len() / shard_size];
                            shard
                                .reduce_scatter(&packed, &mut mine, ReduceOp::Sum)
                                .and_then(|_| match &replicate {
                                    Some(r) => r.all_reduce(&mut mine, ReduceOp::Sum).map(|_| mine),
                                    None => Ok(mine),
                                })
                        }
                    };
                    // After a failure the group is unusable: report it and take no more work.
                    let failed = r.is_err();
                    busy.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    if done.send(r).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawn a communication thread");
        HostQueue {
            user,
            shard_size,
            replicated,
            to_comm: Some(to_comm),
            from_comm,
            in_flight: 0,
            busy_ns,
            worker: Some(worker),
        }
    }

    fn submit(&mut self, job: Job) -> Result<()> {
        self.to_comm
            .as_ref()
            .ok_or_else(|| anyhow!("{} communication thread is gone", self.user))?
            .send(job)
            .map_err(|_| anyhow!("{} communication thread stopped", self.user))?;
        self.in_flight += 1;
        Ok(())
    }
}

impl<B: Backend> CollectiveQueue<B> for HostQueue {
    fn shard_size(&self) -> usize {
        self.shard_size
    }

    fn start_gather(&mut self, be: &B, input: B::Buf) -> Result<()> {
        self.submit(Job::Gather(be.download_owned(input)))
    }

    fn start_reduce_scatter(&mut self, be: &B, input: B::Buf) -> Result<()> {
        self.submit(Job::ReduceScatter(be.download_owned(input)))
    }

    fn finish_oldest(&mut self, be: &B) -> Result<B::Buf> {
        if self.in_flight == 0 {
            return Err(anyhow!("{}: no collective in flight", self.user));
        }
        self.in_flight -= 1;
        let data = self
            .from_comm
            .recv()
            .map_err(|_| anyhow!("{} communication thread stopped", self.user))??;
        Ok(be.upload_owned(data))
    }

    fn replicated(&self) -> bool {
        self.replicated
    }

    /// Seconds the communication thread has spent running collectives: with the time its user
    /// waited for them, how much of the communication the computation hid.
    fn busy_seconds(&self) -> Option<f64> {
        Some(self.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9)
    }
}

impl Drop for HostQueue {
    fn drop(&mut self) {
        self.to_comm = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A collective on a device group, with the buffers it reads and writes.
struct DeviceEntry<B: Backend> {
    _input: B::Buf,
    output: B::Buf,
    shard: Pending,
    /// HSDP's all-reduce across the replicas, started after the reduce-scatter.
    replicated: Option<Pending>,
}

/// The collectives on a device group (`device_group`: NCCL's communicators on GPUs), over the
/// shard group and, for HSDP, the replicas.
pub struct DeviceQueue<B: Backend> {
    /// Who uses the queue, for its errors ("FSDP", "tensor parallel").
    user: &'static str,
    shard: Arc<dyn DeviceGroup<B>>,
    replicate: Option<Arc<dyn DeviceGroup<B>>>,
    in_flight: VecDeque<DeviceEntry<B>>,
}

impl<B: Backend> DeviceQueue<B> {
    pub fn new(
        user: &'static str,
        shard: Arc<dyn DeviceGroup<B>>,
        replicate: Option<Arc<dyn DeviceGroup<B>>>,
    ) -> Self {
        DeviceQueue {
            user,
            shard,
            replicate,
            in_flight: VecDeque::new(),
        }
    }
}

impl<B: Backend> CollectiveQueue<B> for DeviceQueue<B> {
    fn shard_size(&self) -> usize {
        self.shard.size()
    }

    fn start_gather(&mut self, be: &B, input: B::Buf) -> Result<()> {
        // The collective writes every value of the output.
        let mut output = be.uninit(be.len(&input) * self.shard.size());
        let shard = self.shard.start_all_gather(be, &input, &mut output)?;
        self.in_flight.push_back(DeviceEntry {
            _input: input,
            output,
            shard,
            replicated: None,
        });
        Ok(())
    }

    fn start_reduce_scatter(&mut self, be: &B, input: B::Buf) -> Result<()> {
        let mut output = be.uninit(be.len(&input) / self.shard.size());
        let shard = self.shard.start_reduce_scatter(be, &input, &mut output)?;
        // Started after the reduce-scatter on the one communication stream, so it sums the
        // reduce-scatter's result. The entry is queued only once both started, so the caller's
        // record of what is in flight stays in step on an error (which aborts the communicator).
        let replicated = match &self.replicate {
            Some(replicas) => Some(replicas.start_all_reduce_each(be, vec![&mut output])?),
            None => None,
        };
        self.in_flight.push_back(DeviceEntry {
            _input: input,
            output,
            shard,
            replicated,
        });
        Ok(())
    }

    fn finish_oldest(&mut self, _be: &B) -> Result<B::Buf> {
        let entry = self
            .in_flight
            .pop_front()
            .ok_or_else(|| anyhow!("{}: no collective in flight", self.user))?;
        self.shard.wait(entry.shard)?;
        if let (Some(replicas), Some(f)) = (&self.replicate, entry.replicated) {
            replicas.wait(f)?;
        }
        Ok(entry.output)
    }

    fn replicated(&self) -> bool {
        self.replicate.is_some()
    }
}

impl<B: Backend> Drop for DeviceQueue<B> {
    /// Collectives still in flight mean the run is ending on an error: the communicators are
    /// aborted, as NCCL's `ncclCommDestroy` could wait for them forever.
    fn drop(&mut self) {
        if !self.in_flight.is_empty() {
            self.shard.abort();
            if let Some(r) = &self.replicate {
                r.abort();
            }
        }
    }
}

/// The queue `user`'s collectives over `group` run on (for HSDP's reduce-scatters, summed across
/// `replicate` after): on the device when `group` (and `replicate`) carry a device communicator
/// for `B`, else a communication thread over the host transport.
pub fn queue_over<B: Backend>(
    user: &'static str,
    group: &Arc<dyn ProcessGroup>,
    replicate: Option<&Arc<dyn ProcessGroup>>,
) -> Box<dyn CollectiveQueue<B> + Send> {
    let devices = (
        device_of::<B>(group.as_ref()),
        replicate.map(|r| device_of::<B>(r.as_ref())),
    );
    match devices {
        (Some(shard), None) => Box::new(DeviceQueue::new(user, shard, None)),
        (Some(shard), Some(Some(replicas))) => {
            Box::new(DeviceQueue::new(user, shard, Some(replicas)))
        }
        _ => Box::new(HostQueue::new(user, group.clone(), replicate.cloned())),
    }
}
