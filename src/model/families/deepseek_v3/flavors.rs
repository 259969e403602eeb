//! DeepSeek-V3's published shapes (`[model] name = "deepseek_v3"`, TorchTitan's flavor names):
//! multi-head latent attention (`mla`) in every block, a mixture of experts with shared experts
//! after the leading dense blocks, YaRN RoPE on the rotated head parts.
//!
//! The flavors follow TorchTitan's `deepseek_v3` model registry: `debugmodel` (tiny, trains on a
//! CPU), `16B` (DeepSeek-V2-Lite-like shapes), `236B` (DeepSeek-V2's) and `671B` (DeepSeek-V3's).
//! Their YaRN scaling (factor 40 over 4096 positions) gives the softmax scale its mscale² (`mscale`
//! 0.7 for the two small ones, 1.0 for the others), and no cos/sin magnitude (mscale equals
//! mscale_all_dim), as TorchTitan and Hugging Face compute it.

use crate::backend::cpu::rope::{RopeScaling, YarnScaling};
use crate::model::decoder::mla::MlaArgs;
use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "deepseek_v3"`.
pub const FLAVORS: &[&str] = &["debugmodel", "16B", "236B", "671B"];

/// One flavor's numbers (TorchTitan's registry).
struct Flavor {
    dim: usize,
    n_layers: usize,
    n_dense_layers: usize,
    vocab: usize,
    n_heads: usize,
    q_lora_rank: Option<usize>,
    dense_hidden: usize,
    moe_hidden: usize,
    experts: usize,
    shared_experts: usize,
    top_k: usize,
    score_func: ScoreFunc,
    groups: Option<(usize, usize)>,
    route_scale: f32,
    route_norm: bool,
    mscale: f64,
}

fn numbers(name: &str) -> Option<Flavor> {
    let small = |dim, n_layers, vocab, dense_hidden, moe_hidden, experts, top_k| Flavor {
        dim,
        n_layers,
        n_dense_layers: 1,
        vocab,
        n_heads: 16,
        q_lora_rank: None,
        dense_hidden,
        moe_hidden,
        experts,
        shared_experts: 2,
        top_k,
        score_func: ScoreFunc::Softmax,
        groups: None,
        route_scale: 1.0,
        route_norm: false,
        mscale: 0.7,
    };
    Some(match name {
        "debugmodel" => small(256, 6, 2048, 1024, 256, 8, 3),
        "16B" => small(2048, 27, 102400, 10944, 1408, 64, 6),
        "236B" => Flavor {
            n_heads: 128,
            q_lora_rank: Some(1536),
            groups: Some((8, 3)),
            route_scale: 16.0,
            mscale: 1.0,
            ..small(5120, 60, 102400, 12288, 1536, 160, 6)
        },
        "671B" => Flavor {
            n_dense_layers: 3,
            n_heads: 128,
            q_lora_rank: Some(1536),
            shared_experts: 1,
            score_func: ScoreFunc::Sigmoid,
            groups: Some((8, 4)),
            route_scale: 2.5,
            route_norm: true,
            mscale: 1.0,
            ..small(7168, 61, 129280, 18432, 2048, 256, 8)
        },
        _ => return None,
    })
}

/// Published DeepSeek-V3 shapes (`FLAVORS`): every block MLA (key/value latent 512,
/// heads 128 + 64 rotated for queries and keys, 128 for values), RoPE θ 10⁴ with YaRN,
/// RMSNorm ε 10⁻⁶, and experts with aux-loss-free load balancing (bias step 10⁻³, TorchTitan's
/// default).
pub fn flavor(name: &str) -> Option<ModelArgs> {
    let f = numbers(name)?;
    let yarn = YarnScaling {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: None,
        mscale: Some(f.mscale),
        mscale_all_dim: Some(f.mscale),
    };
    let moe = MoeArgs {
        hidden: f.moe_hidden,
        shared_hidden: Some(f.moe_hidden * f.shared_experts),
        router: RouterArgs {
            num_experts: f.experts,
            top_k: f.top_k,
            score_func: f.score_func,
            norm_topk_prob: f.route_norm,
            route_scale: f.route_scale,
            groups: f.groups,
        },
        load_balance_coeff: Some(1e-3),
        aux_loss_coef: None,
        first_dense_layers: f.n_dense_layers,
        sparse_step: 1,
        linear_biases: false,
        activation: Default::default(),
        score_before_experts: false,
    };
    Some(ModelArgs {
        dim: f.dim,
        n_layers: f.n_layers,
        n_heads: f.n_heads,
        n_kv_heads: f.n_heads,
        vocab_size: f.vocab,
        ffn_hidden: f.dense_hidden,
        norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: Some(RopeScaling::Yarn(yarn)),
        max_seq_len: 4 * 4096,
        tied_embeddings: false,
        attention_head_dim: None,
        qk_norm: false,
        moe: Some(moe),
        mla: Some(MlaArgs {
            q_lora_rank: f.q_lora_rank,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }),
        lora: None,
        attention_sinks: false,
        sliding_window: None,
        attention_bias: false,
        every_n_layers_nope: None,
        attention_chunk_size: None,
        l2_qk_norm: false,
        attention_temperature: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flavor_is_valid_and_the_671b_counts_its_published_parameters() {
        for name in FLAVORS {
            flavor(name).unwrap().validate().unwrap();
        }
        // DeepSeek-V3: 671B parameters, 37B active per token (the main model, without its
        // multi-token-prediction layer).
        let v3 = flavor("671B").unwrap();
        let (total, active) = (
            v3.num_params() as f64 / 1e9,
            v3.active_params() as f64 / 1e9,
        );
        assert!((total - 671.0).abs() < 1.0, "{total}B");
        assert!((active - 37.5).abs() < 1.0, "{active}B");
    }
}
