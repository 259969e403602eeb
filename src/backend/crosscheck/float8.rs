//! The float8 checks of `crosscheck`: amaxes along each axis, the quantise-dequantise of every
//! recipe's operand kinds (e4m3 and e5m2, power-of-two scales), MXFP8's casts, and FSDP's float8
//! codes both ways.
//! The test backend must give the reference's numbers exactly (tolerance 0): an emulated float8
//! GEMM on the GPU reads the CPU's operands.

use super::{Checker, OpCheck, Tolerances};
use crate::backend::float8::{
    ContractedDim, Float8Recipe, Fp8Format, LinearGemm, MxBlocks, MxCast, MxScaling, OperandCast,
    Quantization, ScaleAxis,
};
use crate::backend::{Backend, GemmOutput, GemmShape};

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    pub(super) fn float8(&mut self) {
        let (rows, cols) = (67, 96);
        // Values over many powers of two, so some fall below each format's normals and some
        // saturate under the scales of their smaller neighbours.
        let mut x = self.random(rows * cols, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v *= ((i % 29) as f32 - 18.0).exp2();
        }
        let (rx, tx) = self.both(&x);
        for axis in [ScaleAxis::Tensor, ScaleAxis::Rows, ScaleAxis::Columns] {
            let amaxes = self.reference.float8_amaxes(&rx, rows, cols, axis);
            let test_amaxes = self.test.float8_amaxes(&tx, rows, cols, axis);
            self.record(&format!("float8_amax {axis:?}"), &test_amaxes, &amaxes, 0.0);
            for (format, power_of_two_scales) in [
                (Fp8Format::E4M3, false),
                (Fp8Format::E5M2, false),
                (Fp8Format::E4M3, true),
            ] {
                let q = Quantization {
                    format,
                    axis,
                    power_of_two_scales,
                };
                // The dimension a rowwise GEMM sums over is the one its scales do not index.
                let contracted = match axis {
                    ScaleAxis::Columns => ContractedDim::Rows,
                    ScaleAxis::Tensor | ScaleAxis::Rows => ContractedDim::Columns,
                };
                let r = self
                    .reference
                    .float8_fake_quantized(&rx, cols, q, &amaxes, contracted);
                let t = self
                    .test
                    .float8_fake_quantized(&tx, cols, q, &amaxes, contracted);
                let pow2 = if power_of_two_scales { " pow2" } else { "" };
                let name = format!("float8_fake_quantize {axis:?} {format:?}{pow2}");
                self.compare(&name, &r, &t, 0.0);
            }
        }
        // MXFP8 blocks along the rows and down the columns (67 rows: a last group of 3), both
        // scalings.
        for blocks in [MxBlocks::AlongRows, MxBlocks::DownColumns] {
            for scaling in [MxScaling::Floor, MxScaling::Rceil] {
                let cast = MxCast { blocks, scaling };
                let r = self.reference.mx_fake_quantized(&rx, cols, cast);
                let t = self.test.mx_fake_quantized(&tx, cols, cast);
                self.compare(
                    &format!("mx_fake_quantize {blocks:?} {scaling:?}"),
                    &r,
                    &t,
                    0.0,
                );
            }
        }
        // An odd count: the last word padded.
        let odd = self.random(rows * cols - 3, 2.0);
        let (ro, to) = self.both(&odd);
        let scale = 37.5;
        let (rc, tc) = (
            self.reference.float8_encoded(&ro, scale, Fp8Format::E4M3),
            self.test.float8_encoded(&to, scale, Fp8Format::E4M3),
        );
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        let (r_bits, t_bits) = (
            bits(self.reference.download(&rc)),
            bits(self.test.download(&tc)),
        );
        let differ = r_bits.iter().zip(&t_bits).filter(|(a, b)| a != b).count()
            + r_bits.len().abs_diff(t_bits.len());
        self.record("float8_encoded codes", &[differ as f32], &[0.0], 0.0);
        let r = self.reference.float8_decoded(&rc, Fp8Format::E4M3);
        let t = self.test.float8_decoded(&tc, Fp8Format::E4M3);
        self.compare("float8_decoded", &r, &t, 0.0);
    }
}

/// A float8 linear's GEMM in the checks: its shape and each operand's `[rows, cols]` and summed
/// dimension, as `model::float8_linear` casts them (X `[m,k]`, W `[n,k]`, G `[m,n]`).
struct LinearGemmCase {
    gemm: LinearGemm,
    shape: GemmShape,
    operands: [(usize, usize, ContractedDim); 2],
}

fn linear_gemm_cases(m: usize, n: usize, k: usize) -> [LinearGemmCase; 3] {
    use ContractedDim::{Columns, Rows};
    [
        LinearGemmCase {
            gemm: LinearGemm::Output,
            shape: GemmShape::new(m, k, n).b_transposed(),
            operands: [(m, k, Columns), (n, k, Columns)],
        },
        LinearGemmCase {
            gemm: LinearGemm::InputGrad,
            shape: GemmShape::new(m, n, k),
            operands: [(m, n, Columns), (n, k, Rows)],
        },
        LinearGemmCase {
            gemm: LinearGemm::WeightGrad,
            shape: GemmShape::new(n, m, k).a_transposed(),
            operands: [(m, n, Rows), (m, k, Rows)],
        },
    ]
}

/// The float8 GEMMs of a linear (`Y = X·Wᵀ`, `dX = G·W`, `dW = Gᵀ·X`) under the tensorwise and
/// rowwise recipes, on operands cast as a float8 linear casts them: the test backend (CUDA with
/// float8 GEMMs on) multiplies their codes, the reference their dequantised values, so the
/// outputs differ only by the order of the sums. Shapes whose dimensions are multiples of 16 and
/// one that is not (which multiplies the dequantised values on both sides), and an accumulating
/// weight gradient. Returns the rows and how many GEMMs should have run in float8 on the test
/// backend and how many should have fallen back (`CudaBackend::fp8_gemm_counts`).
pub fn check_float8_gemms<R: Backend, T: Backend>(
    reference: &R,
    test: &T,
    tolerance: f64,
    seed: u64,
) -> (Vec<OpCheck>, u64, u64) {
    use rand::SeedableRng;
    let mut checker = Checker {
        reference,
        test,
        rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        tol: Tolerances {
            exact: tolerance,
            gemm: tolerance,
            attention: tolerance,
        },
        results: Vec::new(),
    };
    let (mut fp8, mut emulated) = (0, 0);
    for recipe in [Float8Recipe::Tensorwise, Float8Recipe::Rowwise] {
        for (m, n, k) in [(64, 96, 48), (40, 96, 48)] {
            let aligned = [m, n, k].iter().all(|d| d % 16 == 0);
            for case in linear_gemm_cases(m, n, k) {
                checker.float8_gemm(recipe, &case, (m, n, k));
                *if aligned { &mut fp8 } else { &mut emulated } += 1;
            }
        }
    }
    (checker.results, fp8, emulated)
}

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    fn float8_gemm(
        &mut self,
        recipe: Float8Recipe,
        case: &LinearGemmCase,
        dims: (usize, usize, usize),
    ) {
        let casts = recipe.operand_casts(case.gemm);
        let mut pairs = Vec::new();
        for (slot, &(rows, cols, contracted)) in case.operands.iter().enumerate() {
            let x = self.random(rows * cols, 3.0);
            let (rx, tx) = self.both(&x);
            let Some(OperandCast::Scaled(q)) = casts[slot] else {
                panic!(
                    "{recipe:?} casts every operand of {:?} with scales",
                    case.gemm
                );
            };
            let amaxes = self.reference.float8_amaxes(&rx, rows, cols, q.axis);
            pairs.push((
                self.reference
                    .float8_fake_quantized(&rx, cols, q, &amaxes, contracted),
                self.test
                    .float8_fake_quantized(&tx, cols, q, &amaxes, contracted),
            ));
        }
        let GemmShape { m, n, .. } = case.shape;
        let accumulate = case.gemm == LinearGemm::WeightGrad;
        let start = if accumulate {
            self.random(m * n, 1.0)
        } else {
            vec![0.0; m * n]
        };
        let (mut ro, mut to) = self.both(&start);
        let output = if accumulate {
            GemmOutput::Accumulate
        } else {
            GemmOutput::Overwrite
        };
        self.matmul_both(
            (&mut ro, &mut to),
            (&pairs[0].0, &pairs[0].1),
            (&pairs[1].0, &pairs[1].1),
            case.shape,
            output,
        );
        let name = format!(
            "float8 GEMM {recipe:?} {:?} {}x{}x{}",
            case.gemm, dims.0, dims.1, dims.2
        );
        self.compare(&name, &ro, &to, self.tol.gemm);
    }
}
