//! RMSNorm forward and backward (rows of `dim`, reciprocal RMS saved per row).

use rayon::prelude::*;

use super::rows::{rmsnorm_backward_row, rmsnorm_row};
use super::{SendPtr, COLUMN_BLOCK};

pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    weight: &[f32],
    dim: usize,
    eps: f32,
) {
    let rows = x.len() / dim;
    out[..rows * dim]
        .par_chunks_mut(dim)
        .zip(rstd[..rows].par_iter_mut())
        .zip(x.par_chunks(dim))
        .for_each(|((o, r), xr)| {
            *r = rmsnorm_row(o, xr, weight, eps);
        });
}

/// With `x̂ = x·rstd` and `g = dout·w`: `dx += rstd·(g − x̂·mean(g·x̂))`, `dw += Σ_rows dout·x̂`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    x: &[f32],
    weight: &[f32],
    rstd: &[f32],
    dim: usize,
) {
    let rows = x.len() / dim;
    dx[..rows * dim]
        .par_chunks_mut(dim)
        .enumerate()
        .for_each(|(r, dxr)| {
            let (xr, dy) = (&x[r * dim..(r + 1) * dim], &dout[r * dim..(r + 1) * dim]);
            rmsnorm_backward_row(dxr, dy, xr, weight, rstd[r]);
        });
    // Weight gradient: column blocks, rows summed in order (deterministic).
    let blocks = dim.div_ceil(COLUMN_BLOCK);
    let dw = SendPtr(dweight.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|blk| {
        let c0 = blk * COLUMN_BLOCK;
        let c1 = (c0 + COLUMN_BLOCK).min(dim);
        let mut acc = [0.0f32; COLUMN_BLOCK];
        for r in 0..rows {
            let rs = rstd[r];
            for (c, a) in (c0..c1).zip(acc.iter_mut()) {
                *a += dout[r * dim + c] * x[r * dim + c] * rs;
            }
        }
        // SAFETY: column blocks are disjoint across tasks.
        let dst = unsafe { std::slice::from_raw_parts_mut(dw.get().add(c0), c1 - c0) };
        for (d, a) in dst.iter_mut().zip(acc.iter()) {
            *d += a;
        }
    });
}
