//! Collectives on backend buffers, for FSDP's on-device path: the shards and gradients are packed
//! by backend ops and handed over whole. `ThroughHost` runs them for any backend by copying
//! through the host into a CPU process group (the same reductions as FSDP's host path, so the two
//! give the same bits); `NcclGroup` runs them on the GPUs (`comm::nccl`).

use std::sync::Arc;

use anyhow::Result;

use super::group::{ProcessGroup, ReduceOp};
use super::nccl::NcclGroup;
use crate::backend::cuda::{CudaBackend, CudaBuf};
use crate::backend::Backend;

pub trait BufferCollectives<B: Backend> {
    fn size(&self) -> usize;
    /// `output` (`size × len(input)`) receives every rank's `input` in rank order.
    fn all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<()>;
    /// `input` is `size` equal chunks; `output` receives the sum of every rank's chunk `rank`.
    fn reduce_scatter_sum(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<()>;
    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<()>;
}

/// A CPU process group used for backend buffers by way of host copies.
pub struct ThroughHost(pub Arc<dyn ProcessGroup>);

impl<B: Backend> BufferCollectives<B> for ThroughHost {
    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_gather(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<()> {
        let mine = be.download(input);
        let mut all = vec![0.0f32; mine.len() * self.0.size()];
        self.0.all_gather(&mine, &mut all)?;
        *output = be.upload(&all);
        Ok(())
    }

    fn reduce_scatter_sum(&self, be: &B, input: &B::Buf, output: &mut B::Buf) -> Result<()> {
        let packed = be.download(input);
        let mut mine = vec![0.0f32; packed.len() / self.0.size()];
        self.0.reduce_scatter(&packed, &mut mine, ReduceOp::Sum)?;
        *output = be.upload(&mine);
        Ok(())
    }

    fn all_reduce_sum(&self, be: &B, buf: &mut B::Buf) -> Result<()> {
        let mut values = be.download(buf);
        self.0.all_reduce(&mut values, ReduceOp::Sum)?;
        *buf = be.upload(&values);
        Ok(())
    }
}

impl BufferCollectives<CudaBackend> for NcclGroup {
    fn size(&self) -> usize {
        NcclGroup::size(self)
    }

    fn all_gather(&self, _be: &CudaBackend, input: &CudaBuf, output: &mut CudaBuf) -> Result<()> {
        NcclGroup::all_gather(self, input, output)
    }

    fn reduce_scatter_sum(
        &self,
        _be: &CudaBackend,
        input: &CudaBuf,
        output: &mut CudaBuf,
    ) -> Result<()> {
        NcclGroup::reduce_scatter(self, input, output, ReduceOp::Sum)
    }

    fn all_reduce_sum(&self, _be: &CudaBackend, buf: &mut CudaBuf) -> Result<()> {
        NcclGroup::all_reduce(self, buf, ReduceOp::Sum)
    }
}
