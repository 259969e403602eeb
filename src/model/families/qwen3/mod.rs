//! Qwen3 (`[model] name = "qwen3"`): Llama's block with two differences, both block features of
//! the one decoder: a head width of its own (`attention_head_dim`, not `dim / n_heads`) and an
//! RMSNorm on every query and key head before RoPE (`qk_norm`); Qwen3-MoE's flavors put a
//! mixture of experts (softmax top-k, no shared experts) in every block. Hugging Face
//! `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` (`model_type` "qwen3", "qwen3_moe") both ways.

pub mod flavors;
pub mod hf;

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use super::llama_form::{self, LlamaForm};
use super::{Family, HfShapes, RopeRows};
use crate::model::ModelArgs;

pub use flavors::flavor;

/// The Qwen3 family (dense and mixture of experts).
pub struct Qwen3;

impl Family for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }
    fn flavors(&self) -> &'static [&'static str] {
        flavors::FLAVORS
    }
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs> {
        flavors::flavor(flavor)
    }
    fn owns(&self, args: &ModelArgs) -> bool {
        // Llama 4's routing (the score scaling the expert's input) is Llama 4's.
        let llama4_routing = args.moe.as_ref().is_some_and(|m| m.score_before_experts);
        args.mla.is_none()
            && (args.qk_norm || args.moe.is_some())
            && !llama4_routing
            && super::full_attention(args)
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen3", "qwen3_moe"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        let moe = match cfg.get("model_type").and_then(Value::as_str) {
            Some("qwen3_moe") => Some(hf::moe_from_hf(cfg, file)?),
            _ => None,
        };
        let form = LlamaForm {
            qk_norm: true,
            default_head_dim: Some(128),
        };
        let args = ModelArgs {
            moe,
            ..llama_form::read(cfg, file, &form)?
        };
        Ok(HfShapes {
            args: super::hf_fields::validated(args, file)?,
            rope_rows: RopeRows::Halves,
        })
    }
    fn hf_config(&self, args: &ModelArgs) -> Result<Value> {
        hf::check_exportable(args)?;
        Ok(match &args.moe {
            Some(moe) => {
                let mut config = llama_form::write(args, "Qwen3MoeForCausalLM", "qwen3_moe");
                hf::write_moe(&mut config, moe);
                config
            }
            None => llama_form::write(args, "Qwen3ForCausalLM", "qwen3"),
        })
    }
}
