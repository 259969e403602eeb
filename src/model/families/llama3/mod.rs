//! Llama 3 (`[model] name = "llama3"`): the decoder with grouped-query attention and a dense
//! SwiGLU feed-forward, no QK-norm, no experts; Hugging Face `LlamaForCausalLM` (`model_type`
//! "llama") both ways, RoPE's rows permuted between titan's pairs and transformers' halves.

pub mod flavors;

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use super::llama_form::{self, LlamaForm};
use super::{Family, FfnRounding, HfShapes, RopeRows};
use crate::model::ModelArgs;

pub use flavors::flavor;

/// The Llama 3 family.
pub struct Llama3;

impl Family for Llama3 {
    fn name(&self) -> &'static str {
        "llama3"
    }
    fn flavors(&self) -> &'static [&'static str] {
        flavors::FLAVORS
    }
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs> {
        flavors::flavor(flavor)
    }
    fn ffn_rounding(&self, flavor: &str) -> FfnRounding {
        flavors::ffn_rounding(flavor)
    }
    fn owns(&self, args: &ModelArgs) -> bool {
        let plain = !args.qk_norm && args.moe.is_none() && args.mla.is_none();
        plain && super::full_attention(args)
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["llama"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        let form = LlamaForm {
            qk_norm: false,
            default_head_dim: None,
        };
        let args = super::hf_fields::validated(llama_form::read(cfg, file, &form)?, file)?;
        Ok(HfShapes {
            args,
            rope_rows: RopeRows::Halves,
        })
    }
    fn hf_config(&self, args: &ModelArgs) -> Result<Value> {
        Ok(llama_form::write(args, "LlamaForCausalLM", "llama"))
    }
}
