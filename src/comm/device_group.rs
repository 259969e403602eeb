//! A group's collectives on a backend's own buffers, and how a mesh group carries them.
//!
//! Every group of a rank's mesh is joined once, over the host transport (`group::TcpGroup`). On
//! GPUs the same ranks may also hold a device communicator (NCCL's, on the communication
//! stream): it is attached to the group itself (`attach`), so a layout that crosses the group
//! takes its collectives from the group alone, whatever the device (`queue::queue_over`,
//! `device_of`). A group with no device communicator runs them over the host transport
//! (`queue::HostQueue`).
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

use anyhow::Result;

use super::group::ProcessGroup;
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

/// The device communicator attached to `group` for `B`'s buffers, if any.
pub fn device_of<B: Backend>(group: &dyn ProcessGroup) -> Option<Arc<dyn DeviceGroup<B>>> {
    let link = group.device_slot()?.get()?;
    link.downcast_ref::<Arc<dyn DeviceGroup<B>>>().cloned()
}

/// Attaches `device` to `group` (the same ranks, in the same order). A group that cannot carry
/// one (a shape-only group) or already carries one keeps what it has: returns whether it was
/// attached.
pub fn attach<B: Backend>(group: &dyn ProcessGroup, device: Arc<dyn DeviceGroup<B>>) -> bool {
    group
        .device_slot()
        .is_some_and(|slot| slot.set(Arc::new(device)).is_ok())
}
