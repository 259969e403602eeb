//! Hugging Face MXFP4 releases (`quantization_config.quant_method = "mxfp4"`: gpt-oss's published
//! checkpoints): every block's fused expert weights stored as `{name}_blocks`, `[experts, rows,
//! cols/32, 16]` bytes, two FP4 (E2M1) codes each, the low nibble first, and `{name}_scales`,
//! `[experts, rows, cols/32]` bytes, one E8M0 exponent (bias 127) per 32 values. A value is
//! `e2m1(code) · 2^(scale − 127)`; the `[experts, rows, cols]` result is stored transposed, as
//! `{name}` `[experts, cols, rows]` (transformers' `convert_moe_packed_tensors`). Import
//! dequantises to f32 (titan trains in high precision, as with FP8 releases).

use anyhow::{bail, Result};

use crate::tensor::Tensor;

/// The names of a dequantised tensor's codes and scales.
pub fn parts(name: &str) -> (String, String) {
    (format!("{name}_blocks"), format!("{name}_scales"))
}

/// E2M1's sixteen values, by code (the sign in the top bit).
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The f32 values of `name` from its `blocks` and `scales` (each byte read as an f32 of that
/// value), `[experts, cols, rows]`, or an error naming the tensor when their shapes disagree.
pub fn dequantize(name: &str, blocks: &Tensor, scales: &Tensor) -> Result<(Vec<usize>, Vec<f32>)> {
    let (b, s) = (&blocks.shape, &scales.shape);
    let [experts, rows, groups, 16] = b[..] else {
        bail!("`{name}_blocks` has shape {b:?}; MXFP4 blocks are [experts, rows, groups, 16]");
    };
    if s[..] != [experts, rows, groups] {
        bail!(
            "`{name}_scales` has shape {s:?}; its blocks {b:?} need [{experts}, {rows}, {groups}]"
        );
    }
    let (codes, exps) = (blocks.to_f32_vec(), scales.to_f32_vec());
    let cols = groups * 32;
    let mut out = vec![0.0f32; experts * rows * cols];
    for (g, &e) in exps.iter().enumerate() {
        let scale = (2.0f32).powi(e as i32 - 127);
        let (expert, row, group) = (g / (rows * groups), (g / groups) % rows, g % groups);
        for (k, &byte) in codes[g * 16..(g + 1) * 16].iter().enumerate() {
            let byte = byte as u8;
            for (half, code) in [(0, byte & 0x0f), (1, byte >> 4)] {
                let col = group * 32 + 2 * k + half;
                // Stored transposed: [expert, col, row].
                out[(expert * cols + col) * rows + row] = E2M1[code as usize] * scale;
            }
        }
    }
    Ok((vec![experts, cols, rows], out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_exponents_decode_as_their_definition_and_are_transposed() {
        // One expert, 1 row, 32 columns: byte k holds columns 2k (low) and 2k+1 (high).
        let mut bytes = vec![0.0f32; 16];
        bytes[0] = (0x1 | (0x9 << 4)) as f32; // 0.5, -0.5
        bytes[15] = (0x7 | (0xf << 4)) as f32; // 6, -6
        let blocks = Tensor::from_f32(vec![1, 1, 1, 16], bytes);
        let scales = Tensor::from_f32(vec![1, 1, 1], vec![128.0]); // ×2
        let (shape, v) = dequantize("w", &blocks, &scales).unwrap();
        assert_eq!(shape, [1, 32, 1]);
        assert_eq!((v[0], v[1], v[30], v[31]), (1.0, -1.0, 12.0, -12.0));
        assert!(v[2..30].iter().all(|&x| x == 0.0));
        let bad = Tensor::from_f32(vec![1, 2, 1], vec![127.0; 2]);
        assert!(dequantize("w", &blocks, &bad)
            .unwrap_err()
            .to_string()
            .contains("w_scales"));
    }
}
