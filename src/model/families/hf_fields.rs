//! Reading Hugging Face `config.json` fields every family shares: sizes checked against the
//! ranges `ModelArgs::validate` accepts before anything is sized from them, the fields that change
//! what a model computes and titan does not implement (refused, naming the field), and merging
//! written fields into a config.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::hf_rope::hf_rope_fields;
use crate::model::args::field_range;
use crate::model::ModelArgs;

/// Size `key` of `cfg` (`default` when absent or null), within the range `ModelArgs::validate`
/// accepts for titan's `field`: an error naming the file and the key, before anything is sized
/// from it.
pub fn get_size(
    cfg: &Value,
    key: &str,
    field: &str,
    default: Option<usize>,
    file: &Path,
) -> Result<usize> {
    let v = match (cfg.get(key).filter(|v| !v.is_null()), default) {
        (None, Some(d)) => return Ok(d),
        (None, None) => bail!("{}: `{key}` is missing", file.display()),
        (Some(v), _) => v.as_u64().ok_or_else(|| {
            anyhow!(
                "{}: `{key}` = {v} is not a non-negative integer",
                file.display()
            )
        })?,
    };
    let (min, max) = field_range(field);
    match usize::try_from(v) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => bail!(
            "{}: `{key}` = {v} is out of range (titan's {field}: {min} to {max})",
            file.display()
        ),
    }
}

/// Number `key` of `cfg` (`default` when absent or null), finite and ≥ 0, else an error naming
/// the file and the key.
pub fn get_float(cfg: &Value, key: &str, default: f64, file: &Path) -> Result<f64> {
    match cfg.get(key).filter(|v| !v.is_null()) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| anyhow!("{}: `{key}` = {v} is not a number ≥ 0", file.display())),
    }
}

/// RMSNorm's ε (transformers' default 10⁻⁶ when absent).
pub fn norm_eps(cfg: &Value) -> f32 {
    cfg.get("rms_norm_eps")
        .and_then(Value::as_f64)
        .unwrap_or(1e-6) as f32
}

/// Whether the output projection is the embedding (`tie_word_embeddings`, default false).
pub fn tied_embeddings(cfg: &Value) -> bool {
    cfg.get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// `hidden_act` is SwiGLU's `silu` (absent: transformers' default, the same), else an error
/// naming it.
pub fn refuse_other_activation(cfg: &Value, file: &Path) -> Result<()> {
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        bail!(
            "{}: hidden_act `{act}` is not supported (titan's feed-forwards are SwiGLU: \"silu\")",
            file.display()
        );
    }
    Ok(())
}

/// The `config.json` fields every decoder family writes alike: sizes, heads, the norm's ε,
/// positions (RoPE's θ and scaling), embeddings and SwiGLU's activation.
pub fn decoder_fields(args: &ModelArgs) -> Value {
    let mut fields = serde_json::json!({
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim(),
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tied_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
    });
    merge(
        &mut fields,
        hf_rope_fields(args.rope_theta, args.rope_scaling.as_ref()),
    );
    fields
}

/// Config fields that change what the model computes and that titan does not implement: an
/// error, not a silently different model.
pub fn refuse_unsupported(cfg: &Value, file: &Path) -> Result<()> {
    refuse_other_activation(cfg, file)?;
    if cfg.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        bail!(
            "{}: use_sliding_window = true is not supported (titan's attention is full causal attention)",
            file.display()
        );
    }
    if let Some(kinds) = cfg.get("layer_types").and_then(Value::as_array) {
        if let Some(other) = kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|k| *k != "full_attention")
        {
            bail!(
                "{}: layer_types holds `{other}`; titan implements \"full_attention\" only",
                file.display()
            );
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if cfg.get(key).and_then(Value::as_bool) == Some(true) {
            bail!(
                "{}: {key} = true is not supported (titan's projections have no bias)",
                file.display()
            );
        }
    }
    Ok(())
}

/// `args` validated, the error naming `file` (every family's import ends with it).
pub fn validated(args: ModelArgs, file: &Path) -> Result<ModelArgs> {
    args.validate()
        .map_err(|e| anyhow!("{}: {e}", file.display()))?;
    Ok(args)
}

/// `fields` (an object) written into `config` (an object), replacing what it held under them.
pub fn merge(config: &mut Value, fields: Value) {
    let Value::Object(fields) = fields else {
        unreachable!("config fields are built as a JSON object");
    };
    for (k, v) in fields {
        config[k] = v;
    }
}
