//! Op-by-op comparison of two backends on the same fresh random inputs: every kernel of the trait,
//! forward and backward, run on a reference (the CPU) and on the backend under test (CUDA), with
//! the largest relative error of each output reported. `titan cuda check` prints this table; the
//! tests run it CPU-vs-CPU and against a deliberately broken backend to prove it can fail.

mod attention;
mod float8;
mod gemm;
mod routing;
pub use float8::check_float8_gemms;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{
    AdamWStep, AttnShape, Backend, GemmOutput, GemmShape, LossSum, VocabShard, WeightDecay,
    IGNORE_INDEX,
};

/// One output of one op.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpCheck {
    pub op: String,
    /// `max |test − ref| / max |ref|` over the output (NaN or ∞ when the test output is not finite).
    pub rel_err: f64,
    pub tolerance: f64,
    pub passed: bool,
}

/// Relative error of `test` against `reference`: the largest absolute difference over the largest
/// reference magnitude. A NaN or ∞ anywhere in `test` (or a length mismatch) never passes.
pub fn rel_err(test: &[f32], reference: &[f32]) -> f64 {
    if test.len() != reference.len() || test.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let scale = reference
        .iter()
        .fold(0.0f64, |m, &v| m.max((v as f64).abs()))
        .max(1e-30);
    let diff = test
        .iter()
        .zip(reference)
        .fold(0.0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale
}

/// Tolerances: `exact` for ops computed in fp32 on both sides, `gemm` for ops that go through the
/// test backend's GEMMs (1e-2 when those run in bf16 or TF32), `attention` for attention (1e-2 only
/// where it runs on bf16 tensor cores).
#[derive(Debug, Clone, Copy)]
pub struct Tolerances {
    pub exact: f64,
    pub gemm: f64,
    pub attention: f64,
}

struct Checker<'a, R: Backend, T: Backend> {
    reference: &'a R,
    test: &'a T,
    rng: ChaCha8Rng,
    tol: Tolerances,
    results: Vec<OpCheck>,
}

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    fn random(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.rng.gen::<f32>() * 2.0 - 1.0) * scale)
            .collect()
    }

    fn ids(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n)
            .map(|_| self.rng.gen_range(0..below as u32))
            .collect()
    }

    fn record(&mut self, op: &str, test: &[f32], reference: &[f32], tolerance: f64) {
        let e = rel_err(test, reference);
        self.results.push(OpCheck {
            op: op.to_string(),
            rel_err: e,
            tolerance,
            passed: e <= tolerance,
        });
    }

    /// Uploads `data` to both backends.
    fn both(&self, data: &[f32]) -> (R::Buf, T::Buf) {
        (self.reference.upload(data), self.test.upload(data))
    }

    /// The same product on both backends: each pair is (reference's, test's).
    fn matmul_both(
        &self,
        (ro, to): (&mut R::Buf, &mut T::Buf),
        (ra, ta): (&R::Buf, &T::Buf),
        (rb, tb): (&R::Buf, &T::Buf),
        shape: GemmShape,
        output: GemmOutput,
    ) {
        self.reference.matmul(ro, ra, rb, shape, output);
        self.test.matmul(to, ta, tb, shape, output);
    }

    /// Downloads one buffer from each backend and records their difference.
    fn compare(&mut self, op: &str, r: &R::Buf, t: &T::Buf, tolerance: f64) {
        let (rv, tv) = (self.reference.download(r), self.test.download(t));
        self.record(op, &tv, &rv, tolerance);
    }

    fn embedding(&mut self) {
        let (vocab, dim, tokens) = (50, 96, 300);
        let table = self.random(vocab * dim, 1.0);
        let ids = self.ids(tokens, vocab);
        let (rt, tt) = self.both(&table);
        let (mut ro, mut to) = (
            self.reference.zeros(tokens * dim),
            self.test.zeros(tokens * dim),
        );
        self.reference.embedding_forward(&mut ro, &rt, &ids, dim);
        self.test.embedding_forward(&mut to, &tt, &ids, dim);
        self.compare("embedding_forward", &ro, &to, self.tol.exact);
        let dout = self.random(tokens * dim, 1.0);
        let (rd, td) = self.both(&dout);
        let init = self.random(vocab * dim, 1.0);
        let (mut rg, mut tg) = self.both(&init);
        self.reference.embedding_backward(&mut rg, &rd, &ids, dim);
        self.test.embedding_backward(&mut tg, &td, &ids, dim);
        self.compare("embedding_backward", &rg, &tg, self.tol.exact);
    }

    /// RMSNorm's forward on random rows on both backends: (x, weight, out, rstd), each as a
    /// (reference, test) pair.
    fn rmsnorm_both(&mut self, rows: usize, dim: usize) -> [(R::Buf, T::Buf); 4] {
        let x = self.random(rows * dim, 2.0);
        let w = self.random(dim, 1.0);
        let (rx, tx) = self.both(&x);
        let (rw, tw) = self.both(&w);
        let (mut ro, mut to) = (
            self.reference.zeros(rows * dim),
            self.test.zeros(rows * dim),
        );
        let (mut rr, mut tr) = (self.reference.zeros(rows), self.test.zeros(rows));
        self.reference
            .rmsnorm_forward(&mut ro, &mut rr, &rx, &rw, dim, 1e-5);
        self.test
            .rmsnorm_forward(&mut to, &mut tr, &tx, &tw, dim, 1e-5);
        [(rx, tx), (rw, tw), (ro, to), (rr, tr)]
    }

    fn rmsnorm(&mut self) {
        // Several 128-row chunks of the weight gradient's first pass, the last one partial.
        let (rows, dim) = (300, 1000);
        let [(rx, tx), (rw, tw), (ro, to), (rr, tr)] = self.rmsnorm_both(rows, dim);
        self.compare("rmsnorm_forward out", &ro, &to, self.tol.exact);
        self.compare("rmsnorm_forward rstd", &rr, &tr, self.tol.exact);
        let dout = self.random(rows * dim, 1.0);
        let (rd, td) = self.both(&dout);
        let dx0 = self.random(rows * dim, 1.0);
        let dw0 = self.random(dim, 1.0);
        let (mut rdx, mut tdx) = self.both(&dx0);
        let (mut rdw, mut tdw) = self.both(&dw0);
        self.reference
            .rmsnorm_backward(&mut rdx, &mut rdw, &rd, &rx, &rw, &rr, dim);
        self.test
            .rmsnorm_backward(&mut tdx, &mut tdw, &td, &tx, &tw, &tr, dim);
        self.compare("rmsnorm_backward dx", &rdx, &tdx, self.tol.exact);
        self.compare("rmsnorm_backward dweight", &rdw, &tdw, self.tol.exact);
    }

    fn swiglu_and_elementwise(&mut self) {
        let n = 10_007;
        let g = self.random(n, 4.0);
        let u = self.random(n, 2.0);
        let (rg, tg) = self.both(&g);
        let (ru, tu) = self.both(&u);
        let (mut ro, mut to) = (self.reference.zeros(n), self.test.zeros(n));
        self.reference.swiglu_forward(&mut ro, &rg, &ru);
        self.test.swiglu_forward(&mut to, &tg, &tu);
        self.compare("swiglu_forward", &ro, &to, self.tol.exact);
        let d = self.random(n, 1.0);
        let (rd, td) = self.both(&d);
        let (mut rdg, mut tdg) = (self.reference.zeros(n), self.test.zeros(n));
        let (mut rdu, mut tdu) = (self.reference.zeros(n), self.test.zeros(n));
        self.reference
            .swiglu_backward(&mut rdg, &mut rdu, &rd, &rg, &ru);
        self.test.swiglu_backward(&mut tdg, &mut tdu, &td, &tg, &tu);
        self.compare("swiglu_backward dgate", &rdg, &tdg, self.tol.exact);
        self.compare("swiglu_backward dup", &rdu, &tdu, self.tol.exact);

        self.reference.add(&mut ro, &rg, &ru);
        self.test.add(&mut to, &tg, &tu);
        self.compare("add", &ro, &to, self.tol.exact);
        self.reference.add_assign(&mut ro, &rd);
        self.test.add_assign(&mut to, &td);
        self.compare("add_assign", &ro, &to, self.tol.exact);
        self.reference.scale(&mut ro, -0.37);
        self.test.scale(&mut to, -0.37);
        self.compare("scale", &ro, &to, self.tol.exact);
        let (mut rb, mut tb) = (self.reference.zeros(3 * n), self.test.zeros(3 * n));
        self.reference.fill(&mut rb, 0.5);
        self.test.fill(&mut tb, 0.5);
        self.reference.copy_into_at(&mut rb, n + 3, &ro);
        self.test.copy_into_at(&mut tb, n + 3, &to);
        self.compare("fill + copy_into_at", &rb, &tb, self.tol.exact);
        self.reference.copy_range(&mut rb, 5, &ro, n / 3, n / 2);
        self.test.copy_range(&mut tb, 5, &to, n / 3, n / 2);
        self.compare("copy_range", &rb, &tb, self.tol.exact);
        self.reference.add_range(&mut rb, 2 * n + 1, &ro, 7, n - 9);
        self.test.add_range(&mut tb, 2 * n + 1, &to, 7, n - 9);
        self.compare("add_range", &rb, &tb, self.tol.exact);
        // FSDP's strided packing: 7 rows of 301 values, from rows 1000 apart into rows 400 apart
        // (and back the other way, wider apart than the rows are long).
        let (mut rr, mut tr) = (self.reference.zeros(3000), self.test.zeros(3000));
        self.reference
            .copy_rows(&mut rr, 11, 400, &ro, 3, 1000, 7, 301);
        self.test.copy_rows(&mut tr, 11, 400, &to, 3, 1000, 7, 301);
        self.compare("copy_rows", &rr, &tr, self.tol.exact);
        self.reference
            .copy_rows(&mut rb, 2, 1301, &rr, 11, 400, 7, 301);
        self.test.copy_rows(&mut tb, 2, 1301, &tr, 11, 400, 7, 301);
        self.compare("copy_rows back", &rb, &tb, self.tol.exact);
        self.reference
            .add_rows(&mut rb, 5, 1301, &rr, 11, 400, 7, 301);
        self.test.add_rows(&mut tb, 5, 1301, &tr, 11, 400, 7, 301);
        self.compare("add_rows", &rb, &tb, self.tol.exact);
        let mut values = self.random(n, 3.0);
        values.extend([
            0.0,
            -0.0,
            3.0e38,
            f32::MIN_POSITIVE,
            1.0 + f32::EPSILON,
            1.003_906_3,
        ]);
        let (mut rr, mut tr) = self.both(&values);
        self.reference.round_to_bf16(&mut rr);
        self.test.round_to_bf16(&mut tr);
        self.compare("round_to_bf16", &rr, &tr, 0.0);
        // bf16 pairs (an odd count: the last word's high half is padding), through and back.
        let m = values.len() - 1 + values.len() % 2;
        let (src_r, src_t) = self.both(&values[..m]);
        let (mut wr, mut wt) = (
            self.reference.zeros(m.div_ceil(2)),
            self.test.zeros(m.div_ceil(2)),
        );
        self.reference.pack_bf16_pairs(&mut wr, &src_r);
        self.test.pack_bf16_pairs(&mut wt, &src_t);
        let (mut ur, mut ut) = (self.reference.zeros(m), self.test.zeros(m));
        self.reference.unpack_bf16_pairs(&mut ur, &wr);
        self.test.unpack_bf16_pairs(&mut ut, &wt);
        self.compare("pack_bf16_pairs + unpack", &ur, &ut, 0.0);
        self.reference.copy_from(&mut ro, &rg);
        self.test.copy_from(&mut to, &tg);
        self.compare("copy_from", &ro, &to, self.tol.exact);
    }

    fn cross_entropy(&mut self) {
        // More rows than one loss chunk of either backend, and some ignored targets.
        let (rows, dim, vocab) = (1500, 32, 300);
        let h = self.random(rows * dim, 1.0);
        let w = self.random(vocab * dim, 0.5);
        let mut targets = self.ids(rows, vocab);
        for t in targets.iter_mut().step_by(7) {
            *t = IGNORE_INDEX;
        }
        let (rh, th) = self.both(&h);
        let (rw, tw) = self.both(&w);
        let dh0 = self.random(rows * dim, 0.1);
        let dw0 = self.random(vocab * dim, 0.1);
        let (mut rdh, mut tdh) = self.both(&dh0);
        let (mut rdw, mut tdw) = self.both(&dw0);
        let scale = 1.0 / rows as f32;
        let rl = self.reference.cross_entropy_forward_backward(
            &rh,
            &rw,
            &targets,
            dim,
            vocab,
            scale,
            Some((&mut rdh, &mut rdw)),
        );
        let tl = self.test.cross_entropy_forward_backward(
            &th,
            &tw,
            &targets,
            dim,
            vocab,
            scale,
            Some((&mut tdh, &mut tdw)),
        );
        let count_ok = rl.count == tl.count;
        self.record(
            "cross_entropy loss",
            &[tl.sum as f32, if count_ok { 0.0 } else { f32::NAN }],
            &[rl.sum as f32, 0.0],
            self.tol.gemm,
        );
        self.compare("cross_entropy dh", &rdh, &tdh, self.tol.gemm);
        self.compare("cross_entropy dweight", &rdw, &tdw, self.tol.gemm);
        // The loss of logits given whole (a float8 output head's), with their gradient in place.
        let logits = self.random(rows * vocab, 4.0);
        let (mut rlg, mut tlg) = self.both(&logits);
        let rl = self
            .reference
            .cross_entropy_of_logits(&mut rlg, &targets, vocab, scale, true);
        let tl = self
            .test
            .cross_entropy_of_logits(&mut tlg, &targets, vocab, scale, true);
        let count_ok = rl.count == tl.count;
        self.record(
            "cross_entropy_of_logits loss",
            &[tl.sum as f32, if count_ok { 0.0 } else { f32::NAN }],
            &[rl.sum as f32, 0.0],
            self.tol.gemm,
        );
        self.compare("cross_entropy_of_logits dlogits", &rlg, &tlg, self.tol.gemm);
    }

    /// The vocabulary-parallel loss's three steps on one shard (ids 300..500 of a vocabulary of
    /// 800, targets in and outside it, some ignored), each output against the reference.
    fn vocab_shard_loss(&mut self) {
        let (rows, shard) = (
            300,
            VocabShard {
                vocab: 200,
                offset: 300,
            },
        );
        let logits = self.random(rows * shard.vocab, 4.0);
        let mut targets = self.ids(rows, 800);
        for t in targets.iter_mut().step_by(7) {
            *t = IGNORE_INDEX;
        }
        let (mut rlg, mut tlg) = self.both(&logits);
        let (rm, tm) = (
            self.reference.vocab_shard_row_max(&rlg, shard),
            self.test.vocab_shard_row_max(&tlg, shard),
        );
        self.compare("vocab_shard_row_max", &rm, &tm, self.tol.exact);
        let rs = self
            .reference
            .vocab_shard_row_sums(&rlg, &rm, &targets, shard);
        let ts = self.test.vocab_shard_row_sums(&tlg, &tm, &targets, shard);
        self.compare("vocab_shard_row_sums", &rs, &ts, self.tol.gemm);
        let (mut rl, mut tl) = (
            LossSum { sum: 0.0, count: 0 },
            LossSum { sum: 0.0, count: 0 },
        );
        let grad = (1.0 / rows as f32, true);
        let reference = &self.reference;
        reference.vocab_shard_loss(&mut rlg, (&rm, &rs), &targets, shard, grad, &mut rl);
        self.test
            .vocab_shard_loss(&mut tlg, (&tm, &ts), &targets, shard, grad, &mut tl);
        let count_ok = rl.count == tl.count;
        self.record(
            "vocab_shard_loss loss",
            &[tl.sum as f32, if count_ok { 0.0 } else { f32::NAN }],
            &[rl.sum as f32, 0.0],
            self.tol.gemm,
        );
        self.compare("vocab_shard_loss dlogits", &rlg, &tlg, self.tol.gemm);
    }

    fn adamw_and_norm(&mut self) {
        let n = 5000;
        let p = self.random(n, 1.0);
        let g = self.random(n, 0.1);
        let m = self.random(n, 0.01);
        let v: Vec<f32> = self.random(n, 1e-3).iter().map(|x| x.abs()).collect();
        let (mut rp, mut tp) = self.both(&p);
        let (rg, tg) = self.both(&g);
        let (mut rm, mut tm) = self.both(&m);
        let (mut rv, mut tv) = self.both(&v);
        let hp = AdamWStep {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 7,
            grad_scale: 0.75,
            decay: WeightDecay::Decoupled,
        };
        self.reference
            .adamw_step(&mut rp, &rg, &mut rm, &mut rv, hp);
        self.test.adamw_step(&mut tp, &tg, &mut tm, &mut tv, hp);
        self.compare("adamw_step param", &rp, &tp, self.tol.exact);
        self.compare("adamw_step exp_avg", &rm, &tm, self.tol.exact);
        self.compare("adamw_step exp_avg_sq", &rv, &tv, self.tol.exact);
        // Adam: the decay as an L2 term of the gradient.
        let adam = AdamWStep {
            decay: WeightDecay::L2,
            ..hp
        };
        self.reference
            .adamw_step(&mut rp, &rg, &mut rm, &mut rv, adam);
        self.test.adamw_step(&mut tp, &tg, &mut tm, &mut tv, adam);
        self.compare("adam_step param", &rp, &tp, self.tol.exact);
        self.compare("adam_step exp_avg", &rm, &tm, self.tol.exact);
        let big = self.random(300_001, 3.0);
        let (rb, tb) = self.both(&big);
        let (rs, ts) = (self.reference.sum_squares(&rb), self.test.sum_squares(&tb));
        self.record("sum_squares", &[ts as f32], &[rs as f32], self.tol.exact);
    }

    /// The multi-tensor ops over a list with an empty tensor and lengths on both sides of the
    /// device kernels' 8192-element chunks.
    fn multi_tensor(&mut self) {
        let lens = [3000, 0, 8192, 1, 8193, 20000, 5];
        let (mut rp, mut tp) = self.both_list(&lens, 1.0);
        let (rg, tg) = self.both_list(&lens, 0.1);
        let (mut rm, mut tm) = self.both_list(&lens, 0.01);
        let (mut rv, mut tv) = self.both_list(&lens, -1e-3);
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 0.5,
            decay: WeightDecay::Decoupled,
        };
        // Tensor 2 (8192 values) as a 64 × 128 weight, multiplied before and after the update: a
        // device must not reuse the bf16 conversion of the old values.
        let (m, k, n) = (33, 128, 64);
        let x = self.random(m * k, 1.0);
        let (rx, tx) = self.both(&x);
        let (mut ro, mut to) = (self.reference.zeros(m * n), self.test.zeros(m * n));
        self.matmul_both(
            (&mut ro, &mut to),
            (&rx, &tx),
            (&rp[2], &tp[2]),
            GemmShape::new(m, k, n).b_transposed(),
            GemmOutput::Overwrite,
        );
        self.reference
            .adamw_step_all(&mut rp, &rg, &mut rm, &mut rv, hp);
        self.test.adamw_step_all(&mut tp, &tg, &mut tm, &mut tv, hp);
        for (what, r, t) in [
            ("param", &rp, &tp),
            ("exp_avg", &rm, &tm),
            ("exp_avg_sq", &rv, &tv),
        ] {
            let (rv, tv) = (download_all(self.reference, r), download_all(self.test, t));
            self.record(&format!("adamw_step_all {what}"), &tv, &rv, self.tol.exact);
        }
        self.matmul_both(
            (&mut ro, &mut to),
            (&rx, &tx),
            (&rp[2], &tp[2]),
            GemmShape::new(m, k, n).b_transposed(),
            GemmOutput::Overwrite,
        );
        self.compare(
            "matmul on a parameter after its update",
            &ro,
            &to,
            self.tol.gemm,
        );
        let (rs, ts) = (
            self.reference.sum_squares_all(&rg),
            self.test.sum_squares_all(&tg),
        );
        self.record(
            "sum_squares_all",
            &[ts as f32],
            &[rs as f32],
            self.tol.exact,
        );
        // From identical inputs (the gradients), so the rounding must agree exactly.
        self.reference.copy_rounded_to_bf16_all(&mut rm, &rg);
        self.test.copy_rounded_to_bf16_all(&mut tm, &tg);
        let (rc, tc) = (
            download_all(self.reference, &rm),
            download_all(self.test, &tm),
        );
        self.record("copy_rounded_to_bf16_all", &tc, &rc, 0.0);
        // A GEMM reading a compute-copy tensor: on a device it reads the bf16 twin the copy wrote.
        self.matmul_both(
            (&mut ro, &mut to),
            (&rx, &tx),
            (&rm[2], &tm[2]),
            GemmShape::new(m, k, n).b_transposed(),
            GemmOutput::Overwrite,
        );
        self.compare("matmul on the compute copy", &ro, &to, self.tol.gemm);
        self.reference.fill_all(&mut rv, 0.25);
        self.test.fill_all(&mut tv, 0.25);
        let (rf, tf) = (
            download_all(self.reference, &rv),
            download_all(self.test, &tv),
        );
        self.record("fill_all", &tf, &rf, 0.0);
    }

    /// Random tensors of the given lengths on both backends (uniform in ±scale; with a negative
    /// scale, magnitudes only, as second moments are).
    fn both_list(&mut self, lens: &[usize], scale: f32) -> (Vec<R::Buf>, Vec<T::Buf>) {
        lens.iter()
            .map(|&n| {
                let mut values = self.random(n, scale.abs());
                if scale < 0.0 {
                    values.iter_mut().for_each(|v| *v = v.abs());
                }
                self.both(&values)
            })
            .unzip()
    }
}

/// Every buffer of a list, downloaded back to back.
fn download_all<X: Backend>(be: &X, bufs: &[X::Buf]) -> Vec<f32> {
    bufs.iter().flat_map(|b| be.download(b)).collect()
}

/// Runs every op on both backends and returns one row per output. Each op family runs on its own
/// and waits for the device: a family that panics (a failed launch, a device fault) becomes a
/// failed row naming it and the panic, and the families after it still run, so one broken kernel
/// does not hide the state of the others. With `echo`, each row goes to stderr as it is measured.
pub fn check_ops<R: Backend, T: Backend>(
    reference: &R,
    test: &T,
    tol: Tolerances,
    seed: u64,
    echo: bool,
) -> Vec<OpCheck> {
    let mut c = Checker {
        reference,
        test,
        rng: ChaCha8Rng::seed_from_u64(seed),
        tol,
        results: Vec::new(),
    };
    type Family<'c, 'a, R, T> = (&'static str, Box<dyn FnOnce(&mut Checker<'a, R, T>) + 'c>);
    let families: Vec<Family<'_, '_, R, T>> = vec![
        ("matmul", Box::new(|c| c.matmul())),
        (
            "matmul on kernel outputs",
            Box::new(|c| c.gemm_on_kernel_outputs()),
        ),
        (
            "feed-forward through bf16 activations",
            Box::new(|c| c.feed_forward_through_bf16_activations()),
        ),
        (
            "bf16 activations kept as pairs",
            Box::new(|c| c.bf16_activations_kept_as_pairs()),
        ),
        ("embedding", Box::new(|c| c.embedding())),
        ("rmsnorm", Box::new(|c| c.rmsnorm())),
        ("rope", Box::new(|c| c.rope())),
        (
            "attention MHA hd16",
            Box::new(|c| c.attention("MHA hd16", AttnShape::causal(2, 45, 4, 4, 16), true)),
        ),
        (
            "attention GQA hd64",
            Box::new(|c| c.attention("GQA hd64", AttnShape::causal(1, 77, 4, 2, 64), true)),
        ),
        (
            "attention GQA hd128",
            Box::new(|c| c.attention("GQA hd128", AttnShape::causal(1, 40, 8, 2, 128), true)),
        ),
        (
            "attention GQA hd64 long",
            Box::new(|c| c.attention("GQA hd64 long", AttnShape::causal(2, 200, 4, 2, 64), true)),
        ),
        (
            "attention GQA hd128 long",
            Box::new(|c| c.attention("GQA hd128 long", AttnShape::causal(1, 150, 4, 1, 128), true)),
        ),
        (
            "attention KV cache",
            Box::new(|c| {
                let shape = AttnShape {
                    batch: 2,
                    q_len: 5,
                    kv_len: 38,
                    kv_capacity: 48,
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: 32,
                    q_offset: 33,
                };
                c.attention("KV cache", shape, false)
            }),
        ),
        (
            "attention context-parallel blocks",
            Box::new(|c| {
                // A query chunk against a key chunk wholly before it, and against the keys up to
                // and under it: ring attention's blocks, forward and backward.
                let before = AttnShape {
                    batch: 2,
                    q_len: 40,
                    kv_len: 40,
                    kv_capacity: 40,
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: 64,
                    q_offset: 80,
                };
                c.attention("CP block before", before, true);
                let prefix = AttnShape {
                    kv_len: 120,
                    kv_capacity: 120,
                    ..before
                };
                c.attention("CP prefix", prefix, true);
                c.attention_merge();
            }),
        ),
        (
            "attention documents and window",
            Box::new(|c| c.attention_documents()),
        ),
        ("elementwise", Box::new(|c| c.swiglu_and_elementwise())),
        ("mixture-of-experts row ops", Box::new(|c| c.moe_row_ops())),
        ("mixture-of-experts routing", Box::new(|c| c.moe_routing())),
        (
            "mixture-of-experts grouped GEMMs",
            Box::new(|c| c.grouped_experts()),
        ),
        ("cross_entropy", Box::new(|c| c.cross_entropy())),
        (
            "vocabulary-parallel loss",
            Box::new(|c| c.vocab_shard_loss()),
        ),
        ("adamw and norm", Box::new(|c| c.adamw_and_norm())),
        ("multi-tensor", Box::new(|c| c.multi_tensor())),
        ("float8", Box::new(|c| c.float8())),
    ];
    for (family, run) in families {
        let before = c.results.len();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run(&mut c);
            c.test.synchronize();
        }));
        if let Err(payload) = outcome {
            c.results.push(OpCheck {
                op: format!("{family}: panicked: {}", panic_message(payload.as_ref())),
                rel_err: f64::NAN,
                tolerance: 0.0,
                passed: false,
            });
        }
        if echo {
            for r in &c.results[before..] {
                errln!(
                    "checked {}: rel err {:.2e} (tolerance {:.0e}) {}",
                    r.op,
                    r.rel_err,
                    r.tolerance,
                    if r.passed { "ok" } else { "FAIL" }
                );
            }
        }
    }
    c.results
}

/// The text of a caught panic.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("non-text panic")
}

/// The table `titan cuda check` prints: one line per output, then the verdict.
pub fn format_table(rows: &[OpCheck]) -> String {
    let width = rows.iter().map(|r| r.op.chars().count()).max().unwrap_or(2);
    let mut out = format!(
        "{:<width$}  {:>10}  {:>9}  result\n",
        "op", "rel err", "tolerance"
    );
    for r in rows {
        let pad = width - r.op.chars().count();
        out += &format!(
            "{}{}  {:>10.2e}  {:>9.0e}  {}\n",
            r.op,
            " ".repeat(pad),
            r.rel_err,
            r.tolerance,
            if r.passed { "ok" } else { "FAIL" }
        );
    }
    let failed = rows.iter().filter(|r| !r.passed).count();
    out += &format!(
        "{} of {} outputs within tolerance\n",
        rows.len() - failed,
        rows.len()
    );
    out
}
