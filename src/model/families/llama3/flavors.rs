//! Llama 3's published shapes (`[model] name = "llama3"`, TorchTitan's flavor names): Llama 3.1
//! 8B, 70B and 405B, Llama 3.2 1B and 3B (tied embeddings), and a tiny `debugmodel`.

use crate::backend::cpu::rope::{Llama3Scaling, RopeScaling};
use crate::model::args::ffn_hidden;
use crate::model::families::FfnRounding;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "llama3"`.
pub const FLAVORS: &[&str] = &["debugmodel", "1B", "3B", "8B", "70B", "405B"];

const LLAMA31_SCALING: RopeScaling = RopeScaling::Llama3(Llama3Scaling {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
});
const LLAMA32_SCALING: RopeScaling = RopeScaling::Llama3(Llama3Scaling {
    factor: 32.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
});

/// One flavor's numbers.
struct Flavor {
    dim: usize,
    n_layers: usize,
    n_heads: usize,
    n_kv_heads: usize,
    vocab: usize,
    scaling: Option<RopeScaling>,
    tied: bool,
    max_seq_len: usize,
}

fn numbers(name: &str) -> Option<Flavor> {
    let published = |dim, n_layers, n_heads, scaling, tied| Flavor {
        dim,
        n_layers,
        n_heads,
        n_kv_heads: 8,
        vocab: 128256,
        scaling: Some(scaling),
        tied,
        max_seq_len: 131072,
    };
    Some(match name {
        "debugmodel" => Flavor {
            n_kv_heads: 16,
            vocab: 2048,
            scaling: None,
            max_seq_len: 2048,
            ..published(256, 6, 16, LLAMA31_SCALING, false)
        },
        "1B" => published(2048, 16, 32, LLAMA32_SCALING, true),
        "3B" => published(3072, 28, 24, LLAMA32_SCALING, true),
        "8B" => published(4096, 32, 32, LLAMA31_SCALING, false),
        "70B" => published(8192, 80, 64, LLAMA31_SCALING, false),
        "405B" => published(16384, 126, 128, LLAMA31_SCALING, false),
        _ => return None,
    })
}

/// The FFN width's rounding of each flavor (Meta's `multiple_of` and `ffn_dim_multiplier`).
pub fn ffn_rounding(name: &str) -> FfnRounding {
    let multiplier = match name {
        "1B" => Some(1.5),
        "3B" => Some(1.0),
        "8B" | "70B" => Some(1.3),
        "405B" => Some(1.2),
        _ => None,
    };
    let multiple_of = match name {
        "8B" => 1024,
        "70B" | "405B" => 4096,
        _ => 256,
    };
    FfnRounding {
        multiple_of,
        multiplier,
    }
}

/// Published Llama 3.x dimensions (None: not a Llama 3 flavor).
pub fn flavor(name: &str) -> Option<ModelArgs> {
    let f = numbers(name)?;
    let rounding = ffn_rounding(name);
    Some(ModelArgs {
        dim: f.dim,
        n_layers: f.n_layers,
        n_heads: f.n_heads,
        n_kv_heads: f.n_kv_heads,
        vocab_size: f.vocab,
        ffn_hidden: ffn_hidden(f.dim, rounding.multiple_of, rounding.multiplier),
        norm_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: f.scaling,
        max_seq_len: f.max_seq_len,
        tied_embeddings: f.tied,
        attention_head_dim: None,
        qk_norm: false,
        moe: None,
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
    fn published_ffn_widths() {
        let want = [
            ("debugmodel", 768),
            ("1B", 8192),
            ("3B", 8192),
            ("8B", 14336),
            ("70B", 28672),
            ("405B", 53248),
        ];
        for (name, hidden) in want {
            assert_eq!(flavor(name).unwrap().ffn_hidden, hidden, "{name}");
        }
    }

    #[test]
    fn published_parameter_counts() {
        // Llama 3.1 8B has 8.03B parameters, 70B 70.6B, 405B 405.9B; Llama 3.2 1B 1.24B, 3B 3.21B.
        let approx = [
            ("1B", 1.236e9),
            ("3B", 3.213e9),
            ("8B", 8.030e9),
            ("70B", 70.55e9),
            ("405B", 405.85e9),
        ];
        for (name, n) in approx {
            let got = flavor(name).unwrap().num_params() as f64;
            assert!((got - n).abs() / n < 0.002, "{name}: {got}");
        }
    }
}
