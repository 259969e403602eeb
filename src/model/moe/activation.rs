//! The routed experts' gated activation: SwiGLU, `silu(gate) · up` (Qwen3-MoE, DeepSeek-V3), or
//! gpt-oss's clamped SwiGLU, `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with
//! `g = min(gate, limit)` (transformers' `GptOssExperts._apply_gate`), forward and backward.
//! Both are backend ops (`Backend::swiglu_forward`, `clamped_swiglu_forward`, and their backwards).

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
        match *self {
            ExpertActivation::Swiglu => be.swiglu_forward(act, gate, up),
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                be.clamped_swiglu_forward(act, (gate, up), (alpha, limit))
            }
        }
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
        match *self {
            ExpertActivation::Swiglu => be.swiglu_backward(dgate, dup, dact, gate, up),
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                be.clamped_swiglu_backward((dgate, dup), dact, (gate, up), (alpha, limit))
            }
        }
    }
}
