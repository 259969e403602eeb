//! Llama 4's published shapes (`[model] name = "llama4"`): `17bx16e` (Scout) and `17bx128e`
//! (Maverick), as Meta's Hugging Face configs give them, and TorchTitan's `debugmodel` (dim 256,
//! 6 blocks, 8 experts of 512 with a shared one, the experts in every other block).

use crate::backend::cpu::rope::{Llama3Scaling, RopeScaling};
use crate::model::args::AttentionTemperature;
use crate::model::moe::activation::ExpertActivation;
use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "llama4"`.
pub const FLAVORS: &[&str] = &["debugmodel", "17bx16e", "17bx128e"];

/// Llama 4's temperature tuning on its NoPE blocks: 1 below position 8191.
pub const TEMPERATURE: AttentionTemperature = AttentionTemperature {
    floor_scale: 8192,
    scale: 0.1,
};

/// Scout's (and TorchTitan's debug model's) RoPE: Llama 3's scaling by 16 of 8192 positions,
/// both frequency factors 1.
pub const SCOUT_ROPE: RopeScaling = RopeScaling::Llama3(Llama3Scaling {
    factor: 16.0,
    low_freq_factor: 1.0,
    high_freq_factor: 1.0,
    original_max_position_embeddings: 8192,
});

/// What tells Llama 4's flavors apart.
pub struct Llama4Shape {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    /// The dense blocks' SwiGLU width (`intermediate_size_mlp`).
    pub ffn_hidden: usize,
    /// Each routed expert's width, and the shared expert's (`intermediate_size`).
    pub moe_hidden: usize,
    pub experts: usize,
    /// The experts in block `l` when `l + 1` is a multiple of it (`interleave_moe_layer_step`).
    pub moe_step: usize,
    /// Chunked attention's chunk on the blocks with RoPE (None: full causal attention).
    pub chunk: Option<usize>,
    pub l2_qk_norm: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub max_seq_len: usize,
}

/// The block every Llama 4 shares: every fourth block without RoPE (blocks 3, 7, …; their
/// queries temperature-tuned), chunked attention on the others (with the L2 QK-norm where
/// `l2_qk_norm`), and in the expert blocks one routed expert per token, chosen by the top router
/// logit and its sigmoid scaling the expert's input, beside a shared expert as wide.
pub fn llama4(s: Llama4Shape) -> ModelArgs {
    ModelArgs {
        dim: s.dim,
        n_layers: s.n_layers,
        n_heads: s.n_heads,
        n_kv_heads: s.n_kv_heads,
        vocab_size: s.vocab_size,
        ffn_hidden: s.ffn_hidden,
        norm_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: s.rope_scaling,
        max_seq_len: s.max_seq_len,
        tied_embeddings: false,
        attention_head_dim: None,
        qk_norm: false,
        moe: Some(MoeArgs {
            hidden: s.moe_hidden,
            shared_hidden: Some(s.moe_hidden),
            router: RouterArgs {
                num_experts: s.experts,
                top_k: 1,
                score_func: ScoreFunc::Sigmoid,
                norm_topk_prob: false,
                route_scale: 1.0,
                groups: None,
            },
            // TorchTitan trains Llama 4 with auxiliary-loss-free load balancing.
            load_balance_coeff: Some(1e-3),
            aux_loss_coef: None,
            first_dense_layers: 0,
            sparse_step: s.moe_step,
            linear_biases: false,
            activation: ExpertActivation::Swiglu,
            score_before_experts: true,
        }),
        mla: None,
        lora: None,
        attention_sinks: false,
        sliding_window: None,
        attention_bias: false,
        every_n_layers_nope: Some(4),
        attention_chunk_size: s.chunk,
        l2_qk_norm: s.l2_qk_norm,
        attention_temperature: Some(TEMPERATURE),
    }
}

/// Published Llama 4 shapes (None: not a Llama 4 flavor).
pub fn flavor(name: &str) -> Option<ModelArgs> {
    let big = |experts, moe_step, l2_qk_norm, rope_scaling, max_seq_len| Llama4Shape {
        dim: 5120,
        n_layers: 48,
        n_heads: 40,
        n_kv_heads: 8,
        vocab_size: 202048,
        ffn_hidden: 16384,
        moe_hidden: 8192,
        experts,
        moe_step,
        chunk: Some(8192),
        l2_qk_norm,
        rope_scaling,
        max_seq_len,
    };
    Some(llama4(match name {
        "debugmodel" => Llama4Shape {
            dim: 256,
            n_layers: 6,
            n_heads: 16,
            n_kv_heads: 16,
            vocab_size: 2048,
            ffn_hidden: 768,
            moe_hidden: 512,
            experts: 8,
            moe_step: 2,
            chunk: Some(256),
            l2_qk_norm: true,
            rope_scaling: Some(SCOUT_ROPE),
            max_seq_len: 1 << 20,
        },
        "17bx16e" => big(16, 1, true, Some(SCOUT_ROPE), 10485760),
        // Maverick: experts in every other block, no QK-norm, no RoPE scaling.
        "17bx128e" => big(128, 2, false, None, 1048576),
        _ => return None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_sizes_count_as_published() {
        // Meta's model cards: Scout 109B parameters, 17B active; Maverick 400B, 17B active.
        // Their totals hold the vision encoder too (under 1B), which the text model has not.
        for (name, total, active) in [("17bx16e", 109e9, 17e9), ("17bx128e", 400e9, 17e9)] {
            let a = flavor(name).unwrap();
            a.validate().unwrap();
            let n = a.num_params() as f64;
            let act = a.active_params() as f64;
            assert!((n / total - 1.0).abs() < 0.015, "{name}: {n}");
            assert!((act / active - 1.0).abs() < 0.02, "{name} active: {act}");
        }
    }
}
