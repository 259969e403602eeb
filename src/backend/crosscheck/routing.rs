//! The mixture-of-experts checks of `crosscheck`: the row ops of the dispatch and combine
//! (`row_dots`, `scale_rows`, `scale_rows_by`, `gather_rows`, `moe_combine`) and the routing
//! (`moe_route` with softmax and with DeepSeek-V3's biased, group-limited sigmoid,
//! `moe_route_backward` with the auxiliary loss's gradient, `moe_dispatch_order`, the auxiliary
//! loss's `moe_aux_figures`, `moe_aux_balance`, `moe_aux_score_grads`), the experts'
//! grouped GEMMs, the load count and gpt-oss's clamped SwiGLU. Ids must agree exactly; values within the fp32 tolerance
//! (the routers' `exp`s are each device's), the grouped GEMMs within the GEMM tolerance.

use super::Checker;
use crate::backend::grouped_gemm::GroupedGemm;
use crate::backend::moe_aux::SequenceSpan;
use crate::backend::routing::{ids_of_bits, ids_to_bits, RouterArgs, ScoreFunc};
use crate::backend::{Backend, GemmOutput};

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    /// The same random values uploaded to both backends.
    fn random_both(&mut self, n: usize, scale: f32) -> (R::Buf, T::Buf) {
        let values = self.random(n, scale);
        self.both(&values)
    }

    /// Records two buffers of ids (u32 bits) as numbers, which must be equal.
    fn compare_ids(&mut self, op: &str, r: &R::Buf, t: &T::Buf) {
        let values = |bits: Vec<f32>| -> Vec<f32> {
            ids_of_bits(&bits).iter().map(|&id| id as f32).collect()
        };
        let rv = values(self.reference.download(r));
        let tv = values(self.test.download(t));
        let same = rv.len() == tv.len() && rv == tv;
        self.record(op, &tv, &rv, 0.0);
        if !same {
            self.results.last_mut().expect("just recorded").passed = false;
        }
    }

    /// The combine's row scaling and the weights' gradient dots, and the gather and combine
    /// by ids on the device.
    pub(super) fn moe_row_ops(&mut self) {
        let (rows, width) = (37, 70);
        let x = self.random(rows * width, 1.0);
        let y = self.random(rows * width, 1.0);
        let scales = self.random(rows, 2.0);
        let (mut rx, mut tx) = self.both(&x);
        let (ry, ty) = self.both(&y);
        let rd = self.reference.row_dots(&rx, &ry, width);
        let td = self.test.row_dots(&tx, &ty, width);
        self.compare("row_dots", &rd, &td, self.tol.exact);
        self.reference.scale_rows(&mut rx, &scales, width);
        self.test.scale_rows(&mut tx, &scales, width);
        self.compare("scale_rows", &rx, &tx, self.tol.exact);
        let (rs, ts) = self.both(&scales);
        self.reference.scale_rows_by(&mut rx, &rs, width);
        self.test.scale_rows_by(&mut tx, &ts, width);
        self.compare("scale_rows_by", &rx, &tx, self.tol.exact);
        // Every row of `y` gathered once per choice of 2, then combined back per token.
        let (tokens, k) = (rows, 2);
        let order = self.ids(tokens * k, rows);
        let (ri, ti) = self.both(&ids_to_bits(&order));
        let (mut rg, mut tg) = (
            self.reference.zeros(tokens * k * width),
            self.test.zeros(tokens * k * width),
        );
        self.reference.gather_rows(&mut rg, &ry, &ri, width);
        self.test.gather_rows(&mut tg, &ty, &ti, width);
        self.compare("gather_rows", &rg, &tg, 0.0);
        let mut slots: Vec<u32> = (0..(tokens * k) as u32).collect();
        slots.reverse();
        let (rslots, tslots) = self.both(&ids_to_bits(&slots));
        self.reference
            .moe_combine(&mut rx, &rg, &rslots, (k, width));
        self.test.moe_combine(&mut tx, &tg, &tslots, (k, width));
        self.compare("moe_combine", &rx, &tx, 0.0);
    }

    /// The router forward and backward under two routers, and the dispatch order.
    pub(super) fn moe_routing(&mut self) {
        let tokens = 61;
        let softmax = RouterArgs {
            num_experts: 16,
            top_k: 2,
            score_func: ScoreFunc::Softmax,
            norm_topk_prob: true,
            route_scale: 1.0,
            groups: None,
        };
        let deepseek = RouterArgs {
            num_experts: 32,
            top_k: 4,
            score_func: ScoreFunc::Sigmoid,
            route_scale: 2.5,
            groups: Some((8, 3)),
            ..softmax
        };
        for (name, args, with_bias) in [
            ("softmax", softmax, false),
            ("sigmoid groups", deepseek, true),
        ] {
            let e = args.num_experts;
            let (rl, tl) = self.random_both(tokens * e, 3.0);
            let bias = self.random(e, 0.05);
            let (rb, tb) = self.both(&bias);
            let (rb, tb) = if with_bias {
                (Some(&rb), Some(&tb))
            } else {
                (None, None)
            };
            let r = self.reference.moe_route(&rl, rb, &args);
            let t = self.test.moe_route(&tl, tb, &args);
            self.compare_ids(&format!("moe_route {name} experts"), &r.experts, &t.experts);
            self.compare(
                &format!("moe_route {name} weights"),
                &r.weights,
                &t.weights,
                self.tol.exact,
            );
            self.compare(
                &format!("moe_route {name} scores"),
                &r.scores,
                &t.scores,
                self.tol.exact,
            );
            let (rdw, tdw) = self.random_both(tokens * args.top_k, 1.0);
            let (rg, tg) = self.random_both(tokens * e, 0.3);
            let rd =
                self.reference
                    .moe_route_backward(&args, (&r.scores, &r.experts), &rdw, Some(&rg));
            let td = self
                .test
                .moe_route_backward(&args, (&t.scores, &t.experts), &tdw, Some(&tg));
            self.compare(
                &format!("moe_route_backward {name}"),
                &rd,
                &td,
                self.tol.exact,
            );
            // The dispatch order and the auxiliary loss of the reference's choice on both.
            let experts = self.test.upload(&self.reference.download(&r.experts));
            let scores = self.test.upload(&self.reference.download(&r.scores));
            self.moe_aux(name, &args, (&r.experts, &r.scores), (&experts, &scores));
            let ro = self
                .reference
                .moe_dispatch_order(&r.experts, (e, args.top_k));
            let to = self.test.moe_dispatch_order(&experts, (e, args.top_k));
            for (what, rb, tb) in [
                ("rows", &ro.rows, &to.rows),
                ("slots", &ro.slots, &to.slots),
                ("row_of_slot", &ro.row_of_slot, &to.row_of_slot),
                ("offsets", &ro.offsets, &to.offsets),
            ] {
                self.compare_ids(&format!("moe_dispatch_order {name} {what}"), rb, tb);
            }
        }
    }

    /// The auxiliary loss's figures, balance and scores' gradient of one routing, on a rank whose
    /// 61 rows start at row 3 of four sequences of 16.
    fn moe_aux(
        &mut self,
        name: &str,
        args: &RouterArgs,
        (re, rs): (&R::Buf, &R::Buf),
        (te, ts): (&T::Buf, &T::Buf),
    ) {
        let span = SequenceSpan {
            first: 3,
            seq: 16,
            sequences: 4,
        };
        let rf = self.reference.moe_aux_figures((re, rs), args, span);
        let tf = self.test.moe_aux_figures((te, ts), args, span);
        self.compare(&format!("moe_aux_figures {name}"), &rf, &tf, self.tol.exact);
        let rb = self.reference.moe_aux_balance(&rf, args, span.sequences);
        let tb = self.test.moe_aux_balance(&tf, args, span.sequences);
        self.compare(&format!("moe_aux_balance {name}"), &rb, &tb, self.tol.exact);
        let tokens = self.reference.len(rs) / args.num_experts;
        let rg = (self.reference).moe_aux_score_grads((&rb, &rf), args, (span, tokens), 0.3);
        let tg = (self.test).moe_aux_score_grads((&tb, &tf), args, (span, tokens), 0.3);
        self.compare(
            &format!("moe_aux_score_grads {name}"),
            &rg,
            &tg,
            self.tol.exact,
        );
    }

    /// The experts' grouped GEMMs over uneven blocks of rows (one expert without rows, one of a
    /// single row): the forward, the input gradient added in, the weight gradients added in; and
    /// the load count from the same offsets.
    pub(super) fn grouped_experts(&mut self) {
        let offsets: Vec<u32> = vec![0, 70, 70, 200, 201, 261];
        let (experts, rows, dim, hidden) = (offsets.len() - 1, 261, 40, 72);
        let (ro, to) = self.both(&ids_to_bits(&offsets));
        let weights: Vec<_> = (0..experts)
            .map(|_| self.random_both(hidden * dim, 0.2))
            .collect();
        let rw: Vec<&R::Buf> = weights.iter().map(|w| &w.0).collect();
        let tw: Vec<&T::Buf> = weights.iter().map(|w| &w.1).collect();
        let (rx, tx) = self.random_both(rows * dim, 1.0);
        let forward = GroupedGemm {
            k: dim,
            n: hidden,
            trans_b: true,
            output: GemmOutput::Overwrite,
        };
        let (mut ry, mut ty) = (
            self.reference.zeros(rows * hidden),
            self.test.zeros(rows * hidden),
        );
        self.reference
            .grouped_matmul(&mut ry, &rx, (&rw, &ro), forward);
        self.test.grouped_matmul(&mut ty, &tx, (&tw, &to), forward);
        self.compare("grouped_matmul x.W^T", &ry, &ty, self.tol.gemm);
        let input_grad = GroupedGemm {
            k: hidden,
            n: dim,
            trans_b: false,
            output: GemmOutput::Accumulate,
        };
        let (mut rdx, mut tdx) = self.random_both(rows * dim, 1.0);
        self.reference
            .grouped_matmul(&mut rdx, &ry, (&rw, &ro), input_grad);
        self.test
            .grouped_matmul(&mut tdx, &ty, (&tw, &to), input_grad);
        self.compare("grouped_matmul dx += dy.W", &rdx, &tdx, self.tol.gemm);
        let mut grads: Vec<_> = (0..experts)
            .map(|_| self.random_both(hidden * dim, 1.0))
            .collect();
        let mut rg: Vec<&mut R::Buf> = grads.iter_mut().map(|g| &mut g.0).collect();
        self.reference
            .grouped_weight_grad(&mut rg, (&ry, &rx), &ro, (hidden, dim));
        let mut tg: Vec<&mut T::Buf> = grads.iter_mut().map(|g| &mut g.1).collect();
        self.test
            .grouped_weight_grad(&mut tg, (&ty, &tx), &to, (hidden, dim));
        for (e, (r, t)) in grads.iter().enumerate() {
            self.compare(
                &format!("grouped_weight_grad expert {e}"),
                r,
                t,
                self.tol.gemm,
            );
        }
        let (mut rc, mut tc) = (
            self.reference.zeros(2 * experts),
            self.test.zeros(2 * experts),
        );
        self.reference.moe_count_load(&mut rc, &ro, experts);
        self.test.moe_count_load(&mut tc, &to, experts);
        self.compare("moe_count_load", &rc, &tc, 0.0);
        self.clamped_swiglu();
    }

    /// gpt-oss's clamped SwiGLU, forward and backward, with values past both clamps.
    fn clamped_swiglu(&mut self) {
        let (n, clamp) = (10_007, (1.702, 7.0));
        let (rg, tg) = self.random_both(n, 10.0);
        let (ru, tu) = self.random_both(n, 10.0);
        let (rd, td) = self.random_both(n, 1.0);
        let (mut ra, mut ta) = (self.reference.zeros(n), self.test.zeros(n));
        self.reference
            .clamped_swiglu_forward(&mut ra, (&rg, &ru), clamp);
        self.test.clamped_swiglu_forward(&mut ta, (&tg, &tu), clamp);
        self.compare("clamped_swiglu_forward", &ra, &ta, self.tol.exact);
        let (mut rdg, mut tdg) = (self.reference.zeros(n), self.test.zeros(n));
        let (mut rdu, mut tdu) = (self.reference.zeros(n), self.test.zeros(n));
        let r_grads = (&mut rdg, &mut rdu);
        self.reference
            .clamped_swiglu_backward(r_grads, &rd, (&rg, &ru), clamp);
        let t_grads = (&mut tdg, &mut tdu);
        self.test
            .clamped_swiglu_backward(t_grads, &td, (&tg, &tu), clamp);
        self.compare("clamped_swiglu_backward dgate", &rdg, &tdg, self.tol.exact);
        self.compare("clamped_swiglu_backward dup", &rdu, &tdu, self.tol.exact);
    }
}
