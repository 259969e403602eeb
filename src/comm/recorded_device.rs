//! The flight recorder for device communicators: a wrapper around a group's `DeviceGroup` or
//! `DevicePeers` that records each collective and transfer in a buffer of its own, named after
//! the host group with `/device` appended (`flight_recorder::for_group`): started when it is
//! queued, completed or failed when it is waited for. A device collective that never completes
//! (a dead or hung peer, NCCL's timeout) thus leaves the same dump and the same analysis as a
//! host one, naming the group, the operation and its sequence number. The fault drill
//! (`TITAN_SKIP_COLLECTIVE`) skips a device operation too.
//!
//! The device buffer has its own sequence numbers: on the host-run device road the host
//! transport underneath records its own operations in the host group's buffer as well.

use std::sync::Arc;

use anyhow::Result;

use super::device_group::{DeviceGroup, DevicePeers, Pending};
use super::flight_recorder::{for_group, GroupRecord, Recording};
use super::group::ProcessGroup;
use crate::backend::Backend;

/// A device group whose operations the flight recorder records.
pub struct Recorded<D: ?Sized> {
    inner: Arc<D>,
    record: Arc<GroupRecord>,
}

/// `inner` wrapped in the flight recorder's buffer for the device communicator of `group`, or
/// `inner` itself when the recorder is off.
fn wrap<D: ?Sized>(group: &dyn ProcessGroup, inner: Arc<D>) -> Result<Recorded<D>, Arc<D>> {
    let Some(host) = group.flight_record() else {
        return Err(inner);
    };
    match for_group(&format!("{}/device", host.name()), host.ranks()) {
        Some(record) => Ok(Recorded { inner, record }),
        None => Err(inner),
    }
}

/// `device`, recorded when the flight recorder is on.
pub fn recorded<B: Backend>(
    group: &dyn ProcessGroup,
    device: Arc<dyn DeviceGroup<B>>,
) -> Arc<dyn DeviceGroup<B>> {
    wrap(group, device).map_or_else(|device| device, |r| Arc::new(r))
}

/// `peers`, recorded when the flight recorder is on.
pub fn recorded_peers<B: Backend>(
    group: &dyn ProcessGroup,
    peers: Arc<dyn DevicePeers<B>>,
) -> Arc<dyn DevicePeers<B>> {
    wrap(group, peers).map_or_else(|peers| peers, |r| Arc::new(r))
}

/// A recorded collective in flight: the inner group's (None when the fault drill skipped it).
struct InFlight {
    inner: Option<Pending>,
    recording: Option<Recording>,
}

impl<D: ?Sized> Recorded<D> {
    /// Starts `op` under the recorder: the inner start, unless the drill skips it.
    fn start(
        &self,
        op: &str,
        elements: usize,
        start: impl FnOnce() -> Result<Pending>,
    ) -> Result<Pending> {
        let Some(recording) = self.record.start(op, elements, None) else {
            return Ok(Pending(Box::new(InFlight {
                inner: None,
                recording: None,
            })));
        };
        match start() {
            Ok(inner) => Ok(Pending(Box::new(InFlight {
                inner: Some(inner),
                recording: Some(recording),
            }))),
            Err(e) => {
                let failed = Err(e);
                recording.finish(&failed);
                failed
            }
        }
    }

    /// Runs a blocking transfer under the recorder.
    fn transfer(
        &self,
        op: &str,
        elements: usize,
        peer: usize,
        run: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let Some(recording) = self.record.start(op, elements, Some(peer)) else {
            return Ok(());
        };
        let result = run();
        recording.finish(&result);
        result
    }
}

impl<B: Backend> DeviceGroup<B> for Recorded<dyn DeviceGroup<B>> {
    fn size(&self) -> usize {
        self.inner.size()
    }

    fn start_all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending> {
        self.start("device all_gather", be.len(input), || {
            self.inner.start_all_gather(be, input, output)
        })
    }

    fn start_reduce_scatter(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Pending> {
        self.start("device reduce_scatter", be.len(input), || {
            self.inner.start_reduce_scatter(be, input, output)
        })
    }

    fn start_all_reduce_each(&self, be: &B, bufs: Vec<&mut B::Buf>) -> Result<Pending> {
        let elements = bufs.iter().map(|b| be.len(b)).sum();
        self.start("device all_reduce", elements, || {
            self.inner.start_all_reduce_each(be, bufs)
        })
    }

    fn start_all_reduce_max(&self, be: &B, buf: &mut B::Buf) -> Result<Pending> {
        self.start("device all_reduce_max", be.len(buf), || {
            self.inner.start_all_reduce_max(be, buf)
        })
    }

    fn start_all_to_all(
        &self,
        be: &B,
        input: &B::Buf,
        send_counts: &[usize],
        output: &mut B::Buf,
        recv_counts: &[usize],
    ) -> Result<Pending> {
        self.start("device all_to_all", send_counts.iter().sum(), || {
            self.inner
                .start_all_to_all(be, input, send_counts, output, recv_counts)
        })
    }

    fn wait(&self, pending: Pending) -> Result<()> {
        let flight = match pending.0.downcast::<InFlight>() {
            Ok(flight) => *flight,
            // Not started through this wrapper: the inner group says whose it is.
            Err(other) => return self.inner.wait(Pending(other)),
        };
        let Some(inner) = flight.inner else {
            return Ok(());
        };
        let result = self.inner.wait(inner);
        if let Some(recording) = flight.recording {
            recording.finish(&result);
        }
        result
    }

    fn abort(&self) {
        self.inner.abort()
    }
}

impl<B: Backend> DevicePeers<B> for Recorded<dyn DevicePeers<B>> {
    fn send(&self, be: &B, buf: &B::Buf, peer: usize) -> Result<()> {
        self.transfer("device send", be.len(buf), peer, || {
            self.inner.send(be, buf, peer)
        })
    }

    fn recv(&self, be: &B, buf: &mut B::Buf, peer: usize) -> Result<()> {
        let elements = be.len(buf);
        self.transfer("device recv", elements, peer, || {
            self.inner.recv(be, buf, peer)
        })
    }

    fn abort(&self) {
        self.inner.abort()
    }
}
