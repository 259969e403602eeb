//! titan's parameter names and their Hugging Face `transformers` counterparts (Llama, Qwen3,
//! Qwen3-MoE, DeepSeek-V3), both ways through `hf_name_of`.

use crate::model::ModelArgs;

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

/// titan's MLA parameter names' HF counterparts (the rest is `hf_name`'s).
pub const MLA_NAMES: &[(&str, &str)] = &[
    ("attention.wq_a.", "self_attn.q_a_proj."),
    ("attention.q_norm.", "self_attn.q_a_layernorm."),
    ("attention.wq_b.", "self_attn.q_b_proj."),
    ("attention.wkv_a.", "self_attn.kv_a_proj_with_mqa."),
    ("attention.kv_norm.", "self_attn.kv_a_layernorm."),
    ("attention.wkv_b.", "self_attn.kv_b_proj."),
];

/// titan name → HF name in `args`' model (DeepSeek-V3's attention has names of its own).
pub fn hf_name_of(args: &ModelArgs, name: &str) -> String {
    if args.mla.is_none() {
        return hf_name(name);
    }
    let mut name = name.to_string();
    for (titan, hf) in MLA_NAMES {
        name = name.replace(titan, hf);
    }
    hf_name(&name)
}
