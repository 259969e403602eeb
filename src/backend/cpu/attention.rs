//! Causal grouped-query attention in the flash-attention manner on the CPU.
//!
//! Work is cut into tiles of query rows × key positions, and every product inside a tile is a small
//! single-threaded GEMM on strided views of `q`, `k`, `v` (the `gemm` crate runs these near the
//! core's peak), so nothing is transposed or copied.
//!
//! Forward, per (batch, head, query tile): the tile walks its key tiles with an online softmax; only
//! a `FWD_Q_TILE × FWD_K_TILE` score block exists at a time, and each row's log-sum-exp is saved.
//! The block is key-major and the output accumulator row-minor, so the softmax and both GEMMs run
//! along query rows: with head_dim 16 (the debug model) the GEMM library would otherwise vectorise
//! over head_dim, one register wide (10–12% faster forward, measured with `bench train`).
//! Backward, per (batch, kv-head), FlashAttention-2 order: the outer loop takes a key tile, and every
//! block of later query rows of every head in the group recomputes its probabilities from the saved
//! log-sum-exp and adds its share to `dq`, `dk`, `dv`. Tasks own disjoint outputs and loop
//! in a fixed order, so results do not depend on the thread count.

use std::cell::RefCell;

use rayon::prelude::*;

use super::fastmath::dot;
use super::matmul::{gemm_block, Strided};
use super::rows::{attention_grad_row, online_softmax_tile_keys};
use super::SendPtr;
use crate::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape};

const K_TILE: usize = 128;
/// The backward takes long query blocks per key tile: fewer, longer GEMMs (dV and dK get k = 512).
const BWD_Q_TILE: usize = 512;
/// The forward uses wider key tiles: fewer online-softmax rescales (measured on the debug model).
const FWD_Q_TILE: usize = 128;
const FWD_K_TILE: usize = 256;

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

/// The call's lengths and mask fit its buffers.
fn check(x: &AttnInputs<'_, Vec<f32>>) {
    let s = x.shape;
    assert!(
        s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: {} heads not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    assert!(s.kv_len <= s.kv_capacity, "attention: bad lengths {s:?}");
    assert!(x.q.len() >= s.batch * s.q_len * s.n_heads * s.head_dim);
    assert!(x.k.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
    assert!(x.v.len() >= s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim);
    if let Some(p) = x.mask.positions {
        let queries = s.batch * s.q_len;
        assert!(
            p.len() >= queries,
            "attention: {} document positions for {queries} queries",
            p.len()
        );
    }
    assert!(x.mask.window != Some(0), "attention: a window of 0 keys");
}

/// How many leading keys of the tile from `j0` (`width` wide) lie at or before the causal limit of
/// the query `row` rows after position `first_pos`.
#[inline(always)]
fn visible(first_pos: usize, row: usize, j0: usize, width: usize) -> usize {
    (first_pos + row + 1).saturating_sub(j0).min(width)
}

/// The queries of sequence `b` from `i0` on, before the first whose first visible key
/// (`AttnMask::first_key`) lies after `key`: those that may see `key`, since first keys never move
/// back from query to query. Every query up to `q_len` without a document mask or window.
fn queries_seeing(mask: &AttnMask, s: &AttnShape, b: usize, i0: usize, key: usize) -> usize {
    if mask.is_causal() {
        return s.q_len;
    }
    let (mut lo, mut hi) = (i0, s.q_len);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if mask.first_key(s, b, mid) <= key {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

pub fn attention_forward(out: &mut [f32], lse: &mut [f32], x: AttnInputs<'_, Vec<f32>>) {
    check(&x);
    let AttnInputs {
        q,
        k,
        v,
        shape: s,
        mask,
    } = x;
    let hd = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (q_rs, kv_rs) = (s.n_heads * hd, s.n_kv_heads * hd);
    let out_ptr = SendPtr(out.as_mut_ptr());
    let lse_ptr = SendPtr(lse.as_mut_ptr());
    let q_tiles = s.q_len.div_ceil(FWD_Q_TILE);
    (0..s.batch * s.n_heads * q_tiles)
        .into_par_iter()
        .for_each(|task| {
            let (bh, qt) = (task / q_tiles, task % q_tiles);
            let (b, h) = (bh / s.n_heads, bh % s.n_heads);
            let kvh = h / group;
            let i0 = qt * FWD_Q_TILE;
            let rows = FWD_Q_TILE.min(s.q_len - i0);
            let first_pos = s.q_offset + i0;
            with_scratch(
                FWD_K_TILE * FWD_Q_TILE + FWD_Q_TILE * hd + 3 * FWD_Q_TILE,
                |scratch| {
                    // Key-major scores (`st[j·rows + r]`) and a row-major-transposed accumulator
                    // (`acc[d·rows + r]`): both GEMMs and the softmax then run along query rows,
                    // which keeps them vectorised when head_dim is short.
                    let (st, rest) = scratch.split_at_mut(FWD_K_TILE * FWD_Q_TILE);
                    let (acc, rest) = rest.split_at_mut(FWD_Q_TILE * hd);
                    let (row_max, rest) = rest.split_at_mut(FWD_Q_TILE);
                    let (row_sum, correction) = rest.split_at_mut(FWD_Q_TILE);
                    acc[..rows * hd].fill(0.0);
                    row_max.fill(f32::NEG_INFINITY);
                    row_sum.fill(0.0);
                    let (mut from, mut until) = ([0usize; FWD_K_TILE], [0usize; FWD_K_TILE]);
                    let q_blk = q[((b * s.q_len + i0) * s.n_heads + h) * hd..].as_ptr();
                    // Keys from the first row's first visible one up to the last row's position,
                    // of those there are: tiles wholly masked for every row are never computed.
                    let key_end = (first_pos + rows).min(s.kv_len);
                    let key_begin = mask.first_key(&s, b, i0).min(key_end);
                    for j0 in (key_begin..key_end).step_by(FWD_K_TILE) {
                        let width = FWD_K_TILE.min(key_end - j0);
                        let kv_off = ((b * s.kv_capacity + j0) * s.n_kv_heads + kvh) * hd;
                        // SAFETY: the views stay inside q/k/v (checked shapes); st is local scratch.
                        unsafe {
                            gemm_block(
                                st.as_mut_ptr(),
                                Strided::rows(rows),
                                k[kv_off..].as_ptr(),
                                Strided::rows(kv_rs),
                                q_blk,
                                Strided::transposed(q_rs),
                                width,
                                hd,
                                rows,
                                false,
                            )
                        };
                        // Key j0 + j is visible to the rows at positions from it on, before the
                        // first row whose document (or window) starts after it.
                        let mut seen = 0;
                        for (j, (f, u)) in from.iter_mut().zip(&mut until).take(width).enumerate() {
                            *f = (j0 + j).saturating_sub(first_pos);
                            while seen < rows && mask.first_key(&s, b, i0 + seen) <= j0 + j {
                                seen += 1;
                            }
                            *u = seen;
                        }
                        let (from, until) = (&from[..width], &until[..width]);
                        online_softmax_tile_keys(
                            st, rows, width, from, until, scale, row_max, row_sum, correction,
                        );
                        for col in acc[..rows * hd].chunks_exact_mut(rows) {
                            for (a, c) in col.iter_mut().zip(&correction[..rows]) {
                                *a *= c;
                            }
                        }
                        // SAFETY: as above.
                        unsafe {
                            gemm_block(
                                acc.as_mut_ptr(),
                                Strided::transposed(rows),
                                st.as_ptr(),
                                Strided::transposed(rows),
                                v[kv_off..].as_ptr(),
                                Strided::rows(kv_rs),
                                rows,
                                width,
                                hd,
                                true,
                            )
                        };
                    }
                    for r in 0..rows {
                        // A row that saw no key of this call: output 0, log-sum-exp −∞.
                        let inv = if row_sum[r] > 0.0 {
                            1.0 / row_sum[r]
                        } else {
                            0.0
                        };
                        let i = i0 + r;
                        // SAFETY: (b, h, query tile) rows of `out` and `lse` belong to this task alone.
                        unsafe {
                            let o = std::slice::from_raw_parts_mut(
                                out_ptr.get().add(((b * s.q_len + i) * s.n_heads + h) * hd),
                                hd,
                            );
                            for (d, o) in o.iter_mut().enumerate() {
                                *o = acc[d * rows + r] * inv;
                            }
                            *lse_ptr.get().add((b * s.n_heads + h) * s.q_len + i) =
                                row_max[r] + row_sum[r].ln();
                        }
                    }
                },
            );
        });
}

pub fn attention_backward(
    grads: AttnGrads<'_, Vec<f32>>,
    dout: &[f32],
    x: AttnInputs<'_, Vec<f32>>,
    saved: AttnSaved<'_, Vec<f32>>,
) {
    check(&x);
    let AttnGrads { dq, dk, dv } = grads;
    let AttnInputs {
        q,
        k,
        v,
        shape: s,
        mask,
    } = x;
    let AttnSaved { out, lse } = saved;
    assert!(
        s.kv_capacity == s.kv_len,
        "attention backward expects keys without spare capacity, got {s:?}"
    );
    let (hd, seq, keys) = (s.head_dim, s.q_len, s.kv_len);
    let group = s.n_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (q_rs, kv_rs) = (s.n_heads * hd, s.n_kv_heads * hd);
    // Every gradient is summed into: dQ over key tiles, dK and dV over query tiles and heads.
    dq[..s.batch * seq * q_rs].fill(0.0);
    dk[..s.batch * keys * kv_rs].fill(0.0);
    dv[..s.batch * keys * kv_rs].fill(0.0);
    let (dq_ptr, dk_ptr, dv_ptr) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    (0..s.batch * s.n_kv_heads)
        .into_par_iter()
        .for_each(|task| {
            let (b, kvh) = (task / s.n_kv_heads, task % s.n_kv_heads);
            let heads = kvh * group..(kvh + 1) * group;
            let q_at = |i: usize, h: usize| ((b * seq + i) * s.n_heads + h) * hd;
            let kv_at = |j: usize| ((b * keys + j) * s.n_kv_heads + kvh) * hd;
            with_scratch(2 * BWD_Q_TILE * K_TILE + group * seq, |scratch| {
                let (p, rest) = scratch.split_at_mut(BWD_Q_TILE * K_TILE);
                let (ds, delta) = rest.split_at_mut(BWD_Q_TILE * K_TILE);
                // SAFETY (all raw accesses below): dq rows of the group's heads and dk/dv rows of this kv
                // head belong to this task; every strided view stays inside its buffer.
                for (g, h) in heads.clone().enumerate() {
                    for i in 0..seq {
                        let row = q_at(i, h)..q_at(i, h) + hd;
                        delta[g * seq + i] = dot(&dout[row.clone()], &out[row]);
                    }
                }
                for j0 in (0..keys).step_by(K_TILE) {
                    let width = K_TILE.min(keys - j0);
                    let (k_blk, v_blk) = (k[kv_at(j0)..].as_ptr(), v[kv_at(j0)..].as_ptr());
                    let (dk_blk, dv_blk) =
                        unsafe { (dk_ptr.get().add(kv_at(j0)), dv_ptr.get().add(kv_at(j0))) };
                    // The queries that see at least one key of this tile.
                    let i_begin = j0.saturating_sub(s.q_offset).min(seq);
                    let i_end = queries_seeing(&mask, &s, b, i_begin, j0 + width - 1);
                    for (g, h) in heads.clone().enumerate() {
                        for i0 in (i_begin..i_end).step_by(BWD_Q_TILE) {
                            let rows = BWD_Q_TILE.min(i_end - i0);
                            let (q_blk, do_blk) =
                                (q[q_at(i0, h)..].as_ptr(), dout[q_at(i0, h)..].as_ptr());
                            unsafe {
                                gemm_block(
                                    p.as_mut_ptr(),
                                    Strided::rows(K_TILE),
                                    q_blk,
                                    Strided::rows(q_rs),
                                    k_blk,
                                    Strided::transposed(kv_rs),
                                    rows,
                                    hd,
                                    width,
                                    false,
                                );
                                gemm_block(
                                    ds.as_mut_ptr(),
                                    Strided::rows(K_TILE),
                                    do_blk,
                                    Strided::rows(q_rs),
                                    v_blk,
                                    Strided::transposed(kv_rs),
                                    rows,
                                    hd,
                                    width,
                                    false,
                                );
                            }
                            for r in 0..rows {
                                let n = visible(s.q_offset + i0, r, j0, width);
                                let from = mask.first_key(&s, b, i0 + r).saturating_sub(j0).min(n);
                                let (pr, dsr) = (
                                    &mut p[r * K_TILE..r * K_TILE + width],
                                    &mut ds[r * K_TILE..r * K_TILE + width],
                                );
                                let (row_lse, row_delta) = (
                                    lse[(b * s.n_heads + h) * seq + i0 + r],
                                    delta[g * seq + i0 + r],
                                );
                                attention_grad_row(pr, dsr, from..n, scale, row_lse, row_delta);
                            }
                            unsafe {
                                // dV += Pᵀ·dO, dK += dSᵀ·Q, dQ += dS·K
                                gemm_block(
                                    dv_blk,
                                    Strided::rows(kv_rs),
                                    p.as_ptr(),
                                    Strided::transposed(K_TILE),
                                    do_blk,
                                    Strided::rows(q_rs),
                                    width,
                                    rows,
                                    hd,
                                    true,
                                );
                                gemm_block(
                                    dk_blk,
                                    Strided::rows(kv_rs),
                                    ds.as_ptr(),
                                    Strided::transposed(K_TILE),
                                    q_blk,
                                    Strided::rows(q_rs),
                                    width,
                                    rows,
                                    hd,
                                    true,
                                );
                                gemm_block(
                                    dq_ptr.get().add(q_at(i0, h)),
                                    Strided::rows(q_rs),
                                    ds.as_ptr(),
                                    Strided::rows(K_TILE),
                                    k_blk,
                                    Strided::rows(kv_rs),
                                    rows,
                                    width,
                                    hd,
                                    true,
                                );
                            }
                        }
                    }
                }
            });
        });
}

/// `out`/`lse` ← their log-sum-exp merge with `part_out`/`part_lse` (`Backend::attention_merge`).
pub fn attention_merge(
    out: &mut [f32],
    lse: &mut [f32],
    part_out: &[f32],
    part_lse: &[f32],
    s: AttnShape,
) {
    let (hd, heads, q_len) = (s.head_dim, s.n_heads, s.q_len);
    assert!(out.len() >= s.batch * q_len * heads * hd && part_out.len() >= out.len());
    assert!(lse.len() >= s.batch * heads * q_len && part_lse.len() >= lse.len());
    out[..s.batch * q_len * heads * hd]
        .par_chunks_mut(q_len * heads * hd)
        .zip(lse.par_chunks_mut(heads * q_len))
        .enumerate()
        .for_each(|(b, (out, lse))| {
            for i in 0..q_len {
                for h in 0..heads {
                    let at = h * q_len + i;
                    let (mine, theirs) = (lse[at], part_lse[b * heads * q_len + at]);
                    let merged = log_add_exp(mine, theirs);
                    let (keep, take) = ((mine - merged).exp(), (theirs - merged).exp());
                    let row = (i * heads + h) * hd;
                    let part = &part_out[b * q_len * heads * hd + row..][..hd];
                    for (o, p) in out[row..row + hd].iter_mut().zip(part) {
                        *o = *o * keep + p * take;
                    }
                    lse[at] = merged;
                }
            }
        });
}

/// `log(e^a + e^b)` without overflow; `a` = −∞ gives `b`.
#[inline]
fn log_add_exp(a: f32, b: f32) -> f32 {
    a.max(b) + (-(a - b).abs()).exp().ln_1p()
}

/// Attention sinks folded into a finished attention (`Backend::attention_sinks_forward`).
pub fn attention_sinks_forward(out: &mut [f32], lse: &mut [f32], sinks: &[f32], s: AttnShape) {
    let (hd, heads, q_len) = (s.head_dim, s.n_heads, s.q_len);
    assert!(out.len() >= s.batch * q_len * heads * hd && lse.len() >= s.batch * heads * q_len);
    assert!(sinks.len() >= heads);
    out[..s.batch * q_len * heads * hd]
        .par_chunks_mut(q_len * heads * hd)
        .zip(lse.par_chunks_mut(heads * q_len))
        .for_each(|(out, lse)| {
            for i in 0..q_len {
                for (h, &sink) in sinks[..heads].iter().enumerate() {
                    let at = h * q_len + i;
                    // A query that saw no key (lse −∞) keeps its zero output: lse' is the sink's.
                    let mine = lse[at];
                    let merged = log_add_exp(mine, sink);
                    let keep = (mine - merged).exp();
                    let row = (i * heads + h) * hd;
                    out[row..row + hd].iter_mut().for_each(|o| *o *= keep);
                    lse[at] = merged;
                }
            }
        });
}

/// The sinks' gradient, added into `dsinks` (`Backend::attention_sinks_backward`).
pub fn attention_sinks_backward(
    dsinks: &mut [f32],
    dout: &[f32],
    saved: AttnSaved<'_, Vec<f32>>,
    sinks: &[f32],
    s: AttnShape,
) {
    let (hd, heads, q_len) = (s.head_dim, s.n_heads, s.q_len);
    let (out, lse) = (saved.out, saved.lse);
    assert!(
        out.len() >= s.batch * q_len * heads * hd && dout.len() >= s.batch * q_len * heads * hd
    );
    assert!(lse.len() >= s.batch * heads * q_len && sinks.len() >= heads && dsinks.len() >= heads);
    // Per head, in f64 over every row of the call: a sum of b·q_len terms.
    let per_head: Vec<f64> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let mut sum = 0.0f64;
            for b in 0..s.batch {
                for i in 0..q_len {
                    let row = ((b * q_len + i) * heads + h) * hd;
                    let dot: f32 = dout[row..row + hd]
                        .iter()
                        .zip(&out[row..row + hd])
                        .map(|(g, o)| g * o)
                        .sum();
                    let p_sink = (sinks[h] - lse[(b * heads + h) * q_len + i]).exp();
                    sum += (p_sink * dot) as f64;
                }
            }
            sum
        })
        .collect();
    for (d, g) in dsinks[..heads].iter_mut().zip(per_head) {
        *d -= g as f32;
    }
}
