//! MXFP8 (OCP MX v1.0): e4m3 elements in blocks of 32 sharing one E8M0 scale, with torchao's
//! scale roundings (RCEIL, FLOOR): the scales of a block, and a matrix quantised along its rows.

use super::{amax, Fp8Format};

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
        let byte = rceil_byte(amax(block));
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

/// How an MX block's E8M0 scale comes from its amax (torchao's `ScaleCalculationMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MxScaling {
    /// The amax's power of two less e4m3's (`2^8`): the block's largest values may saturate at
    /// 448 (torchao's default, TorchTitan's `mxfp8_cublas`).
    Floor,
    /// `ceil(log2(amax / 448))`: no value saturates (`mxfp8_cublas_rceil`).
    Rceil,
}

/// Which way an operand's blocks of 32 run: along each row (its contraction runs over columns)
/// or down each column (over rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MxBlocks {
    AlongRows,
    DownColumns,
}

/// How an operand is cast to MXFP8: e4m3 elements, blocks of 32 running as `blocks`, E8M0 scales
/// from `scaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MxCast {
    pub blocks: MxBlocks,
    pub scaling: MxScaling,
}

/// One block's scale: its E8M0 byte, the factor its values are multiplied by before the e4m3
/// cast, and the factor a cast value is multiplied by to stand for the original
/// (`2^(byte − 127)`, NaN for the NaN byte 255).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MxBlockScale {
    pub byte: u8,
    pub multiplier: f32,
    pub dequantize: f32,
}

impl MxScaling {
    /// The scale of a block whose largest magnitude is `amax`, as torchao's `to_mx` computes it.
    pub fn block_scale(self, amax: f32) -> MxBlockScale {
        let byte = match self {
            MxScaling::Rceil => rceil_byte(amax),
            MxScaling::Floor => floor_byte(amax),
        };
        let multiplier = match (self, byte) {
            (_, 255) => f32::NAN,
            (MxScaling::Rceil, 0) => 1.0,
            // torchao divides by `2^(byte − 127)` clamped to f32's smallest normal.
            (MxScaling::Floor, 0) => pow2(126),
            (_, b) => pow2(E8M0_BIAS - i32::from(b)),
        };
        let dequantize = match byte {
            255 => f32::NAN,
            b => pow2(i32::from(b) - E8M0_BIAS),
        };
        MxBlockScale {
            byte,
            multiplier,
            dequantize,
        }
    }
}

/// `2^e` as an f32, built from its bits (exact; `e` in `[-149, 127]`: below -126 a subnormal).
fn pow2(e: i32) -> f32 {
    debug_assert!((-149..=127).contains(&e), "2^{e} is not a finite f32");
    match e >= -126 {
        true => f32::from_bits(((e + 127) as u32) << 23),
        false => f32::from_bits(1u32 << (e + 149)),
    }
}

/// RCEIL: `descale = amax / 448` in f32, the byte `clamp(ceil(log2(descale)), ±127) + 127`;
/// NaN: 255. The exponent is computed exactly from the bits (`ceil_log2`), as the hardware's
/// round-up conversion to E8M0 does; `ceilf(log2f(descale))`, torchao's emulation, differs only
/// for a descale a few ulps above a power of two, where `log2f` rounds down to the integer.
fn rceil_byte(amax: f32) -> u8 {
    let descale = amax / Fp8Format::E4M3.max();
    let exponent = match descale {
        d if d.is_nan() => return 255,
        0.0 => -E8M0_BIAS,
        d if d.is_infinite() => E8M0_BIAS,
        d => ceil_log2(d),
    };
    (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS) as u8
}

/// `ceil(log2(x))` of a positive finite f32, exactly: its exponent, one more unless `x` is a
/// power of two (subnormals included).
pub(super) fn ceil_log2(x: f32) -> i32 {
    let bits = x.to_bits();
    let (field, mantissa) = (((bits >> 23) & 0xff) as i32, bits & 0x7f_ffff);
    if field == 0 {
        // x = mantissa · 2^-149.
        let floor = 31 - mantissa.leading_zeros() as i32;
        return floor - 149 + !mantissa.is_power_of_two() as i32;
    }
    field - 127 + (mantissa != 0) as i32
}

/// FLOOR: the amax's f32 exponent less 8 (e4m3's largest power of two), clamped to
/// `[-127, 128]`, plus 127; NaN: 255.
fn floor_byte(amax: f32) -> u8 {
    if amax.is_nan() {
        return 255;
    }
    let exponent = ((amax.to_bits() >> 23) & 0xff) as i32 - E8M0_BIAS;
    ((exponent - 8).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rceil_exponent_is_the_exact_ceiling_of_log2() {
        let mut values = vec![
            f32::from_bits(1),
            f32::from_bits(3),
            f32::MIN_POSITIVE,
            1.0,
            3.0,
        ];
        for e in -149..=127 {
            let p = pow2(e);
            values.extend([
                p,
                f32::from_bits(p.to_bits() + 1),
                f32::from_bits(p.to_bits() + 2),
            ]);
            values.push(f32::from_bits(p.to_bits() - 1));
        }
        for x in values.into_iter().filter(|x| *x > 0.0 && x.is_finite()) {
            assert_eq!(ceil_log2(x), f64::from(x).log2().ceil() as i32, "{x:e}");
        }
        // Just above a power of two, where f32's log2 rounds down to the integer.
        let above = f32::from_bits(16.0f32.to_bits() + 1);
        assert_eq!(ceil_log2(above), 5);
    }

    #[test]
    fn powers_of_two_from_bits_are_exact_down_to_subnormals() {
        for e in -149..=127 {
            assert_eq!(f64::from(pow2(e)), 2f64.powi(e), "2^{e}");
        }
    }
}
