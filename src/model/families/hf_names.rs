//! The transformers names of the decoder's parameters (Llama's, which Qwen3, Qwen3-MoE and
//! DeepSeek-V3 keep; a family with names of its own maps them first, as DeepSeek-V3's attention).

/// titan name → HF name.
pub fn hf_name(name: &str) -> String {
    let map = [
        ("attention.wq", "self_attn.q_proj"),
        ("attention.wk", "self_attn.k_proj"),
        ("attention.wv", "self_attn.v_proj"),
        ("attention.wo", "self_attn.o_proj"),
        ("attention.q_norm", "self_attn.q_norm"),
        ("attention.k_norm", "self_attn.k_norm"),
        ("feed_forward.w1", "mlp.gate_proj"),
        ("feed_forward.w2", "mlp.down_proj"),
        ("feed_forward.w3", "mlp.up_proj"),
        ("attention_norm", "input_layernorm"),
        ("ffn_norm", "post_attention_layernorm"),
    ];
    match name {
        "tok_embeddings.weight" => return "model.embed_tokens.weight".into(),
        "norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let mut out = format!("model.{name}");
    for (a, b) in map {
        out = out.replace(a, b);
    }
    // Qwen3-MoE: the router is `mlp.gate`, each expert's projections gate/up/down.
    if name.contains(".moe.") {
        out = out
            .replace(".moe.router.gate.", ".mlp.gate.")
            .replace(".moe.experts.", ".mlp.experts.")
            .replace(".moe.shared_experts.", ".mlp.shared_experts.")
            .replace(".w1.weight", ".gate_proj.weight")
            .replace(".w2.weight", ".down_proj.weight")
            .replace(".w3.weight", ".up_proj.weight");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_transformers() {
        assert_eq!(
            hf_name("layers.3.attention.wq.weight"),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("layers.0.feed_forward.w1.weight"),
            "model.layers.0.mlp.gate_proj.weight"
        );
        assert_eq!(
            hf_name("layers.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("output.weight"), "lm_head.weight");
    }
}
