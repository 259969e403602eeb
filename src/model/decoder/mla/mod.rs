//! Multi-head latent attention's shapes (DeepSeek-V2/V3's MLA, `MlaArgs`): the widths of its
//! latents and heads, its parameter count, and how its heads are laid out for the attention
//! kernels.
//!
//! Per token (`n` the attention norm's output, `H` heads):
//! - queries `q = Wq·n`, or through a low-rank latent `q = Wq_b·RMSNorm(Wq_a·n)`; each head
//!   `[q_nope | q_rope]` (`qk_nope_head_dim + qk_rope_head_dim` wide);
//! - a key/value latent `[c | k_rope] = Wkv_a·n`, `kv_lora_rank + qk_rope_head_dim` wide, and
//!   each head's `[k_nope | v] = Wkv_b·RMSNorm(c)`; every head's key is `[k_nope | RoPE(k_rope)]`,
//!   the rotated `k_rope` shared by all heads;
//! - `softmax(q·kᵀ · s)·v` per head with `s = mscale² / sqrt(qk_nope + qk_rope)` (YaRN's mscale,
//!   1 without), then `Wo` over the heads' values (`v_head_dim` each).
//!
//! The value head is narrower than the query/key head (DeepSeek-V3: 128 and 192). The attention
//! kernels (CPU, CUDA, ring attention) take one head width, so MLA hands them every head padded
//! with zeros to `padded_head_dim()` (the wider of the two): zeros add nothing to `q·k`, and a
//! zero value column gives a zero output column, which `Wo` never reads. The kernels scale by
//! `1/sqrt(padded)`; the queries are multiplied by `query_scale()` first so the product is MLA's
//! `s`. What this costs (the padded value columns' FLOPs and memory) buys unchanged kernels.
//!
//! MLA lives in this one folder: the shapes here, its part of the block's forward and backward
//! (`attention`) and its working buffers (`scratch`).

pub(super) mod attention;
pub(super) mod scratch;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::backend::cpu::rope::RopeScaling;
use crate::backend::cpu::rope_scaling::yarn_mscale;

/// MLA's widths (Hugging Face `DeepseekV3Config`'s names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaArgs {
    /// The query latent's width (`q_lora_rank`); None: queries are projected directly.
    pub q_lora_rank: Option<usize>,
    /// The key/value latent's width.
    pub kv_lora_rank: usize,
    /// Each query/key head: the part without position (`qk_nope_head_dim`) and the rotated part
    /// (`qk_rope_head_dim`, shared by all heads on the key side).
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    /// Each value head's width.
    pub v_head_dim: usize,
}

/// The range of each MLA width (`ModelArgs::validate`), named as in the config.
pub const MLA_BOUNDS: &[(&str, usize, usize)] = &[
    ("q_lora_rank", 1, 1 << 16),
    ("kv_lora_rank", 1, 1 << 16),
    ("qk_nope_head_dim", 1, 1 << 11),
    ("qk_rope_head_dim", 2, 1 << 11),
    ("v_head_dim", 1, 1 << 11),
];

impl MlaArgs {
    /// The query/key head width the softmax scale is computed from.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The head width the attention kernels compute with: query, key and value heads padded
    /// with zeros to the wider of the query/key and value heads.
    pub fn padded_head_dim(&self) -> usize {
        self.qk_head_dim().max(self.v_head_dim)
    }

    /// The key/value latent projection's outputs: the latent and the shared rotated key.
    pub fn kv_a_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// One head's outputs of the key/value up-projection: its unrotated key and its value.
    pub fn kv_b_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.v_head_dim
    }

    /// Parameters of one block's attention for `dim` and `n_heads` (the norms' weights included,
    /// the attention norm's not).
    pub fn params(&self, dim: usize, n_heads: usize) -> usize {
        let q = match self.q_lora_rank {
            Some(r) => dim * r + r + r * n_heads * self.qk_head_dim(),
            None => dim * n_heads * self.qk_head_dim(),
        };
        let kv = dim * self.kv_a_dim()
            + self.kv_lora_rank
            + self.kv_lora_rank * n_heads * self.kv_b_head_dim();
        q + kv + n_heads * self.v_head_dim * dim
    }

    /// What multiplies the queries so that the kernels' `1/sqrt(padded_head_dim)` becomes MLA's
    /// `mscale² / sqrt(qk_head_dim)`, where a YaRN scaling with `mscale_all_dim` gives the mscale
    /// (as transformers' `yarn_apply_mscale`: any other scaling leaves it 1).
    pub fn query_scale(&self, scaling: Option<&RopeScaling>) -> f32 {
        let mscale = match scaling {
            Some(RopeScaling::Yarn(y)) => match y.mscale_all_dim {
                Some(all) if all != 0.0 => yarn_mscale(y.factor, all),
                _ => 1.0,
            },
            _ => 1.0,
        };
        let padded = self.padded_head_dim() as f64;
        ((padded / self.qk_head_dim() as f64).sqrt() * mscale * mscale) as f32
    }

    /// The fields' values by `MLA_BOUNDS` name.
    fn fields(&self) -> [(&'static str, Option<usize>); 5] {
        [
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", Some(self.kv_lora_rank)),
            ("qk_nope_head_dim", Some(self.qk_nope_head_dim)),
            ("qk_rope_head_dim", Some(self.qk_rope_head_dim)),
            ("v_head_dim", Some(self.v_head_dim)),
        ]
    }

    /// Every width within its bound, the rotated part even (RoPE turns pairs).
    pub fn validate(&self) -> Result<()> {
        for (field, value) in self.fields() {
            let Some(v) = value else { continue };
            let (_, min, max) = MLA_BOUNDS
                .iter()
                .find(|(f, _, _)| *f == field)
                .expect("every field has a bound");
            if v < *min || v > *max {
                bail!("[model] {field} = {v} is out of range (accepted: {min} to {max})");
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            bail!(
                "[model] qk_rope_head_dim = {} must be even (RoPE rotates pairs)",
                self.qk_rope_head_dim
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepseek_v3() -> MlaArgs {
        MlaArgs {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }
    }

    #[test]
    fn deepseek_v3_attention_has_its_published_parameter_count() {
        // DeepSeek-V3 (dim 7168, 128 heads): q_a 7168·1536, q_b 1536·128·192, kv_a 7168·576,
        // kv_b 512·128·256, o 128·128·7168, norms 1536 + 512.
        let want = 7168 * 1536
            + 1536 * 128 * 192
            + 7168 * 576
            + 512 * 128 * 256
            + 128 * 128 * 7168
            + 1536
            + 512;
        assert_eq!(deepseek_v3().params(7168, 128), want);
        assert_eq!(deepseek_v3().padded_head_dim(), 192);
    }

    #[test]
    fn the_query_scale_turns_the_kernels_scale_into_mlas() {
        let m = MlaArgs {
            v_head_dim: 256,
            ..deepseek_v3()
        };
        // padded 256, qk 192: sqrt(256/192) so that q·k/sqrt(256) = q·k/sqrt(192).
        let s = m.query_scale(None) as f64;
        assert!((s / 256f64.sqrt() - 1.0 / 192f64.sqrt()).abs() < 1e-7);
        assert_eq!(deepseek_v3().query_scale(None), 1.0);
    }

    #[test]
    fn an_out_of_range_width_is_refused_by_name() {
        let bad = MlaArgs {
            qk_rope_head_dim: 63,
            ..deepseek_v3()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("qk_rope_head_dim"));
        let zero = MlaArgs {
            kv_lora_rank: 0,
            ..deepseek_v3()
        };
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("kv_lora_rank"));
    }
}
