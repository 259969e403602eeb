//! Model families: each one folder over the one decoder (`model::decoder`), owning its published
//! flavors, the block features it selects (through `ModelArgs`: QK-norm, multi-head latent
//! attention, a mixture of experts and its routing) and its Hugging Face adapter (model types,
//! `config.json` fields both ways, tensor names, the layout of RoPE's rows, tensors kept beside
//! the weights). `config` and `checkpoint` look a family up here, by `[model] name`, by an HF
//! `model_type` or by the model a checkpoint holds (`of_args`); no family is named anywhere else.
//!
//! Adding a family of a kind the decoder already computes is one folder and one line in
//! `FAMILIES`. The HF helpers every family shares are `hf_fields` (reading `config.json` sizes,
//! refusing what titan does not compute), `hf_rope` (RoPE's config forms), `hf_names` (the
//! transformers names of the decoder's parameters) and `llama_form` (the Llama-shaped config and
//! its RoPE row permutation, which Llama 3 and Qwen3 share).

pub mod deepseek_v3;
pub mod gpt_oss;
pub mod hf_fields;
pub mod hf_names;
pub mod hf_rope;
pub mod llama3;
pub mod llama4;
pub mod llama_form;
pub mod mistral;
pub mod qwen3;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use super::ModelArgs;
use crate::tensor::Tensor;

/// How a Hugging Face checkpoint lays out the rotated rows of each query and key head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeRows {
    /// transformers' usual layout: the two halves `(i, i + head_dim/2)` rotate together.
    Halves,
    /// titan's (and Meta's, TorchTitan's, DeepSeek's releases'): pairs `(2i, 2i+1)`.
    Interleaved,
}

/// What an HF `config.json` says: the model, and how its checkpoint lays out RoPE's rows.
#[derive(Debug, Clone, PartialEq)]
pub struct HfShapes {
    pub args: ModelArgs,
    pub rope_rows: RopeRows,
}

/// An HF folder's tensors by name, each with the file it came from (for errors).
pub type HfTensors = BTreeMap<String, (Tensor, PathBuf)>;

/// Where a titan parameter lies in a Hugging Face checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HfPart {
    /// A tensor of its own, of this name.
    Whole(String),
    /// One expert's slice of a tensor that holds every expert's (gpt-oss's fused experts).
    Expert(ExpertSlice),
}

/// Expert `expert`'s slice of `tensor`, `[experts, rows, cols]` (or `[experts, cols]` for a
/// vector) whose columns hold `parts` parameters: every `step`-th column from `first` (gpt-oss
/// interleaves the gate's and the up projection's features: step 2; Llama 4 puts them side by
/// side: step 1, the up projection's from the middle), transposed into titan's `[out, in]` when
/// `transposed` (transformers keeps its experts `[in, out]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSlice {
    pub tensor: String,
    pub experts: usize,
    pub expert: usize,
    pub parts: usize,
    pub first: usize,
    pub step: usize,
    pub transposed: bool,
}

impl ExpertSlice {
    /// The whole tensor's shape, from the shape of the titan parameter it holds a slice of.
    pub fn fused_shape(&self, piece: &[usize]) -> Vec<usize> {
        match (piece, self.transposed) {
            ([n], _) => vec![self.experts, n * self.parts],
            ([out, inp], true) => vec![self.experts, *inp, out * self.parts],
            ([rows, cols], false) => vec![self.experts, *rows, cols * self.parts],
            _ => unreachable!("an expert's parameters are vectors and matrices"),
        }
    }

    /// Each value of the slice (in titan's order) with its index in the whole tensor of shape
    /// `fused` (`fused_shape`).
    fn places(&self, fused: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (rows, cols) = match fused {
            [_, c] => (1, *c),
            [_, r, c] => (*r, *c),
            _ => unreachable!("a fused experts tensor is 2- or 3-dimensional"),
        };
        let (base, picked) = (self.expert * rows * cols, cols / self.parts);
        let at = move |r: usize, j: usize| base + r * cols + self.first + j * self.step;
        let transposed = self.transposed;
        (0..rows * picked).map(move |i| match transposed {
            // titan's row j (an output feature) holds the HF column, over every HF row.
            true => (i, at(i % rows, i / rows)),
            false => (i, at(i / picked, i % picked)),
        })
    }

    /// The slice, in titan's layout, of the whole tensor `data` of shape `fused`.
    pub fn take(&self, data: &[f32], fused: &[usize]) -> Vec<f32> {
        let mut out = vec![0.0; fused[1..].iter().product::<usize>() / self.parts];
        for (i, at) in self.places(fused) {
            out[i] = data[at];
        }
        out
    }

    /// `piece` (titan's layout) written into its place in the whole tensor `data` of shape `fused`.
    pub fn put(&self, data: &mut [f32], fused: &[usize], piece: &[f32]) {
        for (i, at) in self.places(fused) {
            data[at] = piece[i];
        }
    }
}

/// The FFN width's rounding when `[model]` overrides `dim`, `multiple_of` or
/// `ffn_dim_multiplier` (Llama's rule, `args::ffn_hidden`): a flavor's own `multiple_of` and
/// multiplier where the config does not set them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FfnRounding {
    pub multiple_of: usize,
    pub multiplier: Option<f64>,
}

/// One model family: its flavors and its Hugging Face adapter.
pub trait Family: Sync {
    /// `[model] name`.
    fn name(&self) -> &'static str;
    /// The flavors `[model] flavor` accepts, as published.
    fn flavors(&self) -> &'static [&'static str];
    /// The published shapes of `flavor` (one of `flavors`; None for any other).
    fn flavor_args(&self, flavor: &str) -> Option<ModelArgs>;
    /// How an FFN-width override of `flavor` is rounded.
    fn ffn_rounding(&self, _flavor: &str) -> FfnRounding {
        FfnRounding {
            multiple_of: 256,
            multiplier: None,
        }
    }
    /// Whether `args` is this family's model (exactly one family owns each model; a model with
    /// block features no family's HF form can say is owned by none).
    fn owns(&self, args: &ModelArgs) -> bool;

    /// The `model_type`s of the HF configs this family reads.
    fn hf_model_types(&self) -> &'static [&'static str];
    /// The model an HF `config.json` (`file`, for errors) describes, checked.
    fn read_hf_config(&self, cfg: &Value, file: &Path) -> Result<HfShapes>;
    /// What the names of the model's tensors start with in an HF folder whose `config.json` is
    /// `cfg`: "" but for a multimodal checkpoint's language model (Llama 4's `language_model.`),
    /// whose other tensors are skipped on import.
    fn hf_tensor_prefix(&self, _cfg: &Value) -> &'static str {
        ""
    }
    /// The HF `config.json` of `args` (without the token ids and dtype), or why transformers
    /// has no model for it.
    fn hf_config(&self, args: &ModelArgs) -> Result<Value>;
    /// The HF name of titan parameter `name`.
    fn hf_name(&self, args: &ModelArgs, name: &str) -> String {
        let _ = args;
        hf_names::hf_name(name)
    }
    /// Where parameter `name` lies in the HF checkpoint: by default its own tensor (`hf_name`).
    fn hf_part(&self, args: &ModelArgs, name: &str) -> HfPart {
        HfPart::Whole(self.hf_name(args, name))
    }
    /// Parameter `name`'s rows (`cols` wide) in the HF layout: by default transformers' halves
    /// (`llama_form`).
    fn export_rows(&self, args: &ModelArgs, name: &str, data: &[f32], cols: usize) -> Vec<f32> {
        llama_form::rows_to_halves(args, name, data, cols)
    }
    /// Parameter `name`'s rows from an HF checkpoint laid out as `hf` says, in titan's layout: by
    /// default from transformers' halves.
    fn import_rows(&self, hf: &HfShapes, name: &str, data: Vec<f32>, cols: usize) -> Vec<f32> {
        // Only the permuted tensors are rebuilt; the others are taken as read.
        match llama_form::rope_permutation(name, &hf.args) {
            Some(heads) => llama_form::permute_rows(&data, heads, hf.args.head_dim(), cols, false),
            None => data,
        }
    }
    /// Tensors HF keeps beside the weights that titan keeps as training state (DeepSeek-V3's
    /// routing bias, titan's expert bias): written on export; an error when the family's HF
    /// model has no place for that state (the export is then refused). By default none: a model
    /// whose load balancing moved its expert bias is refused, as it would route differently.
    fn hf_extra_tensors(
        &self,
        _args: &ModelArgs,
        expert_bias: Option<&[Vec<f32>]>,
    ) -> Result<Vec<(String, Tensor)>> {
        refuse_moved_expert_bias(self.name(), expert_bias)?;
        Ok(Vec::new())
    }
    /// The expert bias an HF checkpoint holds (None: the family keeps none).
    fn expert_bias_from_hf(
        &self,
        _args: &ModelArgs,
        _tensors: &HfTensors,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        Ok(None)
    }
    /// How many of `tensors` belong to no parameter of `args` and are skipped on import, with
    /// what they are (DeepSeek-V3's multi-token-prediction layer); 0 for none.
    fn skipped_hf_tensors(&self, _args: &ModelArgs, _tensors: &HfTensors) -> (usize, &'static str) {
        (0, "")
    }
}

impl std::fmt::Debug for dyn Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `args` has none of the attention features only some families select (gpt-oss's
/// sinks, sliding windows and biases; Llama 4's NoPE blocks, chunks, L2 QK-norm and temperature
/// tuning): what a family whose HF form has no field for them checks in `owns`.
pub fn full_attention(args: &ModelArgs) -> bool {
    !args.attention_sinks
        && args.sliding_window.is_none()
        && !args.attention_bias
        && !llama4_attention(args)
}

/// Whether `args` has one of Llama 4's attention features.
pub fn llama4_attention(args: &ModelArgs) -> bool {
    args.every_n_layers_nope.is_some()
        || args.attention_chunk_size.is_some()
        || args.l2_qk_norm
        || args.attention_temperature.is_some()
}

/// Refuses the export of a model whose load balancing moved its expert bias to transformers'
/// model of `family`, which has no place for one (its routing would differ there).
fn refuse_moved_expert_bias(family: &str, expert_bias: Option<&[Vec<f32>]>) -> Result<()> {
    let moved = expert_bias.is_some_and(|b| b.iter().flatten().any(|&x| x != 0.0));
    if moved {
        bail!("this checkpoint routes with an expert bias (load balancing's, [model] load_balance_coeff), which transformers' {family} model has no place for: its export would route differently. Train with load_balance_coeff = 0 to export it");
    }
    Ok(())
}

/// Every family titan trains.
pub static FAMILIES: [&dyn Family; 6] = [
    &llama3::Llama3,
    &qwen3::Qwen3,
    &deepseek_v3::DeepSeekV3,
    &mistral::Mistral,
    &gpt_oss::GptOss,
    &llama4::Llama4,
];

/// The family `[model] name` names.
pub fn by_name(name: &str) -> Result<&'static dyn Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.name() == name)
        .ok_or_else(|| {
            anyhow!(
                "[model] name = `{name}` is not supported (accepted: {})",
                names(FAMILIES.iter().map(|f| f.name()))
            )
        })
}

/// The published shapes of `family`'s `flavor`, or an error listing the family's flavors.
pub fn flavor(family: &dyn Family, flavor: &str) -> Result<ModelArgs> {
    family.flavor_args(flavor).ok_or_else(|| {
        anyhow!(
            "unknown {} flavor `{flavor}` (accepted: {})",
            family.name(),
            family.flavors().join(", ")
        )
    })
}

/// The family whose HF configs have `model_type` (`file`, for the error).
pub fn by_hf_model_type(model_type: &str, file: &Path) -> Result<&'static dyn Family> {
    if let Some(f) = FAMILIES
        .iter()
        .copied()
        .find(|f| f.hf_model_types().contains(&model_type))
    {
        return Ok(f);
    }
    let known = FAMILIES
        .iter()
        .flat_map(|f| f.hf_model_types().iter().map(|t| format!("\"{t}\"")));
    bail!(
        "{}: model_type is `{model_type}`; titan imports {}",
        file.display(),
        names(known)
    )
}

/// The family whose model `args` is.
pub fn of_args(args: &ModelArgs) -> Result<&'static dyn Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.owns(args))
        .ok_or_else(|| {
            anyhow!("no model family has this model's block features together, so it has no Hugging Face form ({args:?})")
        })
}

fn names(items: impl Iterator<Item = impl AsRef<str>>) -> String {
    items
        .map(|s| s.as_ref().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flavor_is_valid_and_owned_by_its_family_alone() {
        for family in FAMILIES {
            for name in family.flavors() {
                let args = flavor(family, name).unwrap();
                args.validate().unwrap();
                let owners: Vec<&str> = FAMILIES
                    .iter()
                    .filter(|f| f.owns(&args))
                    .map(|f| f.name())
                    .collect();
                assert_eq!(owners, [family.name()], "{} {name}", family.name());
            }
            assert!(family.flavor_args("7T").is_none(), "{}", family.name());
        }
    }

    #[test]
    fn every_flavor_hf_transformers_has_round_trips_through_its_config() {
        let file = Path::new("config.json");
        for family in FAMILIES {
            for name in family.flavors() {
                let args = flavor(family, name).unwrap();
                // TorchTitan's small DeepSeek flavors route with softmax: no HF model.
                let Ok(cfg) = family.hf_config(&args) else {
                    continue;
                };
                let model_type = cfg["model_type"].as_str().unwrap();
                let back = by_hf_model_type(model_type, file).unwrap();
                assert_eq!(back.name(), family.name());
                let read = back.read_hf_config(&cfg, file).unwrap().args;
                assert!(read.same_model(&args), "{args:?}\n{read:?}");
            }
        }
    }

    /// DeepSeek-V3 writes the expert bias (`e_score_correction_bias`, its own tests); every other
    /// family's transformers model has no place for one, so a moved one refuses the export.
    #[test]
    fn only_deepseek_exports_a_moved_expert_bias() {
        let moved = vec![vec![0.0, 1e-3]; 2];
        for family in FAMILIES.iter().filter(|f| f.name() != "deepseek_v3") {
            let args = flavor(*family, family.flavors()[0]).unwrap();
            let e = family.hf_extra_tensors(&args, Some(&moved)).unwrap_err();
            assert!(e.to_string().contains(family.name()), "{e}");
            assert!(family.hf_extra_tensors(&args, None).is_ok());
            assert!(family
                .hf_extra_tensors(&args, Some(&[vec![0.0; 2]]))
                .is_ok());
        }
    }

    #[test]
    fn unknown_names_list_the_accepted_ones() {
        let e = by_name("gpt2").unwrap_err().to_string();
        assert!(e.contains("llama3, qwen3, deepseek_v3, mistral"), "{e}");
        let e = flavor(by_name("llama3").unwrap(), "7B")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("7B") && e.contains("debugmodel") && e.contains("405B"),
            "{e}"
        );
        let e = by_hf_model_type("gpt2", Path::new("c.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`gpt2`") && e.contains("\"qwen3_moe\""), "{e}");
    }
}
