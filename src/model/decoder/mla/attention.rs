//! Multi-head latent attention's part of the block (DeepSeek-V3; shapes and the padding of heads
//! in `mla/mod.rs`): from the attention norm's output to the queries, keys and values the
//! attention kernels read, and back. The rest of the block (the norm, attention itself, `wo`, the
//! residual) is the block's own, shared with grouped-query attention.
//!
//! Forward, per token, in this rank's heads:
//! `q = Wq·n` or `Wq_b·RMSNorm(Wq_a·n)`; `[c | k_rope] = Wkv_a·n`; `[k_nope | v] = Wkv_b·RMSNorm(c)`;
//! each head's query `[q_nope | RoPE(q_rope)]·query_scale`, key `[k_nope | RoPE(k_rope)]`, value
//! `v`, each padded with zeros to the kernels' head width.
//!
//! Under tensor parallelism the heads split (`Wq`/`Wq_b` and `Wkv_b` column-parallel, `Wo`
//! row-parallel) and the latents are computed whole on every rank from the gathered rows
//! (replicated `Wq_a`, `Wkv_a` and norms). The latents' gradients are then partial sums (each rank
//! holds its heads' share); everything after them is linear in them, so the column-parallel
//! reduce-scatter of the norm's input gradient and the replicated weights' gradient sum
//! (`parallel::layout`) add the shares up, with no collective of MLA's own.

use anyhow::Result;

use super::scratch::MlaScratch;
use super::MlaArgs;
use crate::backend::Backend;
use crate::model::activation_checkpoint::Act;
use crate::model::decoder::positions::Positions;
use crate::model::decoder::run::{frozen_or, BackwardRun, BlockRun};
use crate::model::decoder::workspace::BlockActs;
use crate::model::decoder::Decoder;
use crate::model::params::{MlaIds, MlaQueryIds, ParamSet};
use crate::model::projection::BlockProjection;

/// Where one head's columns of width `cols` start, in rows of `stride` (`copy_rows`' operands).
#[derive(Clone, Copy)]
struct Columns {
    offset: usize,
    stride: usize,
}

/// `rows` runs of `cols` values from `src` (at `from`) to `dst` (at `to`).
fn copy_columns<B: Backend>(
    be: &B,
    (dst, to): (&mut B::Buf, Columns),
    (src, from): (&B::Buf, Columns),
    rows: usize,
    cols: usize,
) {
    be.copy_rows(
        dst,
        to.offset,
        to.stride,
        src,
        from.offset,
        from.stride,
        rows,
        cols,
    );
}

fn at(offset: usize, stride: usize) -> Columns {
    Columns { offset, stride }
}

impl<B: Backend> Decoder<B> {
    fn mla_args(&self) -> MlaArgs {
        self.local
            .mla
            .expect("an MLA block in a model with MLA arguments")
    }

    /// The block's queries, keys and values (`acts.q`, `acts.k`, `acts.v`, heads padded) from the
    /// attention norm's output, each op run when `run` asks for its output.
    pub(in crate::model::decoder) fn mla_forward(
        &self,
        run: &BlockRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        ids: &MlaIds,
        s: &mut MlaScratch<B>,
        positions: Positions<'_, B>,
        first_position: usize,
    ) -> Result<()> {
        let (a, be, p) = (self.mla_args(), run.be, run.p);
        let eps = self.args.norm_eps;
        let redo = |act| run.redo(act);
        // Intermediate products are computed only where what reads them is.
        let (redo_q, redo_kv) = (redo(Act::Q), redo(Act::K) || redo(Act::V));
        let mut first = Vec::new();
        match ids.query {
            MlaQueryIds::Direct { .. } if redo_q => {
                first.push(run.projection(BlockProjection::Wq, &mut s.q_proj))
            }
            MlaQueryIds::Latent { .. } if redo(Act::QLatent) => {
                first.push(run.projection(BlockProjection::WqA, &mut *acts.q_latent))
            }
            _ => {}
        }
        if redo(Act::KvLatent) {
            first.push(run.projection(BlockProjection::WkvA, &mut *acts.kv_latent));
        }
        self.column_layer(
            run,
            acts.normed_attn,
            acts.normed_attn_full,
            &mut first,
            Act::NormedAttnFull,
        )?;
        run.round(acts, &[Act::QLatent, Act::KvLatent]);
        let rows = run.sp.replicated_rows();
        if let MlaQueryIds::Latent { q_norm, .. } = ids.query {
            let r = a.q_lora_rank.unwrap_or(0);
            if redo(Act::QLatentNormed) || redo(Act::RstdQLatent) {
                let (out, rstd) = (&mut *acts.q_latent_normed, &mut *acts.rstd_q_latent);
                be.rmsnorm_forward(out, rstd, acts.q_latent, &p[q_norm], r, eps);
                run.round(acts, &[Act::QLatentNormed]);
            }
            if redo_q {
                let wq_b = run.projection(BlockProjection::WqB, &mut s.q_proj);
                rows.column_forward(be, acts.q_latent_normed, &mut be.zeros(0), r, &mut [wq_b])?;
            }
        }
        let n = run.batch * run.seq;
        let rkv = a.kv_lora_rank;
        if redo(Act::KvLatentNormed) || redo(Act::RstdKvLatent) {
            copy_columns(
                be,
                (&mut s.kv_c, at(0, rkv)),
                (acts.kv_latent, at(0, a.kv_a_dim())),
                n,
                rkv,
            );
            let (out, rstd) = (&mut *acts.kv_latent_normed, &mut *acts.rstd_kv_latent);
            be.rmsnorm_forward(out, rstd, &s.kv_c, &p[ids.kv_norm], rkv, eps);
            run.round(acts, &[Act::KvLatentNormed]);
        }
        if redo_kv {
            let wkv_b = run.projection(BlockProjection::WkvB, &mut s.kv_up);
            rows.column_forward(
                be,
                acts.kv_latent_normed,
                &mut be.zeros(0),
                rkv,
                &mut [wkv_b],
            )?;
        }
        let rope = |x: &mut B::Buf, heads| {
            let shape = positions.rope(run.batch, run.seq, heads, a.qk_rope_head_dim);
            be.rope_forward(x, positions.cos, positions.sin, shape.at(first_position));
        };
        if redo_q {
            self.assemble_queries(be, acts.q, s, n, &rope);
        }
        if redo(Act::K) {
            self.assemble_keys(be, acts.k, acts.kv_latent, s, n, &rope);
        }
        if redo(Act::V) {
            let (h, padded, up) = (self.local.heads, a.padded_head_dim(), a.kv_b_head_dim());
            if padded > a.v_head_dim {
                be.fill(acts.v, 0.0);
            }
            let (v, kv_up) = (
                (&mut *acts.v, at(0, padded)),
                (&s.kv_up, at(a.qk_nope_head_dim, up)),
            );
            copy_columns(be, v, kv_up, n * h, a.v_head_dim);
        }
        run.round(acts, &[Act::Q, Act::K, Act::V]);
        Ok(())
    }

    /// Each head's query `[q_nope | RoPE(q_rope)] · query_scale`, padded, from `s.q_proj`.
    fn assemble_queries(
        &self,
        be: &B,
        q: &mut B::Buf,
        s: &mut MlaScratch<B>,
        n: usize,
        rope: &impl Fn(&mut B::Buf, usize),
    ) {
        let (a, h) = (self.mla_args(), self.local.heads);
        let (qk, nope, r, padded) = (
            a.qk_head_dim(),
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.padded_head_dim(),
        );
        if padded > qk {
            be.fill(q, 0.0);
        }
        copy_columns(
            be,
            (&mut *q, at(0, padded)),
            (&s.q_proj, at(0, qk)),
            n * h,
            nope,
        );
        copy_columns(
            be,
            (&mut s.q_rope, at(0, r)),
            (&s.q_proj, at(nope, qk)),
            n * h,
            r,
        );
        rope(&mut s.q_rope, h);
        copy_columns(
            be,
            (&mut *q, at(nope, padded)),
            (&s.q_rope, at(0, r)),
            n * h,
            r,
        );
        let scale = a.query_scale(self.args.rope_scaling.as_ref());
        if scale != 1.0 {
            be.scale(q, scale);
        }
    }

    /// Each head's key `[k_nope | RoPE(k_rope)]`, padded: its own unrotated part from
    /// `s.kv_up`, the rotated part shared by every head from the key/value projection.
    fn assemble_keys(
        &self,
        be: &B,
        k: &mut B::Buf,
        kv_latent: &B::Buf,
        s: &mut MlaScratch<B>,
        n: usize,
        rope: &impl Fn(&mut B::Buf, usize),
    ) {
        let (a, h) = (self.mla_args(), self.local.heads);
        let (nope, r, padded) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.padded_head_dim());
        if padded > a.qk_head_dim() {
            be.fill(k, 0.0);
        }
        let up = at(0, a.kv_b_head_dim());
        copy_columns(be, (&mut *k, at(0, padded)), (&s.kv_up, up), n * h, nope);
        let rope_part = at(a.kv_lora_rank, a.kv_a_dim());
        copy_columns(be, (&mut s.k_rope, at(0, r)), (kv_latent, rope_part), n, r);
        rope(&mut s.k_rope, 1);
        for head in 0..h {
            let dst = at(head * padded + nope, h * padded);
            copy_columns(be, (&mut *k, dst), (&s.k_rope, at(0, r)), n, r);
        }
    }

    /// `wo`'s input: each head's value columns of attention's padded output.
    pub(in crate::model::decoder) fn mla_values(
        &self,
        be: &B,
        acts: &mut BlockActs<'_, B>,
        n: usize,
    ) {
        let a = self.mla_args();
        let (src, dst) = (at(0, a.padded_head_dim()), at(0, a.v_head_dim));
        copy_columns(
            be,
            (&mut *acts.attn_values, dst),
            (&*acts.attn_out, src),
            n * self.local.heads,
            a.v_head_dim,
        );
    }
}

/// The gradients MLA's backward starts from (attention's, of the padded heads; `dq` is scaled in
/// place) and where the attention norm's output gradient goes (this rank's rows, through the
/// tensor-parallel partial sums in `full`).
pub(in crate::model::decoder) struct MlaGrads<'g, B: Backend> {
    pub(in crate::model::decoder) dq: &'g mut B::Buf,
    pub(in crate::model::decoder) dk: &'g B::Buf,
    pub(in crate::model::decoder) dv: &'g B::Buf,
    pub(in crate::model::decoder) full: &'g mut B::Buf,
    pub(in crate::model::decoder) dnormed: &'g mut B::Buf,
    pub(in crate::model::decoder) scratch: &'g mut MlaScratch<B>,
}

impl<B: Backend> Decoder<B> {
    /// `wo`'s input gradient (`s.dvalues`) into each head's value columns of attention's padded
    /// output gradient `dattn` (zeros elsewhere).
    pub(in crate::model::decoder) fn mla_values_backward(
        &self,
        be: &B,
        dattn: &mut B::Buf,
        s: &MlaScratch<B>,
        n: usize,
    ) {
        let a = self.mla_args();
        be.fill(dattn, 0.0);
        let (dst, src) = (at(0, a.padded_head_dim()), at(0, a.v_head_dim));
        copy_columns(
            be,
            (dattn, dst),
            (&s.dvalues, src),
            n * self.local.heads,
            a.v_head_dim,
        );
    }

    /// `wo`'s input gradient buffer (MLA's own: narrower than attention's output).
    pub(in crate::model::decoder) fn mla_values_grad<'s>(
        &self,
        s: &'s mut MlaScratch<B>,
    ) -> &'s mut B::Buf {
        &mut s.dvalues
    }

    /// The mirror of `mla_forward`: from the padded heads' gradients to the attention norm's
    /// output gradient and every MLA weight's.
    pub(in crate::model::decoder) fn mla_backward(
        &self,
        run: &BackwardRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        ids: &MlaIds,
        g: MlaGrads<'_, B>,
        grads: &mut ParamSet<B>,
        positions: Positions<'_, B>,
    ) -> Result<()> {
        let s = g.scratch;
        let (a, be, h) = (self.mla_args(), run.be, self.local.heads);
        let n = run.batch * run.seq;
        let (nope, r, padded, up) = (
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.padded_head_dim(),
            a.kv_b_head_dim(),
        );
        let rope_back = |x: &mut B::Buf, heads| {
            let shape = positions.rope(run.batch, run.seq, heads, r);
            be.rope_backward(x, positions.cos, positions.sin, shape);
        };
        // Queries: unscale, unpad, turn the rotated part back.
        let scale = a.query_scale(self.args.rope_scaling.as_ref());
        if scale != 1.0 {
            be.scale(g.dq, scale);
        }
        let qk = a.qk_head_dim();
        copy_columns(
            be,
            (&mut s.q_proj, at(0, qk)),
            (&*g.dq, at(0, padded)),
            n * h,
            nope,
        );
        copy_columns(
            be,
            (&mut s.q_rope, at(0, r)),
            (&*g.dq, at(nope, padded)),
            n * h,
            r,
        );
        rope_back(&mut s.q_rope, h);
        copy_columns(
            be,
            (&mut s.q_proj, at(nope, qk)),
            (&s.q_rope, at(0, r)),
            n * h,
            r,
        );
        // Keys and values: each head's own parts, and the shared rotated key's summed over heads.
        copy_columns(
            be,
            (&mut s.kv_up, at(0, up)),
            (g.dk, at(0, padded)),
            n * h,
            nope,
        );
        copy_columns(
            be,
            (&mut s.kv_up, at(nope, up)),
            (g.dv, at(0, padded)),
            n * h,
            a.v_head_dim,
        );
        be.fill(&mut s.k_rope, 0.0);
        for head in 0..h {
            let from = head * padded + nope;
            be.add_rows(&mut s.k_rope, 0, r, g.dk, from, h * padded, n, r);
        }
        rope_back(&mut s.k_rope, 1);
        let (rkv, kv_a) = (a.kv_lora_rank, a.kv_a_dim());
        copy_columns(
            be,
            (&mut s.dkv_latent, at(rkv, kv_a)),
            (&s.k_rope, at(0, r)),
            n,
            r,
        );
        self.mla_latent_backward(run, acts, ids, s, grads)?;
        let (wq, dq) = match ids.query {
            MlaQueryIds::Direct { .. } => (BlockProjection::Wq, &s.q_proj),
            MlaQueryIds::Latent { .. } => (BlockProjection::WqA, &s.dq_latent),
        };
        let mut first =
            run.projection_grads(grads, [(wq, dq), (BlockProjection::WkvA, &s.dkv_latent)]);
        let x = self.gathered(acts.normed_attn, acts.normed_attn_full);
        run.sp.column_backward(be, &mut first, x, g.full, g.dnormed)
    }

    /// The latents' backward: `Wkv_b`'s and the key/value latent norm's into `s.dkv_latent`'s
    /// latent columns, and (with a query latent) `Wq_b`'s and its norm's into `s.dq_latent`.
    fn mla_latent_backward(
        &self,
        run: &BackwardRun<'_, B>,
        acts: &mut BlockActs<'_, B>,
        ids: &MlaIds,
        s: &mut MlaScratch<B>,
        grads: &mut ParamSet<B>,
    ) -> Result<()> {
        let (a, be, p) = (self.mla_args(), run.be, run.p);
        let n = run.batch * run.seq;
        let rows = run.sp.replicated_rows();
        let none = &mut be.zeros(0);
        let (rkv, kv_a) = (a.kv_lora_rank, a.kv_a_dim());
        {
            let mut grad = run.projection_grads(grads, [(BlockProjection::WkvB, &s.kv_up)]);
            rows.column_backward(
                be,
                &mut grad,
                acts.kv_latent_normed,
                none,
                &mut s.dkv_normed,
            )?;
            copy_columns(
                be,
                (&mut s.kv_c, at(0, rkv)),
                (&*acts.kv_latent, at(0, kv_a)),
                n,
                rkv,
            );
            be.fill(&mut s.dkv_c, 0.0);
            let (w, rstd) = (&p[ids.kv_norm], &*acts.rstd_kv_latent);
            let mut spare = None;
            let dw_norm = frozen_or(be, &mut grads.bufs[ids.kv_norm], &mut spare, rkv);
            be.rmsnorm_backward(&mut s.dkv_c, dw_norm, &s.dkv_normed, &s.kv_c, w, rstd, rkv);
            copy_columns(
                be,
                (&mut s.dkv_latent, at(0, kv_a)),
                (&s.dkv_c, at(0, rkv)),
                n,
                rkv,
            );
        }
        if let MlaQueryIds::Latent { q_norm, .. } = ids.query {
            let r = a.q_lora_rank.unwrap_or(0);
            let mut grad = run.projection_grads(grads, [(BlockProjection::WqB, &s.q_proj)]);
            rows.column_backward(
                be,
                &mut grad,
                acts.q_latent_normed,
                none,
                &mut s.dq_latent_normed,
            )?;
            be.fill(&mut s.dq_latent, 0.0);
            let (w, rstd) = (&p[q_norm], &*acts.rstd_q_latent);
            let mut spare = None;
            let dw_norm = frozen_or(be, &mut grads.bufs[q_norm], &mut spare, r);
            be.rmsnorm_backward(
                &mut s.dq_latent,
                dw_norm,
                &s.dq_latent_normed,
                acts.q_latent,
                w,
                rstd,
                r,
            );
        }
        Ok(())
    }
}
