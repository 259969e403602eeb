//! RoPE in Hugging Face configs, both ways: `rope_parameters` (current `transformers`: one object
//! holding `rope_type`, `rope_theta` and the scaling's fields) or top-level `rope_theta` and
//! `rope_scaling` (earlier versions, `type` or `rope_type`). Reads `default`, `llama3` and `yarn`
//! with transformers' defaults (YaRN: `beta_fast` 32, `beta_slow` 1, `truncate` true,
//! `original_max_position_embeddings` and `factor` from `max_position_embeddings` when absent);
//! any other type, or a YaRN field titan does not know, is an error naming it.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::backend::cpu::rope::{Llama3Scaling, RopeScaling, YarnScaling};

/// The fields a YaRN object may hold (transformers' `_validate_yarn_rope_parameters`, and the
/// older `type`).
const YARN_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
];

/// RoPE's base and scaling from either form; a config with both must say the same in each.
pub fn rope_from_hf(cfg: &Value, file: &Path) -> Result<(f64, Option<RopeScaling>)> {
    let present = |key: &str| cfg.get(key).filter(|v| !v.is_null());
    let max_positions = cfg.get("max_position_embeddings").and_then(Value::as_f64);
    let read = |params: Option<&Value>, theta: Option<&Value>, what: &str| {
        let theta = match theta {
            None => 10000.0,
            Some(t) => t
                .as_f64()
                .ok_or_else(|| anyhow!("{}: {what} rope_theta is not a number", file.display()))?,
        };
        let scaling = match params {
            None => None,
            Some(p) => scaling_from(p, max_positions, &format!("{}: {what}", file.display()))?,
        };
        Ok::<_, anyhow::Error>((theta, scaling))
    };
    let new = present("rope_parameters")
        .map(|p| read(Some(p), p.get("rope_theta"), "rope_parameters"))
        .transpose()?;
    let legacy = (present("rope_theta").is_some() || present("rope_scaling").is_some())
        .then(|| {
            read(
                present("rope_scaling"),
                present("rope_theta"),
                "rope_scaling",
            )
        })
        .transpose()?;
    match (new, legacy) {
        (Some(n), Some(l)) if n != l => bail!(
            "{}: rope_parameters (theta {}, scaling {:?}) and rope_theta/rope_scaling (theta {}, scaling {:?}) disagree",
            file.display(),
            n.0,
            n.1,
            l.0,
            l.1
        ),
        (Some(rope), _) | (None, Some(rope)) => Ok(rope),
        (None, None) => Ok((10000.0, None)),
    }
}

/// The scaling an HF RoPE object `p` describes (`at`: the file and key, for errors).
fn scaling_from(p: &Value, max_positions: Option<f64>, at: &str) -> Result<Option<RopeScaling>> {
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |k: &str| {
        p.get(k).filter(|v| !v.is_null()).map(|v| {
            v.as_f64()
                .ok_or_else(|| anyhow!("{at}.{k} = {v} is not a number"))
        })
    };
    let required = |k: &str| number(k).unwrap_or_else(|| Err(anyhow!("{at}.{k} missing")));
    match kind {
        "default" => Ok(None),
        "llama3" => Ok(Some(RopeScaling::Llama3(Llama3Scaling {
            factor: required("factor")?,
            low_freq_factor: required("low_freq_factor")?,
            high_freq_factor: required("high_freq_factor")?,
            original_max_position_embeddings: required("original_max_position_embeddings")?
                as usize,
        }))),
        "yarn" => {
            if let Some(unknown) = p
                .as_object()
                .and_then(|o| o.keys().find(|k| !YARN_KEYS.contains(&k.as_str())))
            {
                bail!("{at}.{unknown} is not a YaRN field titan implements (accepted: {})", YARN_KEYS.join(", "));
            }
            let original = match number("original_max_position_embeddings").transpose()? {
                Some(o) => o,
                None => max_positions.ok_or_else(|| {
                    anyhow!("{at}: YaRN needs original_max_position_embeddings or max_position_embeddings")
                })?,
            };
            let factor = match number("factor").transpose()? {
                Some(f) => f,
                None => max_positions.map(|m| m / original).ok_or_else(|| {
                    anyhow!("{at}.factor missing (and no max_position_embeddings to derive it)")
                })?,
            };
            // transformers reads `beta_fast or 32`: a zero is the default too.
            let or = |v: Option<f64>, default: f64| v.filter(|&x| x != 0.0).unwrap_or(default);
            let truncate = match p.get("truncate").filter(|v| !v.is_null()) {
                None => true,
                Some(t) => t
                    .as_bool()
                    .ok_or_else(|| anyhow!("{at}.truncate = {t} is not true or false"))?,
            };
            let scaling = RopeScaling::Yarn(YarnScaling {
                factor,
                original_max_position_embeddings: original as usize,
                beta_fast: or(number("beta_fast").transpose()?, 32.0),
                beta_slow: or(number("beta_slow").transpose()?, 1.0),
                truncate,
                attention_factor: number("attention_factor").transpose()?,
                mscale: number("mscale").transpose()?,
                mscale_all_dim: number("mscale_all_dim").transpose()?,
            });
            scaling.validate().map_err(|e| anyhow!("{at}: {e}"))?;
            Ok(Some(scaling))
        }
        other => bail!(
            "{at} rope_type `{other}` is not supported (titan implements \"default\", \"llama3\" and \"yarn\")"
        ),
    }
}

/// A scaling as `transformers` reads it (`rope_type` and its fields; `rope_theta` is added by the
/// caller where the form holds it).
pub fn hf_rope_scaling(scaling: &RopeScaling) -> Value {
    match scaling {
        RopeScaling::Llama3(s) => json!({"rope_type": "llama3", "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}),
        RopeScaling::Yarn(y) => {
            let mut v = json!({"rope_type": "yarn", "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate});
            for (key, value) in [
                ("attention_factor", y.attention_factor),
                ("mscale", y.mscale),
                ("mscale_all_dim", y.mscale_all_dim),
            ] {
                if let Some(x) = value {
                    v[key] = json!(x);
                }
            }
            v
        }
    }
}

/// RoPE in both of transformers' forms, saying the same: `rope_parameters` (current versions read
/// it) and `rope_theta` with `rope_scaling` (earlier versions), so every version loads the same
/// model (current ones without a warning). An object of the three fields, for `hf_fields::merge`.
pub fn hf_rope_fields(theta: f64, scaling: Option<&RopeScaling>) -> Value {
    let scaling = scaling.map(hf_rope_scaling);
    let mut parameters = scaling
        .clone()
        .unwrap_or_else(|| json!({"rope_type": "default"}));
    parameters["rope_theta"] = json!(theta);
    json!({"rope_parameters": parameters, "rope_theta": theta, "rope_scaling": scaling})
}
