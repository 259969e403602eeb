//! `LocalShapes`: the shapes one rank computes with under tensor, context and expert parallelism
//! (its heads, feed-forward and vocabulary slices, token rows, sequence shard and experts), derived
//! from the model's `ModelArgs` and each group's degree and rank, refusing a split that does not
//! divide evenly. With one rank these are the model's own shapes.

use anyhow::{bail, Result};

use super::args::ModelArgs;
use super::decoder::mla::MlaArgs;
use super::moe::MoeArgs;
use super::params::expert_of;
use super::projection::BlockProjection;

/// A block's feed-forward: a dense SwiGLU, or a mixture of experts (with its shared experts as
/// the block's SwiGLU). The two have different widths, so their activations are sized apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Experts,
}

impl FfnKind {
    pub const ALL: [FfnKind; 2] = [FfnKind::Dense, FfnKind::Experts];

    pub fn index(self) -> usize {
        self as usize
    }
}

/// The shapes one rank computes with: its heads, its slice of the feed-forward's hidden width and
/// of the vocabulary (Megatron's column- and row-parallel split), the token rows it holds between
/// blocks (sequence parallel: `batch × seq / tp`), and, with context parallelism, its shard of
/// every sequence (`seq / cp` positions, `model::crossings::context::SequenceShard`). With one rank
/// these are the model's own shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalShapes {
    pub dim: usize,
    pub n_layers: usize,
    pub head_dim: usize,
    /// Query and key/value heads of this rank.
    pub heads: usize,
    pub kv_heads: usize,
    /// This rank's columns of the SwiGLU's hidden layer in a dense block (0 when the model has
    /// none) and in a mixture-of-experts block (its shared experts'; 0 without): `ffn`.
    pub dense_ffn: usize,
    pub shared_ffn: usize,
    /// This rank's rows of the vocabulary, starting at `vocab_offset`.
    pub vocab: usize,
    pub vocab_offset: usize,
    /// Tensor-parallel degree and this rank's place in its group.
    pub tp: usize,
    pub tp_rank: usize,
    /// Whether some block RMS-normalises each query and key head (Qwen3's before RoPE, Llama 4's
    /// weightless after it: `ModelArgs::qk_norm_at`), so the blocks keep q and k un-normed too.
    pub qk_norm: bool,
    /// The mixture-of-experts feed-forward (then `ffn` is its shared experts' width).
    pub moe: Option<MoeArgs>,
    /// Multi-head latent attention's widths (then `head_dim` is its padded head, `kv_heads` =
    /// `heads`).
    pub mla: Option<MlaArgs>,
    /// Context-parallel degree and this rank's place in its group.
    pub cp: usize,
    pub cp_rank: usize,
    /// Expert-parallel degree and this rank's place in its group: the rank computes experts
    /// `local_experts()` (all of them at degree 1).
    pub ep: usize,
    pub ep_rank: usize,
}

impl LocalShapes {
    /// The whole model (one rank).
    pub fn whole(args: &ModelArgs) -> Self {
        LocalShapes {
            dim: args.dim,
            n_layers: args.n_layers,
            head_dim: args.head_dim(),
            heads: args.n_heads,
            kv_heads: args.n_kv_heads,
            dense_ffn: if args.has_dense_blocks() {
                args.ffn_hidden
            } else {
                0
            },
            shared_ffn: args.moe.and_then(|m| m.shared_hidden).unwrap_or(0),
            vocab: args.vocab_size,
            vocab_offset: 0,
            tp: 1,
            tp_rank: 0,
            qk_norm: args.qk_norm || args.l2_qk_norm,
            moe: args.moe,
            mla: args.mla,
            cp: 1,
            cp_rank: 0,
            ep: 1,
            ep_rank: 0,
        }
    }

    /// These shapes on rank `ep_rank` of an expert-parallel group of `ep` ranks: refused, naming
    /// the key, for a dense model or experts that do not split evenly.
    pub fn with_expert_parallel(self, ep: usize, ep_rank: usize) -> Result<Self> {
        let experts = self.moe.map_or(0, |m| m.router.num_experts);
        if ep > 1 && experts == 0 {
            anyhow::bail!("[parallelism] expert_parallel_degree = {ep} needs a mixture-of-experts model (this one has no experts; e.g. [model] name = \"qwen3\", flavor = \"debugmodel_moe\")");
        }
        if !experts.is_multiple_of(ep) {
            anyhow::bail!("[parallelism] expert_parallel_degree = {ep} does not divide the model's {experts} experts; choose a divisor of {experts}");
        }
        Ok(LocalShapes {
            ep,
            ep_rank,
            ..self
        })
    }

    /// The experts this rank computes (global ids), a consecutive run of `experts / ep`.
    pub fn local_experts(&self) -> std::ops::Range<usize> {
        let per = self.moe.map_or(0, |m| m.router.num_experts) / self.ep;
        self.ep_rank * per..(self.ep_rank + 1) * per
    }

    /// Whether this rank holds parameter `name`: every one but other ranks' experts.
    pub fn holds(&self, name: &str) -> bool {
        expert_of(name).is_none_or(|e| self.local_experts().contains(&e))
    }

    /// These shapes on rank `cp_rank` of a context-parallel group of `cp` ranks.
    pub fn with_context_parallel(self, cp: usize, cp_rank: usize) -> Self {
        LocalShapes {
            cp,
            cp_rank,
            ..self
        }
    }

    /// Positions of each sequence of `seq` this rank computes (context parallel: its shard).
    pub fn local_seq(&self, seq: usize) -> usize {
        seq / self.cp
    }

    /// Rank `tp_rank` of `tp`: refuses, naming the key and the numbers, a model whose heads, key/
    /// value heads, feed-forward width or vocabulary do not split evenly.
    pub fn sharded(args: &ModelArgs, tp: usize, tp_rank: usize) -> Result<Self> {
        let whole = Self::whole(args);
        for (key, value) in [
            ("n_heads", args.n_heads),
            ("n_kv_heads", args.n_kv_heads),
            ("feed-forward hidden size", whole.dense_ffn),
            ("shared experts' hidden size", whole.shared_ffn),
            ("vocab_size", args.vocab_size),
        ] {
            if !value.is_multiple_of(tp) {
                bail!("[parallelism] tensor_parallel_degree = {tp} does not divide the model's {key} {value}: every tensor-parallel rank needs an equal share (choose a degree that divides it, or change [model])");
            }
        }
        Ok(LocalShapes {
            heads: args.n_heads / tp,
            kv_heads: args.n_kv_heads / tp,
            dense_ffn: whole.dense_ffn / tp,
            shared_ffn: whole.shared_ffn / tp,
            vocab: args.vocab_size / tp,
            vocab_offset: tp_rank * (args.vocab_size / tp),
            tp,
            tp_rank,
            ..whole
        })
    }

    /// Block `layer`'s feed-forward: dense, or the mixture of experts.
    pub fn ffn_kind(&self, layer: usize) -> FfnKind {
        match self.moe.is_some_and(|m| m.in_layer(layer)) {
            true => FfnKind::Experts,
            false => FfnKind::Dense,
        }
    }

    /// This rank's columns of the SwiGLU of a `kind` block (a mixture of experts': its shared
    /// experts').
    pub fn ffn(&self, kind: FfnKind) -> usize {
        match kind {
            FfnKind::Dense => self.dense_ffn,
            FfnKind::Experts => self.shared_ffn,
        }
    }

    /// Whether some block's feed-forward is of `kind`.
    pub fn has(&self, kind: FfnKind) -> bool {
        (0..self.n_layers).any(|l| self.ffn_kind(l) == kind)
    }

    /// The widest SwiGLU of the model's blocks (for scratch every block shares).
    pub fn max_ffn(&self) -> usize {
        FfnKind::ALL
            .into_iter()
            .filter(|&k| self.has(k))
            .map(|k| self.ffn(k))
            .max()
            .unwrap_or(0)
    }

    /// Width of this rank's queries (and attention output), and of its keys and values.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of `wo`'s input: this rank's heads' values (MLA's narrower than their padded
    /// attention output).
    pub fn values_dim(&self) -> usize {
        match &self.mla {
            Some(mla) => self.heads * mla.v_head_dim,
            None => self.q_dim(),
        }
    }

    /// Block `layer`'s projection `p` in this rank's shapes, `(d_in, d_out)`; None when the block
    /// has no such projection.
    pub fn projection(&self, p: BlockProjection, layer: usize) -> Option<(usize, usize)> {
        use BlockProjection::*;
        let (d, f, h) = (self.dim, self.ffn(self.ffn_kind(layer)), self.heads);
        match (p, &self.mla) {
            (W1 | W3, _) if f > 0 => Some((d, f)),
            (W2, _) if f > 0 => Some((f, d)),
            (Wo, _) => Some((self.values_dim(), d)),
            (Wq, None) => Some((d, self.q_dim())),
            (Wk | Wv, None) => Some((d, self.kv_dim())),
            (Wq, Some(m)) if m.q_lora_rank.is_none() => Some((d, h * m.qk_head_dim())),
            (WqA, Some(m)) => m.q_lora_rank.map(|r| (d, r)),
            (WqB, Some(m)) => m.q_lora_rank.map(|r| (r, h * m.qk_head_dim())),
            (WkvA, Some(m)) => Some((d, m.kv_a_dim())),
            (WkvB, Some(m)) => Some((m.kv_lora_rank, h * m.kv_b_head_dim())),
            _ => None,
        }
    }

    /// Token rows a rank holds between blocks for `tokens` tokens (sequence parallel).
    pub fn rows(&self, tokens: usize) -> usize {
        tokens / self.tp
    }
}
