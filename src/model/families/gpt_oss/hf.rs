//! gpt-oss's Hugging Face form (`GptOssForCausalLM`, `model_type` "gpt_oss"): its
//! `config.json` both ways, and its tensor names, where every block's experts are fused:
//! `mlp.experts.gate_up_proj` `[experts, dim, 2·hidden]` holds the gate's (even columns) and the
//! up projection's (odd columns) weights as `[in, out]`, `gate_up_proj_bias` `[experts,
//! 2·hidden]` their biases likewise, `down_proj` `[experts, hidden, dim]` and `down_proj_bias`.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::flavors::{gpt_oss, YARN};
use crate::backend::cpu::rope::RopeScaling;
use crate::model::args::SlidingWindow;
use crate::model::families::hf_fields::{
    decoder_fields, get_float, get_size, merge, norm_eps, refuse_other_activation, tied_embeddings,
};
use crate::model::families::hf_rope::rope_from_hf;
use crate::model::families::{hf_names, ExpertSlice, HfPart};
use crate::model::moe::activation::ExpertActivation;
use crate::model::params::expert_of;
use crate::model::ModelArgs;

/// The HF name of titan parameter `name` (the experts' are slices: `part`).
pub fn hf_name(name: &str) -> String {
    if let Some((block, leaf)) = name.split_once(".moe.router.gate.") {
        return format!("model.{block}.mlp.router.{leaf}");
    }
    hf_names::hf_name(name).replace(".attention.sinks", ".self_attn.sinks")
}

/// Where titan parameter `name` lies: an expert's slice of its block's fused tensors.
pub fn part(args: &ModelArgs, name: &str) -> HfPart {
    let Some(expert) = expert_of(name) else {
        return HfPart::Whole(hf_name(name));
    };
    let block = name.split_once(".moe.").map_or("", |(b, _)| b);
    let experts = args.moe.as_ref().map_or(0, |m| m.router.num_experts);
    let leaf = name.rsplit('.').take(2).collect::<Vec<_>>();
    // (tensor, first column, step) of w1 (the gate), w3 (up) and w2 (down).
    let (tensor, first, step) = match leaf[1] {
        "w1" => ("gate_up_proj", 0, 2),
        "w3" => ("gate_up_proj", 1, 2),
        _ => ("down_proj", 0, 1),
    };
    let bias = leaf[0] == "bias";
    HfPart::Expert(ExpertSlice {
        tensor: format!(
            "model.{block}.mlp.experts.{tensor}{}",
            if bias { "_bias" } else { "" }
        ),
        experts,
        expert,
        // gate_up_proj holds the gate and the up projection, interleaved.
        parts: step,
        first,
        step,
        transposed: !bias,
    })
}

/// A positive number `key` of `cfg` (`default` when absent).
fn positive(cfg: &Value, key: &str, default: f64, file: &Path) -> Result<f32> {
    let v = get_float(cfg, key, default, file)?;
    if v == 0.0 {
        bail!("{}: `{key}` = 0 must be positive", file.display());
    }
    Ok(v as f32)
}

/// The window pattern of `layer_types`: windows on the even blocks, full attention on the odd
/// ones (transformers' default), anything else refused by name.
fn check_layer_types(cfg: &Value, n_layers: usize, file: &Path) -> Result<()> {
    let Some(kinds) = cfg.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let want: Vec<&str> = (0..n_layers)
        .map(|l| match l % 2 {
            0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    let got: Option<Vec<&str>> = kinds
        .as_array()
        .map(|k| k.iter().filter_map(Value::as_str).collect());
    if got.as_deref() != Some(&want[..]) {
        bail!(
            "{}: layer_types = {kinds} is not a pattern titan computes (gpt-oss's: sliding_attention on the even blocks, full_attention on the odd ones)",
            file.display()
        );
    }
    Ok(())
}

/// Refuses the fields whose other values change what gpt-oss computes.
fn refuse_unsupported(cfg: &Value, file: &Path) -> Result<()> {
    refuse_other_activation(cfg, file)?;
    if cfg.get("attention_bias").and_then(Value::as_bool) == Some(false) {
        bail!(
            "{}: attention_bias = false is not supported (gpt-oss's attention has biases)",
            file.display()
        );
    }
    Ok(())
}

/// Model shapes from a gpt-oss `config.json`; not yet validated.
pub fn read(cfg: &Value, file: &Path) -> Result<ModelArgs> {
    refuse_unsupported(cfg, file)?;
    let size =
        |key: &str, field: &str, default: Option<usize>| get_size(cfg, key, field, default, file);
    let n_layers = size("num_hidden_layers", "n_layers", None)?;
    check_layer_types(cfg, n_layers, file)?;
    let rope_given = ["rope_parameters", "rope_scaling", "rope_theta"]
        .iter()
        .any(|k| cfg.get(k).is_some_and(|v| !v.is_null()));
    let (rope_theta, rope_scaling) = match rope_given {
        true => rope_from_hf(cfg, file)?,
        // transformers' GptOssConfig default.
        false => (150000.0, Some(RopeScaling::Yarn(YARN))),
    };
    let dim = size("hidden_size", "dim", None)?;
    let experts = size("num_local_experts", "moe.num_experts", None)?;
    let mut args = gpt_oss(
        dim,
        n_layers,
        experts,
        size("vocab_size", "vocab_size", None)?,
    );
    let moe = args.moe.as_mut().expect("gpt-oss has experts");
    moe.hidden = size("intermediate_size", "moe.hidden", None)?;
    moe.router.top_k = size("num_experts_per_tok", "moe.num_experts", Some(4))?;
    // transformers' gpt-oss has no expert bias: an imported model routes as it does.
    moe.load_balance_coeff = None;
    moe.activation = ExpertActivation::ClampedSwiglu {
        alpha: positive(cfg, "swiglu_alpha", 1.702, file)?,
        limit: positive(cfg, "swiglu_limit", 7.0, file)?,
    };
    args.ffn_hidden = moe.hidden;
    args.n_heads = size("num_attention_heads", "n_heads", None)?;
    args.n_kv_heads = size("num_key_value_heads", "n_kv_heads", Some(args.n_heads))?;
    args.attention_head_dim = Some(size("head_dim", "attention_head_dim", Some(64))?);
    args.norm_eps = norm_eps(cfg);
    (args.rope_theta, args.rope_scaling) = (rope_theta, rope_scaling);
    args.max_seq_len = size("max_position_embeddings", "max_seq_len", Some(131072))?;
    args.tied_embeddings = tied_embeddings(cfg);
    args.sliding_window = Some(SlidingWindow {
        size: size("sliding_window", "sliding_window.size", Some(128))?,
        period: 2,
    });
    Ok(args)
}

/// The `config.json` of a gpt-oss model.
pub fn write(args: &ModelArgs) -> Result<Value> {
    let (Some(moe), Some(window)) = (&args.moe, args.sliding_window) else {
        bail!("not a gpt-oss model (a titan bug: its family owns it)");
    };
    let ExpertActivation::ClampedSwiglu { alpha, limit } = moe.activation else {
        bail!("not a gpt-oss model (a titan bug: its family owns it)");
    };
    if moe.router.top_k == 0 || window.period != 2 {
        bail!("gpt-oss's windows are on every other block");
    }
    let layer_types: Vec<&str> = (0..args.n_layers)
        .map(|l| match args.window_at(l) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    let mut config = json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": moe.hidden,
        "attention_bias": true,
        "num_local_experts": moe.router.num_experts,
        "num_experts_per_tok": moe.router.top_k,
        "swiglu_alpha": alpha,
        "swiglu_limit": limit,
        "sliding_window": window.size,
        "layer_types": layer_types,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.0,
    });
    merge(&mut config, decoder_fields(args));
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::families::gpt_oss::{flavor, GptOss};
    use crate::model::families::Family;

    #[test]
    fn what_titan_cannot_compute_is_refused_by_name() {
        let file = Path::new("config.json");
        let ok = write(&flavor("debugmodel").unwrap()).unwrap();
        read(&ok, file).unwrap();
        let refused = [
            (
                "layer_types",
                json!([
                    "full_attention",
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention"
                ]),
            ),
            ("attention_bias", json!(false)),
            ("hidden_act", json!("gelu")),
            (
                "rope_parameters",
                json!({"rope_type": "dynamic", "factor": 2.0}),
            ),
            ("swiglu_limit", json!(-1.0)),
        ];
        for (key, value) in refused {
            let mut cfg = ok.clone();
            cfg[key] = value;
            let e = read(&cfg, file).unwrap_err().to_string();
            assert!(e.contains(key) || e.contains("dynamic"), "{key}: {e}");
        }
    }

    #[test]
    fn a_model_that_routes_with_an_expert_bias_is_not_exported() {
        let args = flavor("debugmodel").unwrap();
        let zero = vec![vec![0.0; 8]; 4];
        assert!(GptOss
            .hf_extra_tensors(&args, Some(&zero))
            .unwrap()
            .is_empty());
        let mut moved = zero.clone();
        moved[1][3] = 1e-3;
        let e = GptOss
            .hf_extra_tensors(&args, Some(&moved))
            .unwrap_err()
            .to_string();
        assert!(e.contains("load_balance_coeff = 0"), "{e}");
    }
}
