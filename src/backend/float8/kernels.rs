//! The float8 arithmetic of `Fp8Format::quantize` and `Quantization::scales`, written for hot
//! loops: rounding to the format in f32 bit operations instead of exact f64 arithmetic, amaxes in
//! one pass over a row-major matrix, and quantise-then-dequantise into an output slice (what an
//! emulated float8 GEMM reads). The tests below hold every path to the reference numerics.

use super::recipe::{Quantization, ScaleAxis};
use super::{round_scale_down_to_power_of_two, scale_from_amax, Fp8Format};

/// The larger of an amax so far and `|v|`, NaN once any value is NaN (as `torch.amax`).
#[inline]
fn max_abs(m: f32, v: f32) -> f32 {
    let a = v.abs();
    if a > m || a.is_nan() {
        a
    } else {
        m
    }
}

/// The amaxes of `x` (`[rows, cols]`, row-major) along `axis`: one for the tensor, one per row
/// (over its columns) or one per column (over its rows).
pub fn amaxes(x: &[f32], rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
    assert_eq!(x.len(), rows * cols, "float8 amax: {rows}x{cols} needs {} values", rows * cols);
    match axis {
        ScaleAxis::Tensor => vec![x.iter().fold(0.0, |m, &v| max_abs(m, v))],
        ScaleAxis::Rows => x
            .chunks(cols.max(1))
            .take(rows)
            .map(|row| row.iter().fold(0.0, |m, &v| max_abs(m, v)))
            .collect(),
        ScaleAxis::Columns => {
            let mut out = vec![0f32; cols];
            for row in x.chunks(cols.max(1)).take(rows) {
                for (m, &v) in out.iter_mut().zip(row) {
                    *m = max_abs(*m, v);
                }
            }
            out
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

impl Fp8Format {
    /// `round` for a value already clamped to ±max, in f32: below the smallest normal the
    /// format's spacing is fixed, so adding and subtracting a constant whose f32 spacing equals
    /// it rounds to nearest even; above, the f32 mantissa is cut to the format's bits, ties to
    /// even, the carry moving into the exponent. NaN stays NaN.
    #[inline]
    pub fn round_clamped(self, x: f32) -> f32 {
        let a = x.abs();
        let min_normal = (self.min_normal_exponent() as f32).exp2();
        let rounded = if a < min_normal {
            let spacing_as_f32_ulp =
                ((self.min_normal_exponent() - self.mantissa_bits() + 23) as f32).exp2();
            (a + spacing_as_f32_ulp) - spacing_as_f32_ulp
        } else {
            let cut = (23 - self.mantissa_bits()) as u32;
            let bits = a.to_bits();
            let half_minus_one = (1u32 << (cut - 1)) - 1;
            let odd = (bits >> cut) & 1;
            f32::from_bits((bits + half_minus_one + odd) & !((1u32 << cut) - 1))
        };
        if a.is_nan() {
            x
        } else {
            rounded.copysign(x)
        }
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
    let (format, max) = (q.format, q.format.max());
    let one = |v: f32, s: f32, inv: f32| format.round_clamped((v * s).clamp(-max, max)) * inv;
    match q.axis {
        ScaleAxis::Tensor | ScaleAxis::Rows => {
            for (r, (o, xr)) in out.chunks_mut(cols).zip(x.chunks(cols)).enumerate() {
                let s = match q.axis {
                    ScaleAxis::Tensor => scales[0],
                    _ => scales[first_row + r],
                };
                let inv = s.recip();
                for (o, &v) in o.iter_mut().zip(xr) {
                    *o = one(v, s, inv);
                }
            }
        }
        ScaleAxis::Columns => {
            let inverses: Vec<f32> = scales.iter().map(|s| s.recip()).collect();
            for (o, xr) in out.chunks_mut(cols).zip(x.chunks(cols)) {
                for (((o, &v), &s), &inv) in o.iter_mut().zip(xr).zip(scales).zip(&inverses) {
                    *o = one(v, s, inv);
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
                v.extend([x, -x, f32::from_bits(x.to_bits() + 1), f32::from_bits(x.to_bits() - 1)]);
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
                    let q = Quantization { format, axis, power_of_two_scales };
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
    fn a_nan_makes_its_amax_nan() {
        let x = [1.0, f32::NAN, 3.0, 2.0];
        assert!(amaxes(&x, 2, 2, ScaleAxis::Tensor)[0].is_nan());
        let rows = amaxes(&x, 2, 2, ScaleAxis::Rows);
        assert!(rows[0].is_nan() && rows[1] == 3.0);
        let columns = amaxes(&x, 2, 2, ScaleAxis::Columns);
        assert!(columns[0] == 3.0 && columns[1].is_nan());
    }
}
