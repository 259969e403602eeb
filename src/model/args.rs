//! Model shapes (`ModelArgs`): the decoder's sizes and the block features a family selects
//! (a head width of its own, QK-norm, multi-head latent attention, a mixture of experts), their
//! checks, and the derived quantities (FFN width, parameter count, FLOPs per token) that are known
//! from the config alone, before anything is allocated. The published flavors are the families'
//! (`model::families`).
//! One rank's share of these shapes under tensor, context and expert parallelism is `LocalShapes`
//! (`local_shapes.rs`).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::decoder::mla::MlaArgs;
use super::lora_args::LoraArgs;
use super::moe::MoeArgs;
use crate::backend::cpu::rope::RopeScaling;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelArgs {
    pub dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    pub ffn_hidden: usize,
    pub norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_seq_len: usize,
    pub tied_embeddings: bool,
    /// Width of each attention head when it is not `dim / n_heads` (Qwen3).
    #[serde(default)]
    pub attention_head_dim: Option<usize>,
    /// RMSNorm over each query and key head (weights `[head_dim]` shared by the heads) before
    /// RoPE (Qwen3's QK-norm).
    #[serde(default)]
    pub qk_norm: bool,
    /// A mixture-of-experts feed-forward in every block instead of the dense one (Qwen3-MoE).
    #[serde(default)]
    pub moe: Option<MoeArgs>,
    /// Multi-head latent attention instead of grouped-query attention (DeepSeek-V3); then
    /// `n_kv_heads = n_heads` and the head width is MLA's padded one (`mla.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaArgs>,
    /// Low-rank adapters on the block projections, every other weight frozen (`[lora]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraArgs>,
    /// A learned logit per head in every block's attention softmax, with no value: it only adds
    /// to the denominator (gpt-oss's attention sinks, `layers.N.attention.sinks`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attention_sinks: bool,
    /// Sliding-window attention on some blocks (gpt-oss: every other block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindow>,
    /// Biases on the attention's projections, `wq`, `wk`, `wv` and `wo` (gpt-oss; transformers'
    /// `attention_bias`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attention_bias: bool,
    /// Every `n`-th block (`l + 1` a multiple of `n`) applies no RoPE (Llama 4's iRoPE: NoPE
    /// blocks; TorchTitan's `every_n_layers_nope`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_n_layers_nope: Option<usize>,
    /// Chunked attention on the blocks with RoPE: a query sees only the earlier keys of its own
    /// chunk of `size` positions (Llama 4's `attention_chunk_size`, TorchTitan's
    /// `fixed_attn_block_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_chunk_size: Option<usize>,
    /// A weightless RMSNorm (ε `norm_eps`) over each query and key head after RoPE, on the
    /// blocks that rotate (Llama 4's `use_qk_norm`, transformers' `Llama4TextL2Norm`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub l2_qk_norm: bool,
    /// Attention temperature tuning on the NoPE blocks (Llama 4's `attn_temperature_tuning`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_temperature: Option<AttentionTemperature>,
}

/// Where a block norms its query and key heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// RMSNorm with weights `[head_dim]` before RoPE (Qwen3's).
    Weighted,
    /// A weightless RMSNorm after RoPE (Llama 4's L2 norm).
    Weightless,
}

/// Attention temperature tuning (Llama 4's NoPE blocks, arXiv 2501.19399): the queries of the
/// token at sequence position `p` (from the sequence's first token, whatever its document; a KV
/// cache's earlier positions counted) are scaled by `ln(1 + ⌊(p + 1) / floor_scale⌋) · scale + 1`,
/// which is exactly 1 below `floor_scale − 1` (Llama 4: 8192 and 0.1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionTemperature {
    pub floor_scale: usize,
    pub scale: f32,
}

impl AttentionTemperature {
    /// The factor of the queries at sequence position `position`, in f32 as transformers
    /// computes it.
    pub fn factor(&self, position: usize) -> f32 {
        let steps = ((position as f32 + 1.0) / self.floor_scale as f32).floor();
        steps.ln_1p() * self.scale + 1.0
    }
}

/// Sliding-window attention: in block `l` with `l % period == 0` a query sees only the last
/// `size` keys, itself included (FlexAttention's sliding-window mask: `q − k < size`); the other
/// blocks attend to every earlier key. gpt-oss: size 128, period 2 (blocks 0, 2, 4, … slide);
/// every block sliding: period 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlidingWindow {
    pub size: usize,
    pub period: usize,
}

impl ModelArgs {
    /// Whether `other` computes the same function with the same parameters: every field but
    /// `max_seq_len`, which only bounds the RoPE tables and the sequences (not part of a
    /// model's identity: a checkpoint of one trains or generates at another), and LoRA's
    /// adapters, which a run adds to a base model (a resumed run checks them on their own).
    pub fn same_model(&self, other: &ModelArgs) -> bool {
        // Load balancing's coefficients are training settings, not part of the function either.
        let plain = |a: &ModelArgs| {
            let mut a = a.clone();
            if let Some(moe) = a.moe.as_mut() {
                moe.load_balance_coeff = None;
                moe.aux_loss_coef = None;
            }
            a.max_seq_len = 0;
            a.lora = None;
            // The dense width of a model without dense blocks (gpt-oss) computes nothing.
            if !a.has_dense_blocks() {
                a.ffn_hidden = 0;
            }
            a
        };
        plain(self) == plain(other)
    }
}

/// The range of every size field of `ModelArgs` (`validate`): far above any published model
/// (Llama 3 405B: dim 16384, 126 layers, 128 heads, vocabulary 128256; Qwen3-MoE: 128 experts),
/// low enough that no count derived from them overflows (all together stay below 2⁶² parameters)
/// and that a crafted config or checkpoint is refused before anything is sized from it.
pub const BOUNDS: &[(&str, usize, usize)] = &[
    ("dim", 1, 1 << 17),
    ("n_layers", 1, 1 << 12),
    ("n_heads", 1, 1 << 10),
    ("n_kv_heads", 1, 1 << 10),
    ("vocab_size", 1, 1 << 24),
    ("ffn_hidden", 1, 1 << 20),
    ("max_seq_len", 1, 1 << 24),
    ("attention_head_dim", 2, MAX_HEAD_DIM),
    ("moe.hidden", 1, 1 << 20),
    ("moe.shared_hidden", 1, 1 << 20),
    ("moe.num_experts", 1, 1 << 10),
    ("sliding_window.size", 1, 1 << 24),
    ("sliding_window.period", 1, 1 << 12),
    ("every_n_layers_nope", 1, 1 << 12),
    ("attention_chunk_size", 1, 1 << 24),
    ("attention_temperature.floor_scale", 1, 1 << 24),
];

/// The range `ModelArgs::validate` accepts for size field `field` (a name of `BOUNDS`; any other
/// is unbounded).
pub fn field_range(field: &str) -> (usize, usize) {
    BOUNDS
        .iter()
        .find(|(f, _, _)| *f == field)
        .map_or((0, usize::MAX), |&(_, min, max)| (min, max))
}

/// The widest attention head `validate` accepts.
pub const MAX_HEAD_DIM: usize = 1 << 12;

/// Llama's FFN width: two thirds of 4·dim, times an optional multiplier, rounded up to `multiple_of`.
pub fn ffn_hidden(dim: usize, multiple_of: usize, ffn_dim_multiplier: Option<f64>) -> usize {
    let mut hidden = 2 * 4 * dim / 3;
    if let Some(m) = ffn_dim_multiplier {
        hidden = (m * hidden as f64) as usize;
    }
    multiple_of * hidden.div_ceil(multiple_of)
}

impl ModelArgs {
    /// The sliding window of block `layer`'s attention (None: every earlier key).
    pub fn window_at(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        layer.is_multiple_of(w.period).then_some(w.size)
    }

    /// Whether block `layer` rotates its queries and keys (all but the NoPE blocks).
    pub fn rope_at(&self, layer: usize) -> bool {
        self.every_n_layers_nope
            .is_none_or(|n| !(layer + 1).is_multiple_of(n))
    }

    /// How block `layer` norms its query and key heads (None: not at all).
    pub fn qk_norm_at(&self, layer: usize) -> Option<QkNorm> {
        if self.qk_norm {
            Some(QkNorm::Weighted)
        } else {
            (self.l2_qk_norm && self.rope_at(layer)).then_some(QkNorm::Weightless)
        }
    }

    /// Block `layer`'s attention temperature tuning (only NoPE blocks have one).
    pub fn temperature_at(&self, layer: usize) -> Option<AttentionTemperature> {
        self.attention_temperature.filter(|_| !self.rope_at(layer))
    }

    /// The chunk of block `layer`'s chunked attention (None: not chunked).
    pub fn chunk_at(&self, layer: usize) -> Option<usize> {
        self.attention_chunk_size.filter(|_| self.rope_at(layer))
    }

    /// Block `layer`'s mixture of experts (None: its feed-forward is dense).
    pub fn moe_at(&self, layer: usize) -> Option<&MoeArgs> {
        self.moe.as_ref().filter(|m| m.in_layer(layer))
    }

    /// Hidden width of block `layer`'s SwiGLU: the dense feed-forward's, or a mixture of
    /// experts' shared experts' (0 without).
    pub fn swiglu_hidden_at(&self, layer: usize) -> usize {
        match self.moe_at(layer) {
            Some(moe) => moe.shared_hidden.unwrap_or(0),
            None => self.ffn_hidden,
        }
    }

    /// The widest block SwiGLU (what scratch shared by the blocks is sized for).
    pub fn max_swiglu_hidden(&self) -> usize {
        (0..self.n_layers)
            .map(|l| self.swiglu_hidden_at(l))
            .max()
            .unwrap_or(0)
    }

    /// Whether any block's feed-forward is dense (every block of a dense model; the leading or
    /// interleaved dense blocks of a mixture-of-experts one).
    pub fn has_dense_blocks(&self) -> bool {
        (0..self.n_layers).any(|l| self.moe_at(l).is_none())
    }

    /// Width of each attention head as the attention kernels see it (MLA's: padded, `mla.rs`).
    pub fn head_dim(&self) -> usize {
        match &self.mla {
            Some(mla) => mla.padded_head_dim(),
            None => self.attention_head_dim.unwrap_or(self.dim / self.n_heads),
        }
    }

    /// Width of the rotated part of each query and key head (RoPE's tables): the whole head, or
    /// MLA's `qk_rope_head_dim`.
    pub fn rope_dim(&self) -> usize {
        match &self.mla {
            Some(mla) => mla.qk_rope_head_dim,
            None => self.head_dim(),
        }
    }

    /// Checks every field against its range (`BOUNDS`) and the fields against each other, with
    /// an error naming the field. Every path that builds a model from outside input (a config, a
    /// checkpoint's `state.json`, a Hugging Face `config.json`) calls it before anything is sized
    /// from these values; within the bounds no parameter count overflows a `u64`.
    pub fn validate(&self) -> Result<()> {
        self.check_ranges()?;
        if self.attention_head_dim.is_none() && !self.dim.is_multiple_of(self.n_heads) {
            bail!(
                "dim = {} is not divisible by n_heads = {} (and no attention_head_dim is given)",
                self.dim,
                self.n_heads
            );
        }
        if self.n_kv_heads > self.n_heads || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "n_heads = {} is not a multiple of n_kv_heads = {}",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if !self.head_dim().is_multiple_of(2) || self.head_dim() > MAX_HEAD_DIM {
            bail!(
                "head dim {} (dim / n_heads, or attention_head_dim) must be even for RoPE and at most {MAX_HEAD_DIM}",
                self.head_dim()
            );
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            bail!("norm_eps = {} must be a finite number ≥ 0", self.norm_eps);
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!(
                "rope_theta = {} must be a finite positive number",
                self.rope_theta
            );
        }
        if let Some(s) = &self.rope_scaling {
            s.validate()?;
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
        }
        if let Some(mla) = &self.mla {
            mla.validate()?;
            if self.n_kv_heads != self.n_heads || self.qk_norm {
                bail!("multi-head latent attention has a key and value per head and no QK-norm: n_kv_heads = {} must equal n_heads = {} and qk_norm be off", self.n_kv_heads, self.n_heads);
            }
            if self.attention_bias {
                bail!("attention_bias with multi-head latent attention is not built (no family has both)");
            }
            if self.every_n_layers_nope.is_some() || self.attention_chunk_size.is_some() {
                bail!("NoPE blocks and chunked attention with multi-head latent attention are not built (no family has both)");
            }
            if self.l2_qk_norm {
                bail!(
                    "l2_qk_norm with multi-head latent attention is not built (no family has both)"
                );
            }
        }
        self.check_llama4_features()
    }

    /// Llama 4's attention features against the rest: one QK-norm, temperatures on NoPE blocks.
    fn check_llama4_features(&self) -> Result<()> {
        if self.l2_qk_norm && self.qk_norm {
            bail!("qk_norm (weighted, before RoPE) and l2_qk_norm (weightless, after RoPE) exclude each other");
        }
        if let Some(t) = self.attention_temperature {
            if self.every_n_layers_nope.is_none() {
                bail!("attention temperature tuning applies to NoPE blocks: it needs every_n_layers_nope");
            }
            if !(t.scale.is_finite() && t.scale >= 0.0) {
                bail!(
                    "attention temperature scale = {} must be a finite number ≥ 0",
                    t.scale
                );
            }
        }
        Ok(())
    }

    /// Every size field within `[min, max]` (`BOUNDS`; the optional ones when present).
    fn check_ranges(&self) -> Result<()> {
        let moe = self.moe.as_ref();
        let fields = [
            ("dim", Some(self.dim)),
            ("n_layers", Some(self.n_layers)),
            ("n_heads", Some(self.n_heads)),
            ("n_kv_heads", Some(self.n_kv_heads)),
            ("vocab_size", Some(self.vocab_size)),
            ("ffn_hidden", Some(self.ffn_hidden)),
            ("max_seq_len", Some(self.max_seq_len)),
            ("attention_head_dim", self.attention_head_dim),
            ("moe.hidden", moe.map(|m| m.hidden)),
            ("moe.shared_hidden", moe.and_then(|m| m.shared_hidden)),
            ("moe.num_experts", moe.map(|m| m.router.num_experts)),
            ("sliding_window.size", self.sliding_window.map(|w| w.size)),
            (
                "sliding_window.period",
                self.sliding_window.map(|w| w.period),
            ),
            ("every_n_layers_nope", self.every_n_layers_nope),
            ("attention_chunk_size", self.attention_chunk_size),
            (
                "attention_temperature.floor_scale",
                self.attention_temperature.map(|t| t.floor_scale),
            ),
        ];
        for (field, value) in fields {
            let Some(v) = value else { continue };
            let (min, max) = field_range(field);
            if v < min || v > max {
                bail!("{field} = {v} is out of range (accepted: {min} to {max})");
            }
        }
        Ok(())
    }

    /// Parameters of transformer block `layer`.
    pub fn params_of_layer(&self, layer: usize) -> usize {
        let hd = self.head_dim();
        let attn = match &self.mla {
            Some(mla) => mla.params(self.dim, self.n_heads),
            None => self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2,
        };
        let ffn = match self.moe_at(layer) {
            Some(moe) => moe.params(self.dim),
            None => 3 * self.dim * self.ffn_hidden,
        };
        let qk_norm = if self.qk_norm { 2 * hd } else { 0 };
        let sinks = if self.attention_sinks {
            self.n_heads
        } else {
            0
        };
        let biases = match self.attention_bias {
            true => (self.n_heads + 2 * self.n_kv_heads) * hd + self.dim,
            false => 0,
        };
        attn + ffn + 2 * self.dim + qk_norm + sinks + biases
    }

    /// Parameters of the largest transformer block.
    pub fn params_per_layer(&self) -> usize {
        (0..self.n_layers)
            .map(|l| self.params_of_layer(l))
            .max()
            .unwrap_or(0)
    }

    pub fn embedding_params(&self) -> usize {
        self.vocab_size * self.dim
    }

    pub fn num_params(&self) -> usize {
        let output = if self.tied_embeddings {
            0
        } else {
            self.vocab_size * self.dim
        };
        let blocks: usize = (0..self.n_layers).map(|l| self.params_of_layer(l)).sum();
        self.embedding_params() + blocks + self.dim + output
    }

    /// Parameters one token goes through: all of them for a dense model; with MoE, each block's
    /// router, `top_k` of its experts and its shared ones (TorchTitan's count).
    pub fn active_params(&self) -> usize {
        let inactive: usize = (0..self.n_layers)
            .filter_map(|l| self.moe_at(l))
            .map(|moe| moe.params(self.dim) - moe.active_params(self.dim))
            .sum();
        self.num_params() - inactive
    }

    /// TorchTitan's count: 6·(N_active − N_embedding) + 6·n_layers·heads·(qk + v)·seq_len, `qk`
    /// and `v` the query/key and value head widths (both `head_dim` but for MLA, whose padding
    /// is not counted: the attention width is `dim` for Llama); a block whose queries see at most
    /// a window or a chunk of keys counts that many in place of `seq_len`.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let (qk, v) = match &self.mla {
            Some(mla) => (mla.qk_head_dim(), mla.v_head_dim),
            None => (self.head_dim(), self.head_dim()),
        };
        let keys: usize = (0..self.n_layers)
            .map(|l| {
                let span = self.window_at(l).or(self.chunk_at(l)).unwrap_or(seq_len);
                span.min(seq_len)
            })
            .sum();
        6.0 * (self.active_params() - self.embedding_params()) as f64
            + 6.0 * (self.n_heads * (qk + v) * keys) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_and_chunks_count_the_keys_a_query_sees() {
        let plain = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let attention = |a: &ModelArgs, seq| {
            a.flops_per_token(seq) - 6.0 * (a.active_params() - a.embedding_params()) as f64
        };
        let per_block = 6.0 * (plain.n_heads * 2 * plain.head_dim()) as f64;
        assert_eq!(
            attention(&plain, 64),
            per_block * 64.0 * plain.n_layers as f64
        );
        // A window of 16 on every other block of 6, chunks of 8 on the blocks with RoPE (not 3).
        let windowed = ModelArgs {
            n_layers: 6,
            sliding_window: Some(SlidingWindow {
                size: 16,
                period: 2,
            }),
            ..plain.clone()
        };
        assert_eq!(
            attention(&windowed, 64),
            per_block * (3.0 * 16.0 + 3.0 * 64.0)
        );
        assert_eq!(
            attention(&windowed, 8),
            per_block * 6.0 * 8.0,
            "shorter than the window"
        );
        let chunked = ModelArgs {
            n_layers: 6,
            every_n_layers_nope: Some(4),
            attention_chunk_size: Some(8),
            ..plain
        };
        assert_eq!(attention(&chunked, 64), per_block * (5.0 * 8.0 + 64.0));
    }

    #[test]
    fn every_size_is_bounded_and_an_error_names_the_field() {
        let ok = crate::model::families::llama3::flavor("debugmodel").unwrap();
        ok.validate().unwrap();
        type Edit = fn(&mut ModelArgs);
        let cases: [(&str, Edit); 9] = [
            ("n_heads = 0", |a| a.n_heads = 0),
            ("n_kv_heads = 0", |a| a.n_kv_heads = 0),
            ("dim = 131073", |a| a.dim = (1 << 17) + 1),
            ("vocab_size = 1099511627776", |a| a.vocab_size = 1 << 40),
            ("n_layers = 4097", |a| a.n_layers = 4097),
            ("ffn_hidden = 0", |a| a.ffn_hidden = 0),
            ("attention_head_dim = 8192", |a| {
                a.attention_head_dim = Some(8192)
            }),
            ("not divisible by n_heads", |a| a.dim = 250),
            ("rope_theta", |a| a.rope_theta = f64::NAN),
        ];
        for (want, edit) in cases {
            let mut a = ok.clone();
            edit(&mut a);
            let e = a.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }

    #[test]
    fn the_largest_accepted_model_counts_its_parameters_without_overflow() {
        let bound = |f: &str| field_range(f).1;
        let mut a = crate::model::families::qwen3::flavor("235B-A22B").unwrap();
        (a.dim, a.n_layers, a.vocab_size) = (bound("dim"), bound("n_layers"), bound("vocab_size"));
        (a.n_heads, a.n_kv_heads) = (bound("n_heads"), bound("n_kv_heads"));
        a.attention_head_dim = Some(MAX_HEAD_DIM);
        a.tied_embeddings = false;
        let moe = a.moe.as_mut().unwrap();
        (moe.hidden, moe.shared_hidden) = (bound("moe.hidden"), Some(bound("moe.shared_hidden")));
        moe.router.num_experts = bound("moe.num_experts");
        a.validate().unwrap();
        // The same count in u128.
        let (d, h, kv, hd) = (
            a.dim as u128,
            a.n_heads as u128,
            a.n_kv_heads as u128,
            4096u128,
        );
        let (e, eh, sh) = (1024u128, 1u128 << 20, 1u128 << 20);
        let layer =
            d * h * hd * 2 + d * kv * hd * 2 + e * d + 3 * d * (e * eh + sh) + 2 * d + 2 * hd;
        let want = 2 * (a.vocab_size as u128) * d + a.n_layers as u128 * layer + d;
        assert_eq!(a.num_params() as u128, want);
        assert!(want < 1 << 62, "{want}");
    }
}
