//! The float8 arithmetic of `Fp8Format::quantize` and `Quantization::scales`, written for hot
//! loops: rounding to the format in f32 bit operations instead of exact f64 arithmetic, amaxes in
//! one pass over a row-major matrix, and quantise-then-dequantise into an output slice (what an
//! emulated float8 GEMM reads). The tests below hold every path to the reference numerics.

use super::mx::{MxBlockScale, MxBlocks, MxCast, MX_BLOCK};
use super::recipe::{Quantization, ScaleAxis};
use super::{round_scale_down_to_power_of_two, scale_from_amax, Fp8Format};

/// `|v|` as its bits: for non-negative floats the bits order as the values do, and every NaN
/// orders above infinity, so an integer maximum (which vectorises) is `torch.amax`'s, NaN once
/// any value is NaN.
#[inline(always)]
fn abs_bits(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

fn amax_of(values: &[f32]) -> f32 {
    f32::from_bits(values.iter().fold(0, |m, &v| m.max(abs_bits(v))))
}

/// The amaxes of `x` (`[rows, cols]`, row-major) along `axis`: one for the tensor, one per row
/// (over its columns) or one per column (over its rows).
pub fn amaxes(x: &[f32], rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
    assert_eq!(
        x.len(),
        rows * cols,
        "float8 amax: {rows}x{cols} needs {} values",
        rows * cols
    );
    match axis {
        ScaleAxis::Tensor => vec![amax_of(x)],
        ScaleAxis::Rows => x.chunks(cols.max(1)).take(rows).map(amax_of).collect(),
        ScaleAxis::Columns => {
            let mut out = vec![0u32; cols];
            for row in x.chunks(cols.max(1)).take(rows) {
                for (m, &v) in out.iter_mut().zip(row) {
                    *m = (*m).max(abs_bits(v));
                }
            }
            out.into_iter().map(f32::from_bits).collect()
        }
    }
}

/// The scales of `amaxes` under `q` (torchao's `amax_to_scale`, then the power of two below it
/// for the rowwise recipes).
pub fn scales_from_amaxes(amaxes: &[f32], q: Quantization) -> Vec<f32> {
    amaxes
        .iter()
        .map(|&a| {
            let s = scale_from_amax(a, q.format);
            match q.power_of_two_scales {
                true => round_scale_down_to_power_of_two(s),
                false => s,
            }
        })
        .collect()
}

/// A format's rounding constants, computed once per cast rather than per value.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Rounding {
    /// The format's largest finite value.
    max: f32,
    /// The f32 whose spacing (ulp) is the format's subnormal spacing.
    subnormal_magic: f32,
    /// Mantissa bits of an f32 the format does not have.
    cut: u32,
}

impl Rounding {
    fn of(format: Fp8Format) -> Self {
        let (e, m) = (format.min_normal_exponent(), format.mantissa_bits());
        Rounding {
            max: format.max(),
            subnormal_magic: ((e - m + 23) as f32).exp2(),
            cut: (23 - m) as u32,
        }
    }

    /// `a` (non-negative, at most max) rounded to the format, ties to even: adding and
    /// subtracting `c`, an f32 whose spacing (ulp) is the format's spacing at `a`, rounds there
    /// in the f32 adder itself. `c` is `a`'s power of two times `2^(23 − mantissa bits)`, read off
    /// `a`'s exponent bits, and never below `subnormal_magic`, whose spacing is the format's
    /// below its smallest normal. A carry to the next power of two comes out exact. No branch,
    /// so a loop over values vectorises.
    #[inline(always)]
    fn round_magnitude(self, a: f32) -> f32 {
        let exponent = a.to_bits() & 0x7f80_0000;
        let c = f32::from_bits(exponent + (self.cut << 23)).max(self.subnormal_magic);
        (a + c) - c
    }

    /// `x` (already clamped to ±max) rounded to the format; NaN stays NaN.
    #[inline(always)]
    fn round(self, x: f32) -> f32 {
        if x.is_nan() {
            x
        } else {
            self.round_magnitude(x.abs()).copysign(x)
        }
    }

    /// `v` quantised with scale `s`: the fp8 value `round(clamp(v · s))`, NaN kept (`fake`
    /// before it dequantises).
    #[inline(always)]
    fn quantized(self, v: f32, s: f32) -> f32 {
        let scaled = v * s;
        let clamped = scaled.max(-self.max).min(self.max);
        let q = self.round_magnitude(clamped.abs()).copysign(clamped);
        if scaled.is_nan() {
            scaled
        } else {
            q
        }
    }

    /// `v` quantised with scale `s` and dequantised with `inv` = 1/s. (`max`/`min` instead of
    /// `clamp`, which may panic and so keeps a loop scalar; a NaN is passed on at the end.)
    #[inline(always)]
    fn fake(self, v: f32, s: f32, inv: f32) -> f32 {
        let scaled = v * s;
        let clamped = scaled.max(-self.max).min(self.max);
        let q = self.round_magnitude(clamped.abs()).copysign(clamped) * inv;
        if scaled.is_nan() {
            scaled
        } else {
            q
        }
    }
}

impl Fp8Format {
    /// `round` for a value already clamped to ±max, in f32 bit operations (`Rounding::round`).
    pub fn round_clamped(self, x: f32) -> f32 {
        Rounding::of(self).round(x)
    }
}

/// Rows `first_row..` of `x` (`out.len() / cols` of them, `[rows, cols]` row-major) quantised
/// with `scales` along `q.axis` and dequantised: each value `round(clamp(v · s)) · (1/s)` in f32,
/// as torchao's emulated float8 GEMM reads its operands.
pub fn fake_quantize_rows(
    out: &mut [f32],
    x: &[f32],
    cols: usize,
    first_row: usize,
    scales: &[f32],
    q: Quantization,
) {
    // Each format's constants known at compile time, so the loops vectorise.
    match q.format {
        Fp8Format::E4M3 => cast_rows(E4M3_ROUNDING, out, x, (cols, first_row), scales, q.axis),
        Fp8Format::E5M2 => cast_rows(E5M2_ROUNDING, out, x, (cols, first_row), scales, q.axis),
    }
}

/// `x` quantised to `format` with one `scale`: the fp8 values themselves (held as f32), as
/// `fake_quantize_rows` computes them before it dequantises.
pub fn quantize_with_scale(out: &mut [f32], x: &[f32], scale: f32, format: Fp8Format) {
    let rounding = match format {
        Fp8Format::E4M3 => E4M3_ROUNDING,
        Fp8Format::E5M2 => E5M2_ROUNDING,
    };
    for (o, &v) in out.iter_mut().zip(x) {
        *o = rounding.quantized(v, scale);
    }
}

/// `Rounding::of(Fp8Format::E4M3)`, as a constant.
const E4M3_ROUNDING: Rounding = Rounding {
    max: 448.0,
    subnormal_magic: 16384.0,
    cut: 20,
};

/// `Rounding::of(Fp8Format::E5M2)`, as a constant.
const E5M2_ROUNDING: Rounding = Rounding {
    max: 57344.0,
    subnormal_magic: 128.0,
    cut: 21,
};

#[inline(always)]
fn cast_rows(
    rounding: Rounding,
    out: &mut [f32],
    x: &[f32],
    (cols, first_row): (usize, usize),
    scales: &[f32],
    axis: ScaleAxis,
) {
    match axis {
        ScaleAxis::Tensor | ScaleAxis::Rows => {
            for (r, (o, xr)) in out.chunks_mut(cols).zip(x.chunks(cols)).enumerate() {
                let s = match axis {
                    ScaleAxis::Tensor => scales[0],
                    _ => scales[first_row + r],
                };
                let inv = s.recip();
                for (o, &v) in o.iter_mut().zip(xr) {
                    *o = rounding.fake(v, s, inv);
                }
            }
        }
        ScaleAxis::Columns => {
            let inverses: Vec<f32> = scales.iter().map(|s| s.recip()).collect();
            for (o, xr) in out.chunks_mut(cols).zip(x.chunks(cols)) {
                for (((o, &v), &s), &inv) in o.iter_mut().zip(xr).zip(scales).zip(&inverses) {
                    *o = rounding.fake(v, s, inv);
                }
            }
        }
    }
}

/// Rows of `x` (`[rows, cols]`) cast to MXFP8 as `cast` says and dequantised: the operand
/// torchao's emulated MX GEMM reads. Along rows, `cols` is a multiple of `MX_BLOCK`; down
/// columns, a last block of fewer rows is as if padded with zero rows (an expert's group of rows,
/// which TorchTitan pads to 32).
pub fn mx_fake_quantize_rows(out: &mut [f32], x: &[f32], cols: usize, cast: MxCast) {
    let rounding = E4M3_ROUNDING;
    match cast.blocks {
        MxBlocks::AlongRows => {
            for (o, block) in out.chunks_mut(MX_BLOCK).zip(x.chunks(MX_BLOCK)) {
                let s = cast.scaling.block_scale(amax_of(block));
                for (o, &v) in o.iter_mut().zip(block) {
                    *o = rounding.fake(v, s.multiplier, s.dequantize);
                }
            }
        }
        MxBlocks::DownColumns => {
            let group = MX_BLOCK * cols;
            for (o, rows) in out.chunks_mut(group).zip(x.chunks(group)) {
                // A last group of fewer rows is a block padded with zeros, which change no amax.
                let scales: Vec<MxBlockScale> =
                    amaxes(rows, rows.len() / cols, cols, ScaleAxis::Columns)
                        .into_iter()
                        .map(|a| cast.scaling.block_scale(a))
                        .collect();
                let multipliers: Vec<f32> = scales.iter().map(|s| s.multiplier).collect();
                let dequantize: Vec<f32> = scales.iter().map(|s| s.dequantize).collect();
                for (o, row) in o.chunks_mut(cols).zip(rows.chunks(cols)) {
                    for (((o, &v), &m), &d) in
                        o.iter_mut().zip(row).zip(&multipliers).zip(&dequantize)
                    {
                        *o = rounding.fake(v, m, d);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::recipe::fake_quantize;
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// Values around every power of two the formats reach, ties and near-ties included.
    fn probe_values() -> Vec<f32> {
        let mut v = vec![0.0, -0.0, f32::MIN_POSITIVE, 1e-30, 448.0, 57344.0, 1e30];
        for e in -30..20 {
            let p = (e as f32).exp2();
            for m in 0..64 {
                let x = p * (1.0 + m as f32 / 64.0);
                v.extend([
                    x,
                    -x,
                    f32::from_bits(x.to_bits() + 1),
                    f32::from_bits(x.to_bits() - 1),
                ]);
            }
        }
        v
    }

    #[test]
    fn the_fast_rounding_equals_the_reference_everywhere() {
        for f in FORMATS {
            for &x in &probe_values() {
                let c = x.clamp(-f.max(), f.max());
                assert_eq!(
                    f.round_clamped(c).to_bits(),
                    f.round(c).to_bits(),
                    "{f:?} {x:e}"
                );
            }
            assert!(f.round_clamped(f32::NAN).is_nan());
        }
    }

    #[test]
    fn fast_fake_quantisation_equals_the_reference_on_every_axis() {
        let (rows, cols) = (7, 12);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 10f32.powi((i % 9) as i32 - 5))
            .collect();
        for format in FORMATS {
            for axis in [ScaleAxis::Tensor, ScaleAxis::Rows, ScaleAxis::Columns] {
                for power_of_two_scales in [false, true] {
                    let q = Quantization {
                        format,
                        axis,
                        power_of_two_scales,
                    };
                    let scales = scales_from_amaxes(&amaxes(&x, rows, cols, axis), q);
                    let mut fast = vec![0f32; x.len()];
                    fake_quantize_rows(&mut fast[cols * 3..], &x[cols * 3..], cols, 3, &scales, q);
                    fake_quantize_rows(&mut fast[..cols * 3], &x[..cols * 3], cols, 0, &scales, q);
                    let reference = fake_quantize(&x, rows, cols, q);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&fast), bits(&reference), "{q:?}");
                }
            }
        }
    }

    #[test]
    fn mx_casts_equal_the_reference_blocks_both_ways() {
        use super::super::mx::{mx_quantize, MxScaling};
        let (rows, cols) = (64, 96);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 10f32.powi((i % 11) as i32 - 5))
            .collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let rceil = |blocks| MxCast {
            blocks,
            scaling: MxScaling::Rceil,
        };
        let mut along = vec![0f32; x.len()];
        mx_fake_quantize_rows(&mut along, &x, cols, rceil(MxBlocks::AlongRows));
        let reference = mx_quantize(&x, cols).unwrap().dequantize();
        assert_eq!(bits(&along), bits(&reference));
        // Down columns is along the rows of the transpose.
        let transpose = |m: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..r * c).map(|i| m[(i % r) * c + i / r]).collect()
        };
        let mut down = vec![0f32; x.len()];
        mx_fake_quantize_rows(&mut down, &x, cols, rceil(MxBlocks::DownColumns));
        let t = mx_quantize(&transpose(&x, rows, cols), rows)
            .unwrap()
            .dequantize();
        assert_eq!(bits(&down), bits(&transpose(&t, cols, rows)));
    }

    #[test]
    fn a_partial_block_down_columns_is_a_block_padded_with_zeros() {
        use super::super::mx::MxScaling;
        let (rows, cols) = (45, 8);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 10f32.powi((i % 5) as i32 - 2))
            .collect();
        let cast = MxCast {
            blocks: MxBlocks::DownColumns,
            scaling: MxScaling::Rceil,
        };
        let mut partial = vec![0f32; x.len()];
        mx_fake_quantize_rows(&mut partial, &x, cols, cast);
        let mut padded_x = x.clone();
        padded_x.resize(64 * cols, 0.0);
        let mut padded = vec![0f32; padded_x.len()];
        mx_fake_quantize_rows(&mut padded, &padded_x, cols, cast);
        assert_eq!(partial, padded[..x.len()]);
    }

    #[test]
    fn floor_scales_follow_torchaos_bit_arithmetic() {
        use super::super::mx::MxScaling;
        // amax 448 = 1.75 · 2^8: exponent 8 − 8 = 0, byte 127, no scaling; 449 the same power.
        for (amax, byte) in [
            (448.0, 127),
            (449.0, 127),
            (512.0, 128),
            (1.0, 119),
            (0.0, 0),
        ] {
            assert_eq!(MxScaling::Floor.block_scale(amax).byte, byte, "{amax}");
        }
        assert_eq!(MxScaling::Floor.block_scale(f32::NAN).byte, 255);
        assert_eq!(MxScaling::Floor.block_scale(f32::MAX).byte, 127 + 119);
        // RCEIL never saturates: 449 needs the next power.
        assert_eq!(MxScaling::Rceil.block_scale(449.0).byte, 128);
    }

    #[test]
    fn the_constant_roundings_are_the_formats() {
        assert_eq!(E4M3_ROUNDING, Rounding::of(Fp8Format::E4M3));
        assert_eq!(E5M2_ROUNDING, Rounding::of(Fp8Format::E5M2));
    }

    #[test]
    fn a_nan_makes_its_amax_nan() {
        let x = [1.0, f32::NAN, 3.0, 2.0];
        assert!(amaxes(&x, 2, 2, ScaleAxis::Tensor)[0].is_nan());
        let rows = amaxes(&x, 2, 2, ScaleAxis::Rows);
        assert!(rows[0].is_nan() && rows[1] == 3.0);
        let columns = amaxes(&x, 2, 2, ScaleAxis::Columns);
        assert!(columns[0] == 3.0 && columns[1].is_nan());
    }
}
