//! Causal grouped-query attention in the flash-attention manner on the CPU.
//!
//! Keys and values of a head are transposed into `[head_dim, seq]` scratch, so every inner loop runs
//! along key positions: contiguous, vectorised, and independent of the head size.
//!
//! Forward, per (batch, head): blocks of query rows walk key tiles with an online softmax, so only a
//! `[rows, tile]` score block exists at a time; each row's log-sum-exp is saved.
//! Backward, per (batch, kv-head), FlashAttention-2 order: the outer loop takes a tile of keys, whose
//! `kᵀ`, `vᵀ`, `dkᵀ`, `dvᵀ` stay in L1 while every later query row of every head in the group
//! recomputes its probabilities from the saved log-sum-exp and adds its share to `dq`, `dk`, `dv`.
//! Tasks own disjoint outputs and loops run in a fixed order, so results do not depend on threads.

use std::cell::RefCell;

use rayon::prelude::*;

use super::fastmath::{axpy, dot, exp, max, sum};
use super::SendPtr;
use crate::backend::AttnShape;

const ROW_BLOCK: usize = 16;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a thread-local scratch slice of `len` floats (grown once, reused afterwards).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
}

/// Key positions per tile: the four `[head_dim, tile]` blocks of the backward fit in ~32 KiB of L1.
fn key_tile(head_dim: usize) -> usize {
    (2048 / head_dim).clamp(16, 128)
}

/// Copies rows `0..s.kv_len` of one kv head of `src` into `dst` as `[head_dim, kv_len]`.
fn transpose_head(dst: &mut [f32], src: &[f32], s: AttnShape, b: usize, kvh: usize) {
    let hd = s.head_dim;
    for j in 0..s.kv_len {
        let row = &src[((b * s.kv_capacity + j) * s.n_kv_heads + kvh) * hd..][..hd];
        for (d, &v) in row.iter().enumerate() {
            dst[d * s.kv_len + j] = v;
        }
    }
}

fn check(s: AttnShape, q: &[f32], k: &[f32], v: &[f32]) {
    assert!(s.n_heads.is_multiple_of(s.n_kv_heads), "attention: {} heads not a multiple of {} kv heads", s.n_heads, s.n_kv_heads);
    assert!(s.q_offset + s.q_len <= s.kv_len && s.kv_len <= s.kv_capacity, "attention: bad lengths {s:?}");
    assert!(q.len() >= s.batch * s.q_len * s.n_heads * s.head_dim);
    assert!(k.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
    assert!(v.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
}

pub fn attention_forward(out: &mut [f32], lse: &mut [f32], q: &[f32], k: &[f32], v: &[f32], s: AttnShape) {
    check(s, q, k, v);
    let (hd, kv_len) = (s.head_dim, s.kv_len);
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let tile = key_tile(hd);
    let out_ptr = SendPtr(out.as_mut_ptr());
    let lse_ptr = SendPtr(lse.as_mut_ptr());
    (0..s.batch * s.n_heads).into_par_iter().for_each(|task| {
        let (b, h) = (task / s.n_heads, task % s.n_heads);
        let kvh = h / group;
        with_scratch(2 * hd * kv_len + ROW_BLOCK * (tile + 2 * hd + 2), |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * kv_len);
            let (vt, rest) = rest.split_at_mut(hd * kv_len);
            let (scores, rest) = rest.split_at_mut(ROW_BLOCK * tile);
            let (qs, rest) = rest.split_at_mut(ROW_BLOCK * hd);
            let (acc, rest) = rest.split_at_mut(ROW_BLOCK * hd);
            let (row_max, row_sum) = rest.split_at_mut(ROW_BLOCK);
            transpose_head(kt, k, s, b, kvh);
            transpose_head(vt, v, s, b, kvh);
            for i0 in (0..s.q_len).step_by(ROW_BLOCK) {
                let rows = ROW_BLOCK.min(s.q_len - i0);
                for r in 0..rows {
                    let qrow = &q[((b * s.q_len + i0 + r) * s.n_heads + h) * hd..][..hd];
                    for (x, &y) in qs[r * hd..(r + 1) * hd].iter_mut().zip(qrow) {
                        *x = y * scale;
                    }
                }
                acc[..rows * hd].fill(0.0);
                row_max[..rows].fill(f32::NEG_INFINITY);
                row_sum[..rows].fill(0.0);
                let last_pos = s.q_offset + i0 + rows - 1;
                for j0 in (0..=last_pos).step_by(tile) {
                    for r in 0..rows {
                        let pos = s.q_offset + i0 + r;
                        if j0 > pos {
                            continue;
                        }
                        let width = tile.min(pos + 1 - j0);
                        let sc = &mut scores[r * tile..r * tile + width];
                        sc.fill(0.0);
                        for (d, &qd) in qs[r * hd..(r + 1) * hd].iter().enumerate() {
                            axpy(sc, qd, &kt[d * kv_len + j0..][..width]);
                        }
                        let new_max = row_max[r].max(max(sc));
                        let correction = if row_max[r] == f32::NEG_INFINITY { 0.0 } else { exp(row_max[r] - new_max) };
                        row_max[r] = new_max;
                        for x in sc.iter_mut() {
                            *x = exp(*x - new_max);
                        }
                        row_sum[r] = row_sum[r] * correction + sum(sc);
                        for (d, a) in acc[r * hd..(r + 1) * hd].iter_mut().enumerate() {
                            *a = *a * correction + dot(sc, &vt[d * kv_len + j0..][..width]);
                        }
                    }
                }
                for r in 0..rows {
                    let inv = 1.0 / row_sum[r];
                    let i = i0 + r;
                    // SAFETY: (b, h) rows of `out` and `lse` belong to this task alone.
                    unsafe {
                        let o = std::slice::from_raw_parts_mut(out_ptr.get().add(((b * s.q_len + i) * s.n_heads + h) * hd), hd);
                        for (o, &a) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                            *o = a * inv;
                        }
                        *lse_ptr.get().add((b * s.n_heads + h) * s.q_len + i) = row_max[r] + row_sum[r].ln();
                    }
                }
            }
        });
    });
}

#[allow(clippy::too_many_arguments)]
pub fn attention_backward(dq: &mut [f32], dk: &mut [f32], dv: &mut [f32], dout: &[f32], q: &[f32], k: &[f32], v: &[f32], out: &[f32], lse: &[f32], s: AttnShape) {
    check(s, q, k, v);
    assert!(s.q_offset == 0 && s.kv_len == s.q_len && s.kv_capacity == s.q_len, "attention backward expects the training shape, got {s:?}");
    let (hd, seq) = (s.head_dim, s.q_len);
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let tile = key_tile(hd);
    let (dq_ptr, dk_ptr, dv_ptr) = (SendPtr(dq.as_mut_ptr()), SendPtr(dk.as_mut_ptr()), SendPtr(dv.as_mut_ptr()));
    (0..s.batch * s.n_kv_heads).into_par_iter().for_each(|task| {
        let (b, kvh) = (task / s.n_kv_heads, task % s.n_kv_heads);
        let heads = kvh * group..(kvh + 1) * group;
        let row_of = |i: usize, h: usize| ((b * seq + i) * s.n_heads + h) * hd;
        // Per query row of the group: q·scale, dO, and δ = dO·O.
        let per_row = group * seq;
        with_scratch(2 * hd * seq + 2 * hd * tile + 2 * per_row * hd + per_row + 2 * tile, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * seq);
            let (vt, rest) = rest.split_at_mut(hd * seq);
            let (dkt, rest) = rest.split_at_mut(hd * tile);
            let (dvt, rest) = rest.split_at_mut(hd * tile);
            let (qs, rest) = rest.split_at_mut(per_row * hd);
            let (dos, rest) = rest.split_at_mut(per_row * hd);
            let (delta, rest) = rest.split_at_mut(per_row);
            let (p, ds) = rest.split_at_mut(tile);
            transpose_head(kt, k, s, b, kvh);
            transpose_head(vt, v, s, b, kvh);
            for (g, h) in heads.clone().enumerate() {
                for i in 0..seq {
                    let (x, o) = (row_of(i, h), g * seq + i);
                    for (dst, &src) in qs[o * hd..(o + 1) * hd].iter_mut().zip(&q[x..x + hd]) {
                        *dst = src * scale;
                    }
                    dos[o * hd..(o + 1) * hd].copy_from_slice(&dout[x..x + hd]);
                    delta[o] = dot(&dout[x..x + hd], &out[x..x + hd]);
                    // SAFETY: dq rows of the heads in this group belong to this task.
                    unsafe { std::slice::from_raw_parts_mut(dq_ptr.get().add(x), hd) }.fill(0.0);
                }
            }
            for j0 in (0..seq).step_by(tile) {
                let width = tile.min(seq - j0);
                dkt.fill(0.0);
                dvt.fill(0.0);
                for (g, h) in heads.clone().enumerate() {
                    for i in j0..seq {
                        let o = g * seq + i;
                        let n = width.min(i + 1 - j0);
                        let (qi, doi) = (&qs[o * hd..(o + 1) * hd], &dos[o * hd..(o + 1) * hd]);
                        let (p, ds) = (&mut p[..n], &mut ds[..n]);
                        p.fill(0.0);
                        ds.fill(0.0);
                        for d in 0..hd {
                            axpy(p, qi[d], &kt[d * seq + j0..][..n]);
                            axpy(ds, doi[d], &vt[d * seq + j0..][..n]);
                        }
                        let (row_lse, row_delta) = (lse[(b * s.n_heads + h) * seq + i], delta[o]);
                        for (pj, dsj) in p.iter_mut().zip(ds.iter_mut()) {
                            *pj = exp(*pj - row_lse);
                            // dS = P ∘ (dP − δ), times the softmax scale.
                            *dsj = *pj * (*dsj - row_delta) * scale;
                        }
                        // SAFETY: see above.
                        let dqi = unsafe { std::slice::from_raw_parts_mut(dq_ptr.get().add(row_of(i, h)), hd) };
                        for d in 0..hd {
                            axpy(&mut dvt[d * tile..d * tile + n], doi[d], p);
                            axpy(&mut dkt[d * tile..d * tile + n], qi[d] / scale, ds);
                            dqi[d] += dot(ds, &kt[d * seq + j0..][..n]);
                        }
                    }
                }
                for c in 0..width {
                    let at = ((b * seq + j0 + c) * s.n_kv_heads + kvh) * hd;
                    // SAFETY: (b, kvh) rows of dk and dv belong to this task.
                    let (dkr, dvr) = unsafe { (std::slice::from_raw_parts_mut(dk_ptr.get().add(at), hd), std::slice::from_raw_parts_mut(dv_ptr.get().add(at), hd)) };
                    for d in 0..hd {
                        dkr[d] = dkt[d * tile + c];
                        dvr[d] = dvt[d * tile + c];
                    }
                }
            }
        });
    });
}
