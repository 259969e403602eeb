//! Every activation and gradient buffer of one rank's training step (`Workspace`), allocated
//! once per (batch, seq) shape, and the float counts the memory estimate reads from the same
//! source: each block's activations (`LayerActs`), kept per block or in one shared set that the
//! blocks which keep less recompute into (activation checkpointing).

use super::generate::KvCache;
use super::mla_scratch::{mla_scratch_floats, MlaScratch};
use crate::backend::Backend;
use crate::model::activation_checkpoint::{Act, ActivationPlan, BlockSave};
use crate::model::args::ModelArgs;
use crate::model::local_shapes::{FfnKind, LocalShapes};
use crate::model::moe::stats::ExpertStats;
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
    /// With context parallelism, the RoPE tables of the shard's rows (their global positions),
    /// made by `Llama::load_tokens` the first time.
    pub(super) rope: Option<(B::Buf, B::Buf)>,
    /// Input of block `l` at `resid[l]`; the last entry is the final block's output.
    pub(super) resid: Vec<B::Buf>,
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
    pub(super) expert_stats: Option<ExpertStats>,
    /// Generation: the keys and values of the earlier tokens, which every block's forward reads
    /// and extends (None in training and validation).
    pub(super) kv_cache: Option<KvCache<B>>,
    /// Generation: the logits of the last position (`Llama::head_last_logits`).
    pub(super) last_logits: Vec<f32>,
}

/// A SwiGLU's backward scratch: its gate, up and output gradients.
pub(super) struct FfnGrads<B: Backend> {
    pub(super) dgate: B::Buf,
    pub(super) dup: B::Buf,
    pub(super) dact: B::Buf,
}

/// Whether `act`'s size or storage depends on the block's feed-forward kind (its SwiGLU's width;
/// a mixture of experts gathers its normed rows in f32).
fn sized_by_ffn(act: Act) -> bool {
    matches!(act, Act::NormedFfn | Act::Gate | Act::Up | Act::Act)
}

/// Whether some block of `kind` (run here) recomputes `act`: the shared set of that kind needs a
/// buffer for it.
fn needs_scratch_of(plan: &ActivationPlan, m: &LocalShapes, act: Act, kind: FfnKind) -> bool {
    plan.needs_scratch_among(act, |l| m.ffn_kind(l) == kind)
}

/// The SwiGLU widths of the kinds of this rank's blocks, summed (one backward scratch set each).
fn ffn_widths(m: &LocalShapes) -> usize {
    FfnKind::ALL
        .into_iter()
        .filter(|&k| m.has(k))
        .map(|k| m.ffn(k))
        .sum()
}

/// How a device may store an activation (`Backend::zeros_bf16_activation`, `activation_copy_bytes`).
#[derive(Debug, Clone, Copy)]
struct ActStorage {
    floats: usize,
    /// Read only by GEMMs, SwiGLU or a gather feeding GEMMs: a device may keep it in bf16 alone.
    bf16_alone: bool,
    /// Its producer may keep a bf16 copy beside it for the kernels that read it.
    bf16_copy: bool,
}

/// The size and storage of each block activation for one rank's shapes: the single source for
/// allocation and memory estimates.
fn act_storage(m: &LocalShapes, batch: usize, seq: usize, act: Act, kind: FfnKind) -> ActStorage {
    let n = batch * seq;
    let r = m.rows(n);
    let (d, f, qd, kvd) = (m.dim, m.ffn(kind), m.q_dim(), m.kv_dim());
    let tp = m.tp > 1;
    let plain = |floats| ActStorage {
        floats,
        bf16_alone: false,
        bf16_copy: false,
    };
    let copied = |floats| ActStorage {
        bf16_copy: true,
        ..plain(floats)
    };
    let gemm_input = |floats| ActStorage {
        floats,
        bf16_alone: true,
        bf16_copy: true,
    };
    match act {
        // A norm's output feeds the column-parallel GEMMs directly, or (tensor parallel) through
        // the gather, whose result is then the GEMMs' input.
        Act::NormedAttn | Act::NormedFfn if tp => plain(r * d),
        // A mixture of experts gathers the normed rows (not a GEMM reading them): f32 kept.
        Act::NormedFfn if kind == FfnKind::Experts => copied(n * d),
        Act::NormedAttn | Act::NormedFfn => gemm_input(n * d),
        Act::NormedAttnFull | Act::NormedFfnFull if tp => gemm_input(n * d),
        Act::NormedAttnFull | Act::NormedFfnFull => plain(0),
        Act::RstdAttn | Act::RstdFfn => plain(r),
        Act::Q | Act::AttnOut => copied(n * qd),
        Act::K => copied(n * kvd),
        Act::V => plain(n * kvd),
        Act::QRaw if m.qk_norm => plain(n * qd),
        Act::KRaw if m.qk_norm => plain(n * kvd),
        Act::RstdQ if m.qk_norm => plain(n * m.heads),
        Act::RstdK if m.qk_norm => plain(n * m.kv_heads),
        Act::QRaw | Act::KRaw | Act::RstdQ | Act::RstdK => plain(0),
        Act::QLatent | Act::QLatentNormed | Act::RstdQLatent | Act::KvLatent => {
            let mla = m.mla.as_ref();
            let q_rank = mla.and_then(|a| a.q_lora_rank).unwrap_or(0);
            match act {
                Act::QLatent => plain(n * q_rank),
                Act::QLatentNormed => gemm_input(n * q_rank),
                Act::RstdQLatent => plain(if q_rank > 0 { n } else { 0 }),
                _ => plain(n * mla.map_or(0, |a| a.kv_a_dim())),
            }
        }
        Act::KvLatentNormed => gemm_input(n * m.mla.map_or(0, |a| a.kv_lora_rank)),
        Act::RstdKvLatent => plain(if m.mla.is_some() { n } else { 0 }),
        Act::AttnValues if m.mla.is_some() => gemm_input(n * m.values_dim()),
        Act::AttnValues => plain(0),
        Act::Lse => plain(batch * m.heads * seq),
        Act::H => plain(r * d),
        Act::Gate | Act::Up | Act::Act => gemm_input(n * f),
    }
}

/// The block activations' values over the workspace, counting each buffer `plan` allocates, of
/// those selected by `which`.
fn block_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
    which: impl Fn(ActStorage) -> bool,
) -> usize {
    let floats = |act, kind| {
        let st = act_storage(m, batch, seq, act, kind);
        if which(st) {
            st.floats
        } else {
            0
        }
    };
    Act::ALL
        .iter()
        .map(|&act| {
            let kept: usize = (0..plan.blocks.len())
                .filter(|&l| plan.blocks[l].keeps(act))
                .map(|l| floats(act, m.ffn_kind(l)))
                .sum();
            let shared: usize = match sized_by_ffn(act) {
                true => FfnKind::ALL
                    .into_iter()
                    .filter(|&k| needs_scratch_of(plan, m, act, k))
                    .map(|k| floats(act, k))
                    .sum(),
                false if plan.needs_scratch(act) => floats(act, FfnKind::Dense),
                false => 0,
            };
            kept + shared
        })
        .sum()
}

/// Float counts of the workspace for a shape and activation plan: the single source for
/// allocation and memory estimates.
pub fn workspace_floats(m: &LocalShapes, batch: usize, seq: usize, plan: &ActivationPlan) -> usize {
    let seq = m.local_seq(seq);
    let n = batch * seq;
    let r = m.rows(n);
    let (d, f, qd, kvd) = (m.dim, ffn_widths(m), m.q_dim(), m.kv_dim());
    let gathered = if m.tp > 1 { n * d } else { 0 };
    let resid = (m.n_layers + 1) * r * d;
    let final_norm = r * (d + 1) + gathered;
    let qk_norm = if m.qk_norm { n * (qd + kvd) } else { 0 };
    let backward = r * 2 * d + gathered + n * (2 * qd + 2 * kvd + 3 * f) + qk_norm;
    let mla = mla_scratch_floats(m, n, true);
    // Every mixture-of-experts block keeps its routed rows' activations (`Workspace::moe`), and its
    // backward needs about as much again for their gradients.
    let moe = m.moe.map_or(0, |moe| {
        let per_block = n * moe.activation_floats_per_token(d);
        let held = plan
            .blocks
            .iter()
            .filter(|&&b| b != BlockSave::Elsewhere && b != BlockSave::Input)
            .count();
        held * per_block + per_block
    });
    block_floats(m, batch, seq, plan, |_| true) + resid + final_norm + backward + moe + mla
}

/// Values of the workspace allocated by `Backend::zeros_bf16_activation` (the blocks'
/// column-parallel inputs, gate and up projections and SwiGLU outputs, and the backward's SwiGLU
/// input and output gradients), whose f32 storage a device may leave out.
pub fn workspace_bf16_activation_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
) -> usize {
    let seq = m.local_seq(seq);
    block_floats(m, batch, seq, plan, |st| st.bf16_alone) + 3 * batch * seq * ffn_widths(m)
}

/// Values of the workspace whose producers may keep a bf16 copy beside them (or their values in
/// bf16 alone) for the GEMMs, attention and SwiGLU kernels that read them
/// (`Backend::activation_copy_bytes`): the blocks' normed inputs, rotated q and k, attention
/// outputs, gate and up projections and SwiGLU outputs, the final norm's output, and the
/// backward's SwiGLU input and output gradients, rotated dq and dk, and block-input gradient.
pub fn workspace_copied_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
) -> usize {
    let seq = m.local_seq(seq);
    let n = batch * seq;
    let (d, f, qd, kvd) = (m.dim, ffn_widths(m), m.q_dim(), m.kv_dim());
    block_floats(m, batch, seq, plan, |st| st.bf16_copy) + n * d + n * (3 * f + d + qd + kvd)
}

impl<B: Backend> LayerActs<B> {
    /// A block's buffers: those `keep` selects sized for the shapes (and a `kind` block's
    /// feed-forward), the others empty.
    fn allocate(
        be: &B,
        m: &LocalShapes,
        (batch, seq): (usize, usize),
        kind: FfnKind,
        keep: impl Fn(Act) -> bool,
    ) -> Self {
        let buf = |act: Act| {
            let st = act_storage(m, batch, seq, act, kind);
            match (keep(act), st.bf16_alone) {
                (false, _) => be.zeros(0),
                (true, true) => be.zeros_bf16_activation(st.floats),
                (true, false) => be.zeros(st.floats),
            }
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
    /// A block's activations: its own buffers (`own`) for what it keeps (`save`), the shared
    /// sets' for the rest (`ffn_scratch`, the one of the block's feed-forward kind, for the
    /// `sized_by_ffn` activations).
    pub(super) fn pick(
        own: &'a mut LayerActs<B>,
        (scratch, ffn_scratch): (&'a mut LayerActs<B>, &'a mut LayerActs<B>),
        save: BlockSave,
    ) -> Self {
        macro_rules! from {
            ($field:ident, $act:expr) => {
                if save.keeps($act) {
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
        Self::allocate(backend, m, batch, seq, plan, true)
    }

    /// The workspace of a forward with no backward after it (generation): the blocks' activations
    /// in one shared set, no gradient buffers.
    pub fn for_inference(backend: &B, m: &LocalShapes, batch: usize, seq: usize) -> Self {
        let plan = ActivationPlan {
            blocks: vec![BlockSave::Input; m.n_layers],
        };
        Self::allocate(backend, m, batch, seq, plan, false)
    }

    fn allocate(
        backend: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: ActivationPlan,
        backward: bool,
    ) -> Self {
        assert_eq!(plan.blocks.len(), m.n_layers, "a plan per block");
        let seq = m.local_seq(seq);
        let n = batch * seq;
        let r = m.rows(n);
        let (d, qd, kvd) = (m.dim, m.q_dim(), m.kv_dim());
        let z = |len: usize| backend.zeros(len);
        let tp = m.tp > 1;
        // The backward's scratch, none without a backward.
        let grad = |len: usize| backend.zeros(if backward { len } else { 0 });
        // Read only by GEMMs (dgate, dup) or SwiGLU's backward (dact).
        let gemm_input = |len: usize| backend.zeros_bf16_activation(if backward { len } else { 0 });
        Workspace {
            batch,
            seq,
            rope: None,
            resid: (0..=m.n_layers).map(|_| z(r * d)).collect(),
            layers: (0..m.n_layers)
                .map(|l| {
                    let save = plan.blocks[l];
                    LayerActs::allocate(backend, m, (batch, seq), m.ffn_kind(l), |a| save.keeps(a))
                })
                .collect(),
            recomputed: LayerActs::allocate(backend, m, (batch, seq), FfnKind::Dense, |a| {
                !sized_by_ffn(a) && plan.needs_scratch(a)
            }),
            ffn_recomputed: FfnKind::ALL.map(|kind| {
                LayerActs::allocate(backend, m, (batch, seq), kind, |a| {
                    sized_by_ffn(a) && needs_scratch_of(&plan, m, a, kind)
                })
            }),
            plan,
            normed_final: z(r * d),
            normed_final_full: if tp { z(n * d) } else { z(0) },
            rstd_final: z(r),
            dx: grad(r * d),
            dnormed: grad(r * d),
            full: if tp { z(n * d) } else { z(0) },
            dq: grad(n * qd),
            dk: grad(n * kvd),
            dv: grad(n * kvd),
            dq_raw: grad(if m.qk_norm { n * qd } else { 0 }),
            dk_raw: grad(if m.qk_norm { n * kvd } else { 0 }),
            dattn: grad(n * qd),
            ffn_grads: FfnKind::ALL.map(|kind| {
                let f = if m.has(kind) { m.ffn(kind) } else { 0 };
                FfnGrads {
                    dgate: gemm_input(n * f),
                    dup: gemm_input(n * f),
                    dact: gemm_input(n * f),
                }
            }),
            mla: MlaScratch::allocate(backend, m, n, backward),
            inputs: vec![0; n],
            targets: vec![0; n],
            local_ids: vec![0; n],
            moe: (0..m.n_layers).map(|_| None).collect(),
            expert_stats: m.moe.map(|moe| ExpertStats::zeros(&moe, m.n_layers)),
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

    /// The input of block `l` on this rank's rows: the embedding's output for `l = 0`, the final
    /// norm's input for `l = n_layers` (a pipeline stage receives its input here and sends its
    /// output from here).
    pub fn block_input(&self, l: usize) -> &B::Buf {
        &self.resid[l]
    }

    pub fn block_input_mut(&mut self, l: usize) -> &mut B::Buf {
        &mut self.resid[l]
    }

    /// The gradient the backward carries from block to block: ∂L/∂(output) of the next block to
    /// run backward, ∂L/∂(input) of the last one run (a pipeline stage receives the first and
    /// sends the second).
    pub fn carried_grad(&self) -> &B::Buf {
        &self.dx
    }

    /// The expert load and auxiliary loss of the microbatches this workspace trained since the
    /// last call, the counts left at zero (None for a dense model).
    pub fn take_expert_stats(&mut self) -> Option<ExpertStats> {
        self.expert_stats.as_mut().map(ExpertStats::take)
    }

    /// Frees the mixture-of-experts activations the blocks' forwards kept (no backward follows).
    pub fn drop_expert_acts(&mut self) {
        self.moe.iter_mut().for_each(|m| *m = None);
    }

    pub fn carried_grad_mut(&mut self) -> &mut B::Buf {
        &mut self.dx
    }
}
