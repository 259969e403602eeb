//! Hugging Face interop: a folder of `config.json` + safetensors, out of and into titan
//! checkpoints. What is a family's own (its `config.json` fields, tensor names, RoPE's row layout,
//! tensors kept beside the weights) is its adapter's (`model::families`); this module reads and
//! writes the files, checks the weights are there before allocating, and dequantises FP8
//! releases (`hf_fp8`).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::{st, TrainState, FORMAT_VERSION};
use crate::backend::cpu::CpuBackend;
use crate::data::LoaderState;
use crate::model::families::{self, Family, HfPart, HfShapes, HfTensors};
use crate::model::params::param_specs;
use crate::model::{ModelArgs, ParamSet};
use crate::tensor::{DType, Tensor};

/// The HF `config.json` of `args` (its family's), with the tokenizer's ids and the weights' dtype.
pub fn hf_config(args: &ModelArgs, bos: u32, eos: u32, dtype: DType) -> Result<Value> {
    let mut config = families::of_args(args)?.hf_config(args)?;
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!(eos);
    config["torch_dtype"] = json!(if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    });
    Ok(config)
}

pub fn export(checkpoint: &Path, out_dir: &Path, dtype: DType) -> Result<()> {
    let be = CpuBackend::new();
    let dir = super::resolve_checkpoint_dir(checkpoint)?;
    let state = super::read_state(&dir)?;
    let (mut args, mut params) = super::load_weights(&be, &dir)?;
    if let Some(lora) = args.lora.take() {
        // A LoRA run's model is its base with the adapters merged in (`W + (alpha/rank)·B·A`).
        params = crate::model::lora::merge_adapters(&be, params, &lora);
    }
    let tokenizer = crate::data::load_tokenizer(&state.tokenizer_path)?;
    let family = families::of_args(&args)?;
    // Before anything is written: a model transformers has no class for is refused whole.
    let config = hf_config(&args, tokenizer.bos_id(), tokenizer.eos_id(), dtype)?;
    let mut tensors = Vec::new();
    // Tensors holding every expert's slice (gpt-oss), filled as their slices come.
    let mut fused: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for ((name, shape), buf) in params.names.iter().zip(&params.shapes).zip(&params.bufs) {
        match family.hf_part(&args, name) {
            HfPart::Whole(hf) => {
                let data = family.export_rows(&args, name, buf, columns(shape));
                tensors.push((hf, Tensor::from_f32(shape.clone(), data).to_dtype(dtype)));
            }
            HfPart::Expert(slice) => {
                let (whole, values) = fused.entry(slice.tensor.clone()).or_insert_with(|| {
                    let whole = slice.fused_shape(shape);
                    let len = whole.iter().product();
                    (whole, vec![0.0; len])
                });
                slice.put(values, whole, buf);
            }
        }
    }
    for (name, (shape, values)) in fused {
        tensors.push((name, Tensor::from_f32(shape, values).to_dtype(dtype)));
    }
    tensors.extend(family.hf_extra_tensors(&args, state.expert_bias.as_deref())?);
    write_folder_file(out_dir, "model.safetensors", &tensors)?;
    write_atomic(
        &out_dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    if !state.tokenizer_path.is_empty() {
        std::fs::copy(&state.tokenizer_path, out_dir.join("tokenizer.json"))
            .with_context(|| format!("cannot copy tokenizer {}", state.tokenizer_path))?;
    }
    outln!(
        "exported {} (step {}) to {} ({} tensors, {})",
        dir.display(),
        state.step,
        out_dir.display(),
        tensors.len(),
        if dtype == DType::BF16 {
            "bfloat16"
        } else {
            "float32"
        }
    );
    Ok(())
}

/// Columns of a matrix (1 for a vector).
fn columns(shape: &[usize]) -> usize {
    shape.get(1).copied().unwrap_or(1)
}

/// `tensors` as safetensors (with PyTorch's `format: pt` metadata, as transformers writes them)
/// in `out_dir/file`, the folder made first.
pub(super) fn write_folder_file(
    out_dir: &Path,
    file: &str,
    tensors: &[(String, Tensor)],
) -> Result<()> {
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let meta = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    write_atomic(&out_dir.join(file), &st::to_bytes(tensors, Some(meta))?)
}

pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move {} into place", path.display()))?;
    Ok(())
}

/// Model shapes from an HF `config.json` (`file`, for errors), by its `model_type`'s family.
pub fn args_from_hf_config(cfg: &Value, file: &Path) -> Result<ModelArgs> {
    shapes_from_hf_config(cfg, file).map(|(_, shapes)| shapes.args)
}

/// The family that reads `cfg` (by its `model_type`) and the model it describes.
fn shapes_from_hf_config(cfg: &Value, file: &Path) -> Result<(&'static dyn Family, HfShapes)> {
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    let reader = families::by_hf_model_type(model_type, file)?;
    Ok((reader, reader.read_hf_config(cfg, file)?))
}

/// An HF model's shapes, weights (in titan's names and layout, host memory) and, for DeepSeek-V3,
/// each block's routing bias (titan's expert bias; empty blocks for the dense ones).
pub struct HfModel {
    pub args: ModelArgs,
    pub params: ParamSet<CpuBackend>,
    pub expert_bias: Option<Vec<Vec<f32>>>,
}

/// An HF folder's model (`HfModel`).
pub fn read_hf(hf_dir: &Path) -> Result<HfModel> {
    let be = CpuBackend::new();
    let cfg_path = hf_dir.join("config.json");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("cannot read {}", cfg_path.display()))?,
    )
    .map_err(|e| anyhow!("{}: not valid JSON: {e}", cfg_path.display()))?;
    let (reader, shapes) = shapes_from_hf_config(&cfg, &cfg_path)?;
    let family = families::of_args(&shapes.args)?;
    let prefix = reader.hf_tensor_prefix(&cfg);
    let args = &shapes.args;
    let fp8_blocks = super::hf_fp8::block_size(&cfg, &cfg_path)?;
    let files = crate::data::files::list_files(hf_dir, &[".safetensors"])?;
    // An FP8 release's linears take a byte a value, an MXFP4 one's experts half a byte.
    let mxfp4 = cfg["quantization_config"]["quant_method"].as_str() == Some("mxfp4");
    let bits_per_value = match (fp8_blocks, mxfp4) {
        (_, true) => 4,
        (Some(_), _) => 8,
        _ => 16,
    };
    check_weights_present(args, &files, &cfg_path, bits_per_value)?;
    let mut by_name: HfTensors = BTreeMap::new();
    let mut fp8 = std::collections::BTreeSet::new();
    let mut other_models = 0;
    for f in &files {
        let (tensors, fp8_names) = st::read_release_file(f)?;
        let own = |n: &String| n.strip_prefix(prefix).map(str::to_string);
        fp8.extend(fp8_names.iter().filter_map(own));
        for (n, t) in tensors {
            match n.strip_prefix(prefix) {
                Some(own) => drop(by_name.insert(own.to_string(), (t, f.clone()))),
                None => other_models += 1,
            }
        }
    }
    if other_models > 0 {
        outln!(
            "{}: skipping {other_models} tensors outside the language model (`{prefix}`): titan trains the text model",
            hf_dir.display()
        );
    }
    let folder = HfFolder {
        dir: hf_dir,
        files: &files,
        tensors: &by_name,
        fp8: &fp8,
        fp8_blocks,
    };
    let specs = param_specs(args);
    let mut params: ParamSet<CpuBackend> = ParamSet::zeros(&be, &specs);
    // Tensors holding every expert's slice (gpt-oss), read (and dequantised) once.
    let mut fused: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        params.bufs[i] = match family.hf_part(args, name) {
            HfPart::Whole(hf) => {
                let data = folder.whole(&hf, name, shape)?;
                family.import_rows(&shapes, name, data, columns(shape))
            }
            HfPart::Expert(slice) => {
                let whole = slice.fused_shape(shape);
                if !fused.contains_key(&slice.tensor) {
                    let values = folder.fused(&slice.tensor, name, &whole)?;
                    fused.insert(slice.tensor.clone(), values);
                }
                slice.take(&fused[&slice.tensor], &whole)
            }
        };
    }
    let (skipped, what) = family.skipped_hf_tensors(args, &by_name);
    if skipped > 0 {
        outln!(
            "{}: skipping {skipped} tensors of blocks past the model's {} ({what})",
            hf_dir.display(),
            args.n_layers
        );
    }
    let expert_bias = family.expert_bias_from_hf(args, &by_name)?;
    Ok(HfModel {
        args: shapes.args,
        params,
        expert_bias,
    })
}

/// An HF folder's tensors, read: what a parameter's values are taken from.
struct HfFolder<'a> {
    dir: &'a Path,
    files: &'a [std::path::PathBuf],
    tensors: &'a HfTensors,
    /// The tensors stored in e4m3 (FP8 releases) and their blocks' size.
    fp8: &'a std::collections::BTreeSet<String>,
    fp8_blocks: Option<(usize, usize)>,
}

impl HfFolder<'_> {
    /// Tensor `hf` (titan's `name`, for errors), or an error naming it and the files.
    fn get(&self, hf: &str, name: &str) -> Result<&(Tensor, std::path::PathBuf)> {
        self.tensors.get(hf).ok_or_else(|| {
            let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
            anyhow!(
                "{}: tensor `{hf}` (titan `{name}`) is missing from {}",
                self.dir.display(),
                files.join(", ")
            )
        })
    }

    /// Tensor `hf` of shape `shape` in f32, dequantised when an FP8 release stores it in e4m3.
    fn whole(&self, hf: &str, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (t, file) = self.get(hf, name)?;
        if t.shape != shape {
            bail!(
                "{}: tensor `{hf}` has shape {:?}, config.json implies {:?}",
                file.display(),
                t.shape,
                shape
            );
        }
        let scale = self.tensors.get(&super::hf_fp8::scale_name(hf));
        Ok(match (self.fp8.contains(hf), scale, self.fp8_blocks) {
            (false, None, _) => t.to_f32_vec(),
            (true, Some((s, _)), Some(block)) => super::hf_fp8::dequantize(hf, t, s, block)
                .map_err(|e| anyhow!("{}: {e}", file.display()))?,
            (true, _, None) => bail!(
                "{}: `{hf}` is FP8 (E4M3) but config.json has no quantization_config",
                file.display()
            ),
            (true, None, _) => bail!(
                "{}: FP8 weight `{hf}` has no `{}` beside it",
                file.display(),
                super::hf_fp8::scale_name(hf)
            ),
            (false, Some(_), _) => bail!(
                "{}: `{hf}` has block scales but is not FP8 (E4M3)",
                file.display()
            ),
        })
    }

    /// The tensor of every expert's slice, `hf` (of shape `shape`), in f32: stored whole, or as
    /// an MXFP4 release's codes and scales (`hf_mxfp4`), dequantised.
    fn fused(&self, hf: &str, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (blocks, scales) = super::hf_mxfp4::parts(hf);
        let (Some((b, file)), Some((s, _))) =
            (self.tensors.get(&blocks), self.tensors.get(&scales))
        else {
            return self.whole(hf, name, shape);
        };
        let (got, values) = super::hf_mxfp4::dequantize(hf, b, s)
            .map_err(|e| anyhow!("{}: {e}", file.display()))?;
        if got != shape {
            bail!(
                "{}: MXFP4 tensor `{hf}` dequantises to shape {got:?}, config.json implies {shape:?}",
                file.display()
            );
        }
        Ok(values)
    }
}

/// The weights `config.json` describes fit in the safetensors files present (at
/// `bits_per_value`: 16, the narrowest dtype read, 8 for an FP8 release, 4 for an MXFP4 one):
/// checked before the model is allocated, so a config that claims a far larger model than its
/// files hold is an error, not an allocation of that size.
fn check_weights_present(
    args: &ModelArgs,
    files: &[std::path::PathBuf],
    cfg_path: &Path,
    bits_per_value: u64,
) -> Result<()> {
    let mut present = 0u64;
    for f in files {
        let len = std::fs::metadata(f)
            .with_context(|| format!("cannot read {}", f.display()))?
            .len();
        present = present.saturating_add(len);
    }
    // Within `ModelArgs::validate`'s bounds the count stays below 2⁶².
    let needed = (args.num_params() as u64).saturating_mul(bits_per_value) / 8;
    if needed > present {
        bail!(
            "{}: the model it describes has {} parameters ({needed} bytes at least), but the safetensors files beside it hold only {present} bytes",
            cfg_path.display(),
            args.num_params()
        );
    }
    Ok(())
}

pub fn import(hf_dir: &Path, out_dir: &Path) -> Result<()> {
    let be = CpuBackend::new();
    let HfModel {
        args,
        params,
        expert_bias,
    } = read_hf(hf_dir)?;
    let specs = param_specs(&args);
    let tokenizer_path = hf_dir.join("tokenizer.json");
    let zeros: ParamSet<CpuBackend> = ParamSet::zeros(&be, &specs);
    let state = TrainState {
        format_version: FORMAT_VERSION,
        step: 0,
        model_args: args.clone(),
        seed: 0,
        data: LoaderState::default(),
        tokenizer_path: if tokenizer_path.exists() {
            std::fs::canonicalize(&tokenizer_path)?
                .display()
                .to_string()
        } else {
            String::new()
        },
        sharding: None,
        files: Default::default(),
        expert_bias,
        // Zero moments: the state of any optimizer.
        optimizer: None,
    };
    let dir = super::save(&be, out_dir, &params, &zeros, &zeros, state, 0)?;
    outln!(
        "imported {} ({} layers, dim {}, vocab {}) into {}",
        hf_dir.display(),
        args.n_layers,
        args.dim,
        args.vocab_size,
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::rope::{Llama3Scaling, RopeScaling};

    fn config(extra: Value) -> Value {
        let mut c = json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300, "max_position_embeddings": 131072,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    #[test]
    fn rope_is_read_from_either_form_transformers_writes() {
        let file = Path::new("config.json");
        let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let scaling = Some(RopeScaling::Llama3(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }));
        let mut new = llama3.clone();
        new["rope_theta"] = json!(500000.0);
        let read = |c: Value| args_from_hf_config(&config(c), file);
        for form in [
            json!({"rope_parameters": new}),
            json!({"rope_theta": 500000.0, "rope_scaling": llama3}),
            json!({"rope_parameters": new, "rope_theta": 500000.0, "rope_scaling": llama3}),
        ] {
            let a = read(form.clone()).unwrap();
            assert_eq!(
                (a.rope_theta, a.rope_scaling),
                (500000.0, scaling),
                "{form}"
            );
        }
        // Plain RoPE in the new form: its theta, no scaling (not 10000).
        let plain = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}});
        let a = read(plain).unwrap();
        assert_eq!((a.rope_theta, a.rope_scaling), (500000.0, None));
        // Nothing said: transformers' defaults.
        let a = read(json!({})).unwrap();
        assert_eq!(
            (a.rope_theta, a.rope_scaling, a.norm_eps),
            (10000.0, None, 1e-6)
        );
        // What titan writes, it reads back the same.
        let llama3_1b = crate::model::families::llama3::flavor("1B").unwrap();
        let written = hf_config(&llama3_1b, 1, 2, DType::F32).unwrap();
        let back = args_from_hf_config(&written, file).unwrap();
        assert_eq!(back, llama3_1b);
        assert_eq!(written["rope_parameters"]["rope_type"], "llama3");
    }

    #[test]
    fn what_titan_does_not_compute_is_refused() {
        let file = Path::new("config.json");
        for (extra, want) in [
            (
                json!({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}),
                "rope_type `longrope`",
            ),
            (
                json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                    "partial_rotary_factor": 0.5}}),
                "rope_parameters.partial_rotary_factor is not a YaRN field",
            ),
            (
                json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -4.0}}),
                "factor = -4",
            ),
            (
                json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4}),
                "disagree",
            ),
            (json!({"hidden_act": "gelu"}), "hidden_act `gelu`"),
            (json!({"attention_bias": true}), "attention_bias = true"),
            (json!({"mlp_bias": true}), "mlp_bias = true"),
        ] {
            let e = args_from_hf_config(&config(extra.clone()), file)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
    }
}
