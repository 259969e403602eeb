//! `SingleRank`: one process, degree 1 in every crossing. Each operation of the tensor-, context- and
//! expert-parallel interfaces is the local one (a copy, the local attention kernel, the local
//! loss, rows staying where they are), so the single-process path runs the same block code as
//! every parallel layout, with no group and no collective.

use anyhow::Result;

use super::context::ContextParallelOps;
use super::expert::ExpertParallelOps;
use super::tensor::{LossGrads, TensorParallelOps};
use crate::backend::{AttnGrads, AttnInputs, AttnSaved, Backend, LossSum};
use crate::model::local_shapes::LocalShapes;

/// One rank: every operation is the local one.
pub struct SingleRank;

impl<B: Backend> TensorParallelOps<B> for SingleRank {
    fn degree(&self) -> usize {
        1
    }

    fn gather_rows(&self, be: &B, local: &B::Buf, full: &mut B::Buf) -> Result<()> {
        be.copy_from(full, local);
        Ok(())
    }

    fn reduce_scatter_rows(&self, be: &B, partial: &B::Buf, local: &mut B::Buf) -> Result<()> {
        be.copy_from(local, partial);
        Ok(())
    }

    fn all_reduce_sum(&self, _be: &B, _buf: &mut B::Buf) -> Result<()> {
        Ok(())
    }

    fn all_reduce_max(&self, _amaxes: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn cross_entropy(
        &self,
        be: &B,
        h: &B::Buf,
        w: &B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        grad_scale: f32,
        grads: LossGrads<'_, B>,
    ) -> Result<LossSum> {
        Ok(be.cross_entropy_forward_backward(
            h,
            w,
            targets,
            shapes.dim,
            shapes.vocab,
            grad_scale,
            grads,
        ))
    }

    fn loss_of_logits(
        &self,
        be: &B,
        logits: &mut B::Buf,
        targets: &[u32],
        shapes: &LocalShapes,
        (grad_scale, want_grad): (f32, bool),
    ) -> Result<LossSum> {
        Ok(be.cross_entropy_of_logits(logits, targets, shapes.vocab, grad_scale, want_grad))
    }
}

impl<B: Backend> ContextParallelOps<B> for SingleRank {
    fn degree(&self) -> usize {
        1
    }

    fn attention_forward(
        &self,
        be: &B,
        out: &mut B::Buf,
        lse: &mut B::Buf,
        x: AttnInputs<'_, B::Buf>,
    ) -> Result<()> {
        be.attention_forward(out, lse, x);
        Ok(())
    }

    fn attention_backward(
        &self,
        be: &B,
        grads: AttnGrads<'_, B::Buf>,
        dout: &B::Buf,
        x: AttnInputs<'_, B::Buf>,
        saved: AttnSaved<'_, B::Buf>,
    ) -> Result<()> {
        be.attention_backward(grads, dout, x, saved);
        Ok(())
    }
}

impl<B: Backend> ExpertParallelOps<B> for SingleRank {
    fn degree(&self) -> usize {
        1
    }

    fn rank(&self) -> usize {
        0
    }

    fn exchange_counts(&self, counts: &[usize]) -> Result<Vec<Vec<usize>>> {
        Ok(vec![counts.to_vec()])
    }

    fn all_to_all_rows(
        &self,
        _be: &B,
        rows: B::Buf,
        _send: &[usize],
        _recv: &[usize],
        _width: usize,
    ) -> Result<B::Buf> {
        Ok(rows)
    }
}
