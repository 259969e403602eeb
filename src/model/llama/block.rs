//! The decoder block's forward, written once in one rank's local shapes: the training forward,
//! activation checkpointing's recompute and generation with a KV cache all run it.

use anyhow::{bail, Result};

use super::workspace::BlockActs;
use super::Llama;
use crate::backend::{AttnShape, Backend};
use crate::model::activation_checkpoint::{Act, BlockSave};
use crate::model::args::LocalShapes;
use crate::model::linear::Linear;
use crate::model::moe::{self, MoeShapes};
use crate::model::parallel_linear::{Projection, SequenceParallel};
use crate::model::params::{FeedForwardIds, ParamSet};
use crate::model::Workspace;

/// A block's projections in one rank's shapes: attention's (wq, wk, wv column-parallel, wo
/// row-parallel) and the feed-forward's (w1, w3 column-parallel, w2 row-parallel).
pub(super) struct BlockLinears {
    pub(super) wq: Linear,
    pub(super) wk: Linear,
    pub(super) wv: Linear,
    pub(super) wo: Linear,
    pub(super) w1: Linear,
    pub(super) w2: Linear,
    pub(super) w3: Linear,
}

impl BlockLinears {
    pub(super) fn of(m: &LocalShapes) -> Self {
        let (d, f) = (m.dim, m.ffn);
        BlockLinears {
            wq: Linear::new(d, m.q_dim()),
            wk: Linear::new(d, m.kv_dim()),
            wv: Linear::new(d, m.kv_dim()),
            wo: Linear::new(m.q_dim(), d),
            w1: Linear::new(d, f),
            w2: Linear::new(f, d),
            w3: Linear::new(d, f),
        }
    }
}

/// Whether a block's forward keeps its mixture of experts' activations: as its save policy says
/// (not for a block that keeps only its input), or always (the recompute before its backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertActs {
    AsPlanned,
    ForBackward,
}

impl<B: Backend> Llama<B> {
    /// The linear layers of this rank's tensor-parallel group over `tokens` rows.
    pub(super) fn sequence_parallel(&self, tokens: usize) -> SequenceParallel<'_, B> {
        SequenceParallel {
            tp: self.tp.as_ref(),
            tokens,
            deferred: None,
        }
    }

    pub fn block_forward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        self.block_forward_keeping(be, params, ws, l, ExpertActs::AsPlanned)
    }

    /// `block_forward`, keeping a mixture of experts' activations as `experts` says.
    pub(super) fn block_forward_keeping(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        experts_kept: ExpertActs,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} forward"));
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let sp = self.sequence_parallel(b * s);
        let BlockLinears {
            wq,
            wk,
            wv,
            wo,
            w1,
            w2,
            w3,
        } = BlockLinears::of(m);
        let (before, after) = ws.resid.split_at_mut(l + 1);
        let x = &before[l];
        let out = &mut after[0];
        let save = ws.plan.blocks[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        // Attention: h = x + wo · Attention(RoPE(wq·n), RoPE(wk·n), wv·n), n = RMSNorm(x).
        be.rmsnorm_forward(
            acts.normed_attn,
            acts.rstd_attn,
            x,
            &p[id.attention_norm],
            d,
            a.norm_eps,
        );
        // With QK-norm the projections go to q_raw and k_raw, normed per head into q and k.
        let (q_proj, k_proj) = match m.qk_norm {
            true => (&mut *acts.q_raw, &mut *acts.k_raw),
            false => (&mut *acts.q, &mut *acts.k),
        };
        sp.column_forward(
            be,
            acts.normed_attn,
            acts.normed_attn_full,
            d,
            &mut [
                Projection::new(wq, &p[id.wq], q_proj),
                Projection::new(wk, &p[id.wk], k_proj),
                Projection::new(wv, &p[id.wv], acts.v),
            ],
        )?;
        if let (Some(qn), Some(kn)) = (id.q_norm, id.k_norm) {
            be.rmsnorm_forward(acts.q, acts.rstd_q, acts.q_raw, &p[qn], hd, a.norm_eps);
            be.rmsnorm_forward(acts.k, acts.rstd_k, acts.k_raw, &p[kn], hd, a.norm_eps);
        }
        let (cos, sin) = self.rope_tables(&ws.rope);
        be.rope_forward(acts.q, cos, sin, b, s, m.heads, hd, 0);
        be.rope_forward(acts.k, cos, sin, b, s, m.kv_heads, hd, 0);
        let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
        self.cp
            .attention_forward(be, acts.attn_out, acts.lse, acts.q, acts.k, acts.v, shape)?;
        sp.row_forward_residual(be, wo, acts.attn_out, &p[id.wo], x, acts.h, &mut ws.full)?;
        // Feed-forward: out = h + w2 · (silu(w1·n) ∘ w3·n), n = RMSNorm(h), or with a mixture
        // of experts out = h + MoE(n).
        be.rmsnorm_forward(
            acts.normed_ffn,
            acts.rstd_ffn,
            acts.h,
            &p[id.ffn_norm],
            d,
            a.norm_eps,
        );
        // The SwiGLU (the dense feed-forward, or a mixture of experts' shared experts), column-
        // then row-parallel under TP: out = h + w2 · (silu(w1·n) ∘ w3·n).
        match id.ffn.swiglu() {
            Some([i1, i2, i3]) => {
                sp.column_forward(
                    be,
                    acts.normed_ffn,
                    acts.normed_ffn_full,
                    d,
                    &mut [
                        Projection::new(w1, &p[i1], acts.gate),
                        Projection::new(w3, &p[i3], acts.up),
                    ],
                )?;
                be.swiglu_forward(acts.act, acts.gate, acts.up);
                sp.row_forward_residual(be, w2, acts.act, &p[i2], acts.h, out, &mut ws.full)?;
            }
            None => be.copy_from(out, acts.h),
        }
        // The routed experts: out += Σ_j w_j · Expert_j(n), on this rank's rows.
        match &id.ffn {
            FeedForwardIds::Dense { .. } => Ok(()),
            FeedForwardIds::Moe(experts) => {
                let shapes = self.moe_shapes()?;
                let bias = self.block_expert_bias(l);
                let sum = |v: &mut [f32]| self.sum_over_sequence_ranks(be, v);
                let moe_acts = moe::forward(
                    be,
                    &shapes,
                    experts,
                    p,
                    acts.normed_ffn,
                    out,
                    bias.as_deref(),
                    self.ep.as_ref(),
                    self.sequence_rows(b, s, &sum),
                )?;
                // A block that keeps only its input recomputes its experts before its backward.
                let keep = experts_kept == ExpertActs::ForBackward || save != BlockSave::Input;
                ws.moe[l] = keep.then_some(moe_acts);
                Ok(())
            }
        }
    }

    /// The mixture-of-experts layer's shapes (a MoE model's): its routed experts (the block
    /// computes the shared experts as its SwiGLU, `FeedForwardIds::swiglu`).
    pub(super) fn moe_shapes(&self) -> Result<MoeShapes> {
        match &self.args.moe {
            Some(moe) => Ok(MoeShapes::new(self.args.dim, moe)),
            None => {
                bail!("a mixture-of-experts block in a model without MoE arguments (a titan bug)")
            }
        }
    }

    /// Before block `l`'s backward, what its forward did not keep (activation checkpointing):
    /// with the same kernels on the same inputs, so the values are the forward's, bit for bit.
    pub(super) fn recompute(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} recompute"));
        match ws.plan.blocks[l] {
            BlockSave::Everything => Ok(()),
            // The whole forward again, from the block's input (its output, the next block's
            // input, is written again with the same values).
            BlockSave::Input => {
                self.block_forward_keeping(be, params, ws, l, ExpertActs::ForBackward)
            }
            BlockSave::ExpensiveOps => self.recompute_missing(be, params, ws, l),
            BlockSave::Elsewhere => {
                anyhow::bail!("block {l} runs on another pipeline rank, not this one")
            }
        }
    }

    /// Selective checkpointing: every activation the block did not keep, op by op in the
    /// forward's order, from the block's input and what it kept (an op whose output was kept is
    /// skipped; the block's output is not needed again).
    pub(super) fn recompute_missing(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let n = b * s;
        let save = ws.plan.blocks[l];
        let redo = |act: Act| !save.keeps(act);
        let x = &ws.resid[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        let (cos, sin) = self.rope_tables(&ws.rope);
        let tp = m.tp > 1;
        let sp = self.sequence_parallel(n);
        if redo(Act::NormedAttn) || redo(Act::RstdAttn) {
            let w = &p[id.attention_norm];
            be.rmsnorm_forward(acts.normed_attn, acts.rstd_attn, x, w, d, a.norm_eps);
        }
        // The projections go through the forward's own column-parallel layer (gather and GEMMs,
        // chunked alike under async TP), so their values are the forward's to the bit.
        let (redo_q, redo_k) = (redo(Act::Q), redo(Act::K));
        {
            let BlockLinears { wq, wk, wv, .. } = BlockLinears::of(m);
            let mut qkv = Vec::new();
            // With QK-norm the projections are q_raw and k_raw (then normed into q and k).
            let (q_proj, k_proj, redo_q_proj, redo_k_proj) = match m.qk_norm {
                true => (
                    &mut *acts.q_raw,
                    &mut *acts.k_raw,
                    redo(Act::QRaw),
                    redo(Act::KRaw),
                ),
                false => (&mut *acts.q, &mut *acts.k, redo_q, redo_k),
            };
            if redo_q_proj {
                qkv.push(Projection::new(wq, &p[id.wq], q_proj));
            }
            if redo_k_proj {
                qkv.push(Projection::new(wk, &p[id.wk], k_proj));
            }
            if redo(Act::V) {
                qkv.push(Projection::new(wv, &p[id.wv], &mut *acts.v));
            }
            if !qkv.is_empty() {
                sp.column_forward(be, acts.normed_attn, acts.normed_attn_full, d, &mut qkv)?;
            } else if tp && redo(Act::NormedAttnFull) {
                self.tp
                    .gather_rows(be, acts.normed_attn, acts.normed_attn_full)?;
            }
        }
        if let (Some(qn), Some(kn)) = (id.q_norm, id.k_norm) {
            if redo_q || redo(Act::RstdQ) {
                be.rmsnorm_forward(acts.q, acts.rstd_q, acts.q_raw, &p[qn], hd, a.norm_eps);
            }
            if redo_k || redo(Act::RstdK) {
                be.rmsnorm_forward(acts.k, acts.rstd_k, acts.k_raw, &p[kn], hd, a.norm_eps);
            }
        }
        if redo_q {
            be.rope_forward(acts.q, cos, sin, b, s, m.heads, hd, 0);
        }
        if redo_k {
            be.rope_forward(acts.k, cos, sin, b, s, m.kv_heads, hd, 0);
        }
        if redo(Act::AttnOut) || redo(Act::Lse) {
            let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
            self.cp.attention_forward(
                be,
                acts.attn_out,
                acts.lse,
                acts.q,
                acts.k,
                acts.v,
                shape,
            )?;
        }
        if redo(Act::H) {
            let w = &p[id.wo];
            let wo = BlockLinears::of(m).wo;
            sp.row_forward_residual(be, wo, acts.attn_out, w, x, acts.h, &mut ws.full)?;
        }
        if redo(Act::NormedFfn) || redo(Act::RstdFfn) {
            let w = &p[id.ffn_norm];
            be.rmsnorm_forward(acts.normed_ffn, acts.rstd_ffn, acts.h, w, d, a.norm_eps);
        }
        // A mixture of experts keeps its routed experts' activations in `ws.moe` (its own
        // forward's, or the recomputed block's): only the SwiGLU (dense, or the shared experts)
        // has projections to redo here.
        if let Some([w1, _, w3]) = id.ffn.swiglu() {
            let mut gate_up = Vec::new();
            if redo(Act::Gate) {
                gate_up.push(Projection::new(
                    Linear::new(d, m.ffn),
                    &p[w1],
                    &mut *acts.gate,
                ));
            }
            if redo(Act::Up) {
                gate_up.push(Projection::new(
                    Linear::new(d, m.ffn),
                    &p[w3],
                    &mut *acts.up,
                ));
            }
            if !gate_up.is_empty() {
                sp.column_forward(be, acts.normed_ffn, acts.normed_ffn_full, d, &mut gate_up)?;
            } else if tp && redo(Act::NormedFfnFull) {
                self.tp
                    .gather_rows(be, acts.normed_ffn, acts.normed_ffn_full)?;
            }
        }
        if redo(Act::Act) && id.ffn.swiglu().is_some() {
            be.swiglu_forward(acts.act, acts.gate, acts.up);
        }
        Ok(())
    }
}
