//! MXFP8 (OCP MX v1.0): e4m3 elements in blocks of 32 sharing one E8M0 scale, with torchao's
//! RCEIL scale rounding.

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
