//! The decoder block's backward, in one rank's local shapes: the chain from ∂L/∂(block output)
//! to ∂L/∂(block input) with every weight gradient, whole or split into its input-gradient and
//! weight-gradient halves (zero-bubble pipeline schedules).

use std::cell::RefCell;

use anyhow::Result;

use super::mla::attention::MlaGrads;
use super::mla::scratch::MlaScratch;
use super::positions::Positions;
use super::run::{frozen_or, BackwardRun, BlockLinears};
use super::workspace::{BlockActs, FfnGrads};
use super::Decoder;
use crate::backend::{AttnGrads, AttnInputs, AttnSaved, AttnShape, Backend};
use crate::model::args::QkNorm;
use crate::model::moe;
use crate::model::moe::stats::{AuxWeight, ExpertStats};
use crate::model::parallel_linear::{DeferredWeightGrad, SequenceParallel};
use crate::model::params::{AttentionIds, FeedForwardIds, GqaIds, ParamSet};
use crate::model::projection::BlockProjection;
use crate::model::Workspace;

impl<B: Backend> Decoder<B> {
    /// On entry `ws.dx` holds ∂L/∂(block output) on this rank's rows; on exit ∂L/∂(block input).
    pub fn block_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} backward"));
        self.block_backward_deferring(be, params, grads, ws, l, None)
    }

    /// The input-gradient half of `block_backward` (zero-bubble pipeline schedules): the same
    /// chain to ∂L/∂(block input) and the norms' weight gradients, with the projections' weight
    /// gradients left in `deferred` for `apply_weight_grads`.
    pub fn block_backward_input(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        deferred: &RefCell<Vec<DeferredWeightGrad<B>>>,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} input gradient"));
        self.block_backward_deferring(be, params, grads, ws, l, Some(deferred))
    }

    /// The weight-gradient half: the projections' `dW += dyᵀ · x` left by `block_backward_input`.
    pub fn apply_weight_grads(
        &self,
        be: &B,
        grads: &mut ParamSet<B>,
        deferred: Vec<DeferredWeightGrad<B>>,
    ) {
        let _span = crate::trace::span("model", "weight gradients");
        for g in deferred {
            g.apply(be, grads);
        }
    }

    /// The block's backward: the feed-forward half, then attention's, each the mirror of the
    /// forward's (`block::run_block`), after recomputing what the forward did not keep.
    fn block_backward_deferring(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        deferred: Option<&RefCell<Vec<DeferredWeightGrad<B>>>>,
    ) -> Result<()> {
        self.recompute(be, params, ws, l)?;
        let Workspace {
            batch,
            seq,
            rope,
            documents,
            chunks,
            resid,
            layers,
            recomputed,
            ffn_recomputed,
            plan,
            dx,
            dnormed,
            full,
            dq,
            dk,
            dv,
            dq_raw,
            dk_raw,
            dattn,
            ffn_grads,
            mla,
            moe,
            expert_stats,
            ..
        } = ws;
        let run = BackwardRun {
            be,
            p: &params.bufs,
            layer: l,
            id: &self.ids.layers[l],
            linears: BlockLinears::of(&self.local, &self.float8, l)
                .with_lora(self.args.lora.as_ref()),
            sp: SequenceParallel {
                deferred,
                ..self.sequence_parallel(*batch * *seq)
            },
            batch: *batch,
            seq: *seq,
        };
        let kind = self.local.ffn_kind(l).index();
        let scratch = (recomputed, &mut ffn_recomputed[kind]);
        let mut acts = BlockActs::pick(&mut layers[l], scratch, |a| plan.keeps_as_computed(l, a));
        let FfnGrads { dgate, dup, dact } = &mut ffn_grads[kind];
        let ffn = FeedForwardGrads {
            dx,
            dnormed,
            full,
            dgate,
            dup,
            dact,
        };
        let moe_acts = moe[l].take();
        let moe = moe_acts.map(|acts| (acts, expert_stats.as_mut()));
        self.feed_forward_backward(&run, &mut acts, ffn, grads, moe, l)?;
        let attn = AttentionGrads {
            dx,
            dnormed,
            full,
            dq,
            dk,
            dv,
            dq_raw,
            dk_raw,
            dattn,
            mla,
        };
        let positions = self.positions(rope, documents, chunks);
        let x = resid.read(be, l);
        self.attention_backward(&run, &mut acts, attn, grads, x, positions)
    }

    /// ∂L/∂h from ∂L/∂out (`grads.dx` on entry and exit): the SwiGLU's row- then column-parallel
    /// backward (dense, or the shared experts'), the routed experts', then the norm's.
    fn feed_forward_backward(
        &self,
        run: &BackwardRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        g: FeedForwardGrads<'_, B>,
        grads: &mut ParamSet<B>,
        moe_acts: Option<(moe::MoeActs<B>, Option<&mut ExpertStats<B>>)>,
        l: usize,
    ) -> Result<()> {
        let (be, p, id) = (run.be, run.p, run.id);
        // ∂L/∂n into dnormed: the SwiGLU's first, then the routed experts' added.
        match id.ffn.swiglu() {
            Some(_) => {
                let [w2] = run.projection_grads(grads, [(BlockProjection::W2, &*g.dx)]);
                run.sp.row_backward(be, w2, g.full, acts.act, g.dact)?;
                be.swiglu_backward(g.dgate, g.dup, g.dact, acts.gate, acts.up);
                let mut gate_up = run.projection_grads(
                    grads,
                    [
                        (BlockProjection::W1, &*g.dgate),
                        (BlockProjection::W3, &*g.dup),
                    ],
                );
                run.sp.column_backward(
                    be,
                    &mut gate_up,
                    self.gathered(acts.normed_ffn, acts.normed_ffn_full),
                    g.full,
                    g.dnormed,
                )?;
            }
            None => be.fill(g.dnormed, 0.0),
        }
        if let FeedForwardIds::Moe(experts) = &id.ffn {
            let (moe_acts, stats) = moe_acts.ok_or_else(|| {
                anyhow::anyhow!("block {l}: no mixture-of-experts activations (a titan bug)")
            })?;
            let stats = stats.ok_or_else(|| {
                anyhow::anyhow!("block {l}: a workspace without expert statistics (a titan bug)")
            })?;
            let aux = self.args.moe.and_then(|m| m.aux_loss_coef);
            let aux_scale = match (&moe_acts.aux, aux) {
                (Some(_), Some(coef)) => coef / self.sequences_per_step as f32,
                _ => 0.0,
            };
            let shapes = self.moe_shapes(l)?;
            moe::backward(
                be,
                &shapes,
                experts,
                p,
                &mut grads.bufs,
                &moe_acts,
                acts.normed_ffn,
                g.dx,
                g.dnormed,
                self.ep.as_ref(),
                aux_scale,
            )?;
            self.count_expert_stats(moe_acts, l, stats, be);
        }
        let d = self.args.dim;
        let w = &p[id.ffn_norm];
        let mut spare = None;
        let dw = frozen_or(be, &mut grads.bufs[id.ffn_norm], &mut spare, d);
        be.rmsnorm_backward(g.dx, dw, g.dnormed, acts.h, w, acts.rstd_ffn, d);
        Ok(())
    }

    /// A mixture-of-experts block's step statistics from its routing (the backward counts each
    /// trained microbatch once): the tokens per expert, and the auxiliary loss's share (its
    /// per-sequence losses kept in their own buffer until taken).
    fn count_expert_stats(
        &self,
        moe_acts: moe::MoeActs<B>,
        l: usize,
        stats: &mut ExpertStats<B>,
        be: &B,
    ) {
        stats.count_load(be, l, moe_acts.load_offsets());
        if let (Some(aux), Some(coef)) = (moe_acts.aux, self.args.moe.and_then(|m| m.aux_loss_coef))
        {
            let weight = AuxWeight {
                coef: coef as f64,
                sequences: self.sequences_per_step as f64,
                share: (self.local.tp * self.local.cp) as f64,
            };
            stats.add_aux(aux.into_values(), weight);
        }
    }

    /// ∂L/∂x from ∂L/∂h (`g.dx` on entry and exit): wo's row-parallel backward, attention's,
    /// then the projections' back to the norm's output (grouped-query attention's RoPE, QK-norm
    /// and column-parallel q/k/v; or MLA's, `mla.rs`), then the norm's.
    fn attention_backward(
        &self,
        run: &BackwardRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        mut g: AttentionGrads<'_, B>,
        grads: &mut ParamSet<B>,
        x: &B::Buf,
        positions: Positions<'_, B>,
    ) -> Result<()> {
        let (be, p, id, m) = (run.be, run.p, run.id, &self.local);
        let (b, s, hd) = (run.batch, run.seq, m.head_dim);
        let mla = match &id.attention {
            AttentionIds::Mla(ids) => Some(ids),
            AttentionIds::Gqa(_) => None,
        };
        {
            let [wo] = run.projection_grads(grads, [(BlockProjection::Wo, &*g.dx)]);
            let (values, dvalues) = match mla {
                Some(_) => (&*acts.attn_values, self.mla_values_grad(g.mla)),
                None => (&*acts.attn_out, &mut *g.dattn),
            };
            run.sp.row_backward(be, wo, g.full, values, dvalues)?;
        }
        if mla.is_some() {
            self.mla_values_backward(be, g.dattn, g.mla, b * s);
        }
        let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
        let x_attn = AttnInputs {
            mask: positions.mask(
                self.args.window_at(run.layer),
                self.args.chunk_at(run.layer).is_some(),
            ),
            ..AttnInputs::causal(&*acts.q, &*acts.k, &*acts.v, shape)
        };
        let saved = AttnSaved {
            out: &*acts.attn_out,
            lse: &*acts.lse,
        };
        if let Some(sinks) = id.sinks {
            // The sinks' gradient from the forward's results; a frozen sink (LoRA: an empty
            // gradient) has none to take.
            if be.len(&grads.bufs[sinks]) > 0 {
                let saved = AttnSaved {
                    out: &*acts.attn_out,
                    lse: &*acts.lse,
                };
                let dsinks = &mut grads.bufs[sinks];
                be.attention_sinks_backward(dsinks, g.dattn, saved, &p[sinks], shape);
            }
        }
        let attn_grads = AttnGrads {
            dq: &mut *g.dq,
            dk: &mut *g.dk,
            dv: &mut *g.dv,
        };
        self.cp
            .attention_backward(be, attn_grads, g.dattn, x_attn, saved)?;
        match &id.attention {
            AttentionIds::Mla(ids) => {
                let heads = MlaGrads {
                    dq: &mut *g.dq,
                    dk: &*g.dk,
                    dv: &*g.dv,
                    full: &mut *g.full,
                    dnormed: &mut *g.dnormed,
                    scratch: &mut *g.mla,
                };
                self.mla_backward(run, acts, ids, heads, grads, positions)?;
            }
            AttentionIds::Gqa(ids) => {
                self.gqa_backward(run, acts, ids, &mut g, grads, positions)?
            }
        }
        let (w, d) = (&p[id.attention_norm], self.args.dim);
        let mut spare = None;
        let g_norm = frozen_or(be, &mut grads.bufs[id.attention_norm], &mut spare, d);
        be.rmsnorm_backward(g.dx, g_norm, g.dnormed, x, w, acts.rstd_attn, d);
        Ok(())
    }

    /// Grouped-query attention's backward from attention's q, k, v gradients to the norm's output
    /// gradient (`g.dnormed`): the forward's steps in reverse (temperature tuning's, then RoPE's and
    /// QK-norm's in the block's order), then the column-parallel q/k/v projections'.
    fn gqa_backward(
        &self,
        run: &BackwardRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        ids: &GqaIds,
        g: &mut AttentionGrads<'_, B>,
        grads: &mut ParamSet<B>,
        positions: Positions<'_, B>,
    ) -> Result<()> {
        let (be, p, m) = (run.be, run.p, &self.local);
        let (b, s, hd, layer) = (run.batch, run.seq, m.head_dim, run.layer);
        let (cos, sin) = (positions.cos, positions.sin);
        let rope_back = |dx: &mut B::Buf, heads: usize| {
            be.rope_backward(dx, cos, sin, positions.rope(b, s, heads, hd));
        };
        if let Some(t) = self.query_temperatures(layer, b, s, 0) {
            be.scale_rows(g.dq, &t, m.q_dim());
        }
        let (rotates, norm) = (self.args.rope_at(layer), self.args.qk_norm_at(layer));
        if rotates && norm != Some(QkNorm::Weightless) {
            rope_back(g.dq, m.heads);
            rope_back(g.dk, m.kv_heads);
        }
        if let Some(norm) = norm {
            let (q_weight, k_weight) = self.qk_norm_weights(ids, p, norm);
            let (mut spare_q, mut spare_k) = (None, None);
            // A weightless norm's weight gradient is computed and dropped.
            let (gq, gk) = match (norm, ids.q_norm.zip(ids.k_norm)) {
                (QkNorm::Weighted, Some((qn, kn))) => {
                    let [gq, gk] = grads
                        .bufs
                        .get_disjoint_mut([qn, kn])
                        .expect("a block's parameters are distinct");
                    let gq = frozen_or(be, gq, &mut spare_q, hd);
                    (gq, frozen_or(be, gk, &mut spare_k, hd))
                }
                _ => (spare_q.insert(be.zeros(hd)), spare_k.insert(be.zeros(hd))),
            };
            be.fill(g.dq_raw, 0.0);
            be.fill(g.dk_raw, 0.0);
            let (q_raw, k_raw) = (&*acts.q_raw, &*acts.k_raw);
            be.rmsnorm_backward(g.dq_raw, gq, g.dq, q_raw, q_weight, acts.rstd_q, hd);
            be.rmsnorm_backward(g.dk_raw, gk, g.dk, k_raw, k_weight, acts.rstd_k, hd);
            if norm == QkNorm::Weightless && rotates {
                rope_back(g.dq_raw, m.heads);
                rope_back(g.dk_raw, m.kv_heads);
            }
        }
        let (dq, dk) = match norm {
            Some(_) => (&*g.dq_raw, &*g.dk_raw),
            None => (&*g.dq, &*g.dk),
        };
        let mut qkv = run.projection_grads(
            grads,
            [
                (BlockProjection::Wq, dq),
                (BlockProjection::Wk, dk),
                (BlockProjection::Wv, &*g.dv),
            ],
        );
        run.sp.column_backward(
            be,
            &mut qkv,
            self.gathered(acts.normed_attn, acts.normed_attn_full),
            g.full,
            g.dnormed,
        )
    }
}

/// The feed-forward backward's buffers: the carried gradient, the norm's input gradient, the
/// tensor-parallel partial sums, SwiGLU's gradients.
struct FeedForwardGrads<'w, B: Backend> {
    dx: &'w mut B::Buf,
    dnormed: &'w mut B::Buf,
    full: &'w mut B::Buf,
    dgate: &'w mut B::Buf,
    dup: &'w mut B::Buf,
    dact: &'w mut B::Buf,
}

/// Attention's backward buffers.
struct AttentionGrads<'w, B: Backend> {
    dx: &'w mut B::Buf,
    dnormed: &'w mut B::Buf,
    full: &'w mut B::Buf,
    dq: &'w mut B::Buf,
    dk: &'w mut B::Buf,
    dv: &'w mut B::Buf,
    dq_raw: &'w mut B::Buf,
    dk_raw: &'w mut B::Buf,
    dattn: &'w mut B::Buf,
    mla: &'w mut MlaScratch<B>,
}
