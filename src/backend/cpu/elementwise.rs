//! SwiGLU, residual adds and scaling: memory-bound loops split into fixed chunks across threads.

use rayon::prelude::*;

use super::fastmath;

const CHUNK: usize = 1 << 14;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + fastmath::exp(-x))
}

pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g * sigmoid(g) * u;
            }
        });
}

/// `d silu(g)/dg = σ(g)·(1 + g·(1 − σ(g)))`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let base = c * CHUNK;
            let n = dg.len();
            let (d, g, u) = (
                &dout[base..base + n],
                &gate[base..base + n],
                &up[base..base + n],
            );
            for i in 0..n {
                let s = sigmoid(g[i]);
                let silu = g[i] * s;
                du[i] = d[i] * silu;
                dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            }
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

pub fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK)
        .for_each(|b| b.iter_mut().for_each(|v| *v *= factor));
}

/// Sum of squares in f64: fixed chunks, partials added in order, whatever the thread count.
pub fn sum_squares(buf: &[f32]) -> f64 {
    let partials: Vec<f64> = buf
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>())
        .collect();
    partials.iter().sum()
}
