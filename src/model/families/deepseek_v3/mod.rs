//! DeepSeek-V3 (`[model] name = "deepseek_v3"`): the decoder with multi-head latent attention
//! (`model::decoder::mla`) in every block and a mixture of experts with shared experts after the
//! leading dense blocks; Hugging Face `DeepseekV3ForCausalLM` (`model_type` "deepseek_v3") both
//! ways, with the routing bias kept beside the weights and RoPE's rows interleaved as DeepSeek's
//! releases store them.

pub mod flavors;
pub mod hf;

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use super::hf_fields::{refuse_unsupported, validated};
use super::{Family, HfShapes, HfTensors, RopeRows};
use crate::model::ModelArgs;
use crate::tensor::Tensor;

pub use flavors::flavor;

/// The DeepSeek-V3 family.
pub struct DeepSeekV3;

impl Family for DeepSeekV3 {
    fn name(&self) -> &'static str {
        "deepseek_v3"
    }
    fn flavors(&self) -> &'static [&'static str] {
        flavors::FLAVORS
    }
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs> {
        flavors::flavor(flavor)
    }
    fn owns(&self, args: &ModelArgs) -> bool {
        args.mla.is_some() && super::full_attention(args)
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["deepseek_v3"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        refuse_unsupported(cfg, file)?;
        let HfShapes { args, rope_rows } = hf::args_from_deepseek_config(cfg, file)?;
        Ok(HfShapes {
            args: validated(args, file)?,
            rope_rows,
        })
    }
    fn hf_config(&self, args: &ModelArgs) -> Result<Value> {
        hf::deepseek_config(args)
    }
    fn hf_name(&self, _args: &ModelArgs, name: &str) -> String {
        hf::hf_name(name)
    }
    /// titan exports the interleaved layout (`rope_interleave = true`): rows unchanged.
    fn export_rows(&self, _args: &ModelArgs, _name: &str, data: &[f32], _cols: usize) -> Vec<f32> {
        data.to_vec()
    }
    fn import_rows(&self, hf: &HfShapes, name: &str, data: Vec<f32>, cols: usize) -> Vec<f32> {
        match hf.rope_rows {
            RopeRows::Interleaved => data,
            RopeRows::Halves => hf::interleave_rope_rows(name, data, cols, &hf.args),
        }
    }
    fn hf_extra_tensors(
        &self,
        args: &ModelArgs,
        expert_bias: Option<&[Vec<f32>]>,
    ) -> Result<Vec<(String, Tensor)>> {
        Ok(hf::routing_bias_tensors(args, expert_bias))
    }
    fn expert_bias_from_hf(
        &self,
        args: &ModelArgs,
        tensors: &HfTensors,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        hf::routing_bias(args, tensors)
    }
    fn skipped_hf_tensors(&self, args: &ModelArgs, tensors: &HfTensors) -> (usize, &'static str) {
        (
            hf::extra_layer_tensors(tensors, args.n_layers),
            "a multi-token-prediction layer titan does not train",
        )
    }
}
