//! The decoder block's forward, written once in one rank's local shapes. The training and
//! validation forward, activation checkpointing's recompute before a block's backward and
//! generation with a KV cache all run this one function (`Decoder::run_block`); they differ only in
//! which ops run (`Pass`: every op, or those whose outputs the block did not keep) and where
//! attention finds its keys and values (`KvSource`: the workspace's sequences, or the cache).
//!
//! Per block: `h = x + Attention(RMSNorm(x))`, `out = h + W2·(silu(W1·n) ∘ W3·n)` with
//! `n = RMSNorm(h)` (or `out = h + MoE(n)`, plus the shared experts as the SwiGLU).

use anyhow::{bail, Result};

use super::mla::scratch::MlaScratch;
use super::positions::Positions;
use super::run::{BlockLinears, BlockRun, Pass};
use super::workspace::BlockActs;
use super::Decoder;
use crate::backend::{AttnInputs, AttnMask, AttnShape, Backend};
use crate::model::activation_checkpoint::{Act, ActivationDtype, BlockSave};
use crate::model::args::QkNorm;
use crate::model::moe::{self, MoeShapes};
use crate::model::parallel_linear::{Projection, SequenceParallel};
use crate::model::params::{AttentionIds, FeedForwardIds, GqaIds, ParamSet};
use crate::model::projection::BlockProjection;
use crate::model::Workspace;

/// Where a block's attention finds its keys and values.
pub(super) enum KvSource<'c, B: Backend> {
    /// The workspace's own sequences (crossing the context-parallel group when they are split).
    Sequences,
    /// Generation: the new positions `pos..` are appended to this block's cache
    /// (`[capacity, kv_dim]` each) and attend to every position before them.
    Cache {
        k: &'c mut B::Buf,
        v: &'c mut B::Buf,
        pos: usize,
        capacity: usize,
    },
}

impl<B: Backend> KvSource<'_, B> {
    /// The position of the first row (RoPE's offset).
    fn first_position(&self) -> usize {
        match self {
            KvSource::Sequences => 0,
            KvSource::Cache { pos, .. } => *pos,
        }
    }
}

impl<B: Backend> Decoder<B> {
    /// The linear layers of this rank's tensor-parallel group over `tokens` rows.
    pub(super) fn sequence_parallel(&self, tokens: usize) -> SequenceParallel<'_, B> {
        SequenceParallel {
            tp: self.tp.as_ref(),
            cp: self.cp.as_ref(),
            tokens,
            deferred: None,
            rows_replicated: false,
        }
    }

    /// Block `l`'s forward from its input to block `l + 1`'s (the residual stream); attending to the
    /// workspace's KV cache and extending it when it holds one (generation).
    pub fn block_forward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let Some(mut cache) = ws.kv_cache.take() else {
            return self.run_block(be, params, ws, l, Pass::Forward, KvSource::Sequences);
        };
        let (pos, capacity) = (cache.len, cache.capacity);
        let kv = KvSource::Cache {
            k: &mut cache.k[l],
            v: &mut cache.v[l],
            pos,
            capacity,
        };
        let done = self.run_block(be, params, ws, l, Pass::Forward, kv);
        ws.kv_cache = Some(cache);
        done
    }

    /// Before block `l`'s backward, what its forward did not keep (activation checkpointing):
    /// the same ops on the same inputs, so the values are the forward's, bit for bit.
    pub(super) fn recompute(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} recompute"));
        let pass = match ws.plan.blocks[l] {
            BlockSave::Everything => None,
            BlockSave::Input => Some(Pass::RecomputeAll),
            BlockSave::ExpensiveOps => Some(Pass::RecomputeMissing),
            BlockSave::Elsewhere => bail!("block {l} runs on another pipeline rank, not this one"),
        };
        ws.unpack_kept(be, l, self.local.ffn_kind(l));
        match pass {
            Some(pass) => self.run_block(be, params, ws, l, pass, KvSource::Sequences),
            None => Ok(()),
        }
    }

    /// The block, written once: attention then the feed-forward, each op run when `pass` asks
    /// for its output.
    pub(super) fn run_block(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        pass: Pass,
        kv: KvSource<'_, B>,
    ) -> Result<()> {
        let _span = (pass != Pass::RecomputeMissing)
            .then(|| crate::trace::span_named("model", || format!("block {l} forward")));
        let (b, s) = (ws.batch, ws.seq);
        let run = BlockRun {
            be,
            p: &params.bufs,
            layer: l,
            id: &self.ids.layers[l],
            linears: BlockLinears::of(&self.local, &self.float8, l)
                .with_lora(self.args.lora.as_ref()),
            sp: self.sequence_parallel(b * s),
            batch: b,
            seq: s,
            save: ws.plan.blocks[l],
            pass,
            aux_stats: matches!(kv, KvSource::Sequences),
            rounds_to_bf16: ws.plan.dtype == ActivationDtype::BFloat16,
        };
        let (input, output) = ws.resid.block_io(be, l);
        let scratch = (
            &mut ws.recomputed,
            &mut ws.ffn_recomputed[self.local.ffn_kind(l).index()],
        );
        let plan = &ws.plan;
        let mut acts =
            BlockActs::pick(&mut ws.layers[l], scratch, |a| plan.keeps_as_computed(l, a));
        let positions = self.positions(&ws.rope, &ws.documents, &ws.chunks);
        let scratch = (&mut ws.full, &mut ws.mla);
        self.attention_half(&run, &mut acts, input, scratch, positions, kv)?;
        self.feed_forward_half(&run, &mut acts, output, &mut ws.full)?;
        if run.writes_output() {
            if let FeedForwardIds::Moe(_) = &run.id.ffn {
                let moe_acts = self.experts_forward(&run, acts.normed_ffn, output, l)?;
                // A block that keeps only its input recomputes its experts before its backward.
                let keep = pass == Pass::RecomputeAll || run.save != BlockSave::Input;
                ws.moe[l] = keep.then_some(moe_acts);
            }
        }
        // A recompute's output equals the stored one: only the forward stores it.
        if pass == Pass::Forward {
            ws.pack_kept(be, l, self.local.ffn_kind(l));
            ws.resid.commit(be, l + 1);
        }
        Ok(())
    }

    /// `h = x + wo · Attention(q, k, v)` from `n = RMSNorm(x)`: grouped-query attention's
    /// `RoPE(wq·n), RoPE(wk·n), wv·n` (with QK-norm, q and k normed per head; `gqa_forward`), or
    /// multi-head latent attention's heads (`mla.rs`).
    fn attention_half(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        x: &B::Buf,
        (full, mla): (&mut B::Buf, &mut MlaScratch<B>),
        positions: Positions<'_, B>,
        kv: KvSource<'_, B>,
    ) -> Result<()> {
        let (a, be, p, id) = (&self.args, run.be, run.p, run.id);
        if run.redo(Act::NormedAttn) || run.redo(Act::RstdAttn) {
            let w = &p[id.attention_norm];
            be.rmsnorm_forward(acts.normed_attn, acts.rstd_attn, x, w, a.dim, a.norm_eps);
            run.round(acts, &[Act::NormedAttn]);
        }
        let at = kv.first_position();
        match &id.attention {
            AttentionIds::Gqa(ids) => self.gqa_forward(run, acts, ids, positions, at)?,
            AttentionIds::Mla(ids) => self.mla_forward(run, acts, ids, mla, positions, at)?,
        }
        if run.redo(Act::AttnOut) || run.redo(Act::Lse) {
            let l = run.layer;
            let mask = positions.mask(self.args.window_at(l), self.args.chunk_at(l).is_some());
            self.attend(run, acts, kv, mask)?;
            run.round(acts, &[Act::AttnOut]);
        }
        let mla_values = matches!(id.attention, AttentionIds::Mla(_));
        if mla_values && run.redo(Act::AttnValues) {
            self.mla_values(be, acts, run.batch * run.seq);
            run.round(acts, &[Act::AttnValues]);
        }
        if run.redo(Act::H) {
            let values = if mla_values {
                &*acts.attn_values
            } else {
                &*acts.attn_out
            };
            let wo = run.projection(BlockProjection::Wo, acts.h);
            run.sp.row_forward_residual(be, wo, values, x, full)?;
            run.round(acts, &[Act::H]);
        }
        Ok(())
    }

    /// Grouped-query attention's `q = RoPE(wq·n)`, `k = RoPE(wk·n)`, `v = wv·n`, positions from
    /// `at`: with Qwen3's QK-norm q and k normed per head before RoPE, with Llama 4's after it
    /// (weightless); a NoPE block rotates nothing and may scale its queries (temperature tuning).
    fn gqa_forward(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        ids: &GqaIds,
        positions: Positions<'_, B>,
        at: usize,
    ) -> Result<()> {
        let (a, m, be, p) = (&self.args, &self.local, run.be, run.p);
        let (hd, eps, layer) = (m.head_dim, a.norm_eps, run.layer);
        let redo = |act| run.redo(act);
        let (redo_q, redo_k) = (redo(Act::Q), redo(Act::K));
        let norm = a.qk_norm_at(layer);
        {
            // With QK-norm the projections go to q_raw and k_raw, normed per head into q and k.
            let (q_proj, k_proj, redo_q_proj, redo_k_proj) = match norm {
                Some(_) => (
                    &mut *acts.q_raw,
                    &mut *acts.k_raw,
                    redo(Act::QRaw),
                    redo(Act::KRaw),
                ),
                None => (&mut *acts.q, &mut *acts.k, redo_q, redo_k),
            };
            let mut qkv = Vec::new();
            if redo_q_proj {
                qkv.push(run.projection(BlockProjection::Wq, q_proj));
            }
            if redo_k_proj {
                qkv.push(run.projection(BlockProjection::Wk, k_proj));
            }
            if redo(Act::V) {
                qkv.push(run.projection(BlockProjection::Wv, &mut *acts.v));
            }
            self.column_layer(
                run,
                acts.normed_attn,
                acts.normed_attn_full,
                &mut qkv,
                Act::NormedAttnFull,
            )?;
        }
        run.round(acts, &[Act::QRaw, Act::KRaw, Act::Q, Act::K, Act::V]);
        let rope = |x: &mut B::Buf, heads: usize| {
            let shape = positions.rope(run.batch, run.seq, heads, hd).at(at);
            be.rope_forward(x, positions.cos, positions.sin, shape);
        };
        let rotates = a.rope_at(layer);
        // Llama 4's L2 norm reads the rotated rows: RoPE them where they were just projected.
        if norm == Some(QkNorm::Weightless) {
            if redo(Act::QRaw) {
                rope(acts.q_raw, m.heads);
            }
            if redo(Act::KRaw) {
                rope(acts.k_raw, m.kv_heads);
            }
            run.round(acts, &[Act::QRaw, Act::KRaw]);
        }
        if let Some(norm) = norm {
            let (q_weight, k_weight) = self.qk_norm_weights(ids, p, norm);
            if redo_q || redo(Act::RstdQ) {
                be.rmsnorm_forward(acts.q, acts.rstd_q, acts.q_raw, q_weight, hd, eps);
            }
            if redo_k || redo(Act::RstdK) {
                be.rmsnorm_forward(acts.k, acts.rstd_k, acts.k_raw, k_weight, hd, eps);
            }
        }
        if rotates && norm != Some(QkNorm::Weightless) {
            if redo_q {
                rope(acts.q, m.heads);
            }
            if redo_k {
                rope(acts.k, m.kv_heads);
            }
        }
        if redo_q {
            if let Some(t) = self.query_temperatures(layer, run.batch, run.seq, at) {
                be.scale_rows(acts.q, &t, m.q_dim());
            }
        }
        run.round(acts, &[Act::Q, Act::K]);
        Ok(())
    }

    /// The weights of QK-norm `norm` over the query and the key heads: the block's (Qwen3's),
    /// or ones (Llama 4's weightless norm).
    pub(super) fn qk_norm_weights<'p>(
        &'p self,
        ids: &GqaIds,
        p: &'p [B::Buf],
        norm: QkNorm,
    ) -> (&'p B::Buf, &'p B::Buf) {
        match (norm, ids.q_norm.zip(ids.k_norm), &self.unit_weight) {
            (QkNorm::Weighted, Some((qn, kn)), _) => (&p[qn], &p[kn]),
            (QkNorm::Weightless, _, Some(ones)) => (ones, ones),
            _ => unreachable!("a weighted QK-norm has weights; a weightless one the unit ones"),
        }
    }

    /// The factor of each query row (`[batch, seq]`) of block `layer`'s temperature tuning, from
    /// the rows' positions in their sequences (a context-parallel shard's, a KV cache's from
    /// `at`); None where the block has none or every factor is 1 (every position below the
    /// floor scale), so such a block computes exactly as one without.
    pub(super) fn query_temperatures(
        &self,
        layer: usize,
        batch: usize,
        seq: usize,
        at: usize,
    ) -> Option<Vec<f32>> {
        let t = self.args.temperature_at(layer)?;
        let indices = match self.local.cp {
            1 => (0..seq).collect(),
            cp => self.sequence_shard().positions(seq * cp),
        };
        let row: Vec<f32> = indices.iter().map(|&i| t.factor(at + i)).collect();
        row.iter().any(|&f| f != 1.0).then(|| row.repeat(batch))
    }

    /// Causal attention of the block's queries over its keys and values: the workspace's
    /// sequences (through the context-parallel group), or the cache with the new rows appended;
    /// then the block's attention sinks, when it has them, folded into the finished softmax.
    fn attend(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        kv: KvSource<'_, B>,
        mask: AttnMask<'_>,
    ) -> Result<()> {
        self.attend_keys(run, acts, kv, mask)?;
        if let Some(sinks) = run.id.sinks {
            let m = &self.local;
            let shape = AttnShape::causal(run.batch, run.seq, m.heads, m.kv_heads, m.head_dim);
            run.be
                .attention_sinks_forward(acts.attn_out, acts.lse, &run.p[sinks], shape);
        }
        Ok(())
    }

    /// `attend`'s attention over the keys.
    fn attend_keys(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        kv: KvSource<'_, B>,
        mask: AttnMask<'_>,
    ) -> Result<()> {
        let (m, be) = (&self.local, run.be);
        let (b, s) = (run.batch, run.seq);
        match kv {
            KvSource::Sequences => {
                let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, m.head_dim);
                let x = AttnInputs {
                    mask,
                    ..AttnInputs::causal(&*acts.q, &*acts.k, &*acts.v, shape)
                };
                self.cp.attention_forward(be, acts.attn_out, acts.lse, x)
            }
            KvSource::Cache {
                k,
                v,
                pos,
                capacity,
            } => {
                let kvd = m.kv_dim();
                be.copy_into_at(k, pos * kvd, acts.k);
                be.copy_into_at(v, pos * kvd, acts.v);
                let shape = AttnShape {
                    batch: b,
                    q_len: s,
                    kv_len: pos + s,
                    kv_capacity: capacity,
                    n_heads: m.heads,
                    n_kv_heads: m.kv_heads,
                    head_dim: m.head_dim,
                    q_offset: pos,
                };
                // Generation: the prompt and what follows are one document, within the
                // block's window, and in a chunked block within each position's chunk.
                let in_chunk: Option<Vec<u32>> = self.args.chunk_at(run.layer).map(|c| {
                    let rows: Vec<u32> = (pos..pos + s).map(|p| (p % c) as u32).collect();
                    rows.repeat(b)
                });
                let x = AttnInputs {
                    mask: AttnMask {
                        positions: in_chunk.as_deref(),
                        window: mask.window,
                    },
                    ..AttnInputs::causal(acts.q, k, v, shape)
                };
                be.attention_forward(acts.attn_out, acts.lse, x);
                Ok(())
            }
        }
    }

    /// The column-parallel projections of `projections` from the normed rows `local` (gathered
    /// over the tensor-parallel group into `full`); with none to run, the gather alone when the
    /// run needs `full` (`full_act`) again.
    pub(super) fn column_layer(
        &self,
        run: &BlockRun<'_, B>,
        local: &B::Buf,
        full: &mut B::Buf,
        projections: &mut [Projection<'_, B>],
        full_act: Act,
    ) -> Result<()> {
        if !projections.is_empty() {
            run.sp
                .column_forward(run.be, local, full, self.args.dim, projections)
        } else if self.local.tp > 1 && run.redo(full_act) {
            self.tp.gather_rows(run.be, local, full)
        } else {
            Ok(())
        }
    }

    /// The feed-forward's norm and SwiGLU (the dense feed-forward, or a mixture of experts' shared
    /// experts), column- then row-parallel under TP: `out = h + w2 · (silu(w1·n) ∘ w3·n)`,
    /// `n = RMSNorm(h)`; without a SwiGLU `out = h` (the routed experts add theirs after).
    fn feed_forward_half(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        out: &mut B::Buf,
        full: &mut B::Buf,
    ) -> Result<()> {
        let (a, be, p, id) = (&self.args, run.be, run.p, run.id);
        let redo = |act| run.redo(act);
        if redo(Act::NormedFfn) || redo(Act::RstdFfn) {
            let w = &p[id.ffn_norm];
            be.rmsnorm_forward(acts.normed_ffn, acts.rstd_ffn, acts.h, w, a.dim, a.norm_eps);
            run.round(acts, &[Act::NormedFfn]);
        }
        if id.ffn.swiglu().is_none() {
            if run.writes_output() {
                be.copy_from(out, acts.h);
            }
            return Ok(());
        };
        let mut gate_up = Vec::new();
        if redo(Act::Gate) {
            gate_up.push(run.projection(BlockProjection::W1, &mut *acts.gate));
        }
        if redo(Act::Up) {
            gate_up.push(run.projection(BlockProjection::W3, &mut *acts.up));
        }
        self.column_layer(
            run,
            acts.normed_ffn,
            acts.normed_ffn_full,
            &mut gate_up,
            Act::NormedFfnFull,
        )?;
        run.round(acts, &[Act::Gate, Act::Up]);
        if redo(Act::Act) {
            be.swiglu_forward(acts.act, acts.gate, acts.up);
            run.round(acts, &[Act::Act]);
        }
        if run.writes_output() {
            let w2 = run.projection(BlockProjection::W2, out);
            run.sp
                .row_forward_residual(be, w2, acts.act, acts.h, full)?;
        }
        Ok(())
    }

    /// The routed experts: `out += Σ_j w_j · Expert_j(n)` on this rank's rows, returning their
    /// activations for the backward.
    fn experts_forward(
        &self,
        run: &BlockRun<'_, B>,
        normed: &B::Buf,
        out: &mut B::Buf,
        l: usize,
    ) -> Result<moe::MoeActs<B>> {
        let FeedForwardIds::Moe(experts) = &run.id.ffn else {
            bail!("block {l} has no mixture of experts (a titan bug)");
        };
        let be = run.be;
        let shapes = MoeShapes {
            bf16_activations: run.rounds_to_bf16,
            ..self.moe_shapes(l)?
        };
        let bias = self.block_expert_bias(l);
        let sum = |v: &mut B::Buf| self.sum_over_sequence_ranks(be, v);
        let rows = match run.aux_stats {
            true => self.sequence_rows(run.batch, run.seq, &sum),
            false => None,
        };
        moe::forward(
            be,
            &shapes,
            experts,
            run.p,
            normed,
            out,
            bias,
            self.ep.as_ref(),
            rows,
        )
    }

    /// Block `layer`'s mixture-of-experts shapes (a MoE model's): its routed experts, computing
    /// in float8 where `quantize.grouped_mm.float8` converted them (the block computes the shared
    /// experts as its SwiGLU, `FeedForwardIds::swiglu`).
    pub(super) fn moe_shapes(&self, layer: usize) -> Result<MoeShapes> {
        match &self.args.moe {
            Some(moe) => Ok(MoeShapes {
                experts_float8: self.float8.experts(layer),
                ..MoeShapes::new(self.args.dim, moe)
            }),
            None => {
                bail!("a mixture-of-experts block in a model without MoE arguments (a titan bug)")
            }
        }
    }
}
