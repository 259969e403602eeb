//! NCCL communicators: collectives between GPUs on CUDA buffers, one communicator per group.
//!
//! The unique id travels through the rendezvous store (rank 0 creates it), and every rank announces
//! itself there before the blocking `ncclCommInitRank`, so a rank that never comes is a store
//! timeout naming it rather than a hang inside NCCL; the init itself is waited for at most the
//! init timeout too (`init_within`).
//!
//! Overlap with compute: collectives run on the backend's communication stream
//! (`CudaBackend::comm_stream`), not the compute stream. Starting one (`start_*`) records an event
//! on the compute stream that the communication stream waits for, so the collective reads what the
//! kernels queued so far wrote (the packed shards, the finished gradients), then queues it and
//! returns an `InFlight` holding an event recorded after it. The compute stream goes on meanwhile.
//! `wait` polls that event and NCCL's asynchronous error instead of blocking, aborts the
//! communicator when the group's timeout passes (a dead peer is an error, never a hang), and makes
//! the compute stream wait for the event before anything it queues next reads the result. Between
//! start and wait the caller keeps the collective's buffers alive and unwritten: the memory pool
//! hands freed memory back to the compute stream, which would overwrite it under the collective.
//!
//! After a failure: the communicator that failed is aborted, and so is every other one of the
//! process when it is dropped (`ANY_ABORTED`): a collective still queued on the shared stream, whose
//! peers may be gone, would hang `ncclCommDestroy`. The failure ends the training run, so buffers
//! of collectives left in flight are freed with the process.
//!
//! Status: run on one GPU only (`titan cuda nccl-check`, a one-rank group): NCCL refuses two ranks
//! on one GPU, and the lent machines have one. When every rank has its own GPU, DDP sums each
//! block's gradients through these groups while the backward goes on with the blocks below
//! (`parallel::ddp::DeviceGradReducer`), and FSDP gathers and reduce-scatters through them one block
//! ahead of or behind the compute (`comm::queue::DeviceQueue`; FSDP's packing and schedule are the
//! ones the CPU runs with the host queue): each communicator is attached to its mesh group
//! (`DeviceGroup`), and the layouts take it from there. The pipeline group carries two-rank
//! channels instead (`peers`), one per direction between neighbouring stage ranks.

mod p2p;
mod peers;

pub use peers::NcclPeers;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result as nccl, sys};

use super::device_group::{DeviceGroup, Pending};
use super::group::ReduceOp;
use super::store::StoreClient;
use crate::backend::cuda::libs::{require, CudaLib};
use crate::backend::cuda::{CudaBackend, CudaBuf};

pub struct NcclGroup {
    comm: sys::ncclComm_t,
    /// Where the collectives run (the backend's communication stream).
    stream: Arc<CudaStream>,
    /// The backend's compute stream, which the collectives are ordered against.
    compute: Arc<CudaStream>,
    name: String,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Set once the communicator is aborted: it must then be neither used nor destroyed.
    aborted: AtomicBool,
}

/// Set when any communicator of this process was aborted: the others then refuse new work and are
/// aborted, not destroyed, when dropped (see the module doc).
static ANY_ABORTED: AtomicBool = AtomicBool::new(false);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not race;
// titan issues a group's collectives from one thread at a time.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

/// A collective queued on the communication stream and not yet waited for (`NcclGroup::wait`).
/// Its buffers must stay alive and unwritten until then (see the module doc).
#[must_use = "a collective in flight must be waited for before its result is read"]
pub struct InFlight {
    /// Recorded on the communication stream right after the collective.
    done: CudaEvent,
    op: &'static str,
}

fn nccl_err(what: &str, e: nccl::NcclError) -> anyhow::Error {
    // cudarc's Debug for NcclError drops the code; the ncclResult_t inside names it.
    anyhow!("NCCL {what} failed: {:?}", e.0)
}

impl NcclGroup {
    /// Joins group `name` of `size` ranks as `rank`, on `be`'s GPU and communication stream.
    pub fn connect(
        store: &StoreClient,
        name: &str,
        rank: usize,
        size: usize,
        be: &CudaBackend,
        init_timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Self> {
        let stream = be.comm_stream()?;
        let timeouts = (init_timeout, op_timeout);
        Self::connect_on(store, (name, rank, size), be, timeouts, stream)
    }

    /// Joins group `name` of `size` ranks as `rank` (`who`), its collectives queued on `stream`;
    /// `timeouts`: the init's and each collective's.
    fn connect_on(
        store: &StoreClient,
        (name, rank, size): (&str, usize, usize),
        be: &CudaBackend,
        (init_timeout, op_timeout): (Duration, Duration),
        stream: Arc<CudaStream>,
    ) -> Result<Self> {
        require(&[CudaLib::Nccl], "NCCL collectives")?;
        if rank >= size {
            bail!("NCCL group `{name}`: rank {rank} is outside a group of {size}");
        }
        let deadline = Instant::now() + init_timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let key = format!("nccl/{name}/id");
        let id = if rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| nccl_err("get unique id", e))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get_within(&key, left()).map_err(|_| {
                anyhow!("NCCL group `{name}` rank {rank}: rank 0 never published the unique id within {init_timeout:.0?}")
            })?;
            if bytes.len() != 128 {
                bail!(
                    "NCCL group `{name}`: the unique id in the store has {} bytes, not 128",
                    bytes.len()
                );
            }
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            sys::ncclUniqueId { internal }
        };
        store.set(&format!("nccl/{name}/arrived/{rank}"), b"1")?;
        for peer in 0..size {
            store
                .get_within(&format!("nccl/{name}/arrived/{peer}"), left())
                .map_err(|_| {
                    anyhow!("NCCL group `{name}` rank {rank}: rank {peer} never arrived within {init_timeout:.0?}")
                })?;
        }
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        let comm = init_within(&stream, id, rank, size, init_timeout).map_err(|e| {
            anyhow!("NCCL group `{name}` rank {rank}: {e:#} (a peer may have died after arriving)")
        })?;
        Ok(NcclGroup {
            comm,
            stream,
            compute: be.stream().clone(),
            name: name.to_string(),
            rank,
            size,
            timeout: op_timeout,
            aborted: AtomicBool::new(false),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
        match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        }
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn check_usable(&self, op: &str) -> Result<()> {
        if self.aborted.load(Ordering::SeqCst) {
            bail!(
                "{op} on NCCL group `{}`: the communicator was aborted after an earlier failure",
                self.name
            );
        }
        if ANY_ABORTED.load(Ordering::SeqCst) {
            bail!(
                "{op} on NCCL group `{}`: another NCCL group of this process failed earlier",
                self.name
            );
        }
        Ok(())
    }

    /// Before queueing a collective: the communication stream waits for the compute stream's work
    /// so far (which wrote the collective's input and allocated its output).
    fn begin(&self, op: &'static str) -> Result<()> {
        self.check_usable(op)?;
        let ready = self
            .compute
            .record_event(None)
            .map_err(|e| self.failed_cuda(op, "recording an event", e))?;
        self.stream
            .wait(&ready)
            .map_err(|e| self.failed_cuda(op, "ordering the communication stream", e))
    }

    /// After queueing a collective: the event that marks its end.
    fn issued(&self, op: &'static str) -> Result<InFlight> {
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| self.failed_cuda(op, "recording an event", e))?;
        Ok(InFlight { done, op })
    }

    /// A CUDA failure around a collective: the communicator may hold queued work, so it is aborted.
    fn failed_cuda(&self, op: &str, what: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
        self.abort();
        anyhow!(
            "{op} on NCCL group `{}` (rank {} of {}): CUDA {what}: {e}",
            self.name,
            self.rank,
            self.size
        )
    }

    /// In place over the whole buffer; waits for the result.
    pub fn all_reduce(&self, buf: &mut CudaBuf, op: ReduceOp) -> Result<()> {
        let f = self.start_all_reduce_each(std::iter::once(buf), op)?;
        self.wait(f)
    }

    /// Each buffer in place, as one NCCL group call; waits for the result.
    pub fn all_reduce_each(&self, bufs: &mut [CudaBuf], op: ReduceOp) -> Result<()> {
        let f = self.start_all_reduce_each(bufs.iter_mut(), op)?;
        self.wait(f)
    }

    /// Starts reducing each buffer in place, as one NCCL group call (one launch sequence, one
    /// event): DDP's gradient sum over a block's parameters.
    pub fn start_all_reduce_each<'a>(
        &self,
        bufs: impl IntoIterator<Item = &'a mut CudaBuf>,
        op: ReduceOp,
    ) -> Result<InFlight> {
        self.group_call("all_reduce", || {
            for buf in bufs.into_iter().filter(|b| !b.is_empty()) {
                let p = buf.device_address_mut(&self.stream);
                // SAFETY: p addresses buf.len() floats on this communicator's device.
                unsafe {
                    nccl::all_reduce(
                        p as *const _,
                        p as *mut _,
                        buf.len(),
                        sys::ncclDataType_t::ncclFloat32,
                        Self::red_op(op),
                        self.comm,
                        self.cu_stream(),
                    )
                }
                .map_err(|e| nccl_err("all_reduce", e))?;
            }
            Ok(())
        })
    }

    /// Queues the calls `queue` makes as one NCCL group call (one launch sequence, one event),
    /// after the compute so far (`begin`). The group is closed whatever happened inside it; a
    /// communicator that failed to take the work is in an unknown state, so it is aborted (never
    /// destroyed or used again).
    fn group_call(&self, op: &'static str, queue: impl FnOnce() -> Result<()>) -> Result<InFlight> {
        self.begin(op)?;
        nccl::group_start().map_err(|e| {
            self.abort();
            nccl_err("group start", e)
        })?;
        let queued = queue();
        let ended = nccl::group_end().map_err(|e| nccl_err("group end", e));
        if queued.is_err() || ended.is_err() {
            self.abort();
        }
        queued?;
        ended?;
        self.issued(op)
    }

    /// `output` (`size × input.len()`) receives every rank's `input` in rank order; waits.
    pub fn all_gather(&self, input: &CudaBuf, output: &mut CudaBuf) -> Result<()> {
        let f = self.start_all_gather(input, output)?;
        self.wait(f)
    }

    /// Starts `all_gather`.
    pub fn start_all_gather(&self, input: &CudaBuf, output: &mut CudaBuf) -> Result<InFlight> {
        if output.len() != input.len() * self.size {
            bail!(
                "all_gather on NCCL group `{}`: output holds {} values, needs {} × {}",
                self.name,
                output.len(),
                self.size,
                input.len()
            );
        }
        let count = input.len();
        self.start_out_of_place("all_gather", input, output, count, |src, dst| {
            // SAFETY: the lengths were checked above.
            unsafe {
                nccl::all_gather(
                    src,
                    dst,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    self.comm,
                    self.cu_stream(),
                )
            }
        })
    }

    /// `input` is `size` equal chunks; `output` receives the reduction of chunk `rank`; waits.
    pub fn reduce_scatter(
        &self,
        input: &CudaBuf,
        output: &mut CudaBuf,
        op: ReduceOp,
    ) -> Result<()> {
        let f = self.start_reduce_scatter(input, output, op)?;
        self.wait(f)
    }

    /// Starts `reduce_scatter`.
    pub fn start_reduce_scatter(
        &self,
        input: &CudaBuf,
        output: &mut CudaBuf,
        op: ReduceOp,
    ) -> Result<InFlight> {
        if input.len() != output.len() * self.size {
            bail!(
                "reduce_scatter on NCCL group `{}`: input holds {} values, needs {} × {}",
                self.name,
                input.len(),
                self.size,
                output.len()
            );
        }
        let count = output.len();
        self.start_out_of_place("reduce_scatter", input, output, count, |src, dst| {
            // SAFETY: the lengths were checked above.
            unsafe {
                nccl::reduce_scatter(
                    src,
                    dst,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    Self::red_op(op),
                    self.comm,
                    self.cu_stream(),
                )
            }
        })
    }

    /// Queues one collective from `input` into `output` (their lengths checked by the caller)
    /// that moves `count` values per rank: `call` issues it on the device addresses. Nothing is
    /// issued for `count` 0; a collective that fails to queue aborts the communicator.
    fn start_out_of_place<S>(
        &self,
        op: &'static str,
        input: &CudaBuf,
        output: &mut CudaBuf,
        count: usize,
        call: impl FnOnce(*const c_void, *mut c_void) -> Result<S, nccl::NcclError>,
    ) -> Result<InFlight> {
        self.begin(op)?;
        if count > 0 {
            let (src, dst) = (
                input.device_address(&self.stream),
                output.device_address_mut(&self.stream),
            );
            call(src as *const c_void, dst as *mut c_void).map_err(|e| {
                self.abort();
                nccl_err(op, e)
            })?;
        }
        self.issued(op)
    }

    /// Aborts the communicator once: a broken one, or one with collectives that will never be
    /// waited for, would hang `ncclCommDestroy` at drop.
    pub fn abort(&self) {
        ANY_ABORTED.store(true, Ordering::SeqCst);
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: aborting a live communicator once; `aborted` keeps it from being used or
            // destroyed afterwards.
            unsafe {
                let _ = nccl::comm_abort(self.comm);
            }
        }
    }

    /// Completes a collective of this group: polls its event, so that a dead or silent peer ends
    /// in an error naming the group within the timeout (the communicator is then aborted and
    /// unusable), then orders the compute stream after it.
    pub fn wait(&self, f: InFlight) -> Result<()> {
        let op = f.op;
        self.check_usable(op)?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match f.done.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    self.abort();
                    bail!(
                        "{op} on NCCL group `{}` (rank {} of {}): CUDA error {e}",
                        self.name,
                        self.rank,
                        self.size
                    )
                }
            }
            let mut async_err = sys::ncclResult_t::ncclSuccess;
            // SAFETY: comm is live; the call only reads its error state.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            let failed = !matches!(
                async_err,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            );
            if failed || Instant::now() >= deadline {
                self.abort();
                let why = if failed {
                    format!("NCCL reported {async_err:?} (a peer may have died)")
                } else {
                    format!(
                        "did not complete within {:.0?} (train_timeout_seconds); a peer may have died or hung",
                        self.timeout
                    )
                };
                bail!(
                    "{op} on NCCL group `{}` (rank {} of {}): {why}",
                    self.name,
                    self.rank,
                    self.size
                );
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        // Done already; the compute stream's wait keeps the order explicit for what it queues next.
        self.compute
            .wait(&f.done)
            .map_err(|e| self.failed_cuda(op, "ordering the compute stream", e))
    }
}

/// NCCL is the device group of CUDA buffers: FSDP's queue, DDP's sums and tensor parallelism's
/// rows run through it once it is attached to a mesh group (`device_group::attach`).
impl DeviceGroup<CudaBackend> for NcclGroup {
    fn size(&self) -> usize {
        self.size
    }

    fn start_all_gather(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        output: &mut CudaBuf,
    ) -> Result<Pending> {
        Ok(Pending(Box::new(NcclGroup::start_all_gather(
            self, input, output,
        )?)))
    }

    fn start_reduce_scatter(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        output: &mut CudaBuf,
    ) -> Result<Pending> {
        let f = NcclGroup::start_reduce_scatter(self, input, output, ReduceOp::Sum)?;
        Ok(Pending(Box::new(f)))
    }

    fn start_all_reduce_each(&self, _be: &CudaBackend, bufs: Vec<&mut CudaBuf>) -> Result<Pending> {
        let f = NcclGroup::start_all_reduce_each(self, bufs, ReduceOp::Sum)?;
        Ok(Pending(Box::new(f)))
    }

    fn start_all_reduce_max(&self, _be: &CudaBackend, buf: &mut CudaBuf) -> Result<Pending> {
        let f = NcclGroup::start_all_reduce_each(self, std::iter::once(buf), ReduceOp::Max)?;
        Ok(Pending(Box::new(f)))
    }

    fn start_all_to_all(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        send_counts: &[usize],
        output: &mut CudaBuf,
        recv_counts: &[usize],
    ) -> Result<Pending> {
        let f = NcclGroup::start_all_to_all(self, input, send_counts, output, recv_counts)?;
        Ok(Pending(Box::new(f)))
    }

    fn wait(&self, pending: Pending) -> Result<()> {
        let f = pending.0.downcast::<InFlight>().map_err(|_| {
            anyhow!(
                "NCCL group `{}`: waited for another group's collective",
                self.name
            )
        })?;
        NcclGroup::wait(self, *f)
    }

    fn abort(&self) {
        NcclGroup::abort(self)
    }
}

/// A communicator handle moved out of the thread that created it.
struct SendComm(sys::ncclComm_t);
// SAFETY: the handle is only passed back to the thread that owns the group.
unsafe impl Send for SendComm {}

/// `ncclCommInitRank` blocks until every rank has called it, so it runs on a helper thread and is
/// waited for at most `timeout`: a peer that dies between arriving at the store and calling it is
/// an error, not a hang. (A helper left blocked then ends with the process, which fails.)
fn init_within(
    stream: &Arc<CudaStream>,
    id: sys::ncclUniqueId,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<sys::ncclComm_t> {
    let (done, result) = std::sync::mpsc::channel();
    let ctx = stream.context().clone();
    std::thread::Builder::new()
        .name("titan-nccl-init".into())
        .spawn(move || {
            let r = ctx
                .bind_to_thread()
                .map_err(|e| anyhow!("binding the CUDA context: {e}"))
                .and_then(|_| {
                    let mut comm = std::mem::MaybeUninit::uninit();
                    // SAFETY: comm is written by NCCL on success; the id is the group's.
                    unsafe {
                        nccl::comm_init_rank(comm.as_mut_ptr(), size as i32, id, rank as i32)
                            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
                        Ok(SendComm(comm.assume_init()))
                    }
                });
            let _ = done.send(r);
        })
        .map_err(|e| anyhow!("spawning the NCCL init thread: {e}"))?;
    match result.recv_timeout(timeout) {
        Ok(r) => r.map(|c| c.0),
        Err(_) => Err(anyhow!(
            "ncclCommInitRank did not complete within {timeout:.0?} (init_timeout_seconds)"
        )),
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        if ANY_ABORTED.load(Ordering::SeqCst) {
            self.abort();
            return;
        }
        // SAFETY: the communicator was created in `connect` and is destroyed once.
        unsafe {
            let _ = nccl::comm_destroy(self.comm);
        }
    }
}
