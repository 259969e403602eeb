//! A workspace's buffers counted, from one rank's shapes and activation plan: how each block
//! activation is sized and stored (`act_storage`), which buffers live per microbatch and which
//! within one action (`WorkspacePart`), and the float counts that allocation and the memory
//! estimate both read (`WorkspaceFloats`), so the two cannot drift apart.

use super::mla::scratch::mla_scratch_floats;
use super::residual::stored_len;
use crate::model::activation_checkpoint::{Act, ActivationDtype, ActivationPlan, BlockSave};
use crate::model::local_shapes::{FfnKind, LocalShapes};

/// Whether `act`'s size or storage depends on the block's feed-forward kind (its SwiGLU's width;
/// a mixture of experts gathers its normed rows in f32).
pub(super) fn sized_by_ffn(act: Act) -> bool {
    matches!(act, Act::NormedFfn | Act::Gate | Act::Up | Act::Act)
}

/// Whether some block of `kind` (run here) recomputes `act`: the shared set of that kind needs a
/// buffer for it.
pub(super) fn needs_scratch_of(
    plan: &ActivationPlan,
    m: &LocalShapes,
    act: Act,
    kind: FfnKind,
) -> bool {
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
pub(super) struct ActStorage {
    pub(super) floats: usize,
    /// Read only by GEMMs, SwiGLU or a gather feeding GEMMs: a device may keep it in bf16 alone.
    pub(super) bf16_alone: bool,
    /// Its producer may keep a bf16 copy beside it for the kernels that read it.
    pub(super) bf16_copy: bool,
}

/// The size and storage of each block activation for one rank's shapes: the single source for
/// allocation and memory estimates.
pub(super) fn act_storage(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    act: Act,
    kind: FfnKind,
) -> ActStorage {
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

/// How a block that keeps `act` stores it: as `act_storage` says (`st`), or when the plan packs it
/// (`ActivationPlan::packs`) as bf16 pairs, two values to an f32 word.
pub(super) fn kept_storage(plan: &ActivationPlan, act: Act, st: ActStorage) -> ActStorage {
    match plan.packs(act) {
        true => ActStorage {
            floats: st.floats.div_ceil(2),
            bf16_alone: false,
            bf16_copy: false,
        },
        false => st,
    }
}

/// Which of a workspace's buffers a count covers. A pipeline rank holds the `PerMicrobatch` ones
/// of each microbatch in flight and one `Transient` set (the recomputed activations and the
/// backward's scratch), lent to the workspace running an action (`Workspace::trade_transient`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkspacePart {
    Whole,
    /// What lives from a microbatch's first action to its last: block inputs, kept activations,
    /// the carried gradient, the routing of its experts.
    PerMicrobatch,
    /// What lives within one action: the shared recompute sets and the backward's scratch.
    Transient,
}

impl WorkspacePart {
    fn kept(self) -> bool {
        self != WorkspacePart::Transient
    }
    fn transient(self) -> bool {
        self != WorkspacePart::PerMicrobatch
    }
    /// `n` when this part covers per-microbatch buffers, else 0.
    fn if_kept(self, n: usize) -> usize {
        if self.kept() {
            n
        } else {
            0
        }
    }
    /// `n` when this part covers transient buffers, else 0.
    fn if_transient(self, n: usize) -> usize {
        if self.transient() {
            n
        } else {
            0
        }
    }
}

/// The block activations' values over the workspace, counting each buffer `plan` allocates, of
/// those selected by `which`, in `part`.
fn block_floats(
    m: &LocalShapes,
    (batch, seq): (usize, usize),
    plan: &ActivationPlan,
    part: WorkspacePart,
    which: impl Fn(ActStorage) -> bool,
) -> usize {
    let counted = |st: ActStorage| if which(st) { st.floats } else { 0 };
    let floats = |act, kind| counted(act_storage(m, batch, seq, act, kind));
    Act::ALL
        .iter()
        .map(|&act| {
            let kept: usize = (0..plan.blocks.len())
                .filter(|&l| plan.blocks[l].keeps(act))
                .map(|l| {
                    let st = act_storage(m, batch, seq, act, m.ffn_kind(l));
                    counted(kept_storage(plan, act, st))
                })
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
            part.if_kept(kept) + part.if_transient(shared)
        })
        .sum()
}

/// Float counts of a workspace's buffers (`part` of them) for a shape and activation plan: the
/// single source for allocation and memory estimates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceFloats {
    /// Every value.
    pub all: usize,
    /// Those allocated by `Backend::zeros_bf16_activation` (the blocks' column-parallel inputs,
    /// gate and up projections and SwiGLU outputs, and the backward's SwiGLU input and output
    /// gradients), whose f32 storage a device may leave out.
    pub bf16_alone: usize,
    /// Those whose producers may keep a bf16 copy beside them (or their values in bf16 alone)
    /// for the GEMMs, attention and SwiGLU kernels that read them
    /// (`Backend::activation_copy_bytes`): the blocks' normed inputs, rotated q and k, attention
    /// outputs, gate and up projections and SwiGLU outputs, the final norm's output, and the
    /// backward's SwiGLU input and output gradients, rotated dq and dk, and block-input gradient.
    pub copied: usize,
}

impl WorkspaceFloats {
    /// `part` of one workspace of `batch` sequences of `seq` positions.
    pub fn of(
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: &ActivationPlan,
        part: WorkspacePart,
    ) -> Self {
        let seq = m.local_seq(seq);
        let n = batch * seq;
        let r = m.rows(n);
        let (d, f, qd, kvd) = (m.dim, ffn_widths(m), m.q_dim(), m.kv_dim());
        let gathered = if m.tp > 1 { n * d } else { 0 };
        let shape = (batch, seq);
        // The stream's stored entries, and (bf16) the unpacked input and output of the block
        // running (`ResidualStream`).
        let resid = plan.block_inputs_held() * stored_len(plan.dtype, r * d);
        let unpacked = match plan.dtype {
            ActivationDtype::Float32 => 0,
            ActivationDtype::BFloat16 => 2 * r * d,
        };
        let final_norm = r * (d + 1) + gathered;
        let qk_norm = if m.qk_norm { n * (qd + kvd) } else { 0 };
        // The carried gradient (`dx`) lives from a microbatch's backward to the next stage's on
        // this rank; the rest of the backward's buffers within one action.
        let carried = r * d;
        let backward = r * d + gathered + n * (2 * qd + 2 * kvd + 3 * f) + qk_norm;
        let mla = mla_scratch_floats(m, n, true);
        // Every mixture-of-experts block keeps its routed rows' activations (`Workspace::moe`;
        // under bf16 as pairs, unpacked for its backward), and its backward needs about as much
        // again for their gradients.
        let (moe_kept, moe_grads) = m.moe.map_or((0, 0), |moe| {
            let per_block = n * moe.activation_floats_per_token(d);
            let held = plan
                .blocks
                .iter()
                .filter(|&&b| b != BlockSave::Elsewhere && b != BlockSave::Input)
                .count();
            match plan.dtype {
                ActivationDtype::Float32 => (held * per_block, per_block),
                ActivationDtype::BFloat16 => (held * per_block.div_ceil(2), 2 * per_block),
            }
        });
        let all = block_floats(m, shape, plan, part, |_| true)
            + part.if_kept(resid + final_norm + carried + moe_kept)
            + part.if_transient(backward + moe_grads + mla + unpacked);
        let bf16_alone =
            block_floats(m, shape, plan, part, |st| st.bf16_alone) + part.if_transient(3 * n * f);
        let copied = block_floats(m, shape, plan, part, |st| st.bf16_copy)
            + part.if_kept(n * d + n * d)
            + part.if_transient(n * (3 * f + qd + kvd));
        WorkspaceFloats {
            all,
            bf16_alone,
            copied,
        }
    }

    /// A pipeline rank's workspaces: `workspaces` microbatches of `batch` sequences held at
    /// once, each with its own per-microbatch buffers, all sharing one transient set.
    pub fn pipelined(
        m: &LocalShapes,
        (batch, seq): (usize, usize),
        plan: &ActivationPlan,
        workspaces: usize,
    ) -> Self {
        let kept = Self::of(m, batch, seq, plan, WorkspacePart::PerMicrobatch);
        let shared = Self::of(m, batch, seq, plan, WorkspacePart::Transient);
        WorkspaceFloats {
            all: workspaces * kept.all + shared.all,
            bf16_alone: workspaces * kept.bf16_alone + shared.bf16_alone,
            copied: workspaces * kept.copied + shared.copied,
        }
    }
}

/// Values of one whole workspace (`WorkspaceFloats::of`).
pub fn workspace_floats(m: &LocalShapes, batch: usize, seq: usize, plan: &ActivationPlan) -> usize {
    WorkspaceFloats::of(m, batch, seq, plan, WorkspacePart::Whole).all
}
