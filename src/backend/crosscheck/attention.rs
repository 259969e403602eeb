//! The attention checks of `crosscheck`: RoPE (tables per position and per token), attention
//! forward and backward at the training, KV-cache and ring-attention shapes, with documents and a
//! sliding window, and ring attention's merge.

use super::{rel_err, Checker, OpCheck};
use crate::backend::cpu::rope::rope_tables;
use crate::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape, Backend, RopeShape};

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    pub(super) fn rope(&mut self) {
        let (batch, seq, heads, hd, offset) = (2, 19, 3, 64, 5);
        let (cos, sin) = rope_tables(hd, seq + offset, 500000.0, None);
        let (rc, tc) = self.both(&cos);
        let (rs, ts) = self.both(&sin);
        let x = self.random(batch * seq * heads * hd, 1.0);
        let (mut rx, mut tx) = self.both(&x);
        self.reference.rope_forward(
            &mut rx,
            &rc,
            &rs,
            RopeShape::new(batch, seq, heads, hd).at(offset),
        );
        self.test.rope_forward(
            &mut tx,
            &tc,
            &ts,
            RopeShape::new(batch, seq, heads, hd).at(offset),
        );
        self.compare("rope_forward", &rx, &tx, self.tol.exact);
        let (mut rx, mut tx) = self.both(&x);
        self.reference
            .rope_backward(&mut rx, &rc, &rs, RopeShape::new(batch, seq, heads, hd));
        self.test
            .rope_backward(&mut tx, &tc, &ts, RopeShape::new(batch, seq, heads, hd));
        self.compare("rope_backward", &rx, &tx, self.tol.exact);
        // Tables with a row per token (documents packed in a sequence restart their positions).
        let per_token = RopeShape::new(batch, seq, heads, hd).tables_per_token(true);
        let (cos, sin) = rope_tables(hd, batch * seq, 10000.0, None);
        let ((rc, tc), (rs, ts)) = (self.both(&cos), self.both(&sin));
        let (mut rx, mut tx) = self.both(&x);
        self.reference.rope_forward(&mut rx, &rc, &rs, per_token);
        self.test.rope_forward(&mut tx, &tc, &ts, per_token);
        self.compare("rope_forward per token", &rx, &tx, self.tol.exact);
    }

    pub(super) fn attention(&mut self, label: &str, s: AttnShape, backward: bool) {
        self.masked_attention(label, s, AttnMask::CAUSAL, backward)
    }

    fn masked_attention(&mut self, label: &str, s: AttnShape, mask: AttnMask, backward: bool) {
        let q = self.random(s.batch * s.q_len * s.n_heads * s.head_dim, 1.0);
        let kv_len = s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim;
        let k = self.random(kv_len, 1.0);
        let v = self.random(kv_len, 1.0);
        let (rq, tq) = self.both(&q);
        let (rk, tk) = self.both(&k);
        let (rv, tv) = self.both(&v);
        let (mut ro, mut to) = (self.reference.zeros(q.len()), self.test.zeros(q.len()));
        let stats = s.batch * s.n_heads * s.q_len;
        let (mut rl, mut tl) = (self.reference.zeros(stats), self.test.zeros(stats));
        let (r_in, t_in) = (
            AttnInputs {
                mask,
                ..AttnInputs::causal(&rq, &rk, &rv, s)
            },
            AttnInputs {
                mask,
                ..AttnInputs::causal(&tq, &tk, &tv, s)
            },
        );
        self.reference.attention_forward(&mut ro, &mut rl, r_in);
        self.test.attention_forward(&mut to, &mut tl, t_in);
        let tol = self.tol.attention;
        self.compare(&format!("attention_forward {label} out"), &ro, &to, tol);
        self.compare_lse(&format!("attention_forward {label} lse"), &rl, &tl, tol);
        if !backward {
            return;
        }
        let dout = self.random(q.len(), 1.0);
        let (rd, td) = self.both(&dout);
        let (mut rdq, mut tdq) = (self.reference.zeros(q.len()), self.test.zeros(q.len()));
        let (mut rdk, mut tdk) = (self.reference.zeros(kv_len), self.test.zeros(kv_len));
        let (mut rdv, mut tdv) = (self.reference.zeros(kv_len), self.test.zeros(kv_len));
        let (r_saved, t_saved) = (
            AttnSaved { out: &ro, lse: &rl },
            AttnSaved { out: &to, lse: &tl },
        );
        let r_grads = AttnGrads {
            dq: &mut rdq,
            dk: &mut rdk,
            dv: &mut rdv,
        };
        self.reference
            .attention_backward(r_grads, &rd, r_in, r_saved);
        let t_grads = AttnGrads {
            dq: &mut tdq,
            dk: &mut tdk,
            dv: &mut tdv,
        };
        self.test.attention_backward(t_grads, &td, t_in, t_saved);
        for (name, r, t) in [("dq", &rdq, &tdq), ("dk", &rdk, &tdk), ("dv", &rdv, &tdv)] {
            self.compare(&format!("attention_backward {label} {name}"), r, t, tol);
        }
        // The backward again on the test backend: the same bits (training is repeatable), which
        // a device's racing additions would not give.
        let first = [&tdq, &tdk, &tdv].map(|b| self.test.download(b));
        let t_grads = AttnGrads {
            dq: &mut tdq,
            dk: &mut tdk,
            dv: &mut tdv,
        };
        let t_saved = AttnSaved { out: &to, lse: &tl };
        self.test.attention_backward(t_grads, &td, t_in, t_saved);
        let again: Vec<f32> = [&tdq, &tdk, &tdv]
            .iter()
            .flat_map(|b| self.test.download(b))
            .collect();
        let first: Vec<f32> = first.concat();
        let same = first
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        self.results.push(OpCheck {
            op: format!("attention_backward {label} repeats bit for bit"),
            rel_err: if same { 0.0 } else { rel_err(&again, &first) },
            tolerance: 0.0,
            passed: same,
        });
    }

    /// Ring attention's merge of two blocks' outputs by their log-sum-exp (context parallelism).
    pub(super) fn attention_merge(&mut self) {
        let s = AttnShape::causal(2, 37, 4, 2, 32);
        let (n, rows) = (2 * 37 * 4 * 32, 2 * 4 * 37);
        let out = self.random(n, 1.0);
        let part = self.random(n, 1.0);
        let lse = self.random(rows, 3.0);
        let part_lse = self.random(rows, 3.0);
        let (mut ro, mut to) = self.both(&out);
        let (mut rl, mut tl) = self.both(&lse);
        let (rp, tp) = self.both(&part);
        let (rpl, tpl) = self.both(&part_lse);
        self.reference
            .attention_merge(&mut ro, &mut rl, &rp, &rpl, s);
        self.test.attention_merge(&mut to, &mut tl, &tp, &tpl, s);
        let tol = self.tol.attention;
        self.compare("attention_merge out", &ro, &to, tol);
        self.compare("attention_merge lse", &rl, &tl, tol);
    }

    /// Compares log-sum-exps, where a query that saw no key holds −∞: stood in for by −10⁴ on
    /// both sides, so a finite value or a NaN where the reference has −∞ still fails.
    fn compare_lse(&mut self, op: &str, r: &R::Buf, t: &T::Buf, tolerance: f64) {
        let stand_in = |x: Vec<f32>| -> Vec<f32> {
            x.into_iter()
                .map(|v| if v == f32::NEG_INFINITY { -1e4 } else { v })
                .collect()
        };
        let (r, t) = (
            stand_in(self.reference.download(r)),
            stand_in(self.test.download(t)),
        );
        self.record(op, &t, &r, tolerance);
    }

    /// Block-causal attention over packed documents (one crossing a 32-key tile, one a single
    /// token), then with a sliding window as well, and a context-parallel block wholly before the
    /// last document's queries (their rows see none of it).
    pub(super) fn attention_documents(&mut self) {
        let lengths: [&[u32]; 2] = [&[30, 1, 50, 39], &[120]];
        let positions: Vec<u32> = lengths
            .iter()
            .flat_map(|row| row.iter().flat_map(|&n| 0..n))
            .collect();
        let documents = AttnMask {
            positions: Some(&positions),
            window: None,
        };
        let shape = AttnShape::causal(2, 120, 4, 2, 64);
        self.masked_attention("documents", shape, documents, true);
        let windowed = AttnMask {
            window: Some(17),
            ..documents
        };
        self.masked_attention("documents+window", shape, windowed, true);
        let before = AttnShape {
            q_len: 40,
            kv_len: 40,
            kv_capacity: 40,
            q_offset: 80,
            ..shape
        };
        let chunk: Vec<u32> = (0..2)
            .flat_map(|b| positions[b * 120 + 80..][..40].to_vec())
            .collect();
        let blocks = AttnMask {
            positions: Some(&chunk),
            window: None,
        };
        self.masked_attention("CP block before documents", before, blocks, true);
    }
}
