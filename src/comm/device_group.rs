//! A group's collectives on a backend's own buffers, and how a mesh group carries them.
//!
//! Every group of a rank's mesh is joined once, over the host transport (`group::TcpGroup`). On
//! GPUs the same ranks may also hold a device communicator (NCCL's, on the communication
//! stream): it is attached to the group itself (`attach`), so a layout that crosses the group
//! takes its collectives from the group alone, whatever the device (`queue::queue_over`,
//! `device_of`). A group with no device communicator runs them over the host transport
//! (`queue::HostQueue`).
//!
//! The pipeline group carries point-to-point channels instead (`DevicePeers`): a stage's output
//! goes to the next stage's rank and its input gradient back, each in the order the schedule
//! produces them, with sends and receives to the same peer in flight at once on different
//! threads. NCCL needs a communicator per direction for that (`nccl::peers`); a group carries
//! either collectives or peers.
//!
//! The slot is type-erased (`group::DeviceSlot`) because the groups are joined before the
//! backend's type is chosen at run time (`[training] device`); `device_of::<B>` finds a
//! communicator only on the buffers it was attached for.
//!
//! `DeviceGroup` is the interface a device communicator gives: collectives started on device
//! buffers and waited for later (`Pending`), so they run while the compute goes on. NCCL's
//! (`nccl::NcclGroup`) is one; `host_device::HostDeviceGroup` runs the same calls through the
//! host transport, so that the device road (FSDP's device queue, DDP's in-place sums, tensor
//! parallelism's row collectives on the queue) runs and is tested on the CPU too.

use std::any::Any;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::group::{ProcessGroup, ReduceOp};
use crate::backend::Backend;

/// A collective started on a device group and not yet waited for (`DeviceGroup::wait`). Its
/// buffers must stay alive and unwritten until then.
#[must_use = "a collective in flight must be waited for before its result is read"]
pub struct Pending(pub Box<dyn Any + Send>);

/// Collectives between the ranks of one group on `B`'s buffers. Every reduction is a sum.
pub trait DeviceGroup<B: Backend>: Send + Sync {
    fn size(&self) -> usize;
    /// Starts gathering every rank's `input`, in rank order, into `output` (`size × len(input)`).
    fn start_all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending>;
    /// Starts a reduce-scatter: `input` is `size` equal chunks; `output` receives the sum of
    /// chunk `rank` over the group.
    fn start_reduce_scatter(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending>;
    /// Starts summing each buffer in place over the group (one call: DDP's sum of a block).
    fn start_all_reduce_each(&self, be: &B, bufs: Vec<&mut B::Buf>) -> Result<Pending>;
    /// Starts taking the elementwise maximum of `buf` over the group, in place (the row maxima
    /// of tensor parallelism's vocabulary-parallel loss).
    fn start_all_reduce_max(&self, be: &B, buf: &mut B::Buf) -> Result<Pending>;
    /// Starts an all-to-all with uneven splits: part `p` of `input` (laid out by `send_counts`,
    /// values per rank) goes to rank `p`, and rank `p`'s part for this rank lands in part `p` of
    /// `output` (laid out by `recv_counts`). A count of 0 moves nothing, so a ring shift is an
    /// all-to-all with one part each way.
    fn start_all_to_all(
        &self,
        be: &B,
        input: &B::Buf,
        send_counts: &[usize],
        output: &mut B::Buf,
        recv_counts: &[usize],
    ) -> Result<Pending>;
    /// Waits for a collective this group started (within the group's timeout: a dead peer is an
    /// error, never a hang).
    fn wait(&self, pending: Pending) -> Result<()>;
    /// Ends the communicator after a failure, or with collectives left that nobody will wait for.
    fn abort(&self);
}

/// Point-to-point traffic between the ranks of one group on `B`'s buffers, ordered per directed
/// pair: what a rank sends a peer arrives in the order it was sent. A send and a receive, with the
/// same peer or others, may run at once on different threads; sends to one peer come from one
/// thread at a time, as do receives from one peer.
pub trait DevicePeers<B: Backend>: Send + Sync {
    /// Sends `buf` to group rank `peer` and returns once it has left (the buffer may then be
    /// freed), within the group's timeout.
    fn send(&self, be: &B, buf: &B::Buf, peer: usize) -> Result<()>;
    /// Receives the next buffer group rank `peer` sends this rank into `buf` (its length), within
    /// the group's timeout.
    fn recv(&self, be: &B, buf: &mut B::Buf, peer: usize) -> Result<()>;
    /// Whether this rank has a channel to group rank `peer` each way (NCCL's join ring
    /// neighbours only).
    fn reaches(&self, _peer: usize) -> bool {
        true
    }
    /// Ends the channels after a failure.
    fn abort(&self);
}

/// The device communicator attached to `group` for `B`'s buffers, if any.
pub fn device_of<B: Backend>(group: &dyn ProcessGroup) -> Option<Arc<dyn DeviceGroup<B>>> {
    let link = group.device_slot()?.get()?;
    link.downcast_ref::<Arc<dyn DeviceGroup<B>>>().cloned()
}

/// The point-to-point channels attached to `group` for `B`'s buffers, if any.
pub fn peers_of<B: Backend>(group: &dyn ProcessGroup) -> Option<Arc<dyn DevicePeers<B>>> {
    let link = group.device_slot()?.get()?;
    link.downcast_ref::<Arc<dyn DevicePeers<B>>>().cloned()
}

/// Attaches point-to-point channels to `group` (the same ranks, in the same order), as `attach`.
pub fn attach_peers<B: Backend>(group: &dyn ProcessGroup, peers: Arc<dyn DevicePeers<B>>) -> bool {
    group
        .device_slot()
        .is_some_and(|slot| slot.set(Arc::new(peers)).is_ok())
}

/// Attaches `device` to `group` (the same ranks, in the same order). A group that cannot carry
/// one (a shape-only group) or already carries one keeps what it has: returns whether it was
/// attached.
pub fn attach<B: Backend>(group: &dyn ProcessGroup, device: Arc<dyn DeviceGroup<B>>) -> bool {
    group
        .device_slot()
        .is_some_and(|slot| slot.set(Arc::new(device)).is_ok())
}

/// A blocking all-to-all of `input` over `group` with uneven splits (`DeviceGroup::
/// start_all_to_all`'s layout): on the group's device communicator when it carries one for `B`,
/// else through the host (downloaded, the host transport, uploaded). Expert parallelism's rows and
/// Muon's pieces travel through it.
pub fn all_to_all_on<B: Backend>(
    be: &B,
    group: &dyn ProcessGroup,
    input: B::Buf,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<B::Buf> {
    let received = recv_counts.iter().sum();
    if let Some(device) = device_of::<B>(group) {
        let mut output = be.uninit(received);
        let pending = device.start_all_to_all(be, &input, send_counts, &mut output, recv_counts)?;
        device.wait(pending)?;
        return Ok(output);
    }
    let input = be.download_owned(input);
    let mut output = vec![0.0f32; received];
    group.all_to_all(&input, send_counts, &mut output, recv_counts)?;
    Ok(be.upload_owned(output))
}

/// A blocking sum or maximum of `buf` over `group`, in place: on the group's device communicator
/// when it carries one for `B`, else through the host.
pub fn all_reduce_on<B: Backend>(
    be: &B,
    group: &dyn ProcessGroup,
    buf: &mut B::Buf,
    op: ReduceOp,
) -> Result<()> {
    if let Some(device) = device_of::<B>(group) {
        let pending = match op {
            ReduceOp::Sum => device.start_all_reduce_each(be, vec![buf])?,
            ReduceOp::Max => device.start_all_reduce_max(be, buf)?,
            ReduceOp::Avg => bail!("`{}`: device groups sum or take maxima only", group.name()),
        };
        return device.wait(pending);
    }
    let mut values = be.download(buf);
    group.all_reduce(&mut values, op)?;
    *buf = be.upload_owned(values);
    Ok(())
}
