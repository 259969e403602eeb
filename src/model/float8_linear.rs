//! The operands of a float8 linear's GEMMs (TorchTitan's `quantize.linear.float8`, torchao's
//! dynamic scaling, emulated): each of `Y = X·Wᵀ`, `dX = G·W` and `dW = Gᵀ·X` reads its two
//! operands quantised as the recipe says (`Float8Recipe::operands`) and dequantised, and
//! multiplies them in high precision, which is torchao's emulated float8 GEMM number for number.
//!
//! The scales are those of the whole operand. Where tensor parallelism splits the dimension an
//! amax runs over (a column-parallel linear's output features `N`, a row-parallel one's input
//! features `K`), the amaxes are agreed over the group (`TensorParallelOps::all_reduce_max`)
//! before any value is cast; where context parallelism splits each sequence's token rows `M`,
//! amaxes over rows are agreed over its group. So every layout casts exactly as one process does
//! on the same micro-batch. (Data parallelism is not reduced over: as in torchao, each rank's
//! micro-batch is its own GEMM, and one process running the same micro-batches with gradient
//! accumulation casts the same.)

use anyhow::{bail, Result};

use super::crossings::context::ContextParallelOps;
use super::crossings::tensor::TensorParallelOps;
use super::linear::Linear;
use super::local_shapes::LocalShapes;
use crate::backend::float8::{
    Float8Recipe, LinearGemm, MxBlocks, MxCast, OperandCast, Quantization, ScaleAxis, MX_BLOCK,
};
use crate::backend::Backend;

/// A GEMM operand: the high-precision buffer itself, or its fake-quantised copy.
pub enum Operand<'a, B: Backend> {
    HighPrecision(&'a B::Buf),
    Cast(B::Buf),
}

impl<B: Backend> Operand<'_, B> {
    pub fn buf(&self) -> &B::Buf {
        match self {
            Operand::HighPrecision(b) => b,
            Operand::Cast(b) => b,
        }
    }

    /// The operand as a buffer of its own (`len` values; a high-precision one is copied).
    pub fn into_owned(self, be: &B, len: usize) -> B::Buf {
        match self {
            Operand::Cast(b) => b,
            Operand::HighPrecision(b) => {
                let mut copy = be.uninit(len);
                be.copy_range(&mut copy, 0, b, 0, len);
                copy
            }
        }
    }
}

/// Which of a linear's features its tensor-parallel group splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureSplit {
    /// Column-parallel: each rank holds a slice of the output features (`N`).
    Outputs,
    /// Row-parallel: each rank holds a slice of the input features (`K`).
    Inputs,
}

/// The three dimensions of a linear's GEMMs: `M` token rows, `N` output and `K` input features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dim {
    M,
    N,
    K,
}

/// Casts a linear's GEMM operands, agreeing scales over the groups that split an amax's axis.
pub struct Float8Casts<'a, B: Backend> {
    /// Splits the features as `split` says.
    pub tp: &'a dyn TensorParallelOps<B>,
    /// Splits each sequence's token rows (`M`).
    pub cp: &'a dyn ContextParallelOps<B>,
    pub split: FeatureSplit,
}

impl<B: Backend> Float8Casts<'_, B> {
    /// The two operands of `gemm` of `linear` over `rows` token rows, in the order the GEMM names
    /// them (`X, W`; `G, W`; `G, X`), each cast as the linear's recipe says (unchanged without
    /// one, or where the recipe keeps that operand in high precision).
    pub fn operands<'x>(
        &self,
        be: &B,
        linear: Linear,
        gemm: LinearGemm,
        (a, b): (&'x B::Buf, &'x B::Buf),
        rows: usize,
    ) -> Result<[Operand<'x, B>; 2]> {
        Ok([
            self.operand(be, (linear, gemm, 0), a, rows)?,
            self.operand(be, (linear, gemm, 1), b, rows)?,
        ])
    }

    /// Operand `slot` (0 or 1, as `operands` orders them) of `gemm` of `linear`.
    pub fn operand<'x>(
        &self,
        be: &B,
        (linear, gemm, slot): (Linear, LinearGemm, usize),
        x: &'x B::Buf,
        rows: usize,
    ) -> Result<Operand<'x, B>> {
        let Some(cast) = linear.float8.and_then(|r| r.operand_casts(gemm)[slot]) else {
            return Ok(Operand::HighPrecision(x));
        };
        let dims = match gemm {
            LinearGemm::Output => [(Dim::M, Dim::K), (Dim::N, Dim::K)],
            LinearGemm::InputGrad => [(Dim::M, Dim::N), (Dim::N, Dim::K)],
            LinearGemm::WeightGrad => [(Dim::M, Dim::N), (Dim::M, Dim::K)],
        }[slot];
        let size = |d| match d {
            Dim::M => rows,
            Dim::N => linear.d_out,
            Dim::K => linear.d_in,
        };
        let (rows, cols) = (size(dims.0), size(dims.1));
        match cast {
            OperandCast::Scaled(q) => self.cast(be, x, [(dims.0, rows), (dims.1, cols)], q),
            OperandCast::Mx(mx) => mx_cast(be, x, (rows, cols), mx),
        }
    }

    /// `x` (`[rows, cols]`, their dimensions named) fake-quantised with `q`.
    fn cast<'x>(
        &self,
        be: &B,
        x: &B::Buf,
        [(row_dim, rows), (col_dim, cols)]: [(Dim, usize); 2],
        q: Quantization,
    ) -> Result<Operand<'x, B>> {
        let mut amaxes = be.float8_amaxes(x, rows, cols, q.axis);
        let spans: &[Dim] = match q.axis {
            ScaleAxis::Tensor => &[row_dim, col_dim],
            ScaleAxis::Rows => &[col_dim],
            ScaleAxis::Columns => &[row_dim],
        };
        let split = match self.split {
            FeatureSplit::Outputs => Dim::N,
            FeatureSplit::Inputs => Dim::K,
        };
        if self.tp.degree() > 1 && spans.contains(&split) {
            self.tp.all_reduce_max(&mut amaxes)?;
        }
        if self.cp.degree() > 1 && spans.contains(&Dim::M) {
            self.cp.max_amax_over_group(&mut amaxes)?;
        }
        Ok(Operand::Cast(be.float8_fake_quantized(x, cols, q, &amaxes)))
    }
}

/// `x` (`[rows, cols]`) cast to MXFP8. Each block of 32 holds values of one rank, so no scale is
/// agreed over a group: a split dimension whose local size is a multiple of 32 keeps one
/// process's blocks (a local size that is not is refused here; context parallelism's chunks are
/// checked with the config).
fn mx_cast<'x, B: Backend>(
    be: &B,
    x: &B::Buf,
    (rows, cols): (usize, usize),
    mx: MxCast,
) -> Result<Operand<'x, B>> {
    let (along, what) = match mx.blocks {
        MxBlocks::AlongRows => (cols, "features"),
        MxBlocks::DownColumns => (rows, "token rows"),
    };
    if !along.is_multiple_of(MX_BLOCK) {
        bail!("MXFP8: an operand's {along} {what} (this rank's, per micro-batch) do not split into blocks of {MX_BLOCK}; choose shapes, batch and parallel degrees that keep them multiples of {MX_BLOCK}");
    }
    Ok(Operand::Cast(be.mx_fake_quantized(x, cols, mx)))
}

/// The input `X` several projections of one layer read (a column-parallel layer's), cast once
/// per recipe instead of once per projection.
pub struct SharedInput<'x, B: Backend> {
    x: &'x B::Buf,
    /// `Output` (X is operand 0) or `WeightGrad` (operand 1).
    gemm: LinearGemm,
    casts: Vec<(Option<Float8Recipe>, Operand<'x, B>)>,
}

impl<'x, B: Backend> SharedInput<'x, B> {
    pub fn new(x: &'x B::Buf, gemm: LinearGemm) -> Self {
        SharedInput {
            x,
            gemm,
            casts: Vec::new(),
        }
    }

    /// `X` as `linear`'s GEMM reads it.
    pub fn for_linear(
        &mut self,
        casts: &Float8Casts<'_, B>,
        be: &B,
        linear: Linear,
        rows: usize,
    ) -> Result<&B::Buf> {
        let slot = match self.gemm {
            LinearGemm::WeightGrad => 1,
            _ => 0,
        };
        let i = match self.casts.iter().position(|(r, _)| *r == linear.float8) {
            Some(i) => i,
            None => {
                let cast = casts.operand(be, (linear, self.gemm, slot), self.x, rows)?;
                self.casts.push((linear.float8, cast));
                self.casts.len() - 1
            }
        };
        Ok(self.casts[i].1.buf())
    }
}

/// Bytes of the cast operand copies a float8 layer holds at once, over `tokens` rows of this
/// rank's shapes (the memory estimate's kernel scratch): the column-parallel backward's, the
/// most, holds each projection's cast output gradient, the shared cast input and a cast weight
/// (f32 here: the emulated casts keep their values in f32).
pub fn cast_scratch_bytes(local: &LocalShapes, tokens: usize) -> u64 {
    let widest = local.dim.max(local.ffn).max(local.q_dim());
    let projections = 3;
    let largest_weight = local.dim * local.ffn.max(local.q_dim());
    4 * ((projections + 1) * tokens * widest + largest_weight) as u64
}
