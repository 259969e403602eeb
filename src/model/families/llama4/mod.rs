//! Llama 4 text (`[model] name = "llama4"`): the decoder with iRoPE — every fourth block without
//! RoPE (`ModelArgs::every_n_layers_nope`), its queries temperature-tuned
//! (`attention_temperature`), chunked attention on the other blocks (`attention_chunk_size`) with
//! a weightless QK-norm after RoPE (`l2_qk_norm`) — and a mixture of experts in every
//! `interleave_moe_layer_step`-th block (`MoeArgs::sparse_step`; dense SwiGLU blocks between):
//! one routed expert per token, the sigmoid of its top logit scaling the expert's input
//! (`MoeArgs::score_before_experts`), beside a shared expert. Every one of these is a block
//! feature of the one decoder. Hugging Face `Llama4ForCausalLM` (`model_type` "llama4_text") both
//! ways (`hf`): the fused expert tensors sliced per expert, RoPE's rows interleaved as titan's.
//!
//! NoPE blocks are those with `l + 1` a multiple of 4 (blocks 3, 7, …), as in Meta's release and
//! transformers; TorchTitan's own Llama 4 puts them at `l` a multiple of 4 and has neither the
//! QK-norm nor temperature tuning, so its checkpoints are not this family's function.

pub mod flavors;
pub mod hf;

use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::Value;

use super::hf_fields::validated;
use super::{Family, HfPart, HfShapes, RopeRows};
use crate::model::ModelArgs;

pub use flavors::flavor;

/// Whether `cfg` is a multimodal Llama 4's (`Llama4ForConditionalGeneration`, whose text model
/// titan imports).
fn multimodal(cfg: &Value) -> bool {
    cfg.get("model_type").and_then(Value::as_str) == Some("llama4")
}

/// The Llama 4 family.
pub struct Llama4;

impl Family for Llama4 {
    fn name(&self) -> &'static str {
        "llama4"
    }
    fn flavors(&self) -> &'static [&'static str] {
        flavors::FLAVORS
    }
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs> {
        flavors::flavor(flavor)
    }
    /// Llama 4's routing (the score scaling the expert's input) marks it; what its HF form cannot
    /// say of the rest is refused on export (`hf::write`).
    fn owns(&self, args: &ModelArgs) -> bool {
        let routing = args.moe.as_ref().is_some_and(|m| m.score_before_experts);
        routing
            && !args.attention_sinks
            && args.sliding_window.is_none()
            && !args.attention_bias
            && !args.qk_norm
            && args.mla.is_none()
    }
    /// The text model's, and Meta's published multimodal checkpoints'
    /// (`Llama4ForConditionalGeneration`: its `text_config` and `language_model.` tensors).
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["llama4_text", "llama4"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        let text = match multimodal(cfg) {
            true => cfg
                .get("text_config")
                .filter(|t| t.is_object())
                .ok_or_else(|| {
                    anyhow!(
                        "{}: a Llama 4 (model_type \"llama4\") config without its text_config",
                        file.display()
                    )
                })?,
            false => cfg,
        };
        Ok(HfShapes {
            args: validated(hf::read(text, file)?, file)?,
            rope_rows: RopeRows::Interleaved,
        })
    }
    fn hf_tensor_prefix(&self, cfg: &Value) -> &'static str {
        match multimodal(cfg) {
            true => "language_model.",
            false => "",
        }
    }
    fn hf_config(&self, args: &ModelArgs) -> Result<Value> {
        hf::write(args)
    }
    fn hf_name(&self, _args: &ModelArgs, name: &str) -> String {
        hf::hf_name(name)
    }
    fn hf_part(&self, args: &ModelArgs, name: &str) -> HfPart {
        hf::part(args, name)
    }
    /// transformers rotates interleaved pairs in Llama 4, as titan does: rows unchanged.
    fn export_rows(&self, _args: &ModelArgs, _name: &str, data: &[f32], _cols: usize) -> Vec<f32> {
        data.to_vec()
    }
    fn import_rows(&self, _hf: &HfShapes, _name: &str, data: Vec<f32>, _cols: usize) -> Vec<f32> {
        data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_a_place_and_the_experts_are_slices() {
        let args = flavor("debugmodel").unwrap();
        assert!(Llama4.owns(&args));
        let name = |n| Llama4.hf_name(&args, n);
        assert_eq!(
            name("layers.1.moe.router.gate.weight"),
            "model.layers.1.feed_forward.router.weight"
        );
        assert_eq!(
            name("layers.1.moe.shared_experts.w1.weight"),
            "model.layers.1.feed_forward.shared_expert.gate_proj.weight"
        );
        assert_eq!(
            name("layers.0.feed_forward.w2.weight"),
            "model.layers.0.feed_forward.down_proj.weight"
        );
        assert_eq!(
            name("layers.0.attention.wq.weight"),
            "model.layers.0.self_attn.q_proj.weight"
        );
        let HfPart::Expert(s) = Llama4.hf_part(&args, "layers.3.moe.experts.5.w3.weight") else {
            panic!("an expert's weight is a slice")
        };
        assert_eq!(s.tensor, "model.layers.3.feed_forward.experts.gate_up_proj");
        assert_eq!((s.expert, s.parts, s.first, s.step), (5, 2, 512, 1));
        let HfPart::Expert(s) = Llama4.hf_part(&args, "layers.3.moe.experts.0.w2.weight") else {
            panic!("an expert's weight is a slice")
        };
        assert_eq!(s.tensor, "model.layers.3.feed_forward.experts.down_proj");
        assert_eq!((s.parts, s.first, s.transposed), (1, 0, true));
    }
}
