//! The operands of a float8 linear's GEMMs (TorchTitan's `quantize.linear.float8`, torchao's
//! dynamic scaling, emulated): each of `Y = X·Wᵀ`, `dX = G·W` and `dW = Gᵀ·X` reads its two
//! operands quantised as the recipe says (`Float8Recipe::operands`) and dequantised, and
//! multiplies them in high precision, which is torchao's emulated float8 GEMM number for number.
//!
//! The scales are those of the whole operand: the amaxes over a dimension that a layout splits
//! are agreed over the groups that split it (`AmaxGroups`, implemented by the layers that know
//! the groups: `parallel_linear::SplitGroups` for tensor and context parallelism) before any
//! value is cast. So every layout casts exactly as one process does on the same micro-batch.
//! (Data parallelism is not reduced over: as in torchao, each rank's micro-batch is its own GEMM,
//! and one process running the same micro-batches with gradient accumulation casts the same.)
//! This module names no group, so the experts (`moe`) cast with it too (`OnOneRank`).

use anyhow::{bail, Result};

use super::linear::Linear;
use crate::backend::float8::{
    ContractedDim, Float8Recipe, LinearGemm, MxBlocks, MxCast, OperandCast, Quantization,
    ScaleAxis, MX_BLOCK,
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

/// The three dimensions of a linear's GEMMs: `M` token rows, `N` output and `K` input features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmDim {
    M,
    N,
    K,
}

/// The groups that split a linear's GEMM dimensions, as far as its casts need them.
pub trait AmaxGroups {
    /// Makes each of `amaxes` (maxima over the dimensions `spans`) the largest over the groups
    /// that split any of those dimensions, in place (NaN if any rank's is).
    fn agree(&self, amaxes: &mut [f32], spans: &[GemmDim]) -> Result<()>;
}

/// A linear whose GEMM dimensions no group splits (one rank; an expert's GEMMs).
pub struct OnOneRank;

impl AmaxGroups for OnOneRank {
    fn agree(&self, _amaxes: &mut [f32], _spans: &[GemmDim]) -> Result<()> {
        Ok(())
    }
}

/// Casts a linear's GEMM operands, agreeing scales over the groups that split an amax's axis.
pub struct Float8Casts<'a> {
    pub groups: &'a dyn AmaxGroups,
    /// MXFP8 blocks down the token rows may end in a partial block, as if padded with zero rows
    /// (an expert's group of rows, which TorchTitan pads to 32); false for a linear, whose token
    /// rows torchao requires in whole blocks.
    pub partial_row_blocks: bool,
}

impl Float8Casts<'_> {
    /// The two operands of `gemm` of `linear` over `rows` token rows, in the order the GEMM names
    /// them (`X, W`; `G, W`; `G, X`), each cast as the linear's recipe says (unchanged without
    /// one, or where the recipe keeps that operand in high precision).
    pub fn operands<'x, B: Backend>(
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
    pub fn operand<'x, B: Backend>(
        &self,
        be: &B,
        (linear, gemm, slot): (Linear, LinearGemm, usize),
        x: &'x B::Buf,
        rows: usize,
    ) -> Result<Operand<'x, B>> {
        let Some(cast) = linear.float8.and_then(|r| r.operand_casts(gemm)[slot]) else {
            return Ok(Operand::HighPrecision(x));
        };
        // W is operand 1 of `Y = X·Wᵀ` and of `dX = G·W`; FSDP's float8 all-gather cast it. A
        // backend with float8 GEMMs casts it again for its codes: its values are on the float8
        // grid, so the cast returns them (with a scale within an ulp of the gather's).
        let weight = slot == 1 && gemm != LinearGemm::WeightGrad;
        if weight && linear.weight_gathered_in_float8 && !be.keeps_float8_codes() {
            return Ok(Operand::HighPrecision(x));
        }
        let dims = match gemm {
            LinearGemm::Output => [(GemmDim::M, GemmDim::K), (GemmDim::N, GemmDim::K)],
            LinearGemm::InputGrad => [(GemmDim::M, GemmDim::N), (GemmDim::N, GemmDim::K)],
            LinearGemm::WeightGrad => [(GemmDim::M, GemmDim::N), (GemmDim::M, GemmDim::K)],
        }[slot];
        let size = |d| match d {
            GemmDim::M => rows,
            GemmDim::N => linear.d_out,
            GemmDim::K => linear.d_in,
        };
        let (rows, cols) = (size(dims.0), size(dims.1));
        let summed = match gemm {
            LinearGemm::Output => GemmDim::K,
            LinearGemm::InputGrad => GemmDim::N,
            LinearGemm::WeightGrad => GemmDim::M,
        };
        let contracted = if dims.0 == summed {
            ContractedDim::Rows
        } else {
            ContractedDim::Columns
        };
        match cast {
            OperandCast::Scaled(q) => {
                self.cast(be, x, [(dims.0, rows), (dims.1, cols)], (q, contracted))
            }
            OperandCast::Mx(mx) => mx_cast(be, x, (rows, cols), mx, self.partial_row_blocks),
        }
    }

    /// `x` (`[rows, cols]`, their dimensions named) fake-quantised with `q` for a GEMM that sums
    /// over `contracted`.
    fn cast<'x, B: Backend>(
        &self,
        be: &B,
        x: &B::Buf,
        [(row_dim, rows), (col_dim, cols)]: [(GemmDim, usize); 2],
        (q, contracted): (Quantization, ContractedDim),
    ) -> Result<Operand<'x, B>> {
        let mut amaxes = be.float8_amaxes(x, rows, cols, q.axis);
        let spans: &[GemmDim] = match q.axis {
            ScaleAxis::Tensor => &[row_dim, col_dim],
            ScaleAxis::Rows => &[col_dim],
            ScaleAxis::Columns => &[row_dim],
        };
        self.groups.agree(&mut amaxes, spans)?;
        Ok(Operand::Cast(
            be.float8_fake_quantized(x, cols, q, &amaxes, contracted),
        ))
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
    partial_row_blocks: bool,
) -> Result<Operand<'x, B>> {
    let (along, what) = match mx.blocks {
        MxBlocks::AlongRows => (cols, "features"),
        MxBlocks::DownColumns if partial_row_blocks => (MX_BLOCK, "token rows"),
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

    /// `X` itself, as a high-precision GEMM reads it (LoRA's adapters).
    pub fn high_precision(&self) -> &'x B::Buf {
        self.x
    }

    /// `X` as `linear`'s GEMM reads it.
    pub fn for_linear(
        &mut self,
        casts: &Float8Casts<'_>,
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
