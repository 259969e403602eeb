//! The Llama-shaped Hugging Face checkpoint Llama 3 and Qwen3 share: grouped-query attention,
//! `config.json`'s Llama fields both ways, and RoPE's row layout.
//!
//! titan (like Meta's and TorchTitan's code) applies RoPE to interleaved pairs `(2i, 2i+1)` of each
//! head; transformers rotates the two halves `(i, i + head_dim/2)`. The q and k projections are
//! therefore permuted row-wise per head on the way out and back on the way in, which makes the two
//! models compute the same function. Qwen3's QK-norm weights (one per position of a head) take the
//! same permutation.

use std::path::Path;

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::hf_fields::{
    decoder_fields, get_size, merge, norm_eps, refuse_unsupported, tied_embeddings,
};
use super::hf_rope::rope_from_hf;
use crate::model::ModelArgs;

/// Row `j` of an HF head comes from this row of the interleaved (titan) head.
pub fn interleaved_row(j: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    if j < half {
        2 * j
    } else {
        2 * (j - half) + 1
    }
}

/// Reorders the rows of a `[heads·head_dim, cols]` projection between the two RoPE layouts.
pub fn permute_rows(
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

/// The heads whose rows a parameter's RoPE layout permutes: the q and k projections' (and their
/// biases'), and QK-norm's weights (one head's positions).
pub fn rope_permutation(name: &str, args: &ModelArgs) -> Option<usize> {
    if name.ends_with("attention.wq.weight") || name.ends_with("attention.wq.bias") {
        Some(args.n_heads)
    } else if name.ends_with("attention.wk.weight") || name.ends_with("attention.wk.bias") {
        Some(args.n_kv_heads)
    } else if name.ends_with("attention.q_norm.weight") || name.ends_with("attention.k_norm.weight")
    {
        Some(1)
    } else {
        None
    }
}

/// Parameter `name`'s rows in transformers' halves layout (a copy; permuted where RoPE rotates).
pub fn rows_to_halves(args: &ModelArgs, name: &str, data: &[f32], cols: usize) -> Vec<f32> {
    match rope_permutation(name, args) {
        Some(heads) => permute_rows(data, heads, args.head_dim(), cols, true),
        None => data.to_vec(),
    }
}

/// What tells the Llama-shaped families' configs apart.
pub struct LlamaForm {
    /// RMSNorm over each query and key head (Qwen3).
    pub qk_norm: bool,
    /// The head width transformers assumes when `head_dim` is absent (Qwen3's 128; None:
    /// `hidden_size / num_attention_heads`).
    pub default_head_dim: Option<usize>,
}

/// A dense Llama-shaped model from its `config.json` (a family adds its experts); not yet
/// validated.
pub fn read(cfg: &Value, file: &Path, form: &LlamaForm) -> Result<ModelArgs> {
    let dim = get_size(cfg, "hidden_size", "dim", None, file)?;
    let n_heads = get_size(cfg, "num_attention_heads", "n_heads", None, file)?;
    let (rope_theta, rope_scaling) = rope_from_hf(cfg, file)?;
    refuse_unsupported(cfg, file)?;
    let head_dim = head_dim(cfg, dim, n_heads, form.default_head_dim, file)?;
    let kv_heads = get_size(
        cfg,
        "num_key_value_heads",
        "n_kv_heads",
        Some(n_heads),
        file,
    )?;
    Ok(ModelArgs {
        dim,
        n_layers: get_size(cfg, "num_hidden_layers", "n_layers", None, file)?,
        n_heads,
        n_kv_heads: kv_heads,
        vocab_size: get_size(cfg, "vocab_size", "vocab_size", None, file)?,
        ffn_hidden: get_size(cfg, "intermediate_size", "ffn_hidden", None, file)?,
        norm_eps: norm_eps(cfg),
        rope_theta,
        rope_scaling,
        max_seq_len: get_size(
            cfg,
            "max_position_embeddings",
            "max_seq_len",
            Some(2048),
            file,
        )?,
        tied_embeddings: tied_embeddings(cfg),
        attention_head_dim: (head_dim * n_heads != dim).then_some(head_dim),
        qk_norm: form.qk_norm,
        moe: None,
        mla: None,
        lora: None,
        attention_sinks: false,
        sliding_window: None,
        attention_bias: false,
        every_n_layers_nope: None,
        attention_chunk_size: None,
        l2_qk_norm: false,
        attention_temperature: None,
    })
}

/// The width of each attention head: `head_dim` when given, else transformers' default (the
/// family's, or `hidden_size / num_attention_heads`, which must then divide evenly). The sizes
/// are in range (`get_size`), so the products cannot overflow.
fn head_dim(
    cfg: &Value,
    dim: usize,
    n_heads: usize,
    default: Option<usize>,
    file: &Path,
) -> Result<usize> {
    if cfg.get("head_dim").is_some_and(|v| !v.is_null()) {
        return get_size(cfg, "head_dim", "attention_head_dim", None, file);
    }
    if let Some(d) = default {
        return Ok(d);
    }
    if !dim.is_multiple_of(n_heads) {
        bail!(
            "{}: hidden_size = {dim} is not divisible by num_attention_heads = {n_heads} (and no head_dim is given)",
            file.display()
        );
    }
    Ok(dim / n_heads)
}

/// The Llama-shaped `config.json` of `args` as `architecture` / `model_type`.
pub fn write(args: &ModelArgs, architecture: &str, model_type: &str) -> Value {
    let mut config = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "use_sliding_window": false,
        "intermediate_size": args.ffn_hidden,
        "attention_bias": false,
        "mlp_bias": false,
    });
    merge(&mut config, decoder_fields(args));
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_round_trips_and_matches_hf_layout() {
        let (heads, hd, cols) = (2, 4, 1);
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let hf = permute_rows(&w, heads, hd, cols, true);
        // Interleaved pairs (0,1),(2,3) of head 0 become halves (0,2 | 1,3).
        assert_eq!(hf, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(permute_rows(&hf, heads, hd, cols, false), w);
    }
}
