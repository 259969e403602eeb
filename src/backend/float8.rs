//! The float8 formats (OCP FP8 `e4m3fn` and `e5m2`) and torchao's dynamic scaling, on the host:
//! the reference numerics every float8 path (the CPU emulation, the CUDA cast kernels) is checked
//! against. Groundwork of issue 28: the converters and recipes that quantise linears with these
//! are not built yet.
//!
//! A value is quantised as torchao's `to_fp8_saturated` does: multiplied by its scale in f32,
//! clamped to the format's ±max, then rounded to the nearest representable value, ties to even;
//! NaN stays NaN. A scale is `fp8_max / max(amax, 1e-12)`, computed in f64 and rounded to f32
//! (torchao's `amax_to_scale`); rowwise recipes round it down to a power of two.
//!
//! No crate provides the OCP FP8 formats with these exact semantics (`half` has none; `float8`
//! crates differ on saturation and NaN), and the rounding is a few lines of exact f64 arithmetic,
//! so it is written here.

/// The smallest amax a scale is computed from (torchao's `EPS`): an all-zero tensor gets a large,
/// finite scale instead of infinity.
pub const AMAX_EPS: f64 = 1e-12;

/// An OCP FP8 format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

    fn mantissa_bits(self) -> i32 {
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
    fn min_normal_exponent(self) -> i32 {
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
        amaxes
            .into_iter()
            .map(|a| {
                let s = scale_from_amax(a, self.format);
                match self.power_of_two_scales {
                    true => round_scale_down_to_power_of_two(s),
                    false => s,
                }
            })
            .collect()
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

    /// How each operand of `gemm` is quantised (in the order the GEMM names them; None: high
    /// precision), each as stored: `X` `[M,K]`, `W` `[N,K]`, `G` `[M,N]`.
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
        }
    }
}

/// `x` (`[rows, cols]`) as a float8 GEMM of the emulated path reads it: quantised with `q`, then
/// dequantised (torchao's `mm_float8_emulated`: dequantise each operand, multiply in f32).
pub fn fake_quantize(x: &[f32], rows: usize, cols: usize, q: Quantization) -> Vec<f32> {
    q.quantize(x, rows, cols).dequantize(q.axis, cols)
}

/// Elements per MX block (OCP MX v1.0: one shared scale per 32 values).
pub const MX_BLOCK: usize = 32;
/// The bias of an E8M0 scale (its byte is the exponent plus this; 255 is NaN).
pub const E8M0_BIAS: i32 = 127;

/// An MXFP8 matrix: e4m3 values (held as f32) in blocks of `MX_BLOCK` along each row, and one
/// E8M0 scale byte per block (the block's values stand for `value · 2^(byte − 127)`).
#[derive(Debug, Clone, PartialEq)]
pub struct MxQuantized {
    pub values: Vec<f32>,
    pub scales: Vec<u8>,
}

/// `x` (`[rows, cols]`, `cols` a multiple of `MX_BLOCK`) in MXFP8 with RCEIL scales, as torchao's
/// `to_mx` with `ScaleCalculationMode.RCEIL`: per block, `descale = amax / 448` in f32, the scale
/// exponent `ceil(log2(descale))` clamped to ±127 (NaN: the NaN byte), the elements multiplied by
/// `2^(127 − byte)` (1 for byte 0), clamped to ±448 and rounded to e4m3.
pub fn mx_quantize(x: &[f32], cols: usize) -> anyhow::Result<MxQuantized> {
    if cols == 0 || !cols.is_multiple_of(MX_BLOCK) || !x.len().is_multiple_of(cols) {
        anyhow::bail!(
            "MXFP8: rows of {cols} values do not split into blocks of {MX_BLOCK} (a linear's features must be a multiple of {MX_BLOCK})"
        );
    }
    let max_pos = Fp8Format::E4M3.max();
    let mut values = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / MX_BLOCK);
    for block in x.chunks(MX_BLOCK) {
        let descale = amax(block) / max_pos;
        let byte = if descale.is_nan() {
            255u8
        } else {
            (descale
                .log2()
                .ceil()
                .clamp(-E8M0_BIAS as f32, E8M0_BIAS as f32) as i32
                + E8M0_BIAS) as u8
        };
        let multiplier = match byte {
            0 => 1.0,
            b => (E8M0_BIAS as f32 - f32::from(b)).exp2(),
        };
        scales.push(byte);
        values.extend(block.iter().map(|&v| {
            let scaled = v * multiplier;
            match scaled.is_nan() {
                true => scaled,
                false => Fp8Format::E4M3.round(scaled.clamp(-max_pos, max_pos)),
            }
        }));
    }
    Ok(MxQuantized { values, scales })
}

impl MxQuantized {
    /// The values this stands for: each element times its block's `2^(byte − 127)` (NaN for
    /// the NaN byte).
    pub fn dequantize(&self) -> Vec<f32> {
        self.values
            .chunks(MX_BLOCK)
            .zip(&self.scales)
            .flat_map(|(block, &byte)| {
                let scale = match byte {
                    255 => f32::NAN,
                    b => 2f64.powi(i32::from(b) - E8M0_BIAS) as f32,
                };
                block.iter().map(move |&v| v * scale)
            })
            .collect()
    }
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
