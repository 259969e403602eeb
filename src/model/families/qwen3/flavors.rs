//! Qwen3's published shapes (`[model] name = "qwen3"`): the dense 0.6B to 32B and the
//! mixture-of-experts 30B-A3B and 235B-A22B (Hugging Face `Qwen/Qwen3-*` configs), and tiny
//! `debugmodel` and `debugmodel_moe`.

use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "qwen3"`.
pub const FLAVORS: &[&str] = &[
    "debugmodel",
    "0.6B",
    "1.7B",
    "4B",
    "8B",
    "14B",
    "32B",
    "debugmodel_moe",
    "30B-A3B",
    "235B-A22B",
];

/// Published Qwen3 dense dimensions (Hugging Face `Qwen/Qwen3-*` configs: head width 128,
/// QK-norm, RoPE θ 10⁶, RMSNorm ε 10⁻⁶; 0.6B, 1.7B and 4B tie their embeddings), and a tiny
/// `debugmodel` whose head width (64) is not `dim / n_heads` (32), as Qwen3's are not.
pub fn flavor(name: &str) -> Option<ModelArgs> {
    #[allow(clippy::type_complexity)]
    let (dim, n_layers, n_heads, n_kv, head_dim, ffn, vocab, tied): (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
    ) = match name {
        "debugmodel" => (256, 6, 8, 4, 64, 768, 2048, false),
        "0.6B" => (1024, 28, 16, 8, 128, 3072, 151936, true),
        "1.7B" => (2048, 28, 16, 8, 128, 6144, 151936, true),
        "4B" => (2560, 36, 32, 8, 128, 9728, 151936, true),
        "8B" => (4096, 36, 32, 8, 128, 12288, 151936, false),
        "14B" => (5120, 40, 40, 8, 128, 17408, 151936, false),
        "32B" => (5120, 64, 64, 8, 128, 25600, 151936, false),
        "debugmodel_moe" => (256, 6, 8, 4, 64, 768, 2048, false),
        "30B-A3B" => (2048, 48, 32, 4, 128, 6144, 151936, false),
        "235B-A22B" => (4096, 94, 64, 4, 128, 12288, 151936, false),
        _ => return None,
    };
    // Qwen3-MoE: every block's feed-forward is 128 experts (8 for the debug model) of which
    // each token takes 8 (2), softmax scores renormalised over the chosen, no shared experts.
    let moe = |experts: usize, top_k: usize, hidden: usize| MoeArgs {
        hidden,
        shared_hidden: None,
        load_balance_coeff: None,
        aux_loss_coef: None,
        first_dense_layers: 0,
        sparse_step: 1,
        linear_biases: false,
        activation: Default::default(),
        score_before_experts: false,
        router: RouterArgs {
            num_experts: experts,
            top_k,
            score_func: ScoreFunc::Softmax,
            norm_topk_prob: true,
            route_scale: 1.0,
            groups: None,
        },
    };
    let moe = match name {
        "debugmodel_moe" => Some(moe(8, 2, 256)),
        "30B-A3B" => Some(moe(128, 8, 768)),
        "235B-A22B" => Some(moe(128, 8, 1536)),
        _ => None,
    };
    Some(ModelArgs {
        dim,
        n_layers,
        n_heads,
        n_kv_heads: n_kv,
        vocab_size: vocab,
        ffn_hidden: ffn,
        norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        max_seq_len: 40960,
        tied_embeddings: tied,
        // Stored only where it differs from dim / heads, as an imported config stores it.
        attention_head_dim: (head_dim * n_heads != dim).then_some(head_dim),
        qk_norm: true,
        moe,
        mla: None,
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
    fn published_qwen3_parameter_counts() {
        // Qwen3 model cards: 0.6B (tied), 1.7B (tied), 4B (tied), 8.2B, 14.8B, 32.8B in all.
        let approx = [
            ("0.6B", 0.596e9),
            ("1.7B", 1.72e9),
            ("4B", 4.02e9),
            ("8B", 8.19e9),
            ("14B", 14.77e9),
            ("32B", 32.76e9),
        ];
        for (name, n) in approx {
            let a = flavor(name).unwrap();
            assert_eq!(a.head_dim(), 128, "{name}");
            let got = a.num_params() as f64;
            assert!((got - n).abs() / n < 0.01, "{name}: {got}");
        }
        let debug = flavor("debugmodel").unwrap();
        assert_ne!(debug.head_dim(), debug.dim / debug.n_heads);
        debug.validate().unwrap();
    }
}
