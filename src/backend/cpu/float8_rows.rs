//! The CPU's float8 casts for emulated float8 GEMMs: `float8::amaxes` and
//! `float8::fake_quantize_rows` split into blocks of rows across threads. Every value is computed
//! by the same per-element arithmetic as the single-threaded reference, so the thread count
//! changes no number.

use rayon::prelude::*;

use crate::backend::float8::{self, MxCast, Quantization, ScaleAxis};

/// Values per block of rows a thread takes (at least one row).
const BLOCK_VALUES: usize = 1 << 15;

fn rows_per_block(cols: usize) -> usize {
    (BLOCK_VALUES / cols.max(1)).max(1)
}

/// `float8::amaxes`, blocks of rows in parallel (a maximum is exact in any order).
pub fn amaxes(x: &[f32], rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
    let per = rows_per_block(cols);
    if rows <= per {
        return float8::amaxes(x, rows, cols, axis);
    }
    let blocks: Vec<Vec<f32>> = x
        .par_chunks(per * cols)
        .map(|b| float8::amaxes(b, b.len() / cols, cols, axis))
        .collect();
    match axis {
        ScaleAxis::Rows => blocks.concat(),
        ScaleAxis::Tensor | ScaleAxis::Columns => {
            let width = blocks[0].len();
            let joined = blocks.concat();
            float8::amaxes(&joined, joined.len() / width, width, ScaleAxis::Columns)
        }
    }
}

/// `x` (`[rows, cols]`) fake-quantised with `q` and the scales of `amaxes`, blocks of rows in
/// parallel.
pub fn fake_quantized(x: &[f32], cols: usize, q: Quantization, amaxes: &[f32]) -> Vec<f32> {
    let scales = float8::scales_from_amaxes(amaxes, q);
    let per = rows_per_block(cols);
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(per * cols)
        .zip(x.par_chunks(per * cols))
        .enumerate()
        .for_each(|(b, (o, xb))| float8::fake_quantize_rows(o, xb, cols, b * per, &scales, q));
    out
}

/// `x` (`[rows, cols]`) cast to MXFP8 as `cast` says, groups of 32 rows in parallel (a block
/// never crosses a group: along rows it lies in one row, down columns in one group).
pub fn mx_fake_quantized(x: &[f32], cols: usize, cast: MxCast) -> Vec<f32> {
    let per = float8::MX_BLOCK * (BLOCK_VALUES / (float8::MX_BLOCK * cols.max(1))).max(1);
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(per * cols)
        .zip(x.par_chunks(per * cols))
        .for_each(|(o, xb)| float8::mx_fake_quantize_rows(o, xb, cols, cast));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::float8::{fake_quantize, Fp8Format};

    #[test]
    fn threaded_casts_equal_the_reference() {
        let (rows, cols) = (3000, 48);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1009) as f32 - 500.0) * 1e-3 * (1 + i % 13) as f32)
            .collect();
        for axis in [ScaleAxis::Tensor, ScaleAxis::Rows, ScaleAxis::Columns] {
            let q = Quantization {
                format: Fp8Format::E4M3,
                axis,
                power_of_two_scales: true,
            };
            let a = amaxes(&x, rows, cols, axis);
            assert_eq!(a, float8::amaxes(&x, rows, cols, axis), "{axis:?}");
            assert_eq!(
                fake_quantized(&x, cols, q, &a),
                fake_quantize(&x, rows, cols, q)
            );
        }
    }
}
