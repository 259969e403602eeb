//! SwiGLU, residual adds and scaling: memory-bound loops split into fixed chunks across threads.

use rayon::prelude::*;

use super::rows::{swiglu_backward_chunk, swiglu_forward_chunk};

const CHUNK: usize = 1 << 14;

pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| swiglu_forward_chunk(o, g, u));
}

pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let r = c * CHUNK..c * CHUNK + dg.len();
            swiglu_backward_chunk(dg, du, &dout[r.clone()], &gate[r.clone()], &up[r]);
        });
}

pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .zip(b.par_chunks(CHUNK))
        .for_each(|((o, a), b)| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| {
            for (a, x) in a.iter_mut().zip(x) {
                *a += x;
            }
        });
}

/// `half`'s conversion rounds to nearest even, like the CUDA kernel and PyTorch's `.to(bfloat16)`.
pub fn round_to_bf16(buf: &mut [f32]) {
    buf.par_chunks_mut(CHUNK).for_each(|b| {
        b.iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32())
    });
}

pub fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK)
        .for_each(|b| b.iter_mut().for_each(|v| *v *= factor));
}

/// Sum of squares in f64. The buffer is cut into `SUM_BLOCKS` fixed blocks whose partial sums land in a stack array, so
/// the order of additions never depends on the threads and nothing is allocated.
pub fn sum_squares(buf: &[f32]) -> f64 {
    const SUM_BLOCKS: usize = 64;
    let block = buf.len().div_ceil(SUM_BLOCKS).max(1);
    let mut partials = [0.0f64; SUM_BLOCKS];
    partials.par_iter_mut().enumerate().for_each(|(i, p)| {
        let lo = (i * block).min(buf.len());
        let hi = ((i + 1) * block).min(buf.len());
        *p = buf[lo..hi]
            .iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>();
    });
    partials.iter().sum()
}
