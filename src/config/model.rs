//! `[model]`: the model family and flavor with optional shape and mixture-of-experts overrides,
//! and how they become `model::ModelArgs`; with its checks.

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;
use crate::model::{families, ModelArgs};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub name: String,
    pub flavor: String,
    /// A Hugging Face `tokenizer.json`; empty selects the built-in byte-level tokenizer.
    pub tokenizer_path: String,
    // Optional overrides of the flavor's shapes (research and tests).
    pub dim: Option<usize>,
    pub n_layers: Option<usize>,
    pub n_heads: Option<usize>,
    pub n_kv_heads: Option<usize>,
    pub vocab_size: Option<usize>,
    pub multiple_of: Option<usize>,
    pub ffn_dim_multiplier: Option<f64>,
    pub rope_theta: Option<f64>,
    pub norm_eps: Option<f32>,
    /// Mixture-of-experts models: auxiliary-loss-free load balancing, the step of the expert
    /// bias after each step (TorchTitan's `load_balance_coeff`; absent: the flavor's; 0: none).
    pub load_balance_coeff: Option<f32>,
    /// Mixture-of-experts models: the sequence-wise auxiliary balance loss's coefficient (the
    /// name Hugging Face configs use; absent: none).
    pub router_aux_loss_coef: Option<f32>,
    /// Mixture-of-experts models: the hidden width of shared experts every token goes through
    /// besides its routed ones (DeepSeek-V3's; absent: the flavor's, none for Qwen3-MoE).
    pub moe_shared_hidden: Option<usize>,
    /// Mixture-of-experts models: each routed expert's hidden width, the number of routed
    /// experts and how many each token takes (absent: the flavor's).
    pub moe_hidden: Option<usize>,
    pub num_experts: Option<usize>,
    pub top_k: Option<usize>,
    /// The width of each attention head when it is not `dim / n_heads` (Qwen3's, gpt-oss's;
    /// absent: the flavor's). Not for multi-head latent attention, whose widths are its own.
    pub head_dim: Option<usize>,
    /// Mixture-of-experts models: the leading blocks that keep a dense feed-forward instead of
    /// the experts (TorchTitan's DeepSeek-V3 `n_dense_layers`, HF's `first_k_dense_replace`;
    /// absent: the flavor's, none for Qwen3-MoE).
    pub n_dense_layers: Option<usize>,
    /// Multi-head latent attention models (DeepSeek-V3): the query latent's width (0: queries
    /// projected directly), the key/value latent's, and the head widths (absent: the flavor's).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    /// Models with sliding-window attention (Mistral, gpt-oss): the window's length in keys, a
    /// query's own included (TorchTitan's gpt-oss `sliding_window_size`; absent: the flavor's).
    pub sliding_window_size: Option<usize>,
    /// Llama 4's attention (any GQA model): every `n`-th block without RoPE (TorchTitan's
    /// `every_n_layers_nope`), and chunked attention of this many positions on the blocks with
    /// RoPE (transformers' `attention_chunk_size`); absent: the flavor's, none.
    pub every_n_layers_nope: Option<usize>,
    pub attention_chunk_size: Option<usize>,
    /// Llama 4's attention temperature tuning on its NoPE blocks (transformers' names): the
    /// positions per step of the queries' factor and the factor's scale (absent: the flavor's,
    /// 8192 and 0.1). Refused on a model without temperature tuning.
    pub floor_scale: Option<usize>,
    pub attn_scale: Option<f32>,
    /// Mixture-of-experts models: the experts in block `l` when `l + 1` is a multiple of this,
    /// dense feed-forwards in the others (TorchTitan's and transformers' Llama 4 name, Qwen3-MoE's
    /// `decoder_sparse_step`; absent: the flavor's).
    pub interleave_moe_layer_step: Option<usize>,
    /// Model converters applied before parallelizing (TorchTitan's names, e.g.
    /// `quantize.linear.float8`); a list in a file, comma-separated on the command line.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub converters: Vec<String>,
    /// `block_causal` (the default, as TorchTitan's: a token sees only the earlier tokens of its
    /// own document, RoPE at its position in the document) or `causal` (every earlier token of
    /// its sequence).
    pub attn_mask_type: String,
}

/// The values `[model] attn_mask_type` accepts.
pub const ATTN_MASK_TYPES: &[&str] = &["causal", "block_causal"];

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: "llama3".into(),
            flavor: "debugmodel".into(),
            tokenizer_path: String::new(),
            dim: None,
            n_layers: None,
            n_heads: None,
            n_kv_heads: None,
            vocab_size: None,
            multiple_of: None,
            ffn_dim_multiplier: None,
            rope_theta: None,
            norm_eps: None,
            load_balance_coeff: None,
            router_aux_loss_coef: None,
            moe_shared_hidden: None,
            moe_hidden: None,
            num_experts: None,
            top_k: None,
            head_dim: None,
            n_dense_layers: None,
            q_lora_rank: None,
            kv_lora_rank: None,
            qk_nope_head_dim: None,
            qk_rope_head_dim: None,
            v_head_dim: None,
            sliding_window_size: None,
            every_n_layers_nope: None,
            attention_chunk_size: None,
            floor_scale: None,
            attn_scale: None,
            interleave_moe_layer_step: None,
            converters: Vec::new(),
            attn_mask_type: "block_causal".into(),
        }
    }
}

impl Config {
    /// The published shapes of `[model] name` and `flavor`, before the config's overrides.
    fn base_model_args(&self) -> Result<ModelArgs> {
        let family = families::by_name(&self.model.name)?;
        families::flavor(family, &self.model.flavor).map_err(|e| anyhow!("[model] flavor: {e}"))
    }

    pub(super) fn validate_model(&self) -> Result<()> {
        self.base_model_args()?;
        self.validate_attention_mask()
    }

    /// `attn_mask_type` is one titan knows.
    fn validate_attention_mask(&self) -> Result<()> {
        let mask = self.model.attn_mask_type.as_str();
        if !ATTN_MASK_TYPES.contains(&mask) {
            bail!(
                "[model] attn_mask_type = `{mask}` is not known (accepted: {})",
                ATTN_MASK_TYPES.join(", ")
            );
        }
        Ok(())
    }

    /// Model shapes: the flavor, with any `[model]` overrides applied.
    pub fn model_args(&self) -> Result<ModelArgs> {
        let mut a = self.base_model_args()?;
        self.apply_shape_overrides(&mut a)?;
        self.apply_moe_overrides(&mut a)?;
        self.apply_mla_overrides(&mut a)?;
        self.apply_window_override(&mut a)?;
        self.apply_temperature_overrides(&mut a)?;
        a.validate().map_err(|e| anyhow!("[model]: {e}"))?;
        self.validate_lora(&a)?;
        a.lora = self.lora_args();
        Ok(a)
    }

    /// `dim`, `n_layers`, heads, vocabulary, RoPE, norm and FFN overrides; the FFN width is
    /// recomputed (with the flavor's multiplier and rounding where not overridden) when `dim`,
    /// `multiple_of` or `ffn_dim_multiplier` is set.
    fn apply_shape_overrides(&self, a: &mut ModelArgs) -> Result<()> {
        let m = &self.model;
        let rounding = families::by_name(&m.name)?.ffn_rounding(&m.flavor);
        if let Some(v) = m.dim {
            a.dim = v;
        }
        if let Some(v) = m.n_layers {
            a.n_layers = v;
        }
        if let Some(v) = m.n_heads {
            a.n_heads = v;
            if m.n_kv_heads.is_none() && a.n_kv_heads > v {
                a.n_kv_heads = v;
            }
        }
        if let Some(v) = m.n_kv_heads {
            a.n_kv_heads = v;
        }
        if let Some(v) = m.vocab_size {
            a.vocab_size = v;
        }
        if let Some(v) = m.rope_theta {
            a.rope_theta = v;
        }
        if let Some(v) = m.norm_eps {
            a.norm_eps = v;
        }
        a.every_n_layers_nope = m.every_n_layers_nope.or(a.every_n_layers_nope);
        a.attention_chunk_size = m.attention_chunk_size.or(a.attention_chunk_size);
        if let Some(v) = m.head_dim {
            if a.mla.is_some() {
                bail!("[model] head_dim = {v} does not apply to multi-head latent attention (its widths: qk_nope_head_dim, qk_rope_head_dim, v_head_dim)");
            }
            a.attention_head_dim = Some(v);
        }
        if m.dim.is_some() || m.multiple_of.is_some() || m.ffn_dim_multiplier.is_some() {
            a.ffn_hidden = crate::model::args::ffn_hidden(
                a.dim,
                m.multiple_of.unwrap_or(rounding.multiple_of),
                m.ffn_dim_multiplier.or(rounding.multiplier),
            );
        }
        Ok(())
    }

    /// The multi-head latent attention overrides, refused on a model without MLA; an MLA model
    /// keeps a key and value per head whatever `n_heads` is.
    fn apply_mla_overrides(&self, a: &mut ModelArgs) -> Result<()> {
        let m = &self.model;
        let overrides = [
            ("q_lora_rank", m.q_lora_rank),
            ("kv_lora_rank", m.kv_lora_rank),
            ("qk_nope_head_dim", m.qk_nope_head_dim),
            ("qk_rope_head_dim", m.qk_rope_head_dim),
            ("v_head_dim", m.v_head_dim),
        ];
        let Some(mla) = a.mla.as_mut() else {
            if let Some((key, _)) = overrides.iter().find(|(_, v)| v.is_some()) {
                bail!("[model] {key} needs a model with multi-head latent attention (flavor {} of {} has none; e.g. name = \"deepseek_v3\")", m.flavor, m.name);
            }
            return Ok(());
        };
        if let Some(r) = m.q_lora_rank {
            mla.q_lora_rank = (r > 0).then_some(r);
        }
        mla.kv_lora_rank = m.kv_lora_rank.unwrap_or(mla.kv_lora_rank);
        mla.qk_nope_head_dim = m.qk_nope_head_dim.unwrap_or(mla.qk_nope_head_dim);
        mla.qk_rope_head_dim = m.qk_rope_head_dim.unwrap_or(mla.qk_rope_head_dim);
        mla.v_head_dim = m.v_head_dim.unwrap_or(mla.v_head_dim);
        a.n_kv_heads = a.n_heads;
        Ok(())
    }

    /// The sliding window's length, refused on a model without one.
    fn apply_window_override(&self, a: &mut ModelArgs) -> Result<()> {
        let m = &self.model;
        let Some(size) = m.sliding_window_size else {
            return Ok(());
        };
        match a.sliding_window.as_mut() {
            Some(w) => w.size = size,
            None => bail!("[model] sliding_window_size = {size} needs a model with sliding-window attention (flavor {} of {} has none; e.g. name = \"mistral\")", m.flavor, m.name),
        }
        Ok(())
    }

    /// The temperature tuning's overrides, refused on a model without it.
    fn apply_temperature_overrides(&self, a: &mut ModelArgs) -> Result<()> {
        let m = &self.model;
        let Some(t) = a.attention_temperature.as_mut() else {
            if m.floor_scale.is_some() || m.attn_scale.is_some() {
                bail!("[model] floor_scale and attn_scale need a model with attention temperature tuning (flavor {} of {} has none; e.g. name = \"llama4\")", m.flavor, m.name);
            }
            return Ok(());
        };
        t.floor_scale = m.floor_scale.unwrap_or(t.floor_scale);
        t.scale = m.attn_scale.unwrap_or(t.scale);
        Ok(())
    }

    /// The mixture-of-experts overrides, refused on a dense model.
    fn apply_moe_overrides(&self, a: &mut ModelArgs) -> Result<()> {
        let m = &self.model;
        let given = [
            ("load_balance_coeff", m.load_balance_coeff.is_some()),
            ("moe_shared_hidden", m.moe_shared_hidden.is_some()),
            ("n_dense_layers", m.n_dense_layers.is_some()),
            ("router_aux_loss_coef", m.router_aux_loss_coef.is_some()),
            ("moe_hidden", m.moe_hidden.is_some()),
            ("num_experts", m.num_experts.is_some()),
            ("top_k", m.top_k.is_some()),
            (
                "interleave_moe_layer_step",
                m.interleave_moe_layer_step.is_some(),
            ),
        ];
        let layers = a.n_layers;
        let Some(moe) = a.moe.as_mut() else {
            if let Some((key, _)) = given.iter().find(|(_, set)| *set) {
                bail!(
                    "[model] {key} needs a mixture-of-experts model (flavor {} of {} has none)",
                    m.flavor,
                    m.name
                );
            }
            return Ok(());
        };
        if let Some(k) = m.n_dense_layers {
            if k >= layers {
                bail!("[model] n_dense_layers = {k} leaves none of the {layers} blocks a mixture of experts; choose fewer (or a dense flavor)");
            }
            moe.first_dense_layers = k;
        }
        if let Some(c) = m.load_balance_coeff {
            // 0: no expert bias (a flavor that balances with one, trained without).
            moe.load_balance_coeff = (c != 0.0).then_some(c);
        }
        moe.shared_hidden = m.moe_shared_hidden.or(moe.shared_hidden);
        moe.aux_loss_coef = m.router_aux_loss_coef.or(moe.aux_loss_coef);
        moe.hidden = m.moe_hidden.unwrap_or(moe.hidden);
        moe.router.num_experts = m.num_experts.unwrap_or(moe.router.num_experts);
        moe.router.top_k = m.top_k.unwrap_or(moe.router.top_k);
        moe.sparse_step = m.interleave_moe_layer_step.unwrap_or(moe.sparse_step);
        Ok(())
    }
}
