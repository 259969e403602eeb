//! Causal grouped-query attention in the flash-attention manner on the CPU.
//!
//! Forward: for each (batch, head) a block of query rows walks key tiles with an online softmax, so
//! only a `[rows, tile]` score block exists at a time; the log-sum-exp of every row is saved.
//! Backward: for each (batch, kv-head) the probabilities are recomputed from `q`, `k` and the saved
//! log-sum-exp, one query row at a time, and `dq`, `dk`, `dv` are accumulated; tasks own disjoint
//! outputs, so the result does not depend on the thread count.
//!
//! Keys are transposed per head into `[head_dim, kv_len]` scratch so that score rows are computed
//! as axpys over contiguous key positions, which the compiler vectorises.

use std::cell::RefCell;

use rayon::prelude::*;

use super::{fastmath, SendPtr};
use crate::backend::AttnShape;

const ROW_BLOCK: usize = 16;
const KEY_TILE: usize = 128;

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
    assert!(
        s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: {} heads not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    assert!(
        s.q_offset + s.q_len <= s.kv_len && s.kv_len <= s.kv_capacity,
        "attention: bad lengths {s:?}"
    );
    assert!(q.len() >= s.batch * s.q_len * s.n_heads * s.head_dim);
    assert!(k.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
    assert!(v.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
}

pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
) {
    check(s, q, k, v);
    let hd = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    let lse_ptr = SendPtr(lse.as_mut_ptr());
    (0..s.batch * s.n_heads).into_par_iter().for_each(|task| {
        let (b, h) = (task / s.n_heads, task % s.n_heads);
        let kvh = h / group;
        let scratch_len = hd * s.kv_len + ROW_BLOCK * (KEY_TILE + hd + 2);
        with_scratch(scratch_len, |scratch| {
            let (kt, rest) = scratch.split_at_mut(hd * s.kv_len);
            let (scores, rest) = rest.split_at_mut(ROW_BLOCK * KEY_TILE);
            let (acc, rest) = rest.split_at_mut(ROW_BLOCK * hd);
            let (row_max, row_sum) = rest.split_at_mut(ROW_BLOCK);
            transpose_head(kt, k, s, b, kvh);
            for i0 in (0..s.q_len).step_by(ROW_BLOCK) {
                let rows = ROW_BLOCK.min(s.q_len - i0);
                acc[..rows * hd].fill(0.0);
                row_max[..rows].fill(f32::NEG_INFINITY);
                row_sum[..rows].fill(0.0);
                let last_pos = s.q_offset + i0 + rows - 1;
                for j0 in (0..=last_pos).step_by(KEY_TILE) {
                    for r in 0..rows {
                        let pos = s.q_offset + i0 + r;
                        if j0 > pos {
                            continue;
                        }
                        let width = KEY_TILE.min(pos + 1 - j0);
                        let qrow = &q[((b * s.q_len + i0 + r) * s.n_heads + h) * hd..][..hd];
                        let sc = &mut scores[r * KEY_TILE..r * KEY_TILE + width];
                        sc.fill(0.0);
                        for (d, &qd) in qrow.iter().enumerate() {
                            let qd = qd * scale;
                            let krow = &kt[d * s.kv_len + j0..][..width];
                            for (x, &kv) in sc.iter_mut().zip(krow) {
                                *x += qd * kv;
                            }
                        }
                        let tile_max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let new_max = row_max[r].max(tile_max);
                        let correction = if row_max[r] == f32::NEG_INFINITY {
                            0.0
                        } else {
                            fastmath::exp(row_max[r] - new_max)
                        };
                        row_max[r] = new_max;
                        let mut tile_sum = 0.0f32;
                        for x in sc.iter_mut() {
                            *x = fastmath::exp(*x - new_max);
                            tile_sum += *x;
                        }
                        row_sum[r] = row_sum[r] * correction + tile_sum;
                        let a = &mut acc[r * hd..(r + 1) * hd];
                        if correction != 1.0 {
                            a.iter_mut().for_each(|x| *x *= correction);
                        }
                        for (c, &p) in sc.iter().enumerate() {
                            let vrow = &v
                                [((b * s.kv_capacity + j0 + c) * s.n_kv_heads + kvh) * hd..][..hd];
                            for (x, &vv) in a.iter_mut().zip(vrow) {
                                *x += p * vv;
                            }
                        }
                    }
                }
                for r in 0..rows {
                    let inv = 1.0 / row_sum[r];
                    let i = i0 + r;
                    // SAFETY: (b, h) rows of `out` and `lse` belong to this task alone.
                    unsafe {
                        let o = std::slice::from_raw_parts_mut(
                            out_ptr.get().add(((b * s.q_len + i) * s.n_heads + h) * hd),
                            hd,
                        );
                        for (o, &a) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                            *o = a * inv;
                        }
                        *lse_ptr.get().add((b * s.n_heads + h) * s.q_len + i) =
                            row_max[r] + row_sum[r].ln();
                    }
                }
            }
        });
    });
}

#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    s: AttnShape,
) {
    check(s, q, k, v);
    assert!(
        s.q_offset == 0 && s.kv_len == s.q_len && s.kv_capacity == s.q_len,
        "attention backward expects the training shape, got {s:?}"
    );
    let hd = s.head_dim;
    let seq = s.q_len;
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    (0..s.batch * s.n_kv_heads)
        .into_par_iter()
        .for_each(|task| {
            let (b, kvh) = (task / s.n_kv_heads, task % s.n_kv_heads);
            let kv_row = |j: usize| ((b * seq + j) * s.n_kv_heads + kvh) * hd;
            // SAFETY: the (b, kvh) rows of dk/dv and the (b, h in group) rows of dq belong to this task.
            let dk_row = |j: usize| unsafe {
                std::slice::from_raw_parts_mut(dk_ptr.get().add(kv_row(j)), hd)
            };
            let dv_row = |j: usize| unsafe {
                std::slice::from_raw_parts_mut(dv_ptr.get().add(kv_row(j)), hd)
            };
            for j in 0..seq {
                dk_row(j).fill(0.0);
                dv_row(j).fill(0.0);
            }
            with_scratch(2 * hd * seq + 2 * seq, |scratch| {
                let (kt, rest) = scratch.split_at_mut(hd * seq);
                let (vt, rest) = rest.split_at_mut(hd * seq);
                let (p, dp) = rest.split_at_mut(seq);
                transpose_head(kt, k, s, b, kvh);
                transpose_head(vt, v, s, b, kvh);
                for h in kvh * group..(kvh + 1) * group {
                    for i in 0..seq {
                        let qi = ((b * seq + i) * s.n_heads + h) * hd;
                        let (qrow, dorow, orow) =
                            (&q[qi..qi + hd], &dout[qi..qi + hd], &out[qi..qi + hd]);
                        let row_lse = lse[(b * s.n_heads + h) * seq + i];
                        let delta: f32 = dorow.iter().zip(orow).map(|(a, b)| a * b).sum();
                        let n = i + 1;
                        let (p, dp) = (&mut p[..n], &mut dp[..n]);
                        p.fill(0.0);
                        dp.fill(0.0);
                        for d in 0..hd {
                            let (qd, dod) = (qrow[d] * scale, dorow[d]);
                            let (krow, vrow) =
                                (&kt[d * seq..d * seq + n], &vt[d * seq..d * seq + n]);
                            for j in 0..n {
                                p[j] += qd * krow[j];
                                dp[j] += dod * vrow[j];
                            }
                        }
                        for j in 0..n {
                            p[j] = fastmath::exp(p[j] - row_lse);
                            // dS = P ∘ (dP − δ), already multiplied by the softmax scale.
                            dp[j] = p[j] * (dp[j] - delta) * scale;
                        }
                        // SAFETY: see above.
                        let dqrow =
                            unsafe { std::slice::from_raw_parts_mut(dq_ptr.get().add(qi), hd) };
                        dqrow.fill(0.0);
                        for j in 0..n {
                            let (pj, dsj) = (p[j], dp[j]);
                            let kr = &k[kv_row(j)..kv_row(j) + hd];
                            let (dkr, dvr) = (dk_row(j), dv_row(j));
                            for d in 0..hd {
                                dqrow[d] += dsj * kr[d];
                                dkr[d] += dsj * qrow[d];
                                dvr[d] += pj * dorow[d];
                            }
                        }
                    }
                }
            });
        });
}
