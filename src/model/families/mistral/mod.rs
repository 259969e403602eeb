//! Mistral (`[model] name = "mistral"`): Llama's block with sliding-window attention on every
//! block, a family of a kind the decoder already computes and so one folder. Flavors: `7B`
//! (Mistral-7B-v0.1: a window of 4096 keys) and a tiny `debugmodel`. Hugging Face
//! `MistralForCausalLM` (`model_type` "mistral") both ways through the Llama-shaped config, with
//! `sliding_window`. A Mistral config without a window (v0.3) is Llama's model: it imports as one
//! and exports as `LlamaForCausalLM`, which computes the same.

use std::path::Path;

use anyhow::Result;
use serde_json::{json, Value};

use super::hf_fields::get_size;
use super::llama_form::{self, LlamaForm};
use super::{Family, HfShapes, RopeRows};
use crate::model::args::SlidingWindow;
use crate::model::ModelArgs;

/// The flavors `[model] flavor` accepts for `name = "mistral"`.
pub const FLAVORS: &[&str] = &["debugmodel", "7B"];

/// Published Mistral shapes (None: not a Mistral flavor).
pub fn flavor(name: &str) -> Option<ModelArgs> {
    let llama = super::llama3::flavor("debugmodel")?;
    let window = |size| Some(SlidingWindow { size, period: 1 });
    Some(match name {
        "debugmodel" => ModelArgs {
            n_kv_heads: 8,
            rope_theta: 10000.0,
            sliding_window: window(64),
            ..llama
        },
        "7B" => ModelArgs {
            dim: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: 8,
            vocab_size: 32000,
            ffn_hidden: 14336,
            rope_theta: 10000.0,
            max_seq_len: 32768,
            sliding_window: window(4096),
            ..llama
        },
        _ => return None,
    })
}

/// The Mistral family.
pub struct Mistral;

impl Family for Mistral {
    fn name(&self) -> &'static str {
        "mistral"
    }
    fn flavors(&self) -> &'static [&'static str] {
        FLAVORS
    }
    fn flavor_args(&self, name: &str) -> Option<ModelArgs> {
        flavor(name)
    }
    fn owns(&self, args: &ModelArgs) -> bool {
        let plain = !args.qk_norm && args.moe.is_none() && args.mla.is_none();
        plain && !args.attention_sinks && args.sliding_window.is_some_and(|w| w.period == 1)
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["mistral"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        let form = LlamaForm {
            qk_norm: false,
            default_head_dim: None,
        };
        let size = match cfg.get("sliding_window").filter(|v| !v.is_null()) {
            Some(_) => Some(get_size(
                cfg,
                "sliding_window",
                "sliding_window.size",
                None,
                file,
            )?),
            None => None,
        };
        let args = ModelArgs {
            sliding_window: size.map(|size| SlidingWindow { size, period: 1 }),
            ..llama_form::read(cfg, file, &form)?
        };
        Ok(HfShapes {
            args: super::hf_fields::validated(args, file)?,
            rope_rows: RopeRows::Halves,
        })
    }
    fn hf_config(&self, args: &ModelArgs) -> Result<Value> {
        let mut config = llama_form::write(args, "MistralForCausalLM", "mistral");
        let window = args.sliding_window.map(|w| w.size);
        config["sliding_window"] = json!(window);
        if let Some(fields) = config.as_object_mut() {
            fields.remove("use_sliding_window");
        }
        Ok(config)
    }
}
