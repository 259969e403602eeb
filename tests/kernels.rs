//! Every CPU kernel against an f64 reference: forwards agree to f32 precision, and each backward
//! agrees with central finite differences of the f64 reference forward.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan::backend::cpu::rope::{rope_tables, Llama3Scaling, RopeScaling, YarnScaling};
use titan::backend::cpu::CpuBackend;
use titan::backend::{AdamWStep, AttnShape, Backend, WeightDecay, IGNORE_INDEX};
use titan::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved};
use titan::backend::{GemmOutput, GemmShape, RopeShape};

fn rand_vec(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n)
        .map(|_| (rng.gen::<f64>() * 2.0 - 1.0) * scale)
        .collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Inputs rounded to f32 so that the f32 kernel and the f64 reference see the same values.
fn rounded(v: Vec<f64>) -> Vec<f64> {
    v.into_iter().map(|x| x as f32 as f64).collect()
}

fn assert_close(name: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{name}[{i}]: got {g}, want {w} (err {err:e})"
        );
        assert!(g.is_finite(), "{name}[{i}] is not finite");
    }
}

/// Checks `analytic` (∂f/∂x from the kernel) against central differences of `f` at `x`.
fn fd_check(name: &str, x: &[f64], f: impl Fn(&[f64]) -> f64, analytic: &[f32]) {
    let h = 1e-6;
    let mut xp = x.to_vec();
    let mut max_err = 0.0f64;
    let scale = analytic.iter().map(|g| g.abs() as f64).fold(1e-3, f64::max);
    for i in 0..x.len() {
        xp[i] = x[i] + h;
        let up = f(&xp);
        xp[i] = x[i] - h;
        let down = f(&xp);
        xp[i] = x[i];
        let numeric = (up - down) / (2.0 * h);
        let err = (numeric - analytic[i] as f64).abs() / scale;
        max_err = max_err.max(err);
        assert!(
            err < 2e-4,
            "{name}: d/dx[{i}] analytic {} vs numeric {numeric} (err {err:e} of max |g| {scale:e})",
            analytic[i]
        );
    }
    assert!(
        analytic.iter().any(|&g| g != 0.0),
        "{name}: gradient is identically zero"
    );
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

// ---------------------------------------------------------------------------- references (f64)

fn ref_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|p| {
                    (if ta { a[p * m + i] } else { a[i * k + p] })
                        * (if tb { b[j * k + p] } else { b[p * n + j] })
                })
                .sum();
        }
    }
    out
}

fn ref_rmsnorm(x: &[f64], w: &[f64], dim: usize, eps: f64) -> Vec<f64> {
    x.chunks(dim)
        .flat_map(|r| {
            let rs = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / dim as f64 + eps).sqrt();
            r.iter()
                .zip(w)
                .map(move |(v, w)| v * rs * w)
                .collect::<Vec<_>>()
        })
        .collect()
}

fn ref_rope(
    x: &[f64],
    seq: usize,
    heads: usize,
    hd: usize,
    theta: f64,
    scaling: Option<RopeScaling>,
    offset: usize,
) -> Vec<f64> {
    let inv = titan::backend::cpu::rope::inverse_frequencies(hd, theta, scaling);
    let magnitude = scaling.map_or(1.0, |s| s.attention_factor());
    let mut out = x.to_vec();
    for (t, row) in out.chunks_mut(heads * hd).enumerate() {
        let pos = (offset + t % seq) as f64;
        for head in row.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let (c, s) = (
                    (pos * inv[i]).cos() * magnitude,
                    (pos * inv[i]).sin() * magnitude,
                );
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }
    out
}

/// Attention as its definition: query `i` over keys `first_key(i) ..= q_offset + i` (of those
/// there are); a query that sees none gets zeros.
fn ref_masked_attention(q: &[f64], k: &[f64], v: &[f64], s: AttnShape, mask: AttnMask) -> Vec<f64> {
    ref_attention(q, k, v, s, mask, None)
}

/// `ref_masked_attention`, with attention sinks when given: head `h`'s softmax over its scores
/// and `sinks[h]`, whose value is zero (HF gpt-oss's `eager_attention_forward`).
fn ref_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    s: AttnShape,
    mask: AttnMask,
    sinks: Option<&[f64]>,
) -> Vec<f64> {
    let hd = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let mut out = vec![0.0; s.batch * s.q_len * s.n_heads * hd];
    for b in 0..s.batch {
        for h in 0..s.n_heads {
            let kvh = h / group;
            for i in 0..s.q_len {
                let qi = &q[((b * s.q_len + i) * s.n_heads + h) * hd..][..hd];
                let pos = s.q_offset + i;
                let first = mask.first_key(&s, b, i);
                let scores: Vec<f64> = (first..=pos.min(s.kv_len - 1))
                    .map(|j| {
                        dot(
                            qi,
                            &k[((b * s.kv_capacity + j) * s.n_kv_heads + kvh) * hd..][..hd],
                        ) / (hd as f64).sqrt()
                    })
                    .collect();
                let sink = sinks.map(|sinks| sinks[h]);
                let m = scores
                    .iter()
                    .chain(&sink)
                    .cloned()
                    .fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().chain(&sink).map(|x| (x - m).exp()).sum();
                let o = &mut out[((b * s.q_len + i) * s.n_heads + h) * hd..][..hd];
                for (j, sc) in (first..).zip(&scores) {
                    let p = (sc - m).exp() / z;
                    for d in 0..hd {
                        o[d] += p * v[((b * s.kv_capacity + j) * s.n_kv_heads + kvh) * hd + d];
                    }
                }
            }
        }
    }
    out
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn ref_cross_entropy(h: &[f64], w: &[f64], targets: &[u32], dim: usize, vocab: usize) -> f64 {
    let logits = ref_matmul(h, w, targets.len(), dim, vocab, false, true);
    let mut total = 0.0;
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_INDEX {
            continue;
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        total += lse - row[t as usize];
    }
    total
}

// ---------------------------------------------------------------------------- tests

#[test]
fn matmul_all_transpose_combinations() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for &(m, k, n) in &[(3, 5, 4), (67, 45, 81), (1, 256, 300)] {
        for ta in [false, true] {
            for tb in [false, true] {
                let a = rounded(rand_vec(&mut rng, m * k, 1.0));
                let b = rounded(rand_vec(&mut rng, k * n, 1.0));
                let c0 = rounded(rand_vec(&mut rng, m * n, 1.0));
                let want = ref_matmul(&a, &b, m, k, n, ta, tb);
                let mut out = f32s(&c0);
                be.matmul(
                    &mut out,
                    &f32s(&a),
                    &f32s(&b),
                    GemmShape {
                        m,
                        k,
                        n,
                        trans_a: ta,
                        trans_b: tb,
                    },
                    GemmOutput::Overwrite,
                );
                assert_close("matmul", &out, &want, 1e-5, 1e-5);
                let mut acc = f32s(&c0);
                be.matmul(
                    &mut acc,
                    &f32s(&a),
                    &f32s(&b),
                    GemmShape {
                        m,
                        k,
                        n,
                        trans_a: ta,
                        trans_b: tb,
                    },
                    GemmOutput::Accumulate,
                );
                let want_acc: Vec<f64> = want.iter().zip(&c0).map(|(x, y)| x + y).collect();
                assert_close("matmul accumulate", &acc, &want_acc, 1e-5, 1e-5);
            }
        }
    }
}

#[test]
fn embedding_forward_and_backward() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (vocab, dim) = (7, 70);
    let table = rounded(rand_vec(&mut rng, vocab * dim, 1.0));
    let ids = vec![3u32, 0, 3, 6, 3];
    let mut out = vec![0.0; ids.len() * dim];
    be.embedding_forward(&mut out, &f32s(&table), &ids, dim);
    let want: Vec<f64> = ids
        .iter()
        .flat_map(|&i| table[i as usize * dim..(i as usize + 1) * dim].to_vec())
        .collect();
    assert_close("embedding", &out, &want, 0.0, 0.0);
    let r = rounded(rand_vec(&mut rng, ids.len() * dim, 1.0));
    let mut dtable = vec![0.0; vocab * dim];
    be.embedding_backward(&mut dtable, &f32s(&r), &ids, dim);
    fd_check(
        "embedding dtable",
        &table,
        |t| {
            dot(
                &ids.iter()
                    .flat_map(|&i| t[i as usize * dim..(i as usize + 1) * dim].to_vec())
                    .collect::<Vec<_>>(),
                &r,
            )
        },
        &dtable,
    );
}

#[test]
fn rmsnorm_forward_and_backward() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, dim, eps) = (5, 70, 1e-5);
    let x = rounded(rand_vec(&mut rng, rows * dim, 2.0));
    let w = rounded(rand_vec(&mut rng, dim, 1.5));
    let r = rounded(rand_vec(&mut rng, rows * dim, 1.0));
    let (mut out, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows]);
    be.rmsnorm_forward(&mut out, &mut rstd, &f32s(&x), &f32s(&w), dim, eps as f32);
    assert_close("rmsnorm", &out, &ref_rmsnorm(&x, &w, dim, eps), 1e-5, 1e-6);
    let (mut dx, mut dw) = (vec![0.0; rows * dim], vec![0.0; dim]);
    be.rmsnorm_backward(
        &mut dx,
        &mut dw,
        &f32s(&r),
        &f32s(&x),
        &f32s(&w),
        &rstd,
        dim,
    );
    fd_check(
        "rmsnorm dx",
        &x,
        |x| dot(&ref_rmsnorm(x, &w, dim, eps), &r),
        &dx,
    );
    fd_check(
        "rmsnorm dw",
        &w,
        |w| dot(&ref_rmsnorm(&x, w, dim, eps), &r),
        &dw,
    );
}

#[test]
fn rope_forward_and_backward_with_llama31_and_yarn_scaling() {
    let llama3 = RopeScaling::Llama3(Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    });
    // YaRN with its attention factor (0.1·ln 4 + 1) on every cos and sin.
    let yarn = RopeScaling::Yarn(YarnScaling {
        factor: 4.0,
        original_max_position_embeddings: 16,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
    });
    rope_matches_reference(Some(llama3));
    rope_matches_reference(Some(yarn));
}

fn rope_matches_reference(scaling: Option<RopeScaling>) {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (batch, seq, heads, hd, theta) = (2, 9, 3, 16, 10000.0);
    let (cos, sin) = rope_tables(hd, 64, theta, scaling);
    let x = rounded(rand_vec(&mut rng, batch * seq * heads * hd, 1.0));
    let mut y = f32s(&x);
    be.rope_forward(&mut y, &cos, &sin, RopeShape::new(batch, seq, heads, hd));
    assert_close(
        "rope",
        &y,
        &ref_rope(&x, seq, heads, hd, theta, scaling, 0),
        1e-5,
        1e-6,
    );
    let mut y_off = f32s(&x[..seq * heads * hd]);
    be.rope_forward(
        &mut y_off,
        &cos,
        &sin,
        RopeShape::new(1, seq, heads, hd).at(5),
    );
    assert_close(
        "rope offset",
        &y_off,
        &ref_rope(&x[..seq * heads * hd], seq, heads, hd, theta, scaling, 5),
        1e-5,
        1e-6,
    );
    let r = rounded(rand_vec(&mut rng, x.len(), 1.0));
    let mut dx = f32s(&r);
    be.rope_backward(&mut dx, &cos, &sin, RopeShape::new(batch, seq, heads, hd));
    fd_check(
        "rope dx",
        &x,
        |x| dot(&ref_rope(x, seq, heads, hd, theta, scaling, 0), &r),
        &dx,
    );
}

#[test]
fn llama31_scaling_changes_only_low_frequencies() {
    let scaling = RopeScaling::Llama3(Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    });
    let plain = titan::backend::cpu::rope::inverse_frequencies(128, 500000.0, None);
    let scaled = titan::backend::cpu::rope::inverse_frequencies(128, 500000.0, Some(scaling));
    assert_eq!(plain[0], scaled[0]);
    assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-15);
}

fn attention_case(s: AttnShape, seed: u64) {
    masked_attention_case(s, AttnMask::CAUSAL, seed)
}

fn masked_attention_case(s: AttnShape, mask: AttnMask, seed: u64) {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let q = rounded(rand_vec(
        &mut rng,
        s.batch * s.q_len * s.n_heads * s.head_dim,
        1.5,
    ));
    let k = rounded(rand_vec(
        &mut rng,
        s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim,
        1.5,
    ));
    let v = rounded(rand_vec(
        &mut rng,
        s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim,
        1.0,
    ));
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; s.batch * s.n_heads * s.q_len];
    let (qf, kf, vf) = (f32s(&q), f32s(&k), f32s(&v));
    let x = AttnInputs {
        mask,
        ..AttnInputs::causal(&qf, &kf, &vf, s)
    };
    be.attention_forward(&mut out, &mut lse, x);
    let reference = |q: &[f64], k: &[f64], v: &[f64]| ref_masked_attention(q, k, v, s, mask);
    assert_close("attention", &out, &reference(&q, &k, &v), 1e-5, 2e-6);
    if s.kv_capacity != s.kv_len {
        return;
    }
    let r = rounded(rand_vec(&mut rng, q.len(), 1.0));
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let grads = AttnGrads {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
    };
    let saved = AttnSaved {
        out: &out,
        lse: &lse,
    };
    be.attention_backward(grads, &f32s(&r), x, saved);
    fd_check("attention dq", &q, |q| dot(&reference(q, &k, &v), &r), &dq);
    fd_check("attention dk", &k, |k| dot(&reference(&q, k, &v), &r), &dk);
    fd_check("attention dv", &v, |v| dot(&reference(&q, &k, v), &r), &dv);
}

/// Each query's position in its document for sequences cut into documents of `lengths` (one
/// list per sequence).
fn positions_of(lengths: &[&[usize]]) -> Vec<u32> {
    lengths
        .iter()
        .flat_map(|row| row.iter().flat_map(|&n| 0..n as u32))
        .collect()
}

#[test]
fn block_causal_attention_sees_only_each_querys_document() {
    // Two sequences of 9: documents 3 + 4 + 2 and 1 + 8.
    let positions = positions_of(&[&[3, 4, 2], &[1, 8]]);
    let mask = AttnMask {
        positions: Some(&positions),
        window: None,
    };
    masked_attention_case(AttnShape::causal(2, 9, 4, 2, 4), mask, 21);
}

#[test]
fn block_causal_attention_across_tiles_skips_and_masks_exactly() {
    // 300 positions: documents straddling the key tiles' borders (128, 256), a one-token
    // document, and a long last one.
    let positions = positions_of(&[&[100, 1, 60, 139]]);
    let mask = AttnMask {
        positions: Some(&positions),
        window: None,
    };
    masked_attention_case(AttnShape::causal(1, 300, 2, 1, 4), mask, 22);
}

/// gpt-oss's attention sinks: a learned logit per head joins each softmax with a zero value. The
/// forward (attention, then the sinks folded in) against the definition; the backward (the plain
/// attention backward on the forward's results, and the sinks' own gradient) against finite
/// differences of it, causal and with documents and a sliding window.
#[test]
fn attention_sinks_join_each_softmax_forward_and_backward() {
    let s = AttnShape::causal(2, 13, 4, 2, 8);
    let positions = positions_of(&[&[5, 8], &[13]]);
    let windowed = AttnMask {
        positions: Some(&positions),
        window: Some(4),
    };
    for (seed, mask) in [(41, AttnMask::CAUSAL), (42, windowed)] {
        let be = CpuBackend::new();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n_q = s.batch * s.q_len * s.n_heads * s.head_dim;
        let n_kv = s.batch * s.kv_len * s.n_kv_heads * s.head_dim;
        let q = rounded(rand_vec(&mut rng, n_q, 1.5));
        let k = rounded(rand_vec(&mut rng, n_kv, 1.5));
        let v = rounded(rand_vec(&mut rng, n_kv, 1.0));
        let sinks = rounded(rand_vec(&mut rng, s.n_heads, 2.0));
        let (qf, kf, vf, sinks_f) = (f32s(&q), f32s(&k), f32s(&v), f32s(&sinks));
        let x = AttnInputs {
            mask,
            ..AttnInputs::causal(&qf, &kf, &vf, s)
        };
        let mut out = vec![0.0; n_q];
        let mut lse = vec![0.0; s.batch * s.n_heads * s.q_len];
        be.attention_forward(&mut out, &mut lse, x);
        be.attention_sinks_forward(&mut out, &mut lse, &sinks_f, s);
        let reference = |q: &[f64], k: &[f64], v: &[f64], sinks: &[f64]| {
            ref_attention(q, k, v, s, mask, Some(sinks))
        };
        assert_close("sinks", &out, &reference(&q, &k, &v, &sinks), 1e-5, 2e-6);
        let r = rounded(rand_vec(&mut rng, n_q, 1.0));
        let (mut dq, mut dk, mut dv) = (vec![0.0; n_q], vec![0.0; n_kv], vec![0.0; n_kv]);
        let mut dsinks = vec![0.0; s.n_heads];
        let saved = || AttnSaved {
            out: &out,
            lse: &lse,
        };
        be.attention_sinks_backward(&mut dsinks, &f32s(&r), saved(), &sinks_f, s);
        let grads = AttnGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        be.attention_backward(grads, &f32s(&r), x, saved());
        let loss =
            |q: &[f64], k: &[f64], v: &[f64], sinks: &[f64]| dot(&reference(q, k, v, sinks), &r);
        fd_check("sinks dq", &q, |q| loss(q, &k, &v, &sinks), &dq);
        fd_check("sinks dk", &k, |k| loss(&q, k, &v, &sinks), &dk);
        fd_check("sinks dv", &v, |v| loss(&q, &k, v, &sinks), &dv);
        fd_check("dsinks", &sinks, |sinks| loss(&q, &k, &v, sinks), &dsinks);
    }
}

#[test]
fn sliding_window_attention_alone_and_within_documents() {
    let shape = AttnShape::causal(1, 300, 2, 1, 4);
    let window = AttnMask {
        positions: None,
        window: Some(37),
    };
    masked_attention_case(shape, window, 23);
    let positions = positions_of(&[&[20, 250, 30]]);
    let both = AttnMask {
        positions: Some(&positions),
        window: Some(64),
    };
    masked_attention_case(shape, both, 24);
}

#[test]
fn a_block_of_keys_wholly_masked_for_some_queries_merges_as_nothing() {
    // Queries at 8..14 in documents starting at 0 and at 10: keys 0..8 lie before the second
    // document, so its queries see none of that block (output 0, lse −∞), and merging the
    // blocks still equals attention over every key.
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    let (ql, h, kvh, hd, keys) = (6, 2, 1, 4, 14);
    let whole = AttnShape {
        batch: 1,
        q_len: ql,
        kv_len: keys,
        kv_capacity: keys,
        n_heads: h,
        n_kv_heads: kvh,
        head_dim: hd,
        q_offset: 8,
    };
    let positions = [8, 9, 0, 1, 2, 3];
    let mask = AttnMask {
        positions: Some(&positions),
        window: None,
    };
    let q = f32s(&rand_vec(&mut rng, ql * h * hd, 1.5));
    let k = f32s(&rand_vec(&mut rng, keys * kvh * hd, 1.5));
    let v = f32s(&rand_vec(&mut rng, keys * kvh * hd, 1.0));
    let run = |k: &Vec<f32>, v: &Vec<f32>, s: AttnShape| {
        let (mut o, mut l) = (vec![0.0; q.len()], vec![0.0; h * ql]);
        let x = AttnInputs {
            mask,
            ..AttnInputs::causal(&q, k, v, s)
        };
        be.attention_forward(&mut o, &mut l, x);
        (o, l)
    };
    let (out, lse) = run(&k, &v, whole);
    let at = |from: usize, to: usize, x: &[f32]| x[from * kvh * hd..to * kvh * hd].to_vec();
    let first = AttnShape {
        kv_len: 8,
        kv_capacity: 8,
        ..whole
    };
    let (mut merged, mut merged_lse) = run(&at(0, 8, &k), &at(0, 8, &v), first);
    for i in 2..ql {
        for head in 0..h {
            assert_eq!(merged_lse[head * ql + i], f32::NEG_INFINITY);
            assert!(merged[(i * h + head) * hd..][..hd]
                .iter()
                .all(|&o| o == 0.0));
        }
    }
    let diagonal = AttnShape {
        kv_len: 6,
        kv_capacity: 6,
        q_offset: 0,
        ..whole
    };
    let (part, part_lse) = run(&at(8, 14, &k), &at(8, 14, &v), diagonal);
    be.attention_merge(&mut merged, &mut merged_lse, &part, &part_lse, whole);
    let widen = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    assert_close("merged out", &merged, &widen(&out), 1e-5, 1e-6);
    assert_close("merged lse", &merged_lse, &widen(&lse), 1e-5, 1e-6);
}

#[test]
fn attention_multi_head_forward_and_backward() {
    attention_case(AttnShape::causal(2, 7, 2, 2, 8), 5);
}

#[test]
fn attention_grouped_query_forward_and_backward() {
    attention_case(AttnShape::causal(1, 9, 4, 2, 4), 6);
}

#[test]
fn attention_spans_several_tiles() {
    // Longer than the forward key tile (256) and the backward key tile (128), so the online softmax
    // merges tiles and the backward crosses tile boundaries.
    attention_case(AttnShape::causal(1, 300, 2, 1, 4), 7);
}

#[test]
fn attention_with_cache_offset_matches_reference() {
    let s = AttnShape {
        batch: 1,
        q_len: 3,
        kv_len: 8,
        kv_capacity: 12,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        q_offset: 5,
    };
    attention_case(s, 8);
}

#[test]
fn attention_of_a_query_chunk_after_its_keys_forward_and_backward() {
    // Context parallelism's blocks: a query chunk at positions 6.. against the 9 keys before and
    // under it (the diagonal block of a longer sequence), and against 4 keys all before it.
    let chunk = |q_offset, kv_len| AttnShape {
        batch: 2,
        q_len: 5,
        kv_len,
        kv_capacity: kv_len,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 4,
        q_offset,
    };
    attention_case(chunk(6, 9), 11);
    attention_case(chunk(6, 4), 12);
    // Longer than the tiles (forward 128 × 256, backward 512 × 128).
    attention_case(
        AttnShape {
            batch: 1,
            q_len: 200,
            kv_len: 300,
            kv_capacity: 300,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            q_offset: 150,
        },
        13,
    );
}

#[test]
fn merging_attention_over_two_key_blocks_equals_attention_over_all() {
    // Queries at positions 8..14 against keys 0..14, computed as keys 0..8 (all visible) and
    // keys 8..14 (the diagonal), merged by log-sum-exp.
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let (b, ql, h, kvh, hd) = (2, 6, 4, 2, 8);
    let whole = AttnShape {
        batch: b,
        q_len: ql,
        kv_len: 14,
        kv_capacity: 14,
        n_heads: h,
        n_kv_heads: kvh,
        head_dim: hd,
        q_offset: 8,
    };
    let q = f32s(&rand_vec(&mut rng, b * ql * h * hd, 1.5));
    let k = f32s(&rand_vec(&mut rng, b * 14 * kvh * hd, 1.5));
    let v = f32s(&rand_vec(&mut rng, b * 14 * kvh * hd, 1.0));
    let keys = |from: usize, to: usize, x: &[f32]| -> Vec<f32> {
        (0..b)
            .flat_map(|bi| x[(bi * 14 + from) * kvh * hd..(bi * 14 + to) * kvh * hd].to_vec())
            .collect()
    };
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; b * h * ql]);
    be.attention_forward(&mut out, &mut lse, AttnInputs::causal(&q, &k, &v, whole));
    let block = |from: usize, to: usize, q_offset: usize| {
        let s = AttnShape {
            kv_len: to - from,
            kv_capacity: to - from,
            q_offset,
            ..whole
        };
        let (mut o, mut l) = (vec![0.0; q.len()], vec![0.0; b * h * ql]);
        let (k, v) = (keys(from, to, &k), keys(from, to, &v));
        be.attention_forward(&mut o, &mut l, AttnInputs::causal(&q, &k, &v, s));
        (o, l)
    };
    let (mut merged, mut merged_lse) = block(0, 8, 8);
    let (part, part_lse) = block(8, 14, 0);
    be.attention_merge(&mut merged, &mut merged_lse, &part, &part_lse, whole);
    let widen = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    assert_close("merged out", &merged, &widen(&out), 1e-5, 1e-6);
    assert_close("merged lse", &merged_lse, &widen(&lse), 1e-5, 1e-6);
}

#[test]
fn swiglu_forward_and_backward() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let n = 97;
    let g = rounded(rand_vec(&mut rng, n, 4.0));
    let u = rounded(rand_vec(&mut rng, n, 2.0));
    let r = rounded(rand_vec(&mut rng, n, 1.0));
    let mut out = vec![0.0; n];
    be.swiglu_forward(&mut out, &f32s(&g), &f32s(&u));
    let fwd = |g: &[f64], u: &[f64]| {
        g.iter()
            .zip(u)
            .map(|(g, u)| silu(*g) * u)
            .collect::<Vec<_>>()
    };
    assert_close("swiglu", &out, &fwd(&g, &u), 1e-6, 1e-6);
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    be.swiglu_backward(&mut dg, &mut du, &f32s(&r), &f32s(&g), &f32s(&u));
    fd_check("swiglu dgate", &g, |g| dot(&fwd(g, &u), &r), &dg);
    fd_check("swiglu dup", &u, |u| dot(&fwd(&g, u), &r), &du);
}

#[test]
fn cross_entropy_fused_with_projection() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    // More rows than one chunk, so chunk boundaries are crossed; one ignored target.
    let (rows, dim, vocab) = (300, 6, 11);
    let h = rounded(rand_vec(&mut rng, rows * dim, 1.0));
    let w = rounded(rand_vec(&mut rng, vocab * dim, 1.0));
    let mut targets: Vec<u32> = (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect();
    targets[17] = IGNORE_INDEX;
    let scale = 0.37f32;
    let (mut dh, mut dw) = (vec![0.0; rows * dim], vec![0.0; vocab * dim]);
    let loss = be.cross_entropy_forward_backward(
        &f32s(&h),
        &f32s(&w),
        &targets,
        dim,
        vocab,
        scale,
        Some((&mut dh, &mut dw)),
    );
    let want = ref_cross_entropy(&h, &w, &targets, dim, vocab);
    assert_eq!(loss.count, rows - 1);
    assert!(
        (loss.sum - want).abs() < 1e-4 * want.abs(),
        "{} vs {want}",
        loss.sum
    );
    let s = scale as f64;
    fd_check(
        "cross-entropy dh",
        &h,
        |h| s * ref_cross_entropy(h, &w, &targets, dim, vocab),
        &dh,
    );
    fd_check(
        "cross-entropy dweight",
        &w,
        |w| s * ref_cross_entropy(&h, w, &targets, dim, vocab),
        &dw,
    );
}

#[test]
fn adamw_matches_pytorch_formula() {
    let be = CpuBackend::new();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let n = 50;
    let mut p = f32s(&rand_vec(&mut rng, n, 1.0));
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let (mut pr, mut mr, mut vr): (Vec<f64>, Vec<f64>, Vec<f64>) = (
        p.iter().map(|&x| x as f64).collect(),
        vec![0.0; n],
        vec![0.0; n],
    );
    for step in 1..=3u64 {
        let g = f32s(&rand_vec(&mut rng, n, 1.0));
        let hp = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step,
            grad_scale: 1.0,
            decay: WeightDecay::Decoupled,
        };
        be.adamw_step(&mut p, &g, &mut m, &mut v, hp);
        for i in 0..n {
            let gi = g[i] as f64;
            pr[i] *= 1.0 - 1e-2 * 0.1;
            mr[i] = 0.9 * mr[i] + 0.1 * gi;
            vr[i] = 0.95 * vr[i] + 0.05 * gi * gi;
            let mhat = mr[i] / (1.0 - 0.9f64.powi(step as i32));
            let vhat = vr[i] / (1.0 - 0.95f64.powi(step as i32));
            pr[i] -= 1e-2 * mhat / (vhat.sqrt() + 1e-8);
        }
    }
    assert_close("adamw", &p, &pr, 1e-5, 1e-6);
}

#[test]
fn sum_squares_is_exact_and_thread_independent() {
    let be = CpuBackend::new();
    let x: Vec<f32> = (0..100_000)
        .map(|i| ((i % 17) as f32 - 8.0) * 0.25)
        .collect();
    let want: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
    let got = be.sum_squares(&x);
    assert!((got - want).abs() < 1e-9 * want);
    let single = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| be.sum_squares(&x));
    assert_eq!(got.to_bits(), single.to_bits());
}

#[test]
fn round_to_bf16_is_round_to_nearest_even() {
    let be = CpuBackend::new();
    let tie_down = 1.0 + 2f32.powi(-8); // halfway between 1 and the next bf16: even is 1
    let tie_up = 1.0 + 3.0 * 2f32.powi(-8); // halfway between 1+2^-7 and 1+2^-6: even is 1+2^-6
    let mut buf = vec![
        tie_down,
        tie_up,
        1.0 + 2f32.powi(-8) + 2f32.powi(-20),
        -2.5,
        0.0,
        f32::NAN,
    ];
    be.round_to_bf16(&mut buf);
    assert_eq!(buf[0], 1.0);
    assert_eq!(buf[1], 1.0 + 2f32.powi(-6));
    assert_eq!(buf[2], 1.0 + 2f32.powi(-7));
    assert_eq!(buf[3], -2.5);
    assert_eq!(buf[4], 0.0);
    assert!(buf[5].is_nan());
}

// ---- the kernels' API boundary (issue 27, item 7): a bad shape or id is a clear panic, never UB

/// A panic's message, from `catch_unwind`.
fn panic_message(f: impl FnOnce()) -> String {
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .expect_err("the kernel accepted what it must refuse");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn embedding_kernels_refuse_ids_outside_the_table_and_short_buffers() {
    let be = CpuBackend::new();
    let (dim, rows) = (4, 3);
    let table = vec![1.0f32; rows * dim];
    // The backward's scatter-add writes through a raw pointer: an id one past the table was
    // an out-of-bounds write before the check.
    let mut dtable = vec![0.0f32; rows * dim];
    let dout = vec![1.0f32; 2 * dim];
    let e = panic_message(|| be.embedding_backward(&mut dtable, &dout, &[0, 3], dim));
    assert!(
        e.contains("embedding_backward") && e.contains("token id 3 at position 1"),
        "{e}"
    );
    assert!(dtable.iter().all(|&x| x == 0.0), "nothing written");
    let e = panic_message(|| be.embedding_backward(&mut dtable, &dout, &[0, 1, 2], dim));
    assert!(e.contains("3 ids of width 4 need 12 floats"), "{e}");
    let mut out = vec![0.0f32; 2 * dim];
    let e = panic_message(|| be.embedding_forward(&mut out, &table, &[0, 1, 2], dim));
    assert!(e.contains("embedding_forward: 3 ids"), "{e}");
    let e = panic_message(|| be.embedding_forward(&mut out, &table, &[7], dim));
    assert!(e.contains("token id 7 at position 0"), "{e}");
    // Another rank's tokens (IGNORE_INDEX) stay a zero row and no gradient.
    be.embedding_forward(&mut out, &table, &[IGNORE_INDEX, 2], dim);
    assert_eq!(&out[..dim], &[0.0; 4]);
}

#[test]
fn cross_entropy_refuses_targets_outside_the_vocabulary_and_short_buffers() {
    let be = CpuBackend::new();
    let (dim, vocab, rows) = (4, 8, 3);
    let h = vec![0.1f32; rows * dim];
    let w = vec![0.2f32; vocab * dim];
    let e = panic_message(|| {
        be.cross_entropy_forward_backward(&h, &w, &[1, 9, 2], dim, vocab, 1.0, None);
    });
    assert!(
        e.contains("cross_entropy: target id 9 at row 1 is outside the vocabulary of 8"),
        "{e}"
    );
    let (mut dh, mut dw) = (vec![0.0f32; dim], vec![0.0f32; vocab * dim]);
    let e = panic_message(|| {
        be.cross_entropy_forward_backward(
            &h,
            &w,
            &[1, 2, 3],
            dim,
            vocab,
            1.0,
            Some((&mut dh, &mut dw)),
        );
    });
    assert!(
        e.contains("cross_entropy: dh holds 4 floats, its shape needs 12"),
        "{e}"
    );
    let short_h = vec![0.1f32; dim];
    let e = panic_message(|| {
        be.cross_entropy_forward_backward(&short_h, &w, &[1, 2], dim, vocab, 1.0, None);
    });
    assert!(e.contains("cross_entropy: h holds 4 floats"), "{e}");
}
