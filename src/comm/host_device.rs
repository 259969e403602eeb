//! The device road run through the host: a `DeviceGroup` on any backend's buffers whose
//! collectives go through the group's host transport, each finished when it is started.
//!
//! It exists so that the code a GPU job runs with NCCL attached to its groups (FSDP's
//! `DeviceQueue`, DDP's `DeviceGradReducer`, tensor parallelism's row collectives on the queue)
//! runs, and is tested against the host road bit for bit, on CPU ranks
//! (`TITAN_DEVICE_COLLECTIVES=host`, `launch::device_groups`). The sums are the host transport's,
//! so the numbers are the host road's; what it checks is the device road's bookkeeping (which
//! buffer a queue entry returns, what HSDP sums across replicas, which gradients a block's sum
//! covers).

use std::sync::Arc;

use anyhow::{bail, Result};

use super::device_group::{DeviceGroup, Pending};
use super::group::{ProcessGroup, ReduceOp};
use crate::backend::Backend;

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

impl<B: Backend> DeviceGroup<B> for HostDeviceGroup {
    fn size(&self) -> usize {
        self.host.size()
    }

    fn start_all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending> {
        let mine = be.download(input);
        let mut all = vec![0.0f32; mine.len() * self.host.size()];
        if be.len(output) != all.len() {
            bail!(
                "all_gather on `{}`: output holds {} values, needs {}",
                self.host.name(),
                be.len(output),
                all.len()
            );
        }
        self.host.all_gather(&mine, &mut all)?;
        *output = be.upload_owned(all);
        Ok(done())
    }

    fn start_reduce_scatter(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending> {
        let all = be.download(input);
        let mut mine = vec![0.0f32; be.len(output)];
        if all.len() != mine.len() * self.host.size() {
            bail!(
                "reduce_scatter on `{}`: input holds {} values, needs {} × {}",
                self.host.name(),
                all.len(),
                self.host.size(),
                mine.len()
            );
        }
        self.host.reduce_scatter(&all, &mut mine, ReduceOp::Sum)?;
        *output = be.upload_owned(mine);
        Ok(done())
    }

    fn start_all_reduce_each(&self, be: &B, bufs: Vec<&mut B::Buf>) -> Result<Pending> {
        // One host all-reduce over the buffers side by side, as a device does one group call.
        let mut values = Vec::new();
        for b in &bufs {
            values.extend_from_slice(&be.download(b));
        }
        self.host.all_reduce(&mut values, ReduceOp::Sum)?;
        let mut at = 0;
        for b in bufs {
            let n = be.len(b);
            *b = be.upload(&values[at..at + n]);
            at += n;
        }
        Ok(done())
    }

    fn start_all_to_all(
        &self,
        be: &B,
        input: &B::Buf,
        send_counts: &[usize],
        output: &mut B::Buf,
        recv_counts: &[usize],
    ) -> Result<Pending> {
        let mut received = vec![0.0f32; be.len(output)];
        let sent = be.download(input);
        self.host
            .all_to_all(&sent, send_counts, &mut received, recv_counts)?;
        *output = be.upload_owned(received);
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
