//! Every activation and gradient buffer of one rank's training step (`Workspace`), allocated
//! once per (batch, seq) shape from the sizes the memory estimate counts (`workspace_floats`):
//! each block's activations (`LayerActs`), kept per block or in one shared set that the blocks
//! which keep less recompute into (activation checkpointing); a pipeline rank's workspaces share
//! one set of the transient buffers (`Workspace::trade_transient`).

use super::generate::KvCache;
use super::mla::scratch::MlaScratch;
use super::residual::ResidualStream;
use super::workspace_floats::{
    act_storage, kept_storage, needs_scratch_of, sized_by_ffn, ActStorage,
};
use crate::backend::Backend;
use crate::model::activation_checkpoint::{AcMode, Act, ActivationPlan};
use crate::model::args::ModelArgs;
use crate::model::local_shapes::{FfnKind, LocalShapes};
use crate::model::moe::stats::{ExpertFigures, ExpertStats};
use crate::model::moe::MoeActs;

/// What one block keeps from its forward for its backward.
pub struct LayerActs<B: Backend> {
    /// The attention norm's output on this rank's rows, and (tensor parallel) gathered over the
    /// group: the input of the column-parallel projections.
    pub normed_attn: B::Buf,
    pub normed_attn_full: B::Buf,
    pub rstd_attn: B::Buf,
    pub q: B::Buf,
    pub k: B::Buf,
    pub v: B::Buf,
    /// QK-norm's inputs and statistics (Qwen3; empty without QK-norm).
    pub q_raw: B::Buf,
    pub k_raw: B::Buf,
    pub rstd_q: B::Buf,
    pub rstd_k: B::Buf,
    /// Multi-head latent attention's latents (`Act::QLatent` …; empty without).
    pub q_latent: B::Buf,
    pub q_latent_normed: B::Buf,
    pub rstd_q_latent: B::Buf,
    pub kv_latent: B::Buf,
    pub kv_latent_normed: B::Buf,
    pub rstd_kv_latent: B::Buf,
    pub attn_out: B::Buf,
    pub lse: B::Buf,
    pub attn_values: B::Buf,
    pub h: B::Buf,
    pub normed_ffn: B::Buf,
    pub normed_ffn_full: B::Buf,
    pub rstd_ffn: B::Buf,
    pub gate: B::Buf,
    pub up: B::Buf,
    pub act: B::Buf,
}

/// Every activation and gradient buffer of one training step, allocated once per shape.
pub struct Workspace<B: Backend> {
    pub batch: usize,
    /// Positions of each sequence this rank holds (with context parallelism, its shard).
    pub seq: usize,
    /// The RoPE tables of the rows when they are not the model's, made by `Decoder::load_tokens`:
    /// with context parallelism, the shard's rows (their global positions, made the first time);
    /// for sequences of several documents, a row per token (`documents`).
    pub(super) rope: Option<(B::Buf, B::Buf)>,
    /// Each input token's position in its document (`[batch, seq]`) when block-causal attention
    /// is on and some sequence holds more than one document (`positions.rs`).
    pub(super) documents: Option<Vec<u32>>,
    /// Each input token's place in its chunk of chunked attention, its document's start counted
    /// as a chunk's (`[batch, seq]`; Llama 4's `attention_chunk_size`; None without).
    pub(super) chunks: Option<Vec<u32>>,
    /// Input of block `l` at entry `l`; the last entry is the final block's output. A pipeline
    /// rank's entries of other ranks' blocks are empty (`ActivationPlan::holds_block_input`).
    pub(super) resid: ResidualStream<B>,
    /// Each block's own activations (empty buffers for what it does not keep) and the shared set
    /// the blocks that keep less write and recompute theirs in; what each block keeps.
    pub(super) layers: Vec<LayerActs<B>>,
    pub(super) recomputed: LayerActs<B>,
    /// The shared set of the feed-forward activations whose size or storage depends on the
    /// block's kind (`sized_by_ffn`), one per `FfnKind`.
    pub(super) ffn_recomputed: [LayerActs<B>; 2],
    pub(super) plan: ActivationPlan,
    pub(super) normed_final: B::Buf,
    pub(super) normed_final_full: B::Buf,
    pub(super) rstd_final: B::Buf,
    // backward scratch
    pub(super) dx: B::Buf,
    pub(super) dnormed: B::Buf,
    /// Tensor parallel only: `[tokens, dim]` for a row-parallel projection's partial sums, a
    /// gathered output gradient, or a column-parallel input gradient's partial sums.
    pub(super) full: B::Buf,
    pub(super) dq: B::Buf,
    pub(super) dk: B::Buf,
    pub(super) dv: B::Buf,
    /// With QK-norm: the gradients of the projections before it.
    pub(super) dq_raw: B::Buf,
    pub(super) dk_raw: B::Buf,
    pub(super) dattn: B::Buf,
    /// The SwiGLU backward's gate, up and output gradients, one set per `FfnKind` (the kinds
    /// have different widths).
    pub(super) ffn_grads: [FfnGrads<B>; 2],
    /// Multi-head latent attention's transient products and gradients (empty without MLA).
    pub(super) mla: MlaScratch<B>,
    pub(super) inputs: Vec<u32>,
    pub(super) targets: Vec<u32>,
    /// The inputs as rows of this rank's vocabulary shard (`IGNORE_INDEX` for the others').
    pub(super) local_ids: Vec<u32>,
    /// Each mixture-of-experts block's routing and expert activations, from its forward to its
    /// backward (their sizes depend on nothing but the shape; the routing is per step).
    pub(super) moe: Vec<Option<MoeActs<B>>>,
    /// A mixture of experts' load and auxiliary loss of the microbatches this workspace trained
    /// (None for a dense model).
    pub(super) expert_stats: Option<ExpertStats<B>>,
    /// Generation: the keys and values of the earlier tokens, which every block's forward reads
    /// and extends (None in training and validation).
    pub(super) kv_cache: Option<KvCache<B>>,
    /// Generation: the logits of the last position (`Decoder::head_last_logits`).
    pub(super) last_logits: Vec<f32>,
}

/// Which buffers a workspace allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// Training's: every buffer.
    Everything,
    /// A pipeline workspace that borrows the transient ones (`Workspace::trade_transient`).
    PerMicrobatch,
    /// A forward with no backward (generation): no gradient buffers.
    Forward,
}

/// A SwiGLU's backward scratch: its gate, up and output gradients.
pub(super) struct FfnGrads<B: Backend> {
    pub(super) dgate: B::Buf,
    pub(super) dup: B::Buf,
    pub(super) dact: B::Buf,
}

impl<B: Backend> LayerActs<B> {
    /// A block's buffers, for the shapes (and a `kind` block's feed-forward): each stored as
    /// `stored` says, given its storage as computed (`act_storage`); empty where it says None.
    fn allocate(
        be: &B,
        m: &LocalShapes,
        (batch, seq): (usize, usize),
        kind: FfnKind,
        stored: impl Fn(Act, ActStorage) -> Option<ActStorage>,
    ) -> Self {
        let buf = |act: Act| match stored(act, act_storage(m, batch, seq, act, kind)) {
            None => be.zeros(0),
            Some(st) if st.bf16_alone => be.zeros_bf16_activation(st.floats),
            Some(st) => be.zeros(st.floats),
        };
        LayerActs {
            normed_attn: buf(Act::NormedAttn),
            normed_attn_full: buf(Act::NormedAttnFull),
            rstd_attn: buf(Act::RstdAttn),
            q: buf(Act::Q),
            k: buf(Act::K),
            v: buf(Act::V),
            q_raw: buf(Act::QRaw),
            k_raw: buf(Act::KRaw),
            rstd_q: buf(Act::RstdQ),
            rstd_k: buf(Act::RstdK),
            q_latent: buf(Act::QLatent),
            q_latent_normed: buf(Act::QLatentNormed),
            rstd_q_latent: buf(Act::RstdQLatent),
            kv_latent: buf(Act::KvLatent),
            kv_latent_normed: buf(Act::KvLatentNormed),
            rstd_kv_latent: buf(Act::RstdKvLatent),
            attn_out: buf(Act::AttnOut),
            lse: buf(Act::Lse),
            attn_values: buf(Act::AttnValues),
            h: buf(Act::H),
            normed_ffn: buf(Act::NormedFfn),
            normed_ffn_full: buf(Act::NormedFfnFull),
            rstd_ffn: buf(Act::RstdFfn),
            gate: buf(Act::Gate),
            up: buf(Act::Up),
            act: buf(Act::Act),
        }
    }
}

macro_rules! act_field {
    ($acts:expr, $act:expr, $($borrow:tt)+) => {
        match $act {
            Act::NormedAttn => $($borrow)+ $acts.normed_attn,
            Act::NormedAttnFull => $($borrow)+ $acts.normed_attn_full,
            Act::RstdAttn => $($borrow)+ $acts.rstd_attn,
            Act::Q => $($borrow)+ $acts.q,
            Act::K => $($borrow)+ $acts.k,
            Act::V => $($borrow)+ $acts.v,
            Act::QRaw => $($borrow)+ $acts.q_raw,
            Act::KRaw => $($borrow)+ $acts.k_raw,
            Act::RstdQ => $($borrow)+ $acts.rstd_q,
            Act::RstdK => $($borrow)+ $acts.rstd_k,
            Act::QLatent => $($borrow)+ $acts.q_latent,
            Act::QLatentNormed => $($borrow)+ $acts.q_latent_normed,
            Act::RstdQLatent => $($borrow)+ $acts.rstd_q_latent,
            Act::KvLatent => $($borrow)+ $acts.kv_latent,
            Act::KvLatentNormed => $($borrow)+ $acts.kv_latent_normed,
            Act::RstdKvLatent => $($borrow)+ $acts.rstd_kv_latent,
            Act::AttnOut => $($borrow)+ $acts.attn_out,
            Act::Lse => $($borrow)+ $acts.lse,
            Act::AttnValues => $($borrow)+ $acts.attn_values,
            Act::H => $($borrow)+ $acts.h,
            Act::NormedFfn => $($borrow)+ $acts.normed_ffn,
            Act::NormedFfnFull => $($borrow)+ $acts.normed_ffn_full,
            Act::RstdFfn => $($borrow)+ $acts.rstd_ffn,
            Act::Gate => $($borrow)+ $acts.gate,
            Act::Up => $($borrow)+ $acts.up,
            Act::Act => $($borrow)+ $acts.act,
        }
    };
}

impl<B: Backend> LayerActs<B> {
    /// The buffer of `act`.
    fn get(&self, act: Act) -> &B::Buf {
        act_field!(self, act, &)
    }

    fn get_mut(&mut self, act: Act) -> &mut B::Buf {
        act_field!(self, act, &mut)
    }
}

/// One block's activations as its forward writes them and its backward reads them: each from the
/// block's own buffers when it keeps it, else from the shared scratch set.
pub struct BlockActs<'a, B: Backend> {
    pub normed_attn: &'a mut B::Buf,
    pub normed_attn_full: &'a mut B::Buf,
    pub rstd_attn: &'a mut B::Buf,
    pub q: &'a mut B::Buf,
    pub k: &'a mut B::Buf,
    pub v: &'a mut B::Buf,
    pub q_raw: &'a mut B::Buf,
    pub k_raw: &'a mut B::Buf,
    pub rstd_q: &'a mut B::Buf,
    pub rstd_k: &'a mut B::Buf,
    pub q_latent: &'a mut B::Buf,
    pub q_latent_normed: &'a mut B::Buf,
    pub rstd_q_latent: &'a mut B::Buf,
    pub kv_latent: &'a mut B::Buf,
    pub kv_latent_normed: &'a mut B::Buf,
    pub rstd_kv_latent: &'a mut B::Buf,
    pub attn_out: &'a mut B::Buf,
    pub lse: &'a mut B::Buf,
    pub attn_values: &'a mut B::Buf,
    pub h: &'a mut B::Buf,
    pub normed_ffn: &'a mut B::Buf,
    pub normed_ffn_full: &'a mut B::Buf,
    pub rstd_ffn: &'a mut B::Buf,
    pub gate: &'a mut B::Buf,
    pub up: &'a mut B::Buf,
    pub act: &'a mut B::Buf,
}

impl<'a, B: Backend> BlockActs<'a, B> {
    /// The buffer of `act`.
    pub(super) fn get_mut(&mut self, act: Act) -> &mut B::Buf {
        act_field!(self, act, &mut *)
    }

    /// A block's activations: its own buffers (`own`) for what it keeps as computed (`in_own`:
    /// `ActivationPlan::keeps_as_computed`), the shared sets' for the rest (`ffn_scratch`, the
    /// one of the block's feed-forward kind, for the `sized_by_ffn` activations).
    pub(super) fn pick(
        own: &'a mut LayerActs<B>,
        (scratch, ffn_scratch): (&'a mut LayerActs<B>, &'a mut LayerActs<B>),
        in_own: impl Fn(Act) -> bool,
    ) -> Self {
        macro_rules! from {
            ($field:ident, $act:expr) => {
                if in_own($act) {
                    &mut own.$field
                } else if sized_by_ffn($act) {
                    &mut ffn_scratch.$field
                } else {
                    &mut scratch.$field
                }
            };
        }
        BlockActs {
            normed_attn: from!(normed_attn, Act::NormedAttn),
            normed_attn_full: from!(normed_attn_full, Act::NormedAttnFull),
            rstd_attn: from!(rstd_attn, Act::RstdAttn),
            q: from!(q, Act::Q),
            k: from!(k, Act::K),
            v: from!(v, Act::V),
            q_raw: from!(q_raw, Act::QRaw),
            k_raw: from!(k_raw, Act::KRaw),
            rstd_q: from!(rstd_q, Act::RstdQ),
            rstd_k: from!(rstd_k, Act::RstdK),
            q_latent: from!(q_latent, Act::QLatent),
            q_latent_normed: from!(q_latent_normed, Act::QLatentNormed),
            rstd_q_latent: from!(rstd_q_latent, Act::RstdQLatent),
            kv_latent: from!(kv_latent, Act::KvLatent),
            kv_latent_normed: from!(kv_latent_normed, Act::KvLatentNormed),
            rstd_kv_latent: from!(rstd_kv_latent, Act::RstdKvLatent),
            attn_out: from!(attn_out, Act::AttnOut),
            lse: from!(lse, Act::Lse),
            attn_values: from!(attn_values, Act::AttnValues),
            h: from!(h, Act::H),
            normed_ffn: from!(normed_ffn, Act::NormedFfn),
            normed_ffn_full: from!(normed_ffn_full, Act::NormedFfnFull),
            rstd_ffn: from!(rstd_ffn, Act::RstdFfn),
            gate: from!(gate, Act::Gate),
            up: from!(up, Act::Up),
            act: from!(act, Act::Act),
        }
    }
}

impl<B: Backend> Workspace<B> {
    /// The workspace of a single-process model, keeping every activation.
    pub fn new(backend: &B, args: &ModelArgs, batch: usize, seq: usize) -> Self {
        let plan = ActivationPlan::keep_everything(args.n_layers);
        Self::planned(backend, &LocalShapes::whole(args), batch, seq, plan)
    }

    /// The workspace of one rank for `batch` sequences of `seq` positions (context parallel: it
    /// holds `seq / cp` of each; tensor parallel: `batch × seq / cp` must divide by its degree)
    /// whose blocks keep what `plan` says (activation checkpointing):
    /// a buffer per block for each kept activation, one shared for each recomputed one.
    pub fn planned(
        backend: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: ActivationPlan,
    ) -> Self {
        Self::allocate(backend, m, batch, seq, plan, Holds::Everything)
    }

    /// `planned` without the transient buffers (the recompute sets, the backward's scratch):
    /// a pipeline rank's workspaces after the first, which borrow them (`trade_transient`).
    pub fn planned_borrowing(
        backend: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: ActivationPlan,
    ) -> Self {
        Self::allocate(backend, m, batch, seq, plan, Holds::PerMicrobatch)
    }

    /// Swaps the transient buffers (the recompute sets, the backward's scratch, MLA's) with
    /// `other`'s: a pipeline rank's workspaces share one set, held by the one running an action.
    /// Nothing in them outlives an action (`WorkspacePart::Transient`).
    pub fn trade_transient(&mut self, other: &mut Self) {
        use std::mem::swap;
        swap(&mut self.recomputed, &mut other.recomputed);
        swap(&mut self.ffn_recomputed, &mut other.ffn_recomputed);
        swap(&mut self.dnormed, &mut other.dnormed);
        swap(&mut self.full, &mut other.full);
        swap(&mut self.dq, &mut other.dq);
        swap(&mut self.dk, &mut other.dk);
        swap(&mut self.dv, &mut other.dv);
        swap(&mut self.dq_raw, &mut other.dq_raw);
        swap(&mut self.dk_raw, &mut other.dk_raw);
        swap(&mut self.dattn, &mut other.dattn);
        swap(&mut self.ffn_grads, &mut other.ffn_grads);
        swap(&mut self.mla, &mut other.mla);
        self.resid.trade_transient(&mut other.resid);
    }

    /// The workspace of a forward with no backward after it (generation): the blocks' activations
    /// in one shared set, no gradient buffers.
    pub fn for_inference(backend: &B, m: &LocalShapes, batch: usize, seq: usize) -> Self {
        let plan = AcMode::Full.plan(m.n_layers);
        Self::allocate(backend, m, batch, seq, plan, Holds::Forward)
    }

    fn allocate(
        backend: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: ActivationPlan,
        holds: Holds,
    ) -> Self {
        assert_eq!(plan.blocks.len(), m.n_layers, "a plan per block");
        let backward = holds != Holds::Forward;
        // Transient buffers: none in a workspace that borrows them.
        let transient = holds != Holds::PerMicrobatch;
        let seq = m.local_seq(seq);
        let n = batch * seq;
        let r = m.rows(n);
        let (d, qd, kvd) = (m.dim, m.q_dim(), m.kv_dim());
        let z = |len: usize| backend.zeros(len);
        let tp = m.tp > 1;
        // The backward's scratch, none without a backward; `grad` for the carried gradient.
        let grad = |len: usize| backend.zeros(if backward { len } else { 0 });
        let scratch = |len: usize| backend.zeros(if backward && transient { len } else { 0 });
        let transient_len = |len: usize| if transient { len } else { 0 };
        // Read only by GEMMs (dgate, dup) or SwiGLU's backward (dact).
        let gemm_input =
            |len: usize| backend.zeros_bf16_activation(if backward && transient { len } else { 0 });
        Workspace {
            batch,
            seq,
            rope: None,
            documents: None,
            chunks: None,
            // A pipeline rank's residual stream at its own blocks only.
            resid: ResidualStream::allocate(backend, &plan, r * d, transient),
            layers: (0..m.n_layers)
                .map(|l| {
                    let kept = |a, st| plan.blocks[l].keeps(a).then(|| kept_storage(&plan, a, st));
                    LayerActs::allocate(backend, m, (batch, seq), m.ffn_kind(l), kept)
                })
                .collect(),
            recomputed: LayerActs::allocate(backend, m, (batch, seq), FfnKind::Dense, |a, st| {
                (transient && !sized_by_ffn(a) && plan.needs_scratch(a)).then_some(st)
            }),
            ffn_recomputed: FfnKind::ALL.map(|kind| {
                LayerActs::allocate(backend, m, (batch, seq), kind, |a, st| {
                    let needed =
                        transient && sized_by_ffn(a) && needs_scratch_of(&plan, m, a, kind);
                    needed.then_some(st)
                })
            }),
            plan,
            normed_final: z(r * d),
            normed_final_full: if tp { z(n * d) } else { z(0) },
            rstd_final: z(r),
            dx: grad(r * d),
            dnormed: scratch(r * d),
            full: z(transient_len(if tp { n * d } else { 0 })),
            dq: scratch(n * qd),
            dk: scratch(n * kvd),
            dv: scratch(n * kvd),
            dq_raw: scratch(if m.qk_norm { n * qd } else { 0 }),
            dk_raw: scratch(if m.qk_norm { n * kvd } else { 0 }),
            dattn: scratch(n * qd),
            ffn_grads: FfnKind::ALL.map(|kind| {
                let f = if m.has(kind) { m.ffn(kind) } else { 0 };
                FfnGrads {
                    dgate: gemm_input(n * f),
                    dup: gemm_input(n * f),
                    dact: gemm_input(n * f),
                }
            }),
            mla: match transient {
                true => MlaScratch::allocate(backend, m, n, backward),
                false => MlaScratch::empty(backend),
            },
            inputs: vec![0; n],
            targets: vec![0; n],
            local_ids: vec![0; n],
            moe: (0..m.n_layers).map(|_| None).collect(),
            expert_stats: m
                .moe
                .map(|moe| ExpertStats::zeros(backend, &moe, m.n_layers)),
            kv_cache: None,
            last_logits: Vec::new(),
        }
    }

    /// This workspace's blocks read and extend `cache` (generation).
    pub fn with_kv_cache(mut self, cache: KvCache<B>) -> Self {
        self.kv_cache = Some(cache);
        self
    }

    /// The KV cache handed in by `with_kv_cache` and the last position's logits, after a
    /// generation step.
    pub fn take_generation_output(&mut self) -> (Option<KvCache<B>>, Vec<f32>) {
        (self.kv_cache.take(), std::mem::take(&mut self.last_logits))
    }

    /// What the workspace's blocks keep.
    pub fn plan(&self) -> &ActivationPlan {
        &self.plan
    }

    /// The input of block `l` on this rank's rows, as stored (f32, or bf16 pairs under bf16
    /// mixed precision): the embedding's output for `l = 0`, the final norm's input for
    /// `l = n_layers`. A pipeline stage sends its output from here.
    pub fn block_input(&self, l: usize) -> &B::Buf {
        self.resid.stored(l)
    }

    /// Length of a stored block input on this rank (what a pipeline stage sends and receives).
    pub fn block_input_len(&self) -> usize {
        self.resid.stored_len()
    }

    /// Sets block `l`'s input to `stored` (a pipeline stage's received input, in the stored form).
    pub fn receive_block_input(&mut self, l: usize, stored: B::Buf) {
        self.resid.receive(l, stored);
    }

    /// The gradient the backward carries from block to block: ∂L/∂(output) of the next block to
    /// run backward, ∂L/∂(input) of the last one run (a pipeline stage receives the first and
    /// sends the second).
    pub fn carried_grad(&self) -> &B::Buf {
        &self.dx
    }

    /// The expert load and auxiliary loss of the microbatches this workspace trained since the
    /// last call, the counts left at zero (None for a dense model).
    pub fn take_expert_stats(&mut self, be: &B) -> Option<ExpertFigures> {
        self.expert_stats.as_mut().map(|s| s.take(be))
    }

    /// Frees the mixture-of-experts activations the blocks' forwards kept (no backward follows).
    pub fn drop_expert_acts(&mut self) {
        self.moe.iter_mut().for_each(|m| *m = None);
    }

    pub fn carried_grad_mut(&mut self) -> &mut B::Buf {
        &mut self.dx
    }

    /// After block `l`'s forward: each activation it keeps packed (`ActivationPlan::packs`),
    /// computed in the shared set, stored as bf16 pairs in its own buffer. The forward rounded
    /// each to bf16 where it was produced, so the pairs hold exactly the values it used.
    pub(super) fn pack_kept(&mut self, be: &B, l: usize, kind: FfnKind) {
        for act in self.packed_acts(be, l) {
            let shared = match sized_by_ffn(act) {
                true => &self.ffn_recomputed[kind.index()],
                false => &self.recomputed,
            };
            be.pack_bf16_pairs(self.layers[l].get_mut(act), shared.get(act));
        }
    }

    /// Before block `l`'s backward (and its recompute): its packed activations unpacked into the
    /// shared set, where the recompute and the backward read them.
    pub(super) fn unpack_kept(&mut self, be: &B, l: usize, kind: FfnKind) {
        for act in self.packed_acts(be, l) {
            let shared = match sized_by_ffn(act) {
                true => &mut self.ffn_recomputed[kind.index()],
                false => &mut self.recomputed,
            };
            be.unpack_bf16_pairs(shared.get_mut(act), self.layers[l].get(act));
        }
    }

    /// The activations block `l` keeps packed here (those its shapes leave empty skipped).
    fn packed_acts(&self, be: &B, l: usize) -> Vec<Act> {
        let (plan, own) = (&self.plan, &self.layers[l]);
        Act::ALL
            .into_iter()
            .filter(|&a| plan.blocks[l].keeps(a) && plan.packs(a) && be.len(own.get(a)) > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::workspace_floats::{WorkspaceFloats, WorkspacePart};
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::activation_checkpoint::ActivationDtype;

    /// Values a workspace allocated, every buffer counted.
    fn allocated(be: &CpuBackend, ws: &Workspace<CpuBackend>) -> usize {
        let acts = |a: &LayerActs<CpuBackend>| {
            [
                &a.normed_attn,
                &a.normed_attn_full,
                &a.rstd_attn,
                &a.q,
                &a.k,
                &a.v,
                &a.q_raw,
                &a.k_raw,
                &a.rstd_q,
                &a.rstd_k,
                &a.q_latent,
                &a.q_latent_normed,
                &a.rstd_q_latent,
                &a.kv_latent,
                &a.kv_latent_normed,
                &a.rstd_kv_latent,
                &a.attn_out,
                &a.lse,
                &a.attn_values,
                &a.h,
                &a.normed_ffn,
                &a.normed_ffn_full,
                &a.rstd_ffn,
                &a.gate,
                &a.up,
                &a.act,
            ]
            .iter()
            .map(|b| be.len(b))
            .sum::<usize>()
        };
        let m = &ws.mla;
        let mla: usize = [
            &m.q_proj,
            &m.kv_up,
            &m.q_rope,
            &m.k_rope,
            &m.kv_c,
            &m.dq_latent_normed,
            &m.dq_latent,
            &m.dkv_latent,
            &m.dkv_normed,
            &m.dkv_c,
            &m.dvalues,
        ]
        .iter()
        .map(|b| be.len(b))
        .sum();
        let ffn: usize = ws
            .ffn_grads
            .iter()
            .map(|g| be.len(&g.dgate) + be.len(&g.dup) + be.len(&g.dact))
            .sum();
        let singles: usize = [
            &ws.normed_final,
            &ws.normed_final_full,
            &ws.rstd_final,
            &ws.dx,
            &ws.dnormed,
            &ws.full,
            &ws.dq,
            &ws.dk,
            &ws.dv,
            &ws.dq_raw,
            &ws.dk_raw,
            &ws.dattn,
        ]
        .iter()
        .map(|b| be.len(b))
        .sum();
        ws.resid.allocated(be)
            + ws.layers.iter().map(acts).sum::<usize>()
            + acts(&ws.recomputed)
            + ws.ffn_recomputed.iter().map(acts).sum::<usize>()
            + mla
            + ffn
            + singles
    }

    /// Under bf16 a block keeps its activations as bf16 pairs (half the words) and
    /// its per-row statistics in f32; the shared set holds one f32 copy of each for the block
    /// running. In f32 nothing is shared without checkpointing.
    #[test]
    fn a_bf16_workspace_keeps_activations_at_half_the_words() {
        let be = CpuBackend::new();
        let args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let m = LocalShapes::whole(&args);
        let (batch, seq) = (1, 33);
        let plan = |dtype| AcMode::None.plan(args.n_layers).with_dtype(dtype);
        let f32_ws = Workspace::planned(&be, &m, batch, seq, plan(ActivationDtype::Float32));
        let bf16_ws = Workspace::planned(&be, &m, batch, seq, plan(ActivationDtype::BFloat16));
        for act in [
            Act::NormedAttn,
            Act::Q,
            Act::AttnOut,
            Act::H,
            Act::Gate,
            Act::Act,
        ] {
            let values = be.len(f32_ws.layers[0].get(act));
            assert_eq!(
                be.len(bf16_ws.layers[0].get(act)),
                values.div_ceil(2),
                "{act:?}"
            );
            assert_eq!(
                be.len(bf16_ws.recomputed.get(act)) + be.len(bf16_ws.ffn_recomputed[0].get(act)),
                values,
                "{act:?}"
            );
            assert_eq!(
                be.len(f32_ws.recomputed.get(act)) + be.len(f32_ws.ffn_recomputed[0].get(act)),
                0,
                "{act:?}"
            );
        }
        for act in [Act::RstdAttn, Act::Lse, Act::RstdFfn] {
            let values = be.len(f32_ws.layers[0].get(act));
            assert_eq!(
                be.len(bf16_ws.layers[0].get(act)),
                values,
                "{act:?} stays f32"
            );
        }
    }

    /// The estimate counts what a workspace allocates, whole or as a pipeline rank's (its own
    /// blocks, the transient buffers in one workspace only), for dense, QK-norm and MLA blocks
    /// under every checkpointing mode, with the residual stream in f32 and in bf16; trading the
    /// transient set moves it whole.
    #[test]
    fn the_estimate_counts_what_a_workspace_allocates() {
        let be = CpuBackend::new();
        let mut models = vec![crate::model::families::llama3::flavor("debugmodel").unwrap()];
        models.push(crate::model::families::qwen3::flavor("debugmodel").unwrap());
        // Multi-head latent attention with dense feed-forwards (the experts' buffers are made
        // per step, not with the workspace).
        let mut mla = crate::model::families::deepseek_v3::flavor("debugmodel").unwrap();
        mla.moe = None;
        assert!(mla.mla.is_some());
        models.push(mla);
        for args in &models {
            let m = LocalShapes::whole(args);
            let modes = [AcMode::None, AcMode::Full, AcMode::Op, AcMode::EveryNth(2)];
            let dtypes = [ActivationDtype::Float32, ActivationDtype::BFloat16];
            for (mode, dtype) in modes.into_iter().flat_map(|m| dtypes.map(|d| (m, d))) {
                let whole = mode.plan(args.n_layers).with_dtype(dtype);
                // A pipeline rank running the last two blocks.
                let stage = whole.only(|l| l + 2 >= args.n_layers);
                for plan in [whole, stage] {
                    let held = plan.block_inputs_held();
                    let what = format!("{mode:?}, {dtype:?}, {held} blocks here");
                    let count = |part| WorkspaceFloats::of(&m, 2, 32, &plan, part).all;
                    let mut first = Workspace::planned(&be, &m, 2, 32, plan.clone());
                    let mut other = Workspace::planned_borrowing(&be, &m, 2, 32, plan.clone());
                    assert_eq!(
                        allocated(&be, &first),
                        count(WorkspacePart::Whole),
                        "{what}"
                    );
                    let kept = count(WorkspacePart::PerMicrobatch);
                    assert_eq!(allocated(&be, &other), kept, "{what}");
                    other.trade_transient(&mut first);
                    assert_eq!(allocated(&be, &first), kept, "{what}");
                    assert_eq!(
                        allocated(&be, &other),
                        count(WorkspacePart::Whole),
                        "{what}"
                    );
                }
            }
        }
    }
}
