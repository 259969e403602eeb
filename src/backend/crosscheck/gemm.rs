//! The matrix-product checks of `crosscheck`: plain and accumulating GEMMs in every transpose,
//! the residual GEMM, buffers reused across calls, and GEMMs reading what the other kernels wrote
//! (bf16 activations, the feed-forward chain), where a device's storage tricks could go wrong.

use super::Checker;
use crate::backend::cpu::rope::rope_tables;
use crate::backend::{AttnInputs, AttnShape, Backend, GemmOutput, GemmShape, RopeShape};

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    pub(super) fn matmul(&mut self) {
        let (m, k, n) = (67, 129, 45);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            for accumulate in [false, true] {
                let a = self.random(m * k, 1.0);
                let b = self.random(k * n, 1.0);
                let c = self.random(m * n, 1.0);
                let (ra, tav) = self.both(&a);
                let (rb, tbv) = self.both(&b);
                let (mut rc, mut tc) = self.both(&c);
                let shape = GemmShape {
                    m,
                    k,
                    n,
                    trans_a: ta,
                    trans_b: tb,
                };
                let output = GemmOutput::accumulate_if(accumulate);
                self.matmul_both((&mut rc, &mut tc), (&ra, &tav), (&rb, &tbv), shape, output);
                let name = format!(
                    "matmul {}{}{}",
                    if ta { "Aᵀ" } else { "A" },
                    if tb { "Bᵀ" } else { "B" },
                    if accumulate { " +=" } else { "" }
                );
                self.compare(&name, &rc, &tc, self.tol.gemm);
            }
        }
        self.matmul_reuse();
        self.matmul_add();
    }

    /// `out = residual + a·bᵀ` (a residual connection); `out` starts with other values, which must
    /// not leak into the result.
    fn matmul_add(&mut self) {
        let (m, k, n) = (37, 80, 52);
        let (a, b, residual, stale) = (
            self.random(m * k, 1.0),
            self.random(n * k, 1.0),
            self.random(m * n, 1.0),
            self.random(m * n, 1.0),
        );
        let (ra, ta) = self.both(&a);
        let (rb, tb) = self.both(&b);
        let (rr, tr) = self.both(&residual);
        let (mut ro, mut to) = self.both(&stale);
        self.reference.matmul_add(
            &mut ro,
            &rr,
            &ra,
            &rb,
            GemmShape::new(m, k, n).b_transposed(),
        );
        self.test.matmul_add(
            &mut to,
            &tr,
            &ta,
            &tb,
            GemmShape::new(m, k, n).b_transposed(),
        );
        self.compare("matmul_add (residual + A·Bᵀ)", &ro, &to, self.tol.gemm);
        self.compare("matmul_add leaves the residual", &rr, &tr, self.tol.exact);
    }

    /// One input in two GEMMs in a row (a device converts it to bf16 once and reuses the copy),
    /// then rewritten and used again (the copy must not be reused).
    fn matmul_reuse(&mut self) {
        let (m, k, n) = (40, 96, 24);
        let (a, b1, b2, a_new) = (
            self.random(m * k, 1.0),
            self.random(k * n, 1.0),
            self.random(k * n, 1.0),
            self.random(m * k, 1.0),
        );
        let (mut ra, mut ta) = self.both(&a);
        let (rb1, tb1) = self.both(&b1);
        let (rb2, tb2) = self.both(&b2);
        let (ran, tan) = self.both(&a_new);
        let (mut ro, mut to) = (self.reference.zeros(m * n), self.test.zeros(m * n));
        for (name, b) in [
            ("matmul reusing A", (&rb1, &tb1)),
            ("matmul reusing A again", (&rb2, &tb2)),
        ] {
            self.matmul_both(
                (&mut ro, &mut to),
                (&ra, &ta),
                (b.0, b.1),
                GemmShape::new(m, k, n),
                GemmOutput::Overwrite,
            );
            self.compare(name, &ro, &to, self.tol.gemm);
        }
        self.reference.copy_from(&mut ra, &ran);
        self.test.copy_from(&mut ta, &tan);
        self.matmul_both(
            (&mut ro, &mut to),
            (&ra, &ta),
            (&rb2, &tb2),
            GemmShape::new(m, k, n),
            GemmOutput::Overwrite,
        );
        self.compare("matmul after A was rewritten", &ro, &to, self.tol.gemm);
    }

    /// `out · bᵀ` compared, `out` a kernel's output (rows × k) on each side: on a device the GEMM
    /// may read the bf16 copy that kernel wrote beside its values.
    fn matmul_on(&mut self, op: &str, r_out: &R::Buf, t_out: &T::Buf, rows: usize, k: usize) {
        let n = 24;
        let b = self.random(n * k, 1.0);
        let (rb, tb) = self.both(&b);
        let (mut rc, mut tc) = (self.reference.zeros(rows * n), self.test.zeros(rows * n));
        self.matmul_both(
            (&mut rc, &mut tc),
            (r_out, t_out),
            (&rb, &tb),
            GemmShape::new(rows, k, n).b_transposed(),
            GemmOutput::Overwrite,
        );
        self.compare(op, &rc, &tc, self.tol.gemm);
    }

    /// The feed-forward as the model runs it: the gate and up projections and the gradient of
    /// SwiGLU's output are GEMM outputs in activations a device may keep in bf16 alone
    /// (`zeros_bf16_activation`: there cuBLASLt writes them in bf16), which SwiGLU's forward and
    /// backward then read; a second shape with an odd number of values takes the kernels'
    /// one-by-one path.
    pub(super) fn feed_forward_through_bf16_activations(&mut self) {
        for (rows, dim, hidden) in [(64, 96, 160), (33, 40, 71)] {
            let (x, w1, w3) = (
                self.random(rows * dim, 1.0),
                self.random(hidden * dim, 1.0),
                self.random(hidden * dim, 1.0),
            );
            let ((rx, tx), (rw1, tw1), (rw3, tw3)) =
                (self.both(&x), self.both(&w1), self.both(&w3));
            let (mut rg, mut tg) = self.bf16_activations(rows * hidden);
            let (mut ru, mut tu) = self.bf16_activations(rows * hidden);
            self.matmul_both(
                (&mut rg, &mut tg),
                (&rx, &tx),
                (&rw1, &tw1),
                GemmShape::new(rows, dim, hidden).b_transposed(),
                GemmOutput::Overwrite,
            );
            self.matmul_both(
                (&mut ru, &mut tu),
                (&rx, &tx),
                (&rw3, &tw3),
                GemmShape::new(rows, dim, hidden).b_transposed(),
                GemmOutput::Overwrite,
            );
            let what = format!("{rows}x{dim}x{hidden}");
            self.compare(
                &format!("matmul into a bf16 activation ({what})"),
                &rg,
                &tg,
                self.tol.gemm,
            );
            let (mut ra, mut ta) = self.bf16_activations(rows * hidden);
            self.reference.swiglu_forward(&mut ra, &rg, &ru);
            self.test.swiglu_forward(&mut ta, &tg, &tu);
            self.compare(
                &format!("swiglu_forward on bf16 activations ({what})"),
                &ra,
                &ta,
                self.tol.gemm,
            );
            let (dy, w2) = (self.random(rows * dim, 1.0), self.random(dim * hidden, 1.0));
            let ((rdy, tdy), (rw2, tw2)) = (self.both(&dy), self.both(&w2));
            let (mut rdact, mut tdact) = self.bf16_activations(rows * hidden);
            self.matmul_both(
                (&mut rdact, &mut tdact),
                (&rdy, &tdy),
                (&rw2, &tw2),
                GemmShape::new(rows, dim, hidden),
                GemmOutput::Overwrite,
            );
            let (mut rdg, mut tdg) = self.bf16_activations(rows * hidden);
            let (mut rdu, mut tdu) = self.bf16_activations(rows * hidden);
            self.reference
                .swiglu_backward(&mut rdg, &mut rdu, &rdact, &rg, &ru);
            self.test
                .swiglu_backward(&mut tdg, &mut tdu, &tdact, &tg, &tu);
            self.compare(
                &format!("swiglu_backward dgate on bf16 activations ({what})"),
                &rdg,
                &tdg,
                self.tol.gemm,
            );
            self.compare(
                &format!("swiglu_backward dup on bf16 activations ({what})"),
                &rdu,
                &tdu,
                self.tol.gemm,
            );
        }
    }

    /// Activations a block keeps as bf16 pairs under bf16 mixed precision: a norm's output
    /// rounded in place where it is produced (on a device, keeping its bf16 copy) and SwiGLU's
    /// output in bf16 alone (already bf16), each packed into words and unpacked into a plain and
    /// a bf16-alone buffer, as a backward's shared set holds them, then read by a GEMM. The round
    /// trip on the test backend is exact; an odd count takes the padded last word.
    pub(super) fn bf16_activations_kept_as_pairs(&mut self) {
        for (rows, dim) in [(64, 96), (33, 41)] {
            let n = rows * dim;
            let what = format!("{rows}x{dim}");
            let [_, _, (mut rn, mut tn), _] = self.rmsnorm_both(rows, dim);
            self.reference.round_to_bf16(&mut rn);
            self.test.round_to_bf16(&mut tn);
            self.matmul_on(
                &format!("matmul on rmsnorm's output rounded ({what})"),
                &rn,
                &tn,
                rows,
                dim,
            );
            let (gate, up) = (self.random(n, 3.0), self.random(n, 1.0));
            let ((rg, tg), (ru, tu)) = (self.both(&gate), self.both(&up));
            let (mut ra, mut ta) = self.bf16_activations(n);
            self.reference.swiglu_forward(&mut ra, &rg, &ru);
            self.test.swiglu_forward(&mut ta, &tg, &tu);
            self.reference.round_to_bf16(&mut ra);
            self.test.round_to_bf16(&mut ta);
            for (kept, (r_src, t_src)) in [
                ("rmsnorm's output", (&rn, &tn)),
                ("swiglu's output", (&ra, &ta)),
            ] {
                let (mut rw, mut tw) = (
                    self.reference.zeros(n.div_ceil(2)),
                    self.test.zeros(n.div_ceil(2)),
                );
                self.reference.pack_bf16_pairs(&mut rw, r_src);
                self.test.pack_bf16_pairs(&mut tw, t_src);
                let source = self.test.download(t_src);
                let unpacked = [
                    ("f32", self.reference.zeros(n), self.test.zeros(n)),
                    (
                        "bf16-alone",
                        self.reference.zeros_bf16_activation(n),
                        self.test.zeros_bf16_activation(n),
                    ),
                ];
                for (into, mut ro, mut to) in unpacked {
                    self.reference.unpack_bf16_pairs(&mut ro, &rw);
                    self.test.unpack_bf16_pairs(&mut to, &tw);
                    let op = format!("{kept} packed and unpacked into {into} ({what})");
                    self.record(&op, &self.test.download(&to), &source, 0.0);
                    self.matmul_on(&format!("matmul on {op}"), &ro, &to, rows, dim);
                }
            }
        }
    }

    /// `zeros_bf16_activation` on each side.
    fn bf16_activations(&self, len: usize) -> (R::Buf, T::Buf) {
        (
            self.reference.zeros_bf16_activation(len),
            self.test.zeros_bf16_activation(len),
        )
    }

    /// GEMMs (and attention) reading the outputs of RMSNorm (forward and dx), SwiGLU (forward and
    /// backward), RoPE and attention, the ops whose device kernels write a bf16 copy for them; and
    /// the norm's output rewritten by another op, which must not leave a stale copy behind.
    pub(super) fn gemm_on_kernel_outputs(&mut self) {
        let (rows, dim) = (64, 96);
        let [(rx, tx), (rw, tw), (mut ro, mut to), (rr, tr)] = self.rmsnorm_both(rows, dim);
        self.matmul_on("matmul on rmsnorm's output", &ro, &to, rows, dim);
        self.reference.scale(&mut ro, -0.5);
        self.test.scale(&mut to, -0.5);
        self.matmul_on("matmul on it after a rescale", &ro, &to, rows, dim);
        // RMSNorm's output in a GEMM-operand buffer, as the model allocates it (bf16 alone on a
        // device that keeps the copies).
        let (mut rn, mut tn) = (
            self.reference.zeros_bf16_activation(rows * dim),
            self.test.zeros_bf16_activation(rows * dim),
        );
        let (mut rs2, mut ts2) = (self.reference.zeros(rows), self.test.zeros(rows));
        self.reference
            .rmsnorm_forward(&mut rn, &mut rs2, &rx, &rw, dim, 1e-5);
        self.test
            .rmsnorm_forward(&mut tn, &mut ts2, &tx, &tw, dim, 1e-5);
        self.compare(
            "rmsnorm_forward into a GEMM operand",
            &rn,
            &tn,
            self.tol.gemm,
        );
        self.matmul_on("matmul on that output", &rn, &tn, rows, dim);

        let (gate, up, dout) = (
            self.random(rows * dim, 3.0),
            self.random(rows * dim, 1.0),
            self.random(rows * dim, 1.0),
        );
        let ((rg, tg), (ru, tu), (rd, td)) = (self.both(&gate), self.both(&up), self.both(&dout));
        // SwiGLU's output in a GEMM-operand buffer, as the model allocates it (bf16 alone on a
        // device that keeps the copies): read back, and through both kinds of GEMM.
        let (mut ra, mut ta) = (
            self.reference.zeros_bf16_activation(rows * dim),
            self.test.zeros_bf16_activation(rows * dim),
        );
        self.reference.swiglu_forward(&mut ra, &rg, &ru);
        self.test.swiglu_forward(&mut ta, &tg, &tu);
        self.compare(
            "swiglu_forward into a GEMM operand",
            &ra,
            &ta,
            self.tol.gemm,
        );
        self.matmul_on("matmul on swiglu's output", &ra, &ta, rows, dim);
        let (residual, w2) = (self.random(rows * dim, 1.0), self.random(dim * dim, 1.0));
        let ((rres, tres), (rw2, tw2)) = (self.both(&residual), self.both(&w2));
        let (mut rh, mut th) = (
            self.reference.zeros(rows * dim),
            self.test.zeros(rows * dim),
        );
        self.reference.matmul_add(
            &mut rh,
            &rres,
            &ra,
            &rw2,
            GemmShape::new(rows, dim, dim).b_transposed(),
        );
        self.test.matmul_add(
            &mut th,
            &tres,
            &ta,
            &tw2,
            GemmShape::new(rows, dim, dim).b_transposed(),
        );
        self.compare("matmul_add on swiglu's output", &rh, &th, self.tol.gemm);
        // SwiGLU's gradients, which only GEMMs read: GEMM operands, as in the model's workspace.
        let (mut rdg, mut tdg) = (
            self.reference.zeros_bf16_activation(rows * dim),
            self.test.zeros_bf16_activation(rows * dim),
        );
        let (mut rdu, mut tdu) = (
            self.reference.zeros_bf16_activation(rows * dim),
            self.test.zeros_bf16_activation(rows * dim),
        );
        self.reference
            .swiglu_backward(&mut rdg, &mut rdu, &rd, &rg, &ru);
        self.test.swiglu_backward(&mut tdg, &mut tdu, &td, &tg, &tu);
        self.compare(
            "swiglu_backward dgate as a GEMM operand",
            &rdg,
            &tdg,
            self.tol.gemm,
        );
        self.compare(
            "swiglu_backward dup as a GEMM operand",
            &rdu,
            &tdu,
            self.tol.gemm,
        );
        self.matmul_on("matmul on swiglu's dgate", &rdg, &tdg, rows, dim);
        self.matmul_on("matmul on swiglu's dup", &rdu, &tdu, rows, dim);

        // RMSNorm's dx (accumulated into its previous values).
        let (dout, dx0) = (self.random(rows * dim, 1.0), self.random(rows * dim, 1.0));
        let ((rd, td), (mut rdx, mut tdx)) = (self.both(&dout), self.both(&dx0));
        let (mut rdw, mut tdw) = (self.reference.zeros(dim), self.test.zeros(dim));
        self.reference
            .rmsnorm_backward(&mut rdx, &mut rdw, &rd, &rx, &rw, &rr, dim);
        self.test
            .rmsnorm_backward(&mut tdx, &mut tdw, &td, &tx, &tw, &tr, dim);
        self.matmul_on("matmul on rmsnorm's dx", &rdx, &tdx, rows, dim);

        // Attention on rotated q and k (read through their bf16 copies on a device), then a GEMM
        // on its output.
        let (seq, heads, kv_heads, hd) = (70, 4, 2, 64);
        let s = AttnShape::causal(1, seq, heads, kv_heads, hd);
        let (q_len, kv_len) = (seq * heads * hd, seq * kv_heads * hd);
        let (q, k, v) = (
            self.random(q_len, 1.0),
            self.random(kv_len, 1.0),
            self.random(kv_len, 1.0),
        );
        let ((mut rq, mut tq), (mut rk, mut tk), (rv, tv)) =
            (self.both(&q), self.both(&k), self.both(&v));
        let (cos, sin) = rope_tables(hd, seq, 500000.0, None);
        let ((rc, tc), (rs, ts)) = (self.both(&cos), self.both(&sin));
        for (r, t, h) in [(&mut rq, &mut tq, heads), (&mut rk, &mut tk, kv_heads)] {
            self.reference
                .rope_forward(r, &rc, &rs, RopeShape::new(1, seq, h, hd));
            self.test
                .rope_forward(t, &tc, &ts, RopeShape::new(1, seq, h, hd));
        }
        self.matmul_on("matmul on rope's output", &rq, &tq, seq, heads * hd);
        let (mut rat, mut tat) = (self.reference.zeros(q_len), self.test.zeros(q_len));
        let (mut rl, mut tl) = (
            self.reference.zeros(heads * seq),
            self.test.zeros(heads * seq),
        );
        self.reference
            .attention_forward(&mut rat, &mut rl, AttnInputs::causal(&rq, &rk, &rv, s));
        self.test
            .attention_forward(&mut tat, &mut tl, AttnInputs::causal(&tq, &tk, &tv, s));
        self.compare("attention on rotated q, k", &rat, &tat, self.tol.attention);
        self.matmul_on("matmul on attention's output", &rat, &tat, seq, heads * hd);
    }
}
