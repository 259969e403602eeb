//! Per-row loops shared by the fused kernels (softmax pieces, SwiGLU, AdamW, RMSNorm), each compiled
//! for AVX2 and AVX-512 (see `simd`).

use super::fastmath::{dot, dot3, exp, max, sum};
use super::simd::multiversion;

multiversion! {
    /// One key tile of the online softmax in key-major layout: `st[j·rows + r]` holds the raw score
    /// of key `j` for query row `r`, and key `j` is visible to rows `from[j] <= r < until[j]` (at most 256
    /// rows). Scores become `exp(score·scale − new_max)` (0 where hidden), the running max and sum
    /// are updated, and `correction[r]` receives the factor for earlier accumulations. Every loop
    /// runs over rows, so it vectorises across queries.
    pub fn online_softmax_tile_keys(st: &mut [f32], rows: usize, width: usize, from: &[usize], until: &[usize], scale: f32, row_max: &mut [f32], row_sum: &mut [f32], correction: &mut [f32]) {
        let (row_max, row_sum, correction) = (&mut row_max[..rows], &mut row_sum[..rows], &mut correction[..rows]);
        let mut tile_max = [f32::NEG_INFINITY; 256];
        let tile_max = &mut tile_max[..rows];
        for j in 0..width {
            let col = &st[j * rows..(j + 1) * rows];
            for r in from[j]..until[j].min(rows) {
                tile_max[r] = tile_max[r].max(col[r]);
            }
        }
        for r in 0..rows {
            let new_max = row_max[r].max(tile_max[r] * scale);
            correction[r] = if row_max[r] == f32::NEG_INFINITY { 0.0 } else { exp(row_max[r] - new_max) };
            row_max[r] = new_max;
            row_sum[r] *= correction[r];
        }
        for j in 0..width {
            let col = &mut st[j * rows..(j + 1) * rows];
            let f = from[j].min(rows);
            let u = until[j].clamp(f, rows);
            col[..f].fill(0.0);
            for r in f..u {
                let p = exp(col[r] * scale - row_max[r]);
                col[r] = p;
                row_sum[r] += p;
            }
            col[u..rows].fill(0.0);
        }
    }
}

multiversion! {
    /// Attention backward for one row of a tile: `p = exp(s·scale − lse)`, `ds = p·(dp − δ)·scale` on the
    /// visible entries (`p` holds raw scores and `ds` holds `dP` on entry); the rest are zeroed.
    pub fn attention_grad_row(p: &mut [f32], ds: &mut [f32], visible: std::ops::Range<usize>, scale: f32, lse: f32, delta: f32) {
        let (from, n) = (visible.start, visible.end);
        for (pj, dsj) in p[from..n].iter_mut().zip(ds[from..n].iter_mut()) {
            *pj = exp(*pj * scale - lse);
            *dsj = *pj * (*dsj - delta) * scale;
        }
        p[..from].fill(0.0);
        ds[..from].fill(0.0);
        p[n..].fill(0.0);
        ds[n..].fill(0.0);
    }
}

multiversion! {
    /// Cross-entropy of one row of logits against `target`; with `grad_scale` non-zero the row is
    /// replaced by `grad_scale · (softmax − onehot)`.
    pub fn cross_entropy_row(row: &mut [f32], target: usize, grad_scale: f32, want_grad: bool) -> f32 {
        let m = max(row);
        let target_logit = row[target];
        for x in row.iter_mut() {
            *x = exp(*x - m);
        }
        let z = sum(row);
        if want_grad {
            let inv = grad_scale / z;
            row.iter_mut().for_each(|x| *x *= inv);
            row[target] -= grad_scale;
        }
        m + z.ln() - target_logit
    }
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

multiversion! {
    pub fn swiglu_forward_chunk(out: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    }
}

multiversion! {
    /// `d silu(g)/dg = σ(g)·(1 + g·(1 − σ(g)))`.
    pub fn swiglu_backward_chunk(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
        let n = dgate.len();
        let (dup, dout, gate, up) = (&mut dup[..n], &dout[..n], &gate[..n], &up[..n]);
        for i in 0..n {
            let s = sigmoid(gate[i]);
            dup[i] = dout[i] * gate[i] * s;
            dgate[i] = dout[i] * up[i] * s * (1.0 + gate[i] * (1.0 - s));
        }
    }
}

multiversion! {
    pub fn adamw_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], b1: f32, b2: f32, eps: f32, step_size: f32, bias2_sqrt: f32, decay_l2: (f32, f32), grad_scale: f32) {
        let (decay, l2) = decay_l2;
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let mut gi = g[i] * grad_scale;
            if l2 != 0.0 {
                gi = l2.mul_add(p[i], gi); // Adam's L2 term
            }
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let denom = v[i].sqrt() / bias2_sqrt + eps;
            p[i] = p[i] * decay - step_size * m[i] / denom;
        }
    }
}

multiversion! {
    /// RMSNorm of one row; returns `1/rms`.
    pub fn rmsnorm_row(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) -> f32 {
        let rs = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
        for ((o, &xv), &w) in out.iter_mut().zip(x).zip(weight) {
            *o = xv * rs * w;
        }
        rs
    }
}

multiversion! {
    /// Adds the input gradient of one RMSNorm row into `dx`.
    pub fn rmsnorm_backward_row(dx: &mut [f32], dout: &[f32], x: &[f32], weight: &[f32], rstd: f32) {
        let n = dx.len();
        let (dout, x, weight) = (&dout[..n], &x[..n], &weight[..n]);
        let mean = dot3(dout, weight, x) * rstd / n as f32;
        for i in 0..n {
            dx[i] += rstd * (dout[i] * weight[i] - x[i] * rstd * mean);
        }
    }
}
