//! The routed experts' gated activation: SwiGLU, `silu(gate) · up` (Qwen3-MoE, DeepSeek-V3), or
//! gpt-oss's clamped SwiGLU, `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with
//! `g = min(gate, limit)` (transformers' `GptOssExperts._apply_gate`), forward and backward.
//!
//! The clamped form runs on the host (a download and an upload on a device; no backend op of its
//! own yet, issue 45): an elementwise op over `[rows, hidden]` is far below the experts' GEMMs,
//! and gpt-oss has not run on a GPU.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::backend::Backend;

/// Which gated activation the experts apply to their gate and up projections.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertActivation {
    /// `silu(gate) · up`.
    #[default]
    Swiglu,
    /// gpt-oss's: the gate clamped above at `limit`, the up projection to `[−limit, limit]`,
    /// `(up + 1) · gate · σ(alpha · gate)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl ExpertActivation {
    /// gpt-oss's published constants (transformers' `swiglu_alpha`, `swiglu_limit`).
    pub const GPT_OSS: ExpertActivation = ExpertActivation::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };

    pub fn is_default(&self) -> bool {
        *self == ExpertActivation::Swiglu
    }

    /// `act = f(gate, up)` elementwise.
    pub fn forward<B: Backend>(&self, be: &B, act: &mut B::Buf, gate: &B::Buf, up: &B::Buf) {
        let &ExpertActivation::ClampedSwiglu { alpha, limit } = self else {
            return be.swiglu_forward(act, gate, up);
        };
        let (g, u) = (be.download(gate), be.download(up));
        let out: Vec<f32> = g
            .par_iter()
            .zip(&u)
            .map(|(&g, &u)| clamped(alpha, limit, g, u).0)
            .collect();
        *act = be.upload_owned(out);
    }

    /// `dgate`, `dup` from `dact` and the forward's `gate`, `up`.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        (dgate, dup): (&mut B::Buf, &mut B::Buf),
        dact: &B::Buf,
        gate: &B::Buf,
        up: &B::Buf,
    ) {
        let &ExpertActivation::ClampedSwiglu { alpha, limit } = self else {
            return be.swiglu_backward(dgate, dup, dact, gate, up);
        };
        let (g, u, d) = (be.download(gate), be.download(up), be.download(dact));
        let (dg, du): (Vec<f32>, Vec<f32>) = g
            .par_iter()
            .zip(&u)
            .zip(&d)
            .map(|((&g, &u), &d)| {
                let (_, dg, du) = clamped(alpha, limit, g, u);
                (d * dg, d * du)
            })
            .unzip();
        *dgate = be.upload_owned(dg);
        *dup = be.upload_owned(du);
    }
}

/// The clamped SwiGLU of one pair and its two partial derivatives. A clamp passes the gradient
/// where its input is within the bounds, bounds included (PyTorch's `clamp`).
fn clamped(alpha: f32, limit: f32, gate: f32, up: f32) -> (f32, f32, f32) {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    let s = 1.0 / (1.0 + (-alpha * g).exp());
    let glu = g * s;
    let out = (u + 1.0) * glu;
    let dg = match gate <= limit {
        true => (u + 1.0) * (s + g * alpha * s * (1.0 - s)),
        false => 0.0,
    };
    let du = match (-limit..=limit).contains(&up) {
        true => glu,
        false => 0.0,
    };
    (out, dg, du)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clamped_swiglu_matches_its_definition_and_finite_differences() {
        let (alpha, limit) = (1.702f32, 7.0f32);
        let f = |g: f64, u: f64| {
            let g = g.min(limit as f64);
            let u = u.clamp(-(limit as f64), limit as f64);
            (u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp())
        };
        for (g, u) in [
            (0.3, -0.7),
            (-2.5, 1.2),
            (8.0, 0.5),
            (1.0, 9.0),
            (-3.0, -8.0),
        ] {
            let (out, dg, du) = clamped(alpha, limit, g as f32, u as f32);
            assert!((out as f64 - f(g, u)).abs() < 1e-5, "{g} {u}");
            let eps = 1e-4;
            let ng = (f(g + eps, u) - f(g - eps, u)) / (2.0 * eps);
            let nu = (f(g, u + eps) - f(g, u - eps)) / (2.0 * eps);
            assert!(
                (dg as f64 - ng).abs() < 1e-3,
                "dgate at {g} {u}: {dg} vs {ng}"
            );
            assert!(
                (du as f64 - nu).abs() < 1e-3,
                "dup at {g} {u}: {du} vs {nu}"
            );
        }
    }
}
