//! torchao's dynamic scaling of a matrix (one scale per tensor, row or column) and its recipes:
//! which operand of each of a linear's three GEMMs is quantised how.

use super::mx::{MxBlocks, MxCast, MxScaling, MX_BLOCK};
use super::{amax, Fp8Format};

/// Which scales a matrix `[rows, cols]` is quantised with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleAxis {
    /// One scale for the whole tensor (tensorwise).
    Tensor,
    /// One scale per row, its amax over the row's columns (rowwise `X` in `X·Wᵀ`).
    Rows,
    /// One scale per column, its amax over the column's rows (rowwise `X` in `dW = Gᵀ·X`).
    Columns,
}

/// Which dimension of an operand `[rows, cols]` its GEMM sums over. The emulated GEMM reads the
/// values either way; a real float8 GEMM (cuBLASLt) wants its 8-bit codes laid out with the summed
/// dimension contiguous, so a backend that keeps codes stores them transposed for `Rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContractedDim {
    /// The GEMM sums along each row (`X` and `W` in `Y = X·Wᵀ`; `G` in `dX = G·W`).
    Columns,
    /// The GEMM sums down each column (`W` in `dX = G·W`; both operands of `dW = Gᵀ·X`).
    Rows,
}

/// How a matrix is quantised: the format, the scales' axis, and whether they are rounded down to
/// powers of two (the rowwise recipes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    pub format: Fp8Format,
    pub axis: ScaleAxis,
    pub power_of_two_scales: bool,
}

/// A quantised matrix: its fp8 values (held as f32) and its scales (one, one per row, or one per
/// column). The value it stands for is `values[i] / scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub values: Vec<f32>,
    pub scales: Vec<f32>,
}

impl Quantization {
    /// The scales of `x` (`[rows, cols]`, row-major) along this quantisation's axis.
    pub fn scales(&self, x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            rows * cols,
            "float8 scales: {rows}x{cols} needs {} values",
            rows * cols
        );
        let amaxes: Vec<f32> = match self.axis {
            ScaleAxis::Tensor => vec![amax(x)],
            ScaleAxis::Rows => x.chunks(cols.max(1)).take(rows).map(amax).collect(),
            ScaleAxis::Columns => (0..cols)
                .map(|c| {
                    let column: Vec<f32> = (0..rows).map(|r| x[r * cols + c]).collect();
                    amax(&column)
                })
                .collect(),
        };
        super::scales_from_amaxes(&amaxes, *self)
    }

    /// `x` (`[rows, cols]`) quantised with the scales of its own amaxes.
    pub fn quantize(&self, x: &[f32], rows: usize, cols: usize) -> Quantized {
        let scales = self.scales(x, rows, cols);
        let scale_of = |i: usize| match self.axis {
            ScaleAxis::Tensor => scales[0],
            ScaleAxis::Rows => scales[i / cols],
            ScaleAxis::Columns => scales[i % cols],
        };
        let values = x
            .iter()
            .enumerate()
            .map(|(i, &v)| self.format.quantize(v, scale_of(i)))
            .collect();
        Quantized { values, scales }
    }
}

impl Quantized {
    /// The values this stands for, `[rows, cols]` along `axis`: each fp8 value times the f32
    /// reciprocal of its scale, as torchao's emulated GEMM dequantises (`m.float() * inv_s`).
    pub fn dequantize(&self, axis: ScaleAxis, cols: usize) -> Vec<f32> {
        self.values
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let s = match axis {
                    ScaleAxis::Tensor => self.scales[0],
                    ScaleAxis::Rows => self.scales[i / cols],
                    ScaleAxis::Columns => self.scales[i % cols],
                };
                q * s.recip()
            })
            .collect()
    }
}

/// The dynamic-scaling recipes of torchao's `Float8LinearConfig` (TorchTitan's
/// `[quantize.linear.float8] recipe_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Float8Recipe {
    /// One scale per tensor; `X` and `W` in e4m3, the output gradient in e5m2.
    Tensorwise,
    /// All e4m3, scales per row or column along each GEMM's contraction, rounded down to powers
    /// of two.
    Rowwise,
    /// As `Rowwise`, but `dX` uses `W` with one scale per tensor (its power of two) and `dW`
    /// stays in high precision.
    RowwiseWithGwHp,
    /// MXFP8 (`[quantize.linear.mx]`): every operand e4m3 in blocks of 32 along each GEMM's
    /// contraction, one E8M0 scale per block, as torchao's MXFP8 linear.
    Mxfp8(MxScaling),
}

/// How one GEMM operand is cast: with float8 scales per tensor, row or column, or in MX blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperandCast {
    Scaled(Quantization),
    Mx(MxCast),
}

/// The three GEMMs of a linear `Y = X·Wᵀ` (`X` `[M,K]`, `W` `[N,K]`, `G = ∂L/∂Y` `[M,N]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearGemm {
    /// `Y = X·Wᵀ`: operands `X`, `W`.
    Output,
    /// `dX = G·W`: operands `G`, `W`.
    InputGrad,
    /// `dW = Gᵀ·X`: operands `G`, `X`.
    WeightGrad,
}

impl Float8Recipe {
    /// Parses `recipe_name`; the error names the key and the accepted values.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        match name {
            "tensorwise" => Ok(Float8Recipe::Tensorwise),
            "rowwise" => Ok(Float8Recipe::Rowwise),
            "rowwise_with_gw_hp" => Ok(Float8Recipe::RowwiseWithGwHp),
            other => anyhow::bail!("[quantize.linear.float8] recipe_name = \"{other}\" is not known (accepted: rowwise, rowwise_with_gw_hp, tensorwise)"),
        }
    }

    /// Parses `[quantize.linear.mx] recipe_name` (TorchTitan's names); the error names the key
    /// and the accepted values.
    pub fn parse_mx(name: &str) -> anyhow::Result<Self> {
        match name {
            "mxfp8_cublas" | "mxfp8_emulated" => Ok(Float8Recipe::Mxfp8(MxScaling::Floor)),
            "mxfp8_cublas_rceil" | "mxfp8_emulated_rceil" => {
                Ok(Float8Recipe::Mxfp8(MxScaling::Rceil))
            }
            other => anyhow::bail!("[quantize.linear.mx] recipe_name = \"{other}\" is not known (accepted: mxfp8_cublas (FLOOR scales), mxfp8_cublas_rceil (RCEIL scales), and their emulated forms mxfp8_emulated, mxfp8_emulated_rceil)"),
        }
    }

    /// The multiple a converted linear's features must be of: 16 for float8's GEMMs, 32 (a
    /// block) for MXFP8.
    pub fn feature_multiple(self) -> usize {
        match self {
            Float8Recipe::Mxfp8(_) => MX_BLOCK,
            _ => 16,
        }
    }

    /// How each operand of `gemm` is cast (in the order the GEMM names them; None: high
    /// precision), each as stored: `X` `[M,K]`, `W` `[N,K]`, `G` `[M,N]`.
    pub fn operand_casts(self, gemm: LinearGemm) -> [Option<OperandCast>; 2] {
        let Float8Recipe::Mxfp8(scaling) = self else {
            return self.operands(gemm).map(|q| q.map(OperandCast::Scaled));
        };
        let mx = |blocks| Some(OperandCast::Mx(MxCast { blocks, scaling }));
        match gemm {
            // Blocks run along each GEMM's contraction: K, then N, then M.
            LinearGemm::Output => [mx(MxBlocks::AlongRows), mx(MxBlocks::AlongRows)],
            LinearGemm::InputGrad => [mx(MxBlocks::AlongRows), mx(MxBlocks::DownColumns)],
            LinearGemm::WeightGrad => [mx(MxBlocks::DownColumns), mx(MxBlocks::DownColumns)],
        }
    }

    /// How each operand of `gemm` is quantised with float8 scales (in the order the GEMM names
    /// them; None: high precision or, for MXFP8, `operand_casts`' blocks), each as stored: `X`
    /// `[M,K]`, `W` `[N,K]`, `G` `[M,N]`.
    pub fn operands(self, gemm: LinearGemm) -> [Option<Quantization>; 2] {
        let q = |format, axis, power_of_two_scales| {
            Some(Quantization {
                format,
                axis,
                power_of_two_scales,
            })
        };
        use Fp8Format::{E4M3, E5M2};
        use ScaleAxis::{Columns, Rows, Tensor};
        match (self, gemm) {
            (Float8Recipe::Tensorwise, LinearGemm::Output) => {
                [q(E4M3, Tensor, false), q(E4M3, Tensor, false)]
            }
            (Float8Recipe::Tensorwise, LinearGemm::InputGrad) => {
                [q(E5M2, Tensor, false), q(E4M3, Tensor, false)]
            }
            (Float8Recipe::Tensorwise, LinearGemm::WeightGrad) => {
                [q(E5M2, Tensor, false), q(E4M3, Tensor, false)]
            }
            // Y = X·Wᵀ contracts K: X per row, W per output feature (its rows).
            (_, LinearGemm::Output) => [q(E4M3, Rows, true), q(E4M3, Rows, true)],
            // dX = G·W contracts N: G per row, W per column k.
            (Float8Recipe::Rowwise, LinearGemm::InputGrad) => {
                [q(E4M3, Rows, true), q(E4M3, Columns, true)]
            }
            // torchao's `round_scales_to_power_of_2` is set for the whole recipe, this tensorwise
            // cast included.
            (Float8Recipe::RowwiseWithGwHp, LinearGemm::InputGrad) => {
                [q(E4M3, Rows, true), q(E4M3, Tensor, true)]
            }
            // dW = Gᵀ·X contracts M: G per column n, X per column k.
            (Float8Recipe::Rowwise, LinearGemm::WeightGrad) => {
                [q(E4M3, Columns, true), q(E4M3, Columns, true)]
            }
            (Float8Recipe::RowwiseWithGwHp, LinearGemm::WeightGrad) => [None, None],
            (Float8Recipe::Mxfp8(_), _) => [None, None],
        }
    }
}

/// `x` (`[rows, cols]`) as a float8 GEMM of the emulated path reads it: quantised with `q`, then
/// dequantised (torchao's `mm_float8_emulated`: dequantise each operand, multiply in f32).
pub fn fake_quantize(x: &[f32], rows: usize, cols: usize, q: Quantization) -> Vec<f32> {
    q.quantize(x, rows, cols).dequantize(q.axis, cols)
}
