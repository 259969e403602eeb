//! Collectives on backend buffers, for FSDP's on-device path: the shards and gradients are packed
//! by backend ops and handed over whole. `ThroughHost` runs them for any backend by copying
//! through the host into a CPU process group (the same reductions as FSDP's host path, so the two
//! give the same bits); `NcclGroup` runs them on the GPUs (`comm::nccl`), overlapped with compute.
//!
//! A collective is started and later waited for (`Issued`): between the two its buffers stay alive
//! and unwritten, and its output is not read. The collectives a process starts, through any of its
//! `BufferCollectives`, run in the order they were started (NCCL groups share one stream;
//! `ThroughHost` completes each before returning), so one may consume another's output before that
//! one is waited for (HSDP's all-reduce of a reduce-scatter's result).

use std::sync::Arc;

use anyhow::{bail, Result};

use super::group::{ProcessGroup, ReduceOp};
use super::nccl::{InFlight, NcclGroup};
use crate::backend::cuda::{CudaBackend, CudaBuf};
use crate::backend::Backend;

/// A started collective, which `BufferCollectives::wait` completes.
#[must_use = "a started collective must be waited for before its output is read"]
pub enum Issued {
    /// Finished when it was started (`ThroughHost`).
    Complete,
    /// Queued on the GPU's communication stream.
    Nccl(InFlight),
}

pub trait BufferCollectives<B: Backend> {
    fn size(&self) -> usize;
    /// Starts gathering every rank's `input` into `output` (`size × len(input)`), in rank order.
    fn all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Issued>;
    /// Starts a reduce-scatter: `input` is `size` equal chunks; `output` receives the sum of every
    /// rank's chunk `rank`.
    fn reduce_scatter_sum(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Issued>;
    /// Starts summing `buf` across the ranks, in place.
    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<Issued>;
    /// Completes a collective this group started: its output may be read and its buffers reused.
    fn wait(&self, be: &B, issued: Issued) -> Result<()>;
}

/// A CPU process group used for backend buffers by way of host copies.
pub struct ThroughHost(pub Arc<dyn ProcessGroup>);

impl<B: Backend> BufferCollectives<B> for ThroughHost {
    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Issued> {
        let mine = be.download(input);
        let mut all = vec![0.0f32; mine.len() * self.0.size()];
        self.0.all_gather(&mine, &mut all)?;
        *output = be.upload(&all);
        Ok(Issued::Complete)
    }

    fn reduce_scatter_sum(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<Issued> {
        let packed = be.download(input);
        let mut mine = vec![0.0f32; packed.len() / self.0.size()];
        self.0.reduce_scatter(&packed, &mut mine, ReduceOp::Sum)?;
        *output = be.upload(&mine);
        Ok(Issued::Complete)
    }

    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<Issued> {
        let mut values = be.download(buf);
        self.0.all_reduce(&mut values, ReduceOp::Sum)?;
        *buf = be.upload(&values);
        Ok(Issued::Complete)
    }

    fn wait(&self, _be: &B, issued: Issued) -> Result<()> {
        match issued {
            Issued::Complete => Ok(()),
            Issued::Nccl(_) => bail!("an NCCL collective waited for through a CPU group"),
        }
    }
}

impl BufferCollectives<CudaBackend> for NcclGroup {
    fn size(&self) -> usize {
        NcclGroup::size(self)
    }

    fn all_gather(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        output: &mut CudaBuf,
    ) -> Result<Issued> {
        self.start_all_gather(input, output).map(Issued::Nccl)
    }

    fn reduce_scatter_sum(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        output: &mut CudaBuf,
    ) -> Result<Issued> {
        self.start_reduce_scatter(input, output, ReduceOp::Sum)
            .map(Issued::Nccl)
    }

    fn all_reduce_sum(&self, _be: &CudaBackend, buf: &mut CudaBuf) -> Result<Issued> {
        self.start_all_reduce_each(std::iter::once(buf), ReduceOp::Sum)
            .map(Issued::Nccl)
    }

    fn wait(&self, _be: &CudaBackend, issued: Issued) -> Result<()> {
        match issued {
            Issued::Complete => Ok(()),
            Issued::Nccl(f) => NcclGroup::wait(self, f),
        }
    }
}
