//! The operands of a float8 linear's GEMMs (TorchTitan's `quantize.linear.float8`, torchao's
//! dynamic scaling, emulated): each of `Y = X·Wᵀ`, `dX = G·W` and `dW = Gᵀ·X` reads its two
//! operands quantised as the recipe says (`Float8Recipe::operands`) and dequantised, and
//! multiplies them in high precision, which is torchao's emulated float8 GEMM number for number.
//!
//! The scales are those of the whole operand. Where tensor parallelism splits the dimension an
//! amax runs over (a column-parallel linear's output features `N`, a row-parallel one's input
//! features `K`), the amaxes are agreed over the group (`TensorParallelOps::all_reduce_max`)
//! before any value is cast, so every layout casts exactly as one process does.

use anyhow::Result;

use super::crossings::tensor::TensorParallelOps;
use super::linear::Linear;
use crate::backend::float8::{LinearGemm, Quantization, ScaleAxis};
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

/// Casts a linear's GEMM operands, agreeing scales over its tensor-parallel group.
pub struct Float8Casts<'a, B: Backend> {
    pub tp: &'a dyn TensorParallelOps<B>,
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
        let Some(recipe) = linear.float8 else {
            return Ok([Operand::HighPrecision(a), Operand::HighPrecision(b)]);
        };
        let [qa, qb] = recipe.operands(gemm);
        let [da, db] = match gemm {
            LinearGemm::Output => [(Dim::M, Dim::K), (Dim::N, Dim::K)],
            LinearGemm::InputGrad => [(Dim::M, Dim::N), (Dim::N, Dim::K)],
            LinearGemm::WeightGrad => [(Dim::M, Dim::N), (Dim::M, Dim::K)],
        };
        let size = |d| match d {
            Dim::M => rows,
            Dim::N => linear.d_out,
            Dim::K => linear.d_in,
        };
        let cast = |x: &'x B::Buf, (r, c): (Dim, Dim), q: Option<Quantization>| match q {
            None => Ok(Operand::HighPrecision(x)),
            Some(q) => self.cast(be, x, [(r, size(r)), (c, size(c))], q),
        };
        Ok([cast(a, da, qa)?, cast(b, db, qb)?])
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
        Ok(Operand::Cast(be.float8_fake_quantized(x, cols, q, &amaxes)))
    }
}
