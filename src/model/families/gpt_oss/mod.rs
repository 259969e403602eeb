//! gpt-oss (`[model] name = "gpt_oss"`): the decoder with attention sinks and biases on the
//! attention's projections, a sliding window of 128 keys on every other block, and in every
//! block a mixture of experts with biases, the clamped SwiGLU and softmax weights over each
//! token's top-k logits (the router's softmax renormalised over the chosen, which is the same).
//! Every one of these is a block feature of the one decoder (`ModelArgs::attention_sinks`,
//! `attention_bias`, `sliding_window`; `MoeArgs::linear_biases`, `activation`). Hugging Face
//! `GptOssForCausalLM` (`model_type` "gpt_oss") both ways (`hf`), its fused expert tensors sliced
//! per expert (`HfPart::Expert`), RoPE's rows in transformers' halves.

pub mod flavors;
pub mod hf;

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

use super::hf_fields::validated;
use super::{Family, HfPart, HfShapes, RopeRows};
use crate::model::moe::activation::ExpertActivation;
use crate::model::moe::router::ScoreFunc;
use crate::model::ModelArgs;

pub use flavors::flavor;

/// The gpt-oss family.
pub struct GptOss;

impl Family for GptOss {
    fn name(&self) -> &'static str {
        "gpt_oss"
    }
    fn flavors(&self) -> &'static [&'static str] {
        flavors::FLAVORS
    }
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs> {
        flavors::flavor(flavor)
    }
    fn owns(&self, args: &ModelArgs) -> bool {
        let experts = args.moe.as_ref().is_some_and(|m| {
            m.linear_biases
                && matches!(m.activation, ExpertActivation::ClampedSwiglu { .. })
                && m.shared_hidden.is_none()
                && m.first_dense_layers == 0
                && m.sparse_step == 1
                && m.router.score_func == ScoreFunc::Softmax
                && m.router.norm_topk_prob
                && m.router.groups.is_none()
                && m.router.route_scale == 1.0
        });
        let window = args.sliding_window.is_some_and(|w| w.period == 2);
        experts
            && window
            && args.attention_sinks
            && args.attention_bias
            && !args.qk_norm
            && !super::llama4_attention(args)
            && args.mla.is_none()
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["gpt_oss"]
    }
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes> {
        Ok(HfShapes {
            args: validated(hf::read(cfg, file)?, file)?,
            rope_rows: RopeRows::Halves,
        })
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::families::ExpertSlice;

    #[test]
    fn an_expert_slice_takes_and_puts_back_its_columns() {
        // Two experts, rows 2 (dim), 6 columns (3 hidden × gate/up interleaved).
        let fused_shape = [2, 2, 6];
        let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let up = ExpertSlice {
            tensor: "t".into(),
            experts: 2,
            expert: 1,
            parts: 2,
            first: 1,
            step: 2,
            transposed: true,
        };
        assert_eq!(up.fused_shape(&[3, 2]), fused_shape);
        // Expert 1's rows are 12..18 and 18..24; its up columns 1, 3, 5; titan's [3, 2].
        let piece = up.take(&data, &fused_shape);
        assert_eq!(piece, [13.0, 19.0, 15.0, 21.0, 17.0, 23.0]);
        let mut back = vec![0.0; 24];
        up.put(&mut back, &fused_shape, &piece);
        assert_eq!(back[13], 13.0);
        assert_eq!(back[23], 23.0);
        assert_eq!(back.iter().filter(|&&x| x != 0.0).count(), 6);
        // Side by side (Llama 4's): the up projection's 3 columns from the middle.
        let side = ExpertSlice {
            first: 3,
            step: 1,
            ..up
        };
        assert_eq!(
            side.take(&data, &fused_shape),
            [15.0, 21.0, 16.0, 22.0, 17.0, 23.0]
        );
    }

    #[test]
    fn every_parameter_has_a_place_and_the_experts_are_slices() {
        let args = flavor("debugmodel").unwrap();
        assert!(GptOss.owns(&args));
        assert_eq!(
            GptOss.hf_name(&args, "layers.1.attention.sinks"),
            "model.layers.1.self_attn.sinks"
        );
        assert_eq!(
            GptOss.hf_name(&args, "layers.1.moe.router.gate.bias"),
            "model.layers.1.mlp.router.bias"
        );
        assert_eq!(
            GptOss.hf_name(&args, "layers.0.attention.wq.bias"),
            "model.layers.0.self_attn.q_proj.bias"
        );
        let HfPart::Expert(s) = GptOss.hf_part(&args, "layers.2.moe.experts.5.w3.bias") else {
            panic!("an expert's bias is a slice")
        };
        assert_eq!(s.tensor, "model.layers.2.mlp.experts.gate_up_proj_bias");
        assert_eq!((s.expert, s.first, s.step, s.transposed), (5, 1, 2, false));
    }
}
