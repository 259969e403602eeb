//! Llama 4's Hugging Face form (`Llama4ForCausalLM`, `model_type` "llama4_text": the text model;
//! the vision tower is out of scope): its `config.json` both ways, refusing by name every field
//! whose value titan would compute differently, and its tensor names. A block's feed-forward is
//! `feed_forward`: a dense block's `gate_proj`/`up_proj`/`down_proj`, an expert block's `router`,
//! `shared_expert` and fused `experts.gate_up_proj` `[experts, dim, 2·hidden]` (the gate's
//! columns, then the up projection's, stored `[in, out]`) and `experts.down_proj`
//! `[experts, hidden, dim]`. RoPE's rows are interleaved pairs, as titan's.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use super::flavors::{llama4, Llama4Shape, TEMPERATURE};
use crate::model::args::AttentionTemperature;
use crate::model::families::hf_fields::{
    decoder_fields, get_float, get_size, merge, norm_eps, refuse_other_activation, tied_embeddings,
};
use crate::model::families::hf_rope::rope_from_hf;
use crate::model::families::{hf_names, ExpertSlice, HfPart};
use crate::model::moe::activation::ExpertActivation;
use crate::model::moe::router::ScoreFunc;
use crate::model::params::expert_of;
use crate::model::ModelArgs;

/// A SwiGLU's projections under transformers' names: `w1` → `gate_proj`, `w2` → `down_proj`,
/// `w3` → `up_proj`.
fn swiglu_names(path: &str) -> String {
    let part = |p| match p {
        "w1" => "gate_proj",
        "w2" => "down_proj",
        "w3" => "up_proj",
        p => p,
    };
    path.split('.').map(part).collect::<Vec<_>>().join(".")
}

/// The HF name of titan parameter `name` (the routed experts' are slices: `part`).
pub fn hf_name(name: &str) -> String {
    if let Some((block, rest)) = name.split_once(".moe.") {
        let rest = rest
            .replace("router.gate.", "router.")
            .replace("shared_experts.", "shared_expert.");
        return format!("model.{block}.feed_forward.{}", swiglu_names(&rest));
    }
    if let Some((block, rest)) = name.split_once(".feed_forward.") {
        return format!("model.{block}.feed_forward.{}", swiglu_names(rest));
    }
    hf_names::hf_name(name)
}

/// Where titan parameter `name` lies: a routed expert's is its slice of the block's fused tensors.
pub fn part(args: &ModelArgs, name: &str) -> HfPart {
    let (Some(expert), Some(moe)) = (expert_of(name), &args.moe) else {
        return HfPart::Whole(hf_name(name));
    };
    let block = name.split_once(".moe.").map_or("", |(b, _)| b);
    // (tensor, parts, first column) of w1 (the gate), w3 (up) and w2 (down).
    let (tensor, parts, first) = match name.rsplit('.').nth(1) {
        Some("w1") => ("gate_up_proj", 2, 0),
        Some("w3") => ("gate_up_proj", 2, moe.hidden),
        _ => ("down_proj", 1, 0),
    };
    HfPart::Expert(ExpertSlice {
        tensor: format!("model.{block}.feed_forward.experts.{tensor}"),
        experts: moe.router.num_experts,
        expert,
        parts,
        first,
        step: 1,
        transposed: true,
    })
}

/// Whether boolean field `key` is on (`default` when absent; a number counts as on unless 0, as
/// Python reads it: Scout's config says `attn_temperature_tuning: 4`).
fn flag(cfg: &Value, key: &str, default: bool, file: &Path) -> Result<bool> {
    match cfg.get(key).filter(|v| !v.is_null()) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => v
            .as_f64()
            .map(|x| x != 0.0)
            .ok_or_else(|| anyhow!("{}: `{key}` = {v} is not a boolean", file.display())),
    }
}

/// `key`'s list equals `want` when given (absent, null or empty: transformers computes `want`
/// itself), else an error naming it and the pattern titan computes.
fn check_list(cfg: &Value, key: &str, want: &[Value], pattern: &str, file: &Path) -> Result<()> {
    let Some(given) = cfg.get(key).filter(|v| !v.is_null()) else {
        return Ok(());
    };
    match given.as_array() {
        Some(list) if list.is_empty() || list[..] == want[..] => Ok(()),
        _ => bail!(
            "{}: {key} = {given} is not a pattern titan computes ({pattern})",
            file.display()
        ),
    }
}

/// The blocks' pattern from `no_rope_layers` / `no_rope_layer_interval` (`Some(n)`: every `n`-th
/// block without RoPE, transformers' default list; None: every block rotates).
fn nope_interval(cfg: &Value, n_layers: usize, file: &Path) -> Result<Option<usize>> {
    let n = get_size(
        cfg,
        "no_rope_layer_interval",
        "every_n_layers_nope",
        Some(4),
        file,
    )?;
    let uses_rope = |every: Option<usize>| -> Vec<Value> {
        (0..n_layers)
            .map(|l| json!(every.is_none_or(|n| !(l + 1).is_multiple_of(n)) as u8))
            .collect()
    };
    let given = cfg.get("no_rope_layers").and_then(Value::as_array);
    // Every block rotating is the one other pattern titan computes.
    if given.is_some_and(|g| !g.is_empty() && g[..] == uses_rope(None)[..]) {
        return Ok(None);
    }
    let pattern = format!(
        "1 (RoPE) but for blocks l with l + 1 a multiple of no_rope_layer_interval = {n}, or all 1"
    );
    check_list(cfg, "no_rope_layers", &uses_rope(Some(n)), &pattern, file)?;
    Ok(Some(n))
}

/// Refuses the fields whose other values change what Llama 4 computes.
fn refuse_unsupported(cfg: &Value, file: &Path) -> Result<()> {
    refuse_other_activation(cfg, file)?;
    for key in ["attention_bias"] {
        if flag(cfg, key, false, file)? {
            bail!(
                "{}: {key} = true is not supported (Llama 4's projections have no bias)",
                file.display()
            );
        }
    }
    if get_float(cfg, "router_jitter_noise", 0.0, file)? != 0.0 {
        bail!(
            "{}: router_jitter_noise is not supported (titan routes without noise)",
            file.display()
        );
    }
    Ok(())
}

/// Model shapes from a Llama 4 text `config.json`; not yet validated.
pub fn read(cfg: &Value, file: &Path) -> Result<ModelArgs> {
    refuse_unsupported(cfg, file)?;
    let size =
        |key: &str, field: &str, default: Option<usize>| get_size(cfg, key, field, default, file);
    let n_layers = size("num_hidden_layers", "n_layers", Some(48))?;
    let (dim, n_heads) = (
        size("hidden_size", "dim", Some(5120))?,
        size("num_attention_heads", "n_heads", Some(40))?,
    );
    let moe_step = size("interleave_moe_layer_step", "moe.sparse_step", Some(1))?;
    let moe_layers: Vec<Value> = (0..n_layers)
        .filter(|l| (l + 1).is_multiple_of(moe_step.max(1)))
        .map(|l| json!(l))
        .collect();
    let pattern =
        format!("block l when l + 1 is a multiple of interleave_moe_layer_step = {moe_step}");
    check_list(cfg, "moe_layers", &moe_layers, &pattern, file)?;
    let nope = nope_interval(cfg, n_layers, file)?;
    let chunk = match cfg.get("attention_chunk_size").filter(|v| !v.is_null()) {
        None if cfg.get("attention_chunk_size").is_some() => None,
        _ => Some(size(
            "attention_chunk_size",
            "attention_chunk_size",
            Some(8192),
        )?),
    };
    let layer_types: Vec<Value> = (0..n_layers)
        .map(|l| {
            let rotates = nope.is_none_or(|n| !(l + 1).is_multiple_of(n));
            json!(match rotates && chunk.is_some() {
                true => "chunked_attention",
                false => "full_attention",
            })
        })
        .collect();
    let pattern = "chunked_attention on the blocks with RoPE when attention_chunk_size is set, else full_attention";
    check_list(cfg, "layer_types", &layer_types, pattern, file)?;
    let (rope_theta, rope_scaling) = rope_from_hf(cfg, file)?;
    let moe_hidden = size("intermediate_size", "moe.hidden", Some(8192))?;
    let mut args = llama4(Llama4Shape {
        dim,
        n_layers,
        n_heads,
        n_kv_heads: size("num_key_value_heads", "n_kv_heads", Some(n_heads))?,
        vocab_size: size("vocab_size", "vocab_size", Some(202048))?,
        ffn_hidden: size("intermediate_size_mlp", "ffn_hidden", Some(16384))?,
        moe_hidden,
        experts: size("num_local_experts", "moe.num_experts", Some(16))?,
        moe_step,
        chunk,
        l2_qk_norm: flag(cfg, "use_qk_norm", true, file)?,
        rope_scaling,
        max_seq_len: size("max_position_embeddings", "max_seq_len", Some(131072))?,
    });
    args.every_n_layers_nope = nope;
    args.rope_theta = rope_theta;
    let head_dim = size("head_dim", "attention_head_dim", Some(128))?;
    args.attention_head_dim = (head_dim * n_heads != dim).then_some(head_dim);
    args.norm_eps = norm_eps(cfg);
    args.tied_embeddings = tied_embeddings(cfg);
    let moe = args.moe.as_mut().expect("Llama 4 has experts");
    moe.router.top_k = size("num_experts_per_tok", "moe.num_experts", Some(1))?;
    // transformers' Llama 4 has no expert bias: an imported model routes as it does.
    moe.load_balance_coeff = None;
    let tuned = flag(cfg, "attn_temperature_tuning", true, file)? && nope.is_some();
    args.attention_temperature = tuned
        .then(|| -> Result<AttentionTemperature> {
            Ok(AttentionTemperature {
                floor_scale: size(
                    "floor_scale",
                    "attention_temperature.floor_scale",
                    Some(TEMPERATURE.floor_scale),
                )?,
                scale: get_float(cfg, "attn_scale", TEMPERATURE.scale as f64, file)? as f32,
            })
        })
        .transpose()?;
    Ok(args)
}

/// Why transformers' Llama 4 has no model for `args` (None: it has).
fn not_exportable(args: &ModelArgs) -> Option<String> {
    let moe = args.moe.as_ref()?;
    if moe.shared_hidden != Some(moe.hidden) {
        return Some(format!("its shared expert ({:?} wide) is not as wide as its routed experts ({}): transformers' Llama 4 has one shared expert of intermediate_size", moe.shared_hidden, moe.hidden));
    }
    if moe.first_dense_layers != 0 || moe.router.score_func != ScoreFunc::Sigmoid {
        return Some("its routing is not Llama 4's (sigmoid of the top logits, experts from the first block on)".into());
    }
    if moe.router.norm_topk_prob || moe.router.route_scale != 1.0 || moe.router.groups.is_some() {
        return Some("its routing weights are renormalised, scaled or group-limited, which Llama 4's are not".into());
    }
    if moe.activation != ExpertActivation::Swiglu || moe.linear_biases {
        return Some("its experts are not SwiGLU without biases".into());
    }
    None
}

/// The `config.json` of a Llama 4 model.
pub fn write(args: &ModelArgs) -> Result<Value> {
    let Some(moe) = &args.moe else {
        bail!("not a Llama 4 model (a titan bug: its family owns it)");
    };
    if let Some(why) = not_exportable(args) {
        bail!("this model has no Hugging Face Llama 4 form: {why}");
    }
    let n = args.n_layers;
    let no_rope_layers: Vec<u8> = (0..n).map(|l| args.rope_at(l) as u8).collect();
    let moe_layers: Vec<usize> = (0..n).filter(|&l| moe.in_layer(l)).collect();
    let layer_types: Vec<&str> = (0..n)
        .map(|l| match args.chunk_at(l) {
            Some(_) => "chunked_attention",
            None => "full_attention",
        })
        .collect();
    let t = args.attention_temperature;
    let mut config = json!({
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "intermediate_size": moe.hidden,
        "intermediate_size_mlp": args.ffn_hidden,
        "num_local_experts": moe.router.num_experts,
        "num_experts_per_tok": moe.router.top_k,
        "interleave_moe_layer_step": moe.sparse_step,
        "moe_layers": moe_layers,
        "no_rope_layers": no_rope_layers,
        // transformers reads the list; the interval only makes its default.
        "no_rope_layer_interval": args.every_n_layers_nope.unwrap_or(4),
        "attention_chunk_size": args.attention_chunk_size,
        "layer_types": layer_types,
        "use_qk_norm": args.l2_qk_norm,
        "attn_temperature_tuning": t.is_some(),
        "floor_scale": t.unwrap_or(TEMPERATURE).floor_scale,
        "attn_scale": t.unwrap_or(TEMPERATURE).scale,
        "attention_bias": false,
        "router_jitter_noise": 0.0,
        "output_router_logits": false,
        "router_aux_loss_coef": 0.0,
    });
    merge(&mut config, decoder_fields(args));
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::families::llama4::{flavor, Llama4};
    use crate::model::families::Family;

    #[test]
    fn what_titan_cannot_compute_is_refused_by_name() {
        let file = Path::new("config.json");
        let ok = write(&flavor("debugmodel").unwrap()).unwrap();
        assert_eq!(read(&ok, file).unwrap().every_n_layers_nope, Some(4));
        let refused = [
            ("no_rope_layers", json!([1, 0, 1, 1, 1, 1])),
            ("moe_layers", json!([0, 2, 4])),
            (
                "layer_types",
                json!([
                    "full_attention",
                    "chunked_attention",
                    "chunked_attention",
                    "full_attention",
                    "chunked_attention",
                    "chunked_attention"
                ]),
            ),
            ("attention_bias", json!(true)),
            ("hidden_act", json!("gelu")),
            ("router_jitter_noise", json!(0.1)),
            (
                "rope_parameters",
                json!({"rope_type": "dynamic", "factor": 2.0}),
            ),
        ];
        for (key, value) in refused {
            let mut cfg = ok.clone();
            cfg[key] = value;
            let e = read(&cfg, file).unwrap_err().to_string();
            assert!(e.contains(key) || e.contains("dynamic"), "{key}: {e}");
        }
        // Every block rotating is a pattern titan computes: no NoPE block, no temperature.
        let mut all_rope = ok.clone();
        all_rope["no_rope_layers"] = json!([1, 1, 1, 1, 1, 1]);
        all_rope["layer_types"] = json!(vec!["chunked_attention"; 6]);
        let args = read(&all_rope, file).unwrap();
        assert_eq!(
            (args.every_n_layers_nope, args.attention_temperature),
            (None, None)
        );
    }

    #[test]
    fn a_model_transformers_cannot_hold_is_not_exported() {
        let mut args = flavor("debugmodel").unwrap();
        let zero = vec![vec![0.0; 8]; 6];
        let mut moved = zero.clone();
        moved[1][3] = 1e-3;
        assert!(Llama4.hf_extra_tensors(&args, Some(&zero)).is_ok());
        let e = Llama4.hf_extra_tensors(&args, Some(&moved)).unwrap_err();
        assert!(e.to_string().contains("load_balance_coeff = 0"), "{e}");
        args.moe.as_mut().unwrap().shared_hidden = Some(1024);
        let e = write(&args).unwrap_err().to_string();
        assert!(e.contains("shared expert"), "{e}");
    }
}
