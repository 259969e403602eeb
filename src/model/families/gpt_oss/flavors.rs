//! gpt-oss's published shapes (`[model] name = "gpt_oss"`): `20b` and `120b` (Hugging Face
//! `openai/gpt-oss-*` configs) and TorchTitan's `debugmodel` (dim 256, 4 blocks, 8 experts of
//! 2880 each).

use crate::backend::cpu::rope::{RopeScaling, YarnScaling};
use crate::model::args::SlidingWindow;
use crate::model::moe::activation::ExpertActivation;
use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "gpt_oss"`.
pub const FLAVORS: &[&str] = &["debugmodel", "20b", "120b"];

/// gpt-oss's YaRN: 32 times the 4096 positions it was trained on, the correction range not
/// rounded to whole dimensions (`truncate = false`).
pub const YARN: YarnScaling = YarnScaling {
    factor: 32.0,
    original_max_position_embeddings: 4096,
    beta_fast: 32.0,
    beta_slow: 1.0,
    truncate: false,
    attention_factor: None,
    mscale: None,
    mscale_all_dim: None,
};

/// The block every gpt-oss shares: 64 query heads and 8 key/value heads of 64, biases on the
/// attention's projections, attention sinks, a window of 128 keys on every other block (the
/// first among them), and in every block `experts` experts of `hidden` (with biases, the
/// clamped SwiGLU), each token taking 4 with softmax weights over its 4 logits.
pub fn gpt_oss(dim: usize, n_layers: usize, experts: usize, vocab: usize) -> ModelArgs {
    let hidden = 2880;
    ModelArgs {
        dim,
        n_layers,
        n_heads: 64,
        n_kv_heads: 8,
        vocab_size: vocab,
        ffn_hidden: hidden,
        norm_eps: 1e-5,
        rope_theta: 150000.0,
        rope_scaling: Some(RopeScaling::Yarn(YARN)),
        max_seq_len: 131072,
        tied_embeddings: false,
        attention_head_dim: Some(64),
        qk_norm: false,
        moe: Some(MoeArgs {
            hidden,
            shared_hidden: None,
            router: RouterArgs {
                num_experts: experts,
                top_k: 4,
                score_func: ScoreFunc::Softmax,
                norm_topk_prob: true,
                route_scale: 1.0,
                groups: None,
            },
            // TorchTitan trains gpt-oss with auxiliary-loss-free load balancing.
            load_balance_coeff: Some(1e-3),
            aux_loss_coef: None,
            first_dense_layers: 0,
            sparse_step: 1,
            linear_biases: true,
            activation: ExpertActivation::GPT_OSS,
            score_before_experts: false,
        }),
        mla: None,
        lora: None,
        attention_sinks: true,
        sliding_window: Some(SlidingWindow {
            size: 128,
            period: 2,
        }),
        attention_bias: true,
        every_n_layers_nope: None,
        attention_chunk_size: None,
        l2_qk_norm: false,
        attention_temperature: None,
    }
}

/// Published gpt-oss shapes (None: not a gpt-oss flavor).
pub fn flavor(name: &str) -> Option<ModelArgs> {
    Some(match name {
        "debugmodel" => gpt_oss(256, 4, 8, 2048),
        "20b" => gpt_oss(2880, 24, 32, 201088),
        "120b" => gpt_oss(2880, 36, 128, 201088),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_sizes_count_as_published() {
        // The model card: gpt-oss-20b 20.91B parameters, 3.61B active; gpt-oss-120b 116.83B,
        // 5.13B (its active count leaves the embedding out).
        for (name, total, active) in [("20b", 20.91e9, 3.61e9), ("120b", 116.83e9, 5.13e9)] {
            let a = flavor(name).unwrap();
            a.validate().unwrap();
            let n = a.num_params() as f64;
            let act = (a.active_params() - a.embedding_params()) as f64;
            assert!((n / total - 1.0).abs() < 0.002, "{name}: {n}");
            assert!((act / active - 1.0).abs() < 0.002, "{name} active: {act}");
        }
    }
}
