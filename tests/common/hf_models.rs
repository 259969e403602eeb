//! Python scripts that write tiny transformers models of the families' test shapes (the ones
//! `tests/llama4.rs` and `tests/gpt_oss.rs` give titan) into the folder `sys.argv[1]`.

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
