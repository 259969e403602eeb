//! Python scripts that write tiny transformers models of the families' test shapes into the
//! folder `sys.argv[1]`, and those shapes as titan's `[model]` flags (over `common::TINY_ARGS`'
//! dim 64, 2 blocks, 4/2 heads, vocabulary 300), which `tests/llama4.rs`, `tests/gpt_oss.rs` and
//! `tests/lora.rs` give titan.

/// `llama4_two_blocks`' shapes: block 1 without RoPE (temperature-tuned from position 3 on:
/// floor scale 4), chunks of 8 positions on block 0, experts in block 1 (4 of 32, a shared one of
/// 32) and a dense SwiGLU in block 0.
pub const LLAMA4_SHAPES: &[&str] = &[
    "--model.name",
    "llama4",
    "--model.moe_hidden",
    "32",
    "--model.moe_shared_hidden",
    "32",
    "--model.num_experts",
    "4",
    "--model.every_n_layers_nope",
    "2",
    "--model.attention_chunk_size",
    "8",
    "--model.floor_scale",
    "4",
    "--model.attn_scale",
    "0.5",
];

/// `gpt_oss_two_blocks`' shapes but its window: heads of 16, 4 experts of 32 (2 per token).
pub const GPT_OSS_SHAPES: &[&str] = &[
    "--model.name",
    "gpt_oss",
    "--model.head_dim",
    "16",
    "--model.moe_hidden",
    "32",
    "--model.num_experts",
    "4",
    "--model.top_k",
    "2",
];

/// The script writing the model `config` (a transformers `…Config(...)` expression) of class
/// `model`, seed 0, after running `adjust` (Python lines, indented by 8) on each parameter `p`
/// named `name` without gradients.
fn script(import: &str, config: &str, model: &str, adjust: &str) -> String {
    format!(
        r#"
import sys, torch
from transformers import {import}
cfg = {config}
torch.manual_seed(0)
model = {model}(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        pass
{adjust}
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#
    )
}

/// A Llama 4 of 2 blocks (block 1 NoPE with temperatures from position 3 on, experts 4 of 32 and
/// a shared one; block 0 chunks of 8 with the L2 norm, a dense SwiGLU of 256), Scout's RoPE.
pub fn llama4_two_blocks(adjust: &str) -> String {
    let config = r#"Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=300, max_position_embeddings=256, num_local_experts=4,
                       num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                       attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192},
                       tie_word_embeddings=False)"#;
    script(
        "Llama4TextConfig, Llama4ForCausalLM",
        config,
        "Llama4ForCausalLM",
        adjust,
    )
}

/// A gpt-oss of 2 blocks (4 experts of 32, 2 a token, a window of 6 on block 0), its biases and
/// sinks drawn away from zero before `adjust`.
pub fn gpt_oss_two_blocks(adjust: &str) -> String {
    let config = r#"GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                   tie_word_embeddings=False)"#;
    let adjust = format!(
        "        if name.endswith(\"bias\") or name.endswith(\"sinks\"):\n            p.normal_(0.0, 0.5)\n{adjust}"
    );
    script(
        "GptOssConfig, GptOssForCausalLM",
        config,
        "GptOssForCausalLM",
        &adjust,
    )
}
