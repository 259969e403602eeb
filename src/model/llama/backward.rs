//! The decoder block's backward, in one rank's local shapes: the chain from ∂L/∂(block output)
//! to ∂L/∂(block input) with every weight gradient, whole or split into its input-gradient and
//! weight-gradient halves (zero-bubble pipeline schedules).

use anyhow::Result;

use super::block::BlockLinears;
use super::workspace::BlockActs;
use super::Llama;
use crate::backend::{AttnShape, Backend};
use crate::model::moe;
use crate::model::parallel_linear::{DeferredWeightGrad, ProjectionGrad, SequenceParallel};
use crate::model::params::{FeedForwardIds, ParamSet};
use crate::model::Workspace;

impl<B: Backend> Llama<B> {
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
        deferred: &std::cell::RefCell<Vec<DeferredWeightGrad<B>>>,
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
            g.apply(be, &mut grads.bufs[g.param]);
        }
    }

    fn block_backward_deferring(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        deferred: Option<&std::cell::RefCell<Vec<DeferredWeightGrad<B>>>>,
    ) -> Result<()> {
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let sp = SequenceParallel {
            deferred,
            ..self.sequence_parallel(b * s)
        };
        let BlockLinears {
            wq,
            wk,
            wv,
            wo,
            w1,
            w2,
            w3,
        } = BlockLinears::of(m);
        self.recompute(be, params, ws, l)?;
        let save = ws.plan.blocks[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        // QK-norm's weight gradients, out of the set while the block's others are borrowed.
        let mut qk_norm_grads = match (id.q_norm, id.k_norm) {
            (Some(qn), Some(kn)) => Some((
                (qn, std::mem::replace(&mut grads.bufs[qn], be.zeros(0))),
                (kn, std::mem::replace(&mut grads.bufs[kn], be.zeros(0))),
            )),
            _ => None,
        };
        // Feed-forward: ∂L/∂n into ws.dnormed, the SwiGLU's (dense, or the shared experts')
        // first, then the routed experts' added.
        match id.ffn.swiglu() {
            Some([i1, i2, i3]) => {
                let [g_w1, g_w2, g_w3] = grads
                    .bufs
                    .get_disjoint_mut([i1, i2, i3])
                    .expect("a block's parameters are distinct");
                sp.row_backward(
                    be,
                    w2,
                    &ws.dx,
                    &mut ws.full,
                    &p[i2],
                    (g_w2, i2),
                    acts.act,
                    &mut ws.dact,
                )?;
                be.swiglu_backward(&mut ws.dgate, &mut ws.dup, &ws.dact, acts.gate, acts.up);
                sp.column_backward(
                    be,
                    &mut [
                        ProjectionGrad::new(w1, &ws.dgate, &p[i1], g_w1, i1),
                        ProjectionGrad::new(w3, &ws.dup, &p[i3], g_w3, i3),
                    ],
                    self.gathered(acts.normed_ffn, acts.normed_ffn_full),
                    &mut ws.full,
                    &mut ws.dnormed,
                )?;
            }
            None => be.fill(&mut ws.dnormed, 0.0),
        }
        match &id.ffn {
            FeedForwardIds::Dense { .. } => {}
            FeedForwardIds::Moe(experts) => {
                let moe_acts = ws.moe[l].take().ok_or_else(|| {
                    anyhow::anyhow!("block {l}: no mixture-of-experts activations (a titan bug)")
                })?;
                {
                    let mut load = self.expert_load.lock().unwrap_or_else(|e| e.into_inner());
                    for &e in &moe_acts.routing.experts {
                        load[l][e as usize] += 1;
                    }
                }
                let aux_scale = match (&moe_acts.aux, self.args.moe.and_then(|m| m.aux_loss_coef)) {
                    (Some(stats), Some(coef)) => {
                        let share = (self.local.tp * self.local.cp) as f64;
                        let value: f64 = stats.values.iter().map(|&v| v as f64).sum();
                        *self.aux_loss.lock().unwrap_or_else(|e| e.into_inner()) +=
                            coef as f64 * value / self.sequences_per_step as f64 / share;
                        coef / self.sequences_per_step as f32
                    }
                    _ => 0.0,
                };
                let shapes = self.moe_shapes()?;
                moe::backward(
                    be,
                    &shapes,
                    experts,
                    p,
                    &mut grads.bufs,
                    &moe_acts,
                    acts.normed_ffn,
                    &ws.dx,
                    &mut ws.dnormed,
                    self.ep.as_ref(),
                    aux_scale,
                )?;
            }
        }
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut grads.bufs[id.ffn_norm],
            &ws.dnormed,
            acts.h,
            &p[id.ffn_norm],
            acts.rstd_ffn,
            d,
        );
        let [g_wq, g_wk, g_wv, g_wo, g_attn_norm] = grads
            .bufs
            .get_disjoint_mut([id.wq, id.wk, id.wv, id.wo, id.attention_norm])
            .expect("a block's parameters are distinct");
        // Attention.
        sp.row_backward(
            be,
            wo,
            &ws.dx,
            &mut ws.full,
            &p[id.wo],
            (g_wo, id.wo),
            acts.attn_out,
            &mut ws.dattn,
        )?;
        let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
        self.cp.attention_backward(
            be,
            &mut ws.dq,
            &mut ws.dk,
            &mut ws.dv,
            &ws.dattn,
            acts.q,
            acts.k,
            acts.v,
            acts.attn_out,
            acts.lse,
            shape,
        )?;
        let (cos, sin) = self.rope_tables(&ws.rope);
        be.rope_backward(&mut ws.dq, cos, sin, b, s, m.heads, hd);
        be.rope_backward(&mut ws.dk, cos, sin, b, s, m.kv_heads, hd);
        if let Some(((qn, gq), (kn, gk))) = qk_norm_grads.as_mut() {
            be.fill(&mut ws.dq_raw, 0.0);
            be.fill(&mut ws.dk_raw, 0.0);
            let (q_raw, k_raw) = (&*acts.q_raw, &*acts.k_raw);
            be.rmsnorm_backward(&mut ws.dq_raw, gq, &ws.dq, q_raw, &p[*qn], acts.rstd_q, hd);
            be.rmsnorm_backward(&mut ws.dk_raw, gk, &ws.dk, k_raw, &p[*kn], acts.rstd_k, hd);
        }
        let (dq, dk) = match m.qk_norm {
            true => (&ws.dq_raw, &ws.dk_raw),
            false => (&ws.dq, &ws.dk),
        };
        sp.column_backward(
            be,
            &mut [
                ProjectionGrad::new(wq, dq, &p[id.wq], g_wq, id.wq),
                ProjectionGrad::new(wk, dk, &p[id.wk], g_wk, id.wk),
                ProjectionGrad::new(wv, &ws.dv, &p[id.wv], g_wv, id.wv),
            ],
            self.gathered(acts.normed_attn, acts.normed_attn_full),
            &mut ws.full,
            &mut ws.dnormed,
        )?;
        be.rmsnorm_backward(
            &mut ws.dx,
            g_attn_norm,
            &ws.dnormed,
            &ws.resid[l],
            &p[id.attention_norm],
            acts.rstd_attn,
            d,
        );
        if let Some(((qn, gq), (kn, gk))) = qk_norm_grads {
            grads.bufs[qn] = gq;
            grads.bufs[kn] = gk;
        }
        Ok(())
    }
}
