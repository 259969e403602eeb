//! The device road run through the host: a `DeviceGroup` on the CPU backend's buffers whose
//! collectives go through the group's host transport, on the buffers in place (no upload or
//! download, as a device communicator makes none), each finished when it is started.
//!
//! It exists so that the code a GPU job runs with NCCL attached to its groups (FSDP's
//! `DeviceQueue`, DDP's `DeviceGradReducer`, tensor parallelism's row collectives on the queue)
//! runs, and is tested against the host road bit for bit, on CPU ranks
//! (`TITAN_DEVICE_COLLECTIVES=host`, `launch::device_groups`). The sums are the host transport's,
//! so the numbers are the host road's; what it checks is the device road's bookkeeping (which
//! buffer a queue entry returns, what HSDP sums across replicas, which gradients a block's sum
//! covers). On the pipeline group it carries the stage transfers (`DevicePeers`) over the host
//! transport's point-to-point calls, which already keep each direction's order.

use std::sync::Arc;

use anyhow::{bail, Result};

use super::device_group::{DeviceGroup, DevicePeers, Pending};
use super::group::{ProcessGroup, ReduceOp};
use crate::backend::cpu::CpuBackend;

pub struct HostDeviceGroup {
    host: Arc<dyn ProcessGroup>,
}

impl HostDeviceGroup {
    pub fn new(host: Arc<dyn ProcessGroup>) -> Self {
        HostDeviceGroup { host }
    }
}

/// A collective that finished when it was started.
fn done() -> Pending {
    Pending(Box::new(()))
}

impl DeviceGroup<CpuBackend> for HostDeviceGroup {
    fn size(&self) -> usize {
        self.host.size()
    }

    fn start_all_gather(
        &self,
        _be: &CpuBackend,
        input: &Vec<f32>,
        output: &mut Vec<f32>,
    ) -> Result<Pending> {
        self.host.all_gather(input, output)?;
        Ok(done())
    }

    fn start_reduce_scatter(
        &self,
        _be: &CpuBackend,
        input: &Vec<f32>,
        output: &mut Vec<f32>,
    ) -> Result<Pending> {
        self.host.reduce_scatter(input, output, ReduceOp::Sum)?;
        Ok(done())
    }

    fn start_all_reduce_each(&self, _be: &CpuBackend, bufs: Vec<&mut Vec<f32>>) -> Result<Pending> {
        // One all-reduce over the buffers side by side, as a device does one group call.
        let mut values: Vec<f32> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.host.all_reduce(&mut values, ReduceOp::Sum)?;
        let mut at = 0;
        for b in bufs {
            let n = b.len();
            b.copy_from_slice(&values[at..at + n]);
            at += n;
        }
        Ok(done())
    }

    fn start_all_reduce_max(&self, _be: &CpuBackend, buf: &mut Vec<f32>) -> Result<Pending> {
        self.host.all_reduce(buf, ReduceOp::Max)?;
        Ok(done())
    }

    fn start_all_to_all(
        &self,
        _be: &CpuBackend,
        input: &Vec<f32>,
        send_counts: &[usize],
        output: &mut Vec<f32>,
        recv_counts: &[usize],
    ) -> Result<Pending> {
        self.host
            .all_to_all(input, send_counts, output, recv_counts)?;
        Ok(done())
    }

    fn wait(&self, pending: Pending) -> Result<()> {
        match pending.0.downcast::<()>() {
            Ok(_) => Ok(()),
            Err(_) => bail!(
                "`{}`: waited for another group's collective",
                self.host.name()
            ),
        }
    }

    /// The host transport marks itself broken on a failure; nothing else is held.
    fn abort(&self) {}
}

impl DevicePeers<CpuBackend> for HostDeviceGroup {
    fn send(&self, _be: &CpuBackend, buf: &Vec<f32>, peer: usize) -> Result<()> {
        self.host.send(buf, peer)
    }

    fn recv(&self, _be: &CpuBackend, buf: &mut Vec<f32>, peer: usize) -> Result<()> {
        self.host.recv(buf, peer)
    }

    fn abort(&self) {}
}
