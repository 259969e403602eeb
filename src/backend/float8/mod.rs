//! The float8 formats (OCP FP8 `e4m3fn` and `e5m2`) and torchao's dynamic scaling, on the host:
//! the reference numerics every float8 path (the CPU emulation, the CUDA cast kernels) is checked
//! against. `recipe` scales whole matrices and names each GEMM's operands, `mx` holds MXFP8's
//! blocks, and `kernels` runs the same arithmetic fast, in f32 bit operations, for the CPU's
//! emulated float8 GEMMs.
//!
//! A value is quantised as torchao's `to_fp8_saturated` does: multiplied by its scale in f32,
//! clamped to the format's ±max, then rounded to the nearest representable value, ties to even;
//! NaN stays NaN. A scale is `fp8_max / max(amax, 1e-12)`, computed in f64 and rounded to f32
//! (torchao's `amax_to_scale`); rowwise recipes round it down to a power of two.
//!
//! No crate provides the OCP FP8 formats with these exact semantics (`half` has none; `float8`
//! crates differ on saturation and NaN), and the rounding is a few lines of exact f64 arithmetic,
//! so it is written here.

mod codes;
mod kernels;
mod mx;
mod recipe;

pub use codes::{decode_codes, decode_words, encode_words, CODES_PER_WORD};
pub use kernels::{amaxes, fake_quantize_rows, mx_fake_quantize_rows, scales_from_amaxes};
pub use mx::{
    mx_quantize, MxBlockScale, MxBlocks, MxCast, MxQuantized, MxScaling, E8M0_BIAS, MX_BLOCK,
};
pub use recipe::{
    fake_quantize, ContractedDim, Float8Recipe, LinearGemm, OperandCast, Quantization, Quantized,
    ScaleAxis,
};

/// The smallest amax a scale is computed from (torchao's `EPS`): an all-zero tensor gets a large,
/// finite scale instead of infinity.
pub const AMAX_EPS: f64 = 1e-12;

/// An OCP FP8 format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinity, NaN = `S.1111.111`; max 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, infinities, NaN; max 57344.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    pub(super) fn mantissa_bits(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The exponent of the smallest normal value (below it the spacing stays that of subnormals).
    pub(super) fn min_normal_exponent(self) -> i32 {
        1 - self.bias()
    }

    /// `x` rounded to the nearest value of this format, ties to even, saturating at ±max; NaN
    /// stays NaN. The result is exactly representable in the format (and in f32).
    pub fn round(self, x: f32) -> f32 {
        if x.is_nan() || x == 0.0 {
            return x;
        }
        let a = f64::from(x.abs());
        let e = exponent_of(a).max(self.min_normal_exponent());
        let quantum = 2f64.powi(e - self.mantissa_bits());
        let rounded = ((a / quantum).round_ties_even() * quantum).min(f64::from(self.max()));
        (rounded as f32).copysign(x)
    }

    /// The 8-bit code of `x` rounded to this format (`round`).
    pub fn encode(self, x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return sign | 0x7f;
        }
        let a = f64::from(self.round(x).abs());
        if a == 0.0 {
            return sign;
        }
        let m = self.mantissa_bits();
        let e = exponent_of(a);
        let (exp_field, mantissa) = if e < self.min_normal_exponent() {
            (0, a / 2f64.powi(self.min_normal_exponent() - m))
        } else {
            (e + self.bias(), a / 2f64.powi(e - m) - 2f64.powi(m))
        };
        sign | ((exp_field as u8) << m) | mantissa as u8
    }

    /// The value of an 8-bit code.
    pub fn decode(self, code: u8) -> f32 {
        let m = self.mantissa_bits();
        let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp_field = i32::from((code & 0x7f) >> m);
        let mantissa = f64::from(code & ((1 << m) - 1));
        let all_ones = (1 << (7 - m)) - 1;
        match self {
            Fp8Format::E4M3 if exp_field == all_ones && mantissa == 7.0 => return f32::NAN,
            Fp8Format::E5M2 if exp_field == all_ones && mantissa == 0.0 => {
                return sign as f32 * f32::INFINITY
            }
            Fp8Format::E5M2 if exp_field == all_ones => return f32::NAN,
            _ => {}
        }
        let value = if exp_field == 0 {
            mantissa * 2f64.powi(self.min_normal_exponent() - m)
        } else {
            (1.0 + mantissa / 2f64.powi(m)) * 2f64.powi(exp_field - self.bias())
        };
        (sign * value) as f32
    }

    /// `x` quantised with `scale` (torchao's `to_fp8_saturated`): `x · scale` in f32, clamped to
    /// ±max, rounded. The fp8 value, held as f32.
    pub fn quantize(self, x: f32, scale: f32) -> f32 {
        let scaled = x * scale;
        if scaled.is_nan() {
            return scaled;
        }
        self.round(scaled.clamp(-self.max(), self.max()))
    }
}

/// The binary exponent of a positive, finite, normal f64 (`a = 1.m · 2^e`).
fn exponent_of(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023
}

/// torchao's `amax_to_scale`: `fp8_max / max(amax, 1e-12)` computed in f64, rounded to f32.
pub fn scale_from_amax(amax: f32, format: Fp8Format) -> f32 {
    (f64::from(format.max()) / f64::from(amax).max(AMAX_EPS)) as f32
}

/// A scale rounded down to a power of two (the rowwise recipes: the product of two such scales
/// is exact, and dividing by it only moves the exponent), as torchao computes it:
/// `exp2(floor(log2(scale)))` in f32. (Within an ulp of log2's rounding below a power of two this
/// rounds up to it, as torchao's does.)
pub fn round_scale_down_to_power_of_two(scale: f32) -> f32 {
    scale.log2().floor().exp2()
}

/// The largest magnitude of `values` (NaN if any is NaN, as `torch.amax` of `abs`).
pub fn amax(values: &[f32]) -> f32 {
    let mut m = 0f32;
    for &v in values {
        if v.is_nan() {
            return f32::NAN;
        }
        m = m.max(v.abs());
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// Every finite non-negative value of `f` with its code, ascending.
    fn table(f: Fp8Format) -> Vec<(f32, u8)> {
        let mut t: Vec<(f32, u8)> = (0u8..0x80)
            .map(|c| (f.decode(c), c))
            .filter(|(v, _)| v.is_finite())
            .collect();
        t.sort_by(|a, b| a.0.total_cmp(&b.0));
        t
    }

    /// The nearest table value to `a ≥ 0`, ties to the even code, saturating at max.
    fn nearest(t: &[(f32, u8)], a: f64) -> f32 {
        let mut best = t[0];
        for &(v, c) in t {
            let (d, bd) = ((f64::from(v) - a).abs(), (f64::from(best.0) - a).abs());
            if d < bd || (d == bd && c % 2 == 0 && best.1 % 2 == 1) {
                best = (v, c);
            }
        }
        best.0
    }

    #[test]
    fn the_formats_have_their_published_extremes() {
        let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
        assert_eq!(e4.decode(0x7e), 448.0);
        assert!(e4.decode(0x7f).is_nan());
        assert_eq!(e4.decode(0x01), 2f32.powi(-9));
        assert_eq!(e4.decode(0x08), 2f32.powi(-6));
        assert_eq!(e5.decode(0x7b), 57344.0);
        assert_eq!(e5.decode(0x7c), f32::INFINITY);
        assert!(e5.decode(0x7d).is_nan());
        assert_eq!(e5.decode(0x01), 2f32.powi(-16));
        assert_eq!(e5.decode(0xfb), -57344.0);
    }

    #[test]
    fn every_code_round_trips_and_values_ascend() {
        for f in FORMATS {
            let t = table(f);
            for w in t.windows(2) {
                assert!(w[0].0 < w[1].0, "{f:?}: {w:?}");
            }
            for &(v, c) in &t {
                assert_eq!(f.encode(v), c, "{f:?} {v}");
                assert_eq!(f.encode(-v), c | 0x80, "{f:?} -{v}");
                assert_eq!(f.round(v), v);
            }
        }
    }

    #[test]
    fn rounding_is_to_the_nearest_value_ties_to_even_and_saturates() {
        for f in FORMATS {
            let t = table(f);
            let mut probes: Vec<f64> = Vec::new();
            // Every midpoint (a tie), a hair either side of it, and a spread of values.
            for w in t.windows(2) {
                let mid = (f64::from(w[0].0) + f64::from(w[1].0)) / 2.0;
                probes.extend([mid, mid * (1.0 - 1e-6), mid * (1.0 + 1e-6)]);
            }
            let mut x = 1e-7f64;
            while x < 1e6 {
                probes.push(x);
                x *= 1.013;
            }
            for a in probes {
                let a32 = a as f32;
                let want = nearest(&t, f64::from(a32));
                assert_eq!(f.round(a32), want, "{f:?}: {a32}");
                assert_eq!(f.round(-a32), -want, "{f:?}: -{a32}");
            }
            assert_eq!(f.round(1e30), f.max());
            assert_eq!(f.quantize(1e30, 1.0), f.max());
            assert_eq!(f.quantize(-1e30, 1.0), -f.max());
            assert!(f.round(f32::NAN).is_nan() && f.quantize(f32::NAN, 2.0).is_nan());
        }
    }

    #[test]
    fn scales_follow_torchao() {
        let e4 = Fp8Format::E4M3;
        assert_eq!(scale_from_amax(2.0, e4), 224.0);
        assert_eq!(scale_from_amax(0.0, e4), (448.0 / 1e-12) as f32);
        assert_eq!(scale_from_amax(3.0, e4), (448f64 / 3.0) as f32);
        assert_eq!(round_scale_down_to_power_of_two(149.33), 128.0);
        assert_eq!(round_scale_down_to_power_of_two(128.0), 128.0);
        assert_eq!(round_scale_down_to_power_of_two(0.3), 0.25);
        assert_eq!(amax(&[1.0, -3.5, 2.0]), 3.5);
        assert!(amax(&[1.0, f32::NAN]).is_nan());
        // A quantised value dequantises to within half a step of the scaled input.
        let s = scale_from_amax(3.5, e4);
        let q = e4.quantize(-3.5, s);
        assert_eq!(q, -448.0);
        assert_eq!(q / s, -3.5);
    }

    #[test]
    fn rows_columns_and_tensors_get_the_scales_of_their_amaxes() {
        let (rows, cols) = (3, 4);
        let x: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.37).collect();
        for axis in [ScaleAxis::Tensor, ScaleAxis::Rows, ScaleAxis::Columns] {
            for pow2 in [false, true] {
                let q = Quantization {
                    format: Fp8Format::E4M3,
                    axis,
                    power_of_two_scales: pow2,
                };
                let got = q.quantize(&x, rows, cols);
                let amaxes: Vec<f32> = match axis {
                    ScaleAxis::Tensor => vec![amax(&x)],
                    ScaleAxis::Rows => (0..rows)
                        .map(|r| amax(&x[r * cols..(r + 1) * cols]))
                        .collect(),
                    ScaleAxis::Columns => (0..cols)
                        .map(|c| amax(&(0..rows).map(|r| x[r * cols + c]).collect::<Vec<_>>()))
                        .collect(),
                };
                let want: Vec<f32> = amaxes
                    .iter()
                    .map(|&a| {
                        let s = scale_from_amax(a, Fp8Format::E4M3);
                        if pow2 {
                            round_scale_down_to_power_of_two(s)
                        } else {
                            s
                        }
                    })
                    .collect();
                assert_eq!(got.scales, want, "{axis:?} pow2 {pow2}");
                // Every value is representable, within ±max, and dequantises to within one
                // e4m3 step (2^-3 relative) of the input.
                let back = got.dequantize(axis, cols);
                for ((&v, &q), &b) in x.iter().zip(&got.values).zip(&back) {
                    assert_eq!(Fp8Format::E4M3.round(q), q);
                    assert!(q.abs() <= 448.0);
                    assert!(
                        (b - v).abs() <= v.abs() / 8.0 + 1e-6,
                        "{axis:?}: {v} -> {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn mx_blocks_get_rceil_scales_and_refuse_ragged_rows() {
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.01).collect();
        x[40] = 1000.0;
        let q = mx_quantize(&x, 64).unwrap();
        // Block 0's amax is 0.315: descale 0.315/448 → ceil(log2) = -10 → byte 117.
        assert_eq!(q.scales, vec![117, 127 + 2]);
        // Within half a step of e4m3 (relative 2^-4, or half the smallest subnormal, 2^-10,
        // times the block's scale).
        let back = q.dequantize();
        for (i, (v, b)) in x.iter().zip(&back).enumerate() {
            let scale = 2f32.powi(i32::from(q.scales[i / MX_BLOCK]) - E8M0_BIAS);
            assert!(
                (v - b).abs() <= v.abs() / 16.0 + scale / 1024.0,
                "{v} -> {b}"
            );
        }
        assert!(mx_quantize(&x, 48).is_err());
        let zeros = mx_quantize(&[0.0; 32], 32).unwrap();
        assert_eq!(zeros.scales, vec![0]);
        let nan = mx_quantize(&[f32::NAN; 32], 32).unwrap();
        assert_eq!(nan.scales, vec![255]);
    }
}
