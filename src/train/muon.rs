//! Muon's arithmetic, as `torch.optim.Muon` defines it: the momentum (Nesterov's form by
//! default) on each rank's piece of a matrix, the Newton–Schulz iteration that orthogonalises a
//! whole matrix, and the learning-rate adjustment by its shape. Where the pieces meet (one rank
//! orthogonalising each matrix for all) is `parallel::muon_exchange`; `optimizer` composes both.
//!
//! Everything here is backend ops (GEMMs, scaling, adding, bf16 rounding), so one code runs on the
//! CPU and on CUDA.

use crate::backend::{Backend, GemmOutput, GemmShape};
use crate::config::OptimizerConfig;

/// The Newton–Schulz iteration's settings (`[optimizer] ns_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NewtonSchulz {
    pub coefficients: [f32; 3],
    pub steps: usize,
    pub eps: f32,
    /// Every product rounded to bf16, as PyTorch's Muon computes in bf16 (`ns_dtype`).
    pub bf16: bool,
}

impl NewtonSchulz {
    pub fn of(cfg: &OptimizerConfig) -> Self {
        NewtonSchulz {
            coefficients: cfg.ns_coefficients.map(|c| c as f32),
            steps: cfg.ns_steps,
            eps: cfg.ns_eps as f32,
            bf16: cfg.ns_dtype == "bfloat16",
        }
    }

    /// Multiply-adds ×2 of orthogonalising a `[rows, cols]` matrix: per step, the Gram matrix
    /// (`s²·l`), its square (`s³`) and the product with the matrix (`s²·l`), for `s` the smaller
    /// side and `l` the larger.
    pub fn flops(&self, rows: usize, cols: usize) -> f64 {
        let (s, l) = (rows.min(cols) as f64, rows.max(cols) as f64);
        self.steps as f64 * (4.0 * s * s * l + 2.0 * s * s * s)
    }

    /// Replaces `x` (`[rows, cols]`, row-major) by its approximate orthogonalisation: `x / ‖x‖_F`,
    /// then `steps` times `X ← a·X + (b·A + c·A²)·X` with `A = X·Xᵀ`, on the smaller Gram
    /// matrix (a tall matrix iterates `X ← a·X + X·(b·A + c·A²)` with `A = Xᵀ·X`, which is
    /// PyTorch's iteration on the transpose).
    pub fn orthogonalize<B: Backend>(&self, be: &B, x: &mut B::Buf, rows: usize, cols: usize) {
        let round = |buf: &mut B::Buf| {
            if self.bf16 {
                be.round_to_bf16(buf);
            }
        };
        round(x);
        let mut norm = be.sum_squares(x).sqrt() as f32;
        if self.bf16 {
            norm = half::bf16::from_f32(norm).to_f32();
        }
        be.scale(x, 1.0 / norm.max(self.eps));
        round(x);
        let [a, b, c] = self.coefficients;
        let (tall, s) = (rows > cols, rows.min(cols));
        let gram_shape = match tall {
            false => GemmShape::new(rows, cols, rows).b_transposed(),
            true => GemmShape::new(cols, rows, cols).a_transposed(),
        };
        let update_shape = match tall {
            false => GemmShape::new(rows, rows, cols),
            true => GemmShape::new(rows, cols, cols),
        };
        let (mut gram, mut poly, mut scaled) = (be.zeros(s * s), be.zeros(s * s), be.zeros(s * s));
        let mut next = be.zeros(rows * cols);
        for _ in 0..self.steps {
            be.matmul(&mut gram, x, x, gram_shape, GemmOutput::Overwrite);
            round(&mut gram);
            // poly = b·A + c·A·A
            be.copy_from(&mut poly, &gram);
            be.scale(&mut poly, b);
            be.copy_from(&mut scaled, &gram);
            be.scale(&mut scaled, c);
            let square = GemmShape::new(s, s, s);
            be.matmul(&mut poly, &scaled, &gram, square, GemmOutput::Accumulate);
            round(&mut poly);
            // next = a·X + poly·X (X·poly when tall)
            be.copy_from(&mut next, x);
            be.scale(&mut next, a);
            let (left, right) = if tall { (&*x, &poly) } else { (&poly, &*x) };
            be.matmul(&mut next, left, right, update_shape, GemmOutput::Accumulate);
            round(&mut next);
            std::mem::swap(x, &mut next);
        }
    }
}

/// Muon's learning rate for a `[rows, cols]` matrix (`[optimizer] adjust_lr_fn`).
pub fn adjusted_lr(lr: f64, adjust_lr_fn: &str, rows: usize, cols: usize) -> f64 {
    let (a, b) = (rows as f64, cols as f64);
    lr * match adjust_lr_fn {
        "match_rms_adamw" => 0.2 * a.max(b).sqrt(),
        "spectral_unclamped" => (a / b).sqrt(),
        _ => (a / b).max(1.0).sqrt(),
    }
}

/// How a step advances Muon's momentum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Momentum {
    pub momentum: f32,
    pub nesterov: bool,
    /// The clipping factor the gradient is read with.
    pub grad_scale: f32,
}

/// Advances the momentum buffer `buf` by `grad` (times `m.grad_scale`), `B ← μ·B + (1−μ)·g` (PyTorch's
/// `lerp`), and returns what is orthogonalised: `(1−μ)·g + μ·B` with Nesterov, else `B`. Works on
/// any piece of a matrix (elementwise).
pub fn momentum_update<B: Backend>(be: &B, buf: &mut B::Buf, grad: &B::Buf, m: Momentum) -> B::Buf {
    let mut share = be.copied(grad);
    be.scale(&mut share, m.grad_scale * (1.0 - m.momentum));
    be.scale(buf, m.momentum);
    be.add_assign(buf, &share);
    let mut update = be.copied(buf);
    if m.nesterov {
        be.scale(&mut update, m.momentum);
        be.add_assign(&mut update, &share);
    }
    update
}

/// The Newton–Schulz iteration on `test` against `reference` (`titan cuda check`'s Muon rows):
/// a wide and a tall matrix, in float32 (`gemm` tolerance: the GEMMs sum in another order) and
/// in bf16 (1e-2: a rounding that lands on the other side of a bf16 step moves a value by 2⁻⁸).
pub fn check_newton_schulz<R: Backend, T: Backend>(
    reference: &R,
    test: &T,
    gemm: f64,
    seed: u64,
) -> Vec<crate::backend::crosscheck::OpCheck> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut rows = Vec::new();
    for (bf16, tolerance) in [(false, gemm), (true, gemm.max(1e-2))] {
        let ns = NewtonSchulz {
            coefficients: [3.4445, -4.775, 2.0315],
            steps: 5,
            eps: 1e-7,
            bf16,
        };
        for (r, c) in [(48, 160), (160, 48)] {
            let x: Vec<f32> = (0..r * c).map(|_| rng.gen::<f32>() * 2.0 - 1.0).collect();
            let (mut want, mut got) = (reference.upload(&x), test.upload(&x));
            ns.orthogonalize(reference, &mut want, r, c);
            ns.orthogonalize(test, &mut got, r, c);
            let e = crate::backend::crosscheck::rel_err(
                &test.download(&got),
                &reference.download(&want),
            );
            let dtype = if bf16 { "bf16" } else { "fp32" };
            rows.push(crate::backend::crosscheck::OpCheck {
                op: format!("muon newton_schulz {r}x{c} {dtype}"),
                rel_err: e,
                tolerance,
                passed: e <= tolerance,
            });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// The iteration brings every singular value near 1 (PyTorch's coefficients leave them in
    /// roughly [0.7, 1.2]): `O·Oᵀ` close to the identity, for a wide and a tall matrix.
    #[test]
    fn newton_schulz_orthogonalizes_wide_and_tall_matrices() {
        let be = CpuBackend::new();
        let ns = NewtonSchulz {
            coefficients: [3.4445, -4.775, 2.0315],
            steps: 5,
            eps: 1e-7,
            bf16: false,
        };
        for (r, c) in [(8, 20), (20, 8)] {
            let x: Vec<f32> = (0..r * c)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let mut o = be.upload(&x);
            ns.orthogonalize(&be, &mut o, r, c);
            let s = r.min(c);
            let mut gram = be.zeros(s * s);
            let shape = match r <= c {
                true => GemmShape::new(r, c, r).b_transposed(),
                false => GemmShape::new(c, r, c).a_transposed(),
            };
            be.matmul(&mut gram, &o, &o, shape, GemmOutput::Overwrite);
            for i in 0..s {
                let diagonal = gram[i * s + i];
                assert!((0.45..1.45).contains(&diagonal), "{r}x{c}: σ² {diagonal}");
                for j in (0..s).filter(|&j| j != i) {
                    assert!(
                        gram[i * s + j].abs() < 0.35,
                        "{r}x{c}: ({i},{j}) {}",
                        gram[i * s + j]
                    );
                }
            }
        }
        // The same backend on both sides: identical.
        assert!(check_newton_schulz(&be, &be, 0.0, 3)
            .iter()
            .all(|row| row.passed));
    }
}
