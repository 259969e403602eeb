//! Hugging Face interop: `config.json` + safetensors in `transformers`' `LlamaForCausalLM`,
//! `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` naming (experts one tensor each, as the published
//! checkpoints store them), out of and into titan checkpoints.
//!
//! titan (like Meta's and TorchTitan's code) applies RoPE to interleaved pairs `(2i, 2i+1)` of each
//! head; HF rotates the two halves `(i, i + head_dim/2)`. The q and k projections are therefore
//! permuted row-wise per head on the way out and back on the way in, which makes the two models
//! compute the same function. Qwen3's QK-norm weights (one per position of a head) take the same
//! permutation. RoPE's config forms and scalings are `hf_rope`'s.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::hf_deepseek;
pub use super::hf_names::hf_name;
use super::hf_names::hf_name_of;
use super::hf_rope::{hf_rope_scaling, rope_from_hf};
use super::{st, TrainState, FORMAT_VERSION};
use crate::backend::cpu::CpuBackend;
use crate::data::LoaderState;
use crate::model::params::param_specs;
use crate::model::{ModelArgs, ParamSet};
use crate::tensor::{DType, Tensor};

/// Row `j` of an HF head comes from this row of the interleaved (titan) head.
fn interleaved_row(j: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    if j < half {
        2 * j
    } else {
        2 * (j - half) + 1
    }
}

/// Reorders the rows of a `[heads·head_dim, cols]` projection between the two RoPE layouts.
pub(super) fn permute_rows(
    w: &[f32],
    heads: usize,
    head_dim: usize,
    cols: usize,
    to_hf: bool,
) -> Vec<f32> {
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for j in 0..head_dim {
            let i = interleaved_row(j, head_dim);
            let (dst, src) = if to_hf {
                (h * head_dim + j, h * head_dim + i)
            } else {
                (h * head_dim + i, h * head_dim + j)
            };
            out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
        }
    }
    out
}

/// The heads whose rows a parameter's RoPE layout permutes: the q and k projections', and
/// QK-norm's weights (one head's positions).
pub(super) fn rope_permutation(name: &str, args: &ModelArgs) -> Option<usize> {
    if args.mla.is_some() {
        // DeepSeek's rotated rows are interleaved in its checkpoints (`hf_deepseek`).
        None
    } else if name.ends_with("attention.wq.weight") {
        Some(args.n_heads)
    } else if name.ends_with("attention.wk.weight") {
        Some(args.n_kv_heads)
    } else if name.ends_with("attention.q_norm.weight") || name.ends_with("attention.k_norm.weight")
    {
        Some(1)
    } else {
        None
    }
}

/// The mixture of experts Qwen3-MoE's config can say: softmax scores, scale 1, no groups, no shared
/// experts. Anything else has no `transformers` model to load it as.
fn check_exportable(args: &ModelArgs) -> Result<()> {
    let Some(moe) = &args.moe else {
        return Ok(());
    };
    let r = &moe.router;
    if r.score_func != crate::model::moe::router::ScoreFunc::Softmax
        || r.route_scale != 1.0
        || r.groups.is_some()
        || moe.shared_hidden.is_some()
        || moe.load_balance_coeff.is_some()
        || !args.qk_norm
    {
        bail!("this mixture-of-experts model ({moe:?}) has no Hugging Face model type titan exports to: Qwen3-MoE needs QK-norm, softmax scores, route scale 1, no expert groups, no shared experts and no expert bias (load_balance_coeff)");
    }
    Ok(())
}

pub fn hf_config(args: &ModelArgs, bos: u32, eos: u32, dtype: DType) -> Result<Value> {
    let mut config = match args.mla {
        Some(_) => hf_deepseek::deepseek_config(args)?,
        None => {
            check_exportable(args)?;
            llama_or_qwen3_config(args)
        }
    };
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!(eos);
    config["torch_dtype"] = json!(if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    });
    Ok(config)
}

fn llama_or_qwen3_config(args: &ModelArgs) -> Value {
    let scaling = args.rope_scaling.as_ref().map(hf_rope_scaling);
    // Current `transformers` reads `rope_parameters`; earlier versions `rope_theta` and
    // `rope_scaling`. Both are written, saying the same, so every version loads the same model
    // (current ones without a warning).
    let mut rope_parameters = scaling
        .clone()
        .unwrap_or_else(|| json!({"rope_type": "default"}));
    rope_parameters["rope_theta"] = json!(args.rope_theta);
    let (architecture, model_type) = match (args.qk_norm, args.moe.is_some()) {
        (_, true) => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        (true, false) => ("Qwen3ForCausalLM", "qwen3"),
        (false, false) => ("LlamaForCausalLM", "llama"),
    };
    let mut config = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "use_sliding_window": false,
        "attention_dropout": 0.0,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim(),
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
    });
    if let Some(moe) = &args.moe {
        // The leading dense blocks as `mlp_only_layers`. The auxiliary loss is a training
        // setting (and titan's is sequence-wise, not transformers' batch-wise one): exported as
        // off.
        let dense: Vec<usize> = (0..moe.first_dense_layers).collect();
        let fields = json!({
            "num_experts": moe.router.num_experts,
            "num_experts_per_tok": moe.router.top_k,
            "moe_intermediate_size": moe.hidden,
            "norm_topk_prob": moe.router.norm_topk_prob,
            "decoder_sparse_step": moe.sparse_step,
            "mlp_only_layers": dense,
            "output_router_logits": false,
            "router_aux_loss_coef": 0.0,
        });
        for (k, v) in fields.as_object().expect("an object") {
            config[k] = v.clone();
        }
    }
    config
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
    let mut tensors = Vec::new();
    for ((name, shape), buf) in params.names.iter().zip(&params.shapes).zip(&params.bufs) {
        let data = match rope_permutation(name, &args) {
            Some(heads) => permute_rows(buf, heads, args.head_dim(), columns(shape), true),
            None => buf.clone(),
        };
        tensors.push((
            hf_name_of(&args, name),
            Tensor::from_f32(shape.clone(), data).to_dtype(dtype),
        ));
    }
    if args.mla.is_some() {
        tensors.extend(hf_deepseek::routing_bias_tensors(
            &args,
            state.expert_bias.as_deref(),
        ));
    }
    write_folder_file(out_dir, "model.safetensors", &tensors)?;
    let config = hf_config(&args, tokenizer.bos_id(), tokenizer.eos_id(), dtype)?;
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

/// Size `key` of `cfg` (`default` when absent or null), within the range `ModelArgs::validate`
/// accepts for titan's `field`: an error naming the file and the key, before anything is sized
/// from it.
fn get_size(
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
    let (min, max) = crate::model::args::field_range(field);
    match usize::try_from(v) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => bail!(
            "{}: `{key}` = {v} is out of range (titan's {field}: {min} to {max})",
            file.display()
        ),
    }
}

/// Config fields that change what the model computes and that titan does not implement: an
/// error, not a silently different model.
fn refuse_unsupported(cfg: &Value, file: &Path) -> Result<()> {
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        bail!(
            "{}: hidden_act `{act}` is not supported (titan's feed-forward is SwiGLU: \"silu\")",
            file.display()
        );
    }
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

/// Qwen3-MoE's experts from its `config.json`: in block `l` when `l + 1` is a multiple of
/// `decoder_sparse_step` and `l` is not among `mlp_only_layers` (which titan takes as a prefix
/// `0..k` of dense blocks, DeepSeek's `first_k_dense_replace`; another set is refused, naming
/// it), softmax scores renormalised over the chosen when `norm_topk_prob`.
fn moe_from_hf(cfg: &Value, file: &Path) -> Result<crate::model::moe::MoeArgs> {
    use crate::model::moe::router::{RouterArgs, ScoreFunc};
    let sparse_step = match cfg.get("decoder_sparse_step").filter(|v| !v.is_null()) {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(step) if (1..=1 << 12).contains(&step) => step as usize,
            _ => bail!(
                "{}: decoder_sparse_step = {v} is not a block count from 1 to 4096",
                file.display()
            ),
        },
    };
    let dense: Vec<u64> = match cfg.get("mlp_only_layers").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| {
                anyhow!(
                    "{}: mlp_only_layers = {v} is not a list of block numbers",
                    file.display()
                )
            })?,
    };
    if dense.iter().enumerate().any(|(i, &l)| l != i as u64) {
        bail!(
            "{}: mlp_only_layers = {dense:?} is not supported: titan's dense blocks in a mixture-of-experts model are the leading ones (0, 1, …, k-1)",
            file.display()
        );
    }
    Ok(crate::model::moe::MoeArgs {
        hidden: get_size(cfg, "moe_intermediate_size", "moe.hidden", None, file)?,
        shared_hidden: None,
        load_balance_coeff: None,
        aux_loss_coef: None,
        first_dense_layers: dense.len(),
        sparse_step,
        router: RouterArgs {
            // Current transformers writes `num_local_experts`, earlier `num_experts`.
            num_experts: match cfg.get("num_local_experts").filter(|v| !v.is_null()) {
                Some(_) => get_size(cfg, "num_local_experts", "moe.num_experts", None, file)?,
                None => get_size(cfg, "num_experts", "moe.num_experts", None, file)?,
            },
            top_k: get_size(cfg, "num_experts_per_tok", "moe.num_experts", None, file)?,
            score_func: ScoreFunc::Softmax,
            norm_topk_prob: cfg
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            route_scale: 1.0,
            groups: None,
        },
    })
}

/// Model shapes from an HF Llama, Qwen3 or Qwen3-MoE `config.json`.
pub fn args_from_hf_config(cfg: &Value, file: &Path) -> Result<ModelArgs> {
    model_from_hf_config(cfg, file).map(|(args, _)| args)
}

/// Model shapes from an HF `config.json`, and whether its rotated rows are interleaved pairs
/// (DeepSeek's `rope_interleave`; the others rotate halves, `rope_permutation`).
fn model_from_hf_config(cfg: &Value, file: &Path) -> Result<(ModelArgs, bool)> {
    let arch = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    let (qwen3, qwen3_moe) = match arch {
        "llama" => (false, false),
        "qwen3" => (true, false),
        "qwen3_moe" => (true, true),
        "deepseek_v3" => {
            refuse_unsupported(cfg, file)?;
            let (args, interleaved) = hf_deepseek::args_from_deepseek_config(cfg, file)?;
            args.validate()
                .map_err(|e| anyhow!("{}: {e}", file.display()))?;
            return Ok((args, interleaved));
        }
        other => bail!(
            "{}: model_type is `{other}`; titan imports Llama (\"llama\"), Qwen3 (\"qwen3\"), Qwen3-MoE (\"qwen3_moe\") and DeepSeek-V3 (\"deepseek_v3\") models",
            file.display()
        ),
    };
    let moe = if qwen3_moe {
        Some(moe_from_hf(cfg, file)?)
    } else {
        None
    };
    let dim = get_size(cfg, "hidden_size", "dim", None, file)?;
    let n_heads = get_size(cfg, "num_attention_heads", "n_heads", None, file)?;
    let (rope_theta, rope_scaling) = rope_from_hf(cfg, file)?;
    refuse_unsupported(cfg, file)?;
    let head_dim = hf_head_dim(cfg, dim, n_heads, qwen3, file)?;
    let args = ModelArgs {
        dim,
        n_layers: get_size(cfg, "num_hidden_layers", "n_layers", None, file)?,
        n_heads,
        n_kv_heads: get_size(
            cfg,
            "num_key_value_heads",
            "n_kv_heads",
            Some(n_heads),
            file,
        )?,
        vocab_size: get_size(cfg, "vocab_size", "vocab_size", None, file)?,
        ffn_hidden: get_size(cfg, "intermediate_size", "ffn_hidden", None, file)?,
        // transformers' defaults where a field is absent.
        norm_eps: cfg
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6) as f32,
        rope_theta,
        rope_scaling,
        max_seq_len: get_size(
            cfg,
            "max_position_embeddings",
            "max_seq_len",
            Some(2048),
            file,
        )?,
        tied_embeddings: cfg
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        attention_head_dim: (head_dim * n_heads != dim).then_some(head_dim),
        qk_norm: qwen3,
        moe,
        mla: None,
        lora: None,
    };
    args.validate()
        .map_err(|e| anyhow!("{}: {e}", file.display()))?;
    Ok((args, false))
}

/// The width of each attention head: `head_dim` when given, else transformers' default (Qwen3's
/// 128, Llama's `hidden_size / num_attention_heads`, which must then divide evenly). The sizes
/// are in range (`get_size`), so the products cannot overflow.
fn hf_head_dim(cfg: &Value, dim: usize, n_heads: usize, qwen3: bool, file: &Path) -> Result<usize> {
    if cfg.get("head_dim").is_some_and(|v| !v.is_null()) {
        return get_size(cfg, "head_dim", "attention_head_dim", None, file);
    }
    if qwen3 {
        return Ok(128);
    }
    if !dim.is_multiple_of(n_heads) {
        bail!(
            "{}: hidden_size = {dim} is not divisible by num_attention_heads = {n_heads} (and no head_dim is given)",
            file.display()
        );
    }
    Ok(dim / n_heads)
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
    let (args, interleaved) = model_from_hf_config(&cfg, &cfg_path)?;
    let fp8_blocks = super::hf_fp8::block_size(&cfg, &cfg_path)?;
    let files = crate::data::files::list_files(hf_dir, &[".safetensors"])?;
    // An FP8 release's linears take a byte a value.
    let bytes_per_value = if fp8_blocks.is_some() { 1 } else { 2 };
    check_weights_present(&args, &files, &cfg_path, bytes_per_value)?;
    let mut by_name: BTreeMap<String, (Tensor, std::path::PathBuf)> = BTreeMap::new();
    let mut fp8 = std::collections::BTreeSet::new();
    for f in &files {
        let (tensors, fp8_names) = st::read_release_file(f)?;
        fp8.extend(fp8_names);
        for (n, t) in tensors {
            by_name.insert(n, (t, f.clone()));
        }
    }
    let specs = param_specs(&args);
    let mut params: ParamSet<CpuBackend> = ParamSet::zeros(&be, &specs);
    for (i, (name, shape)) in specs.iter().enumerate() {
        let hf = hf_name_of(&args, name);
        let (t, file) = by_name.get(&hf).ok_or_else(|| {
            anyhow!(
                "{}: tensor `{hf}` (titan `{name}`) is missing from {}",
                hf_dir.display(),
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        if &t.shape != shape {
            bail!(
                "{}: tensor `{hf}` has shape {:?}, config.json implies {:?}",
                file.display(),
                t.shape,
                shape
            );
        }
        let scale = by_name.get(&super::hf_fp8::scale_name(&hf));
        let data = match (fp8.contains(&hf), scale, fp8_blocks) {
            (false, None, _) => t.to_f32_vec(),
            (true, Some((s, _)), Some(block)) => super::hf_fp8::dequantize(&hf, t, s, block)
                .map_err(|e| anyhow!("{}: {e}", file.display()))?,
            (true, _, None) => bail!(
                "{}: `{hf}` is FP8 (E4M3) but config.json has no quantization_config",
                file.display()
            ),
            (true, None, _) => bail!(
                "{}: FP8 weight `{hf}` has no `{}` beside it",
                file.display(),
                super::hf_fp8::scale_name(&hf)
            ),
            (false, Some(_), _) => bail!(
                "{}: `{hf}` has block scales but is not FP8 (E4M3)",
                file.display()
            ),
        };
        params.bufs[i] = match rope_permutation(name, &args) {
            Some(heads) => permute_rows(&data, heads, args.head_dim(), columns(shape), false),
            None if !interleaved => {
                hf_deepseek::interleave_rope_rows(name, data, columns(shape), &args)
            }
            None => data,
        };
    }
    let extra = hf_deepseek::extra_layer_tensors(by_name.keys(), args.n_layers);
    if extra > 0 {
        outln!("{}: skipping {extra} tensors of blocks past the model's {} (a multi-token-prediction layer titan does not train)", hf_dir.display(), args.n_layers);
    }
    let expert_bias = hf_deepseek::routing_bias(&args, &by_name)?;
    Ok(HfModel {
        args,
        params,
        expert_bias,
    })
}

/// The weights `config.json` describes fit in the safetensors files present (at
/// `bytes_per_value`: 2, the narrowest dtype read, or 1 for an FP8 release): checked before the model is allocated, so a config that claims a
/// far larger model than its files hold is an error, not an allocation of that size.
fn check_weights_present(
    args: &ModelArgs,
    files: &[std::path::PathBuf],
    cfg_path: &Path,
    bytes_per_value: u64,
) -> Result<()> {
    let mut present = 0u64;
    for f in files {
        let len = std::fs::metadata(f)
            .with_context(|| format!("cannot read {}", f.display()))?
            .len();
        present = present.saturating_add(len);
    }
    // Within `ModelArgs::validate`'s bounds the count stays below 2⁶².
    let needed = (args.num_params() as u64).saturating_mul(bytes_per_value);
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

    #[test]
    fn every_published_flavor_round_trips_through_its_hf_config() {
        let llama = crate::model::args::FLAVORS
            .iter()
            .map(|f| ModelArgs::flavor(f).unwrap());
        let qwen3 = crate::model::args::QWEN3_FLAVORS
            .iter()
            .map(|f| ModelArgs::qwen3_flavor(f).unwrap());
        for args in llama.chain(qwen3) {
            let cfg = hf_config(&args, 1, 2, DType::BF16).unwrap();
            let back = args_from_hf_config(&cfg, Path::new("config.json")).unwrap();
            assert!(back.same_model(&args), "{args:?}\n{back:?}");
        }
    }

    #[test]
    fn permutation_round_trips_and_matches_hf_layout() {
        let (heads, hd, cols) = (2, 4, 1);
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let hf = permute_rows(&w, heads, hd, cols, true);
        // Interleaved pairs (0,1),(2,3) of head 0 become halves (0,2 | 1,3).
        assert_eq!(hf, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(permute_rows(&hf, heads, hd, cols, false), w);
    }

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
        let written = hf_config(&ModelArgs::flavor("1B").unwrap(), 1, 2, DType::F32).unwrap();
        let back = args_from_hf_config(&written, file).unwrap();
        assert_eq!(back, ModelArgs::flavor("1B").unwrap());
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

    #[test]
    fn names_follow_transformers() {
        assert_eq!(
            hf_name("layers.3.attention.wq.weight"),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("layers.0.feed_forward.w1.weight"),
            "model.layers.0.mlp.gate_proj.weight"
        );
        assert_eq!(
            hf_name("layers.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("output.weight"), "lm_head.weight");
    }
}
