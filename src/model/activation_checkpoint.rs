//! Activation checkpointing as a save policy: what each block's forward keeps for its backward.
//! titan's backward is explicit, so checkpointing is not a wrapper around the block: a block that
//! kept less recomputes the rest, with the same kernels on the same inputs, at the start of its
//! backward (`Decoder::block_backward`), and the gradients are bit-identical to a run that kept
//! everything.
//!
//! TorchTitan's modes (`[activation_checkpoint]`):
//! - `none`: every block keeps every activation;
//! - `full`: every block keeps only its input (the residual stream, kept anyway) and reruns its
//!   whole forward before its backward;
//! - `selective` with `selective_ac_option = N`: every N-th block (blocks 0, N, 2N, …) as `full`,
//!   the others as `none`;
//! - `selective` with `op`: every block keeps the outputs of its expensive ops (`OP_SAVED`:
//!   attention and the projections feeding it) and recomputes the rest (the norms with their
//!   tensor-parallel gathers, the feed-forward's gate and up projections, SwiGLU) from them.
//!
//! What a block does not keep lives in one shared scratch set, so the memory saved is real: the
//! workspace allocates each kept activation per block and each recomputed one once
//! (`ActivationPlan::copies`).

use anyhow::{bail, Result};

/// A block's activations, as its backward reads them (`decoder::LayerActs` has one buffer of each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// The attention norm's output on this rank's rows, and gathered over the tensor-parallel
    /// group; its inverse RMS per row.
    NormedAttn,
    NormedAttnFull,
    RstdAttn,
    /// Query, key and value projections (query and key rotated; with QK-norm, normed first).
    Q,
    K,
    V,
    /// With QK-norm (Qwen3): the query and key projections before it, and its inverse RMS per
    /// token and head. Empty without.
    QRaw,
    KRaw,
    RstdQ,
    RstdK,
    /// Multi-head latent attention (empty without): the query latent before and after its norm
    /// and the norm's inverse RMS per token (with `q_lora_rank`); the key/value projection
    /// (latent and shared rotated key), its latent normed and the inverse RMS.
    QLatent,
    QLatentNormed,
    RstdQLatent,
    KvLatent,
    KvLatentNormed,
    RstdKvLatent,
    /// Attention's output and its log-sum-exp per query.
    AttnOut,
    Lse,
    /// MLA: each head's value columns of attention's output (`wo`'s input; without MLA `wo` reads
    /// `AttnOut` itself, and this is empty).
    AttnValues,
    /// The residual stream after attention.
    H,
    NormedFfn,
    NormedFfnFull,
    RstdFfn,
    /// The feed-forward's gate and up projections and SwiGLU's output.
    Gate,
    Up,
    Act,
}

impl Act {
    pub const ALL: [Act; 26] = [
        Act::NormedAttn,
        Act::NormedAttnFull,
        Act::RstdAttn,
        Act::Q,
        Act::K,
        Act::V,
        Act::QRaw,
        Act::KRaw,
        Act::RstdQ,
        Act::RstdK,
        Act::QLatent,
        Act::QLatentNormed,
        Act::RstdQLatent,
        Act::KvLatent,
        Act::KvLatentNormed,
        Act::RstdKvLatent,
        Act::AttnOut,
        Act::Lse,
        Act::AttnValues,
        Act::H,
        Act::NormedFfn,
        Act::NormedFfnFull,
        Act::RstdFfn,
        Act::Gate,
        Act::Up,
        Act::Act,
    ];

    /// A per-row statistic (a norm's inverse RMS, attention's log-sum-exp): small, and kept in
    /// f32 whatever the activations' dtype, as PyTorch's bf16 norms and attention keep theirs.
    pub fn is_statistic(self) -> bool {
        matches!(
            self,
            Act::RstdAttn
                | Act::RstdQ
                | Act::RstdK
                | Act::RstdQLatent
                | Act::RstdKvLatent
                | Act::Lse
                | Act::RstdFfn
        )
    }
}

/// Per-op selective checkpointing keeps attention's inputs and outputs (its q, k, v projections,
/// its output with the log-sum-exp, the residual stream after it) and the norms' per-row
/// statistics. The feed-forward's norm, gate and up projections and SwiGLU, and the attention
/// norm, with their tensor-parallel gathers, are recomputed. Of the three candidates measured
/// (`docs/performance.md`) this keeps least for the time: also keeping the gate and up projections
/// saves a fifth of the memory instead of almost half, and keeping only attention's output costs
/// a sixth of the throughput. Multi-head latent attention keeps its latents (small: a few hundred
/// values per token) and its heads' values, and recomputes only the latents' norms.
pub const OP_SAVED: &[Act] = &[
    Act::RstdAttn,
    Act::Q,
    Act::K,
    Act::V,
    Act::QRaw,
    Act::KRaw,
    Act::RstdQ,
    Act::RstdK,
    Act::QLatent,
    Act::RstdQLatent,
    Act::KvLatent,
    Act::RstdKvLatent,
    Act::AttnOut,
    Act::Lse,
    Act::AttnValues,
    Act::H,
    Act::RstdFfn,
];

/// What one block keeps from its forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSave {
    /// Every activation (no checkpointing).
    Everything,
    /// Only its input: the whole forward is recomputed.
    Input,
    /// `OP_SAVED`: the cheap ops are recomputed.
    ExpensiveOps,
    /// On another pipeline rank: this rank never runs it and holds nothing of it.
    Elsewhere,
}

impl BlockSave {
    /// Whether the block keeps `act` from its forward.
    pub fn keeps(self, act: Act) -> bool {
        match self {
            BlockSave::Everything => true,
            BlockSave::Input | BlockSave::Elsewhere => false,
            BlockSave::ExpensiveOps => OP_SAVED.contains(&act),
        }
    }
}

/// `[activation_checkpoint]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcMode {
    None,
    Full,
    /// Every N-th block fully checkpointed.
    EveryNth(usize),
    /// Per-op selective.
    Op,
}

/// The accepted values, for errors and docs.
pub const AC_MODES: &[&str] = &["none", "full", "selective"];

impl AcMode {
    /// From `mode` and `selective_ac_option` (`op` or a positive integer, read only with
    /// `selective`).
    pub fn parse(mode: &str, selective_option: &str) -> Result<Self> {
        match mode {
            "none" => Ok(AcMode::None),
            "full" => Ok(AcMode::Full),
            "selective" => match selective_option {
                "op" => Ok(AcMode::Op),
                n => match n.parse::<usize>() {
                    Ok(n) if n > 0 => Ok(AcMode::EveryNth(n)),
                    _ => bail!("[activation_checkpoint] selective_ac_option = `{n}` is not known (accepted: \"op\" or a positive integer N: every N-th block fully checkpointed)"),
                },
            },
            other => bail!(
                "[activation_checkpoint] mode = `{other}` is not known (accepted: {})",
                AC_MODES.join(", ")
            ),
        }
    }

    /// How TorchTitan's config would spell it.
    pub fn describe(self) -> String {
        match self {
            AcMode::None => "none".into(),
            AcMode::Full => "full".into(),
            AcMode::EveryNth(n) => format!("selective, every {n}"),
            AcMode::Op => "selective, op".into(),
        }
    }

    /// What each of `n_layers` blocks keeps.
    pub fn plan(self, n_layers: usize) -> ActivationPlan {
        let save = |l: usize| match self {
            AcMode::None => BlockSave::Everything,
            AcMode::Full => BlockSave::Input,
            AcMode::EveryNth(n) if l.is_multiple_of(n) => BlockSave::Input,
            AcMode::EveryNth(_) => BlockSave::Everything,
            AcMode::Op => BlockSave::ExpensiveOps,
        };
        ActivationPlan {
            blocks: (0..n_layers).map(save).collect(),
            dtype: ActivationDtype::Float32,
        }
    }
}

/// How the activations a step keeps are stored: the residual stream between blocks (each block's
/// input, kept for its backward) and what each block keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationDtype {
    /// f32, as the blocks compute them.
    Float32,
    /// Rounded to bf16 where they are produced and stored two values to a word (half the
    /// memory), as PyTorch's bf16 ops store their outputs under FSDP2's `param_dtype = bfloat16`:
    /// `[training] mixed_precision_param = "bfloat16"`. The per-row statistics of the norms and
    /// attention stay f32 (`ActivationPlan::packs`).
    BFloat16,
}

impl ActivationDtype {
    /// The dtype's name, as PyTorch spells it.
    pub fn name(self) -> &'static str {
        match self {
            ActivationDtype::Float32 => "float32",
            ActivationDtype::BFloat16 => "bfloat16",
        }
    }
}

/// What every block of a model keeps, and how the kept activations are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationPlan {
    pub blocks: Vec<BlockSave>,
    pub dtype: ActivationDtype,
}

impl ActivationPlan {
    /// No checkpointing.
    pub fn keep_everything(n_layers: usize) -> Self {
        AcMode::None.plan(n_layers)
    }

    /// Whether some block recomputes `act`, so the shared scratch set needs a buffer for it.
    pub fn needs_scratch(&self, act: Act) -> bool {
        self.needs_scratch_among(act, |_| true)
    }

    /// Whether some block `among` selects (by index) computes `act` in the shared set here: it
    /// recomputes it, or keeps it packed (`packs`), written there and packed after its forward,
    /// unpacked there before its backward.
    pub fn needs_scratch_among(&self, act: Act, among: impl Fn(usize) -> bool) -> bool {
        self.blocks.iter().enumerate().any(|(l, &b)| {
            among(l) && b != BlockSave::Elsewhere && (!b.keeps(act) || self.packs(act))
        })
    }

    /// Whether block `l` keeps `act` in its own buffer as computed (not packed): its forward and
    /// backward read it there; they read the others in the shared set.
    pub fn keeps_as_computed(&self, l: usize, act: Act) -> bool {
        self.blocks[l].keeps(act) && !self.packs(act)
    }

    /// Whether a block that keeps `act` keeps it as bf16 pairs (`Backend::pack_bf16_pairs`):
    /// under bf16 mixed precision, every activation but the per-row statistics. Its forward rounds
    /// it to bf16 where it is produced, so the ops after it, a recompute and the backward all
    /// read the same values.
    pub fn packs(&self, act: Act) -> bool {
        self.dtype == ActivationDtype::BFloat16 && !act.is_statistic()
    }

    /// The plan of a pipeline rank running only the blocks `here` says: the others keep nothing.
    pub fn only(&self, here: impl Fn(usize) -> bool) -> Self {
        ActivationPlan {
            blocks: self
                .blocks
                .iter()
                .enumerate()
                .map(|(l, &b)| if here(l) { b } else { BlockSave::Elsewhere })
                .collect(),
            dtype: self.dtype,
        }
    }

    /// This plan with the kept activations stored in `dtype`.
    pub fn with_dtype(self, dtype: ActivationDtype) -> Self {
        ActivationPlan { dtype, ..self }
    }

    /// Whether this rank holds the residual stream at block `l`'s input (`l` = n_layers: the
    /// final norm's input): a block it runs reads it there, or the one before writes it, or it is
    /// the embedding's output or the head's input (which a pipeline rank may hold without a
    /// block beside them). A pipeline rank holds those of its own blocks only; a stage that
    /// receives its input where it holds nothing gets the buffer with the transfer.
    pub fn holds_block_input(&self, l: usize) -> bool {
        let here = |b: usize| {
            self.blocks
                .get(b)
                .is_some_and(|&s| s != BlockSave::Elsewhere)
        };
        l == 0 || l == self.blocks.len() || here(l) || (l > 0 && here(l - 1))
    }

    /// How many block inputs this rank holds (`holds_block_input`), of the `n_layers + 1`.
    pub fn block_inputs_held(&self) -> usize {
        (0..=self.blocks.len())
            .filter(|&l| self.holds_block_input(l))
            .count()
    }

    /// Buffers of `act` in the workspace: one per block keeping it, and one shared by the blocks
    /// that recompute it or keep it packed.
    pub fn copies(&self, act: Act) -> usize {
        let kept = self.blocks.iter().filter(|b| b.keeps(act)).count();
        kept + self.needs_scratch(act) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_plan_the_blocks() {
        assert_eq!(AcMode::parse("none", "2").unwrap(), AcMode::None);
        assert_eq!(AcMode::parse("full", "op").unwrap(), AcMode::Full);
        assert_eq!(AcMode::parse("selective", "op").unwrap(), AcMode::Op);
        assert_eq!(
            AcMode::parse("selective", "2").unwrap(),
            AcMode::EveryNth(2)
        );
        for (mode, option, want) in [
            ("partial", "op", "mode = `partial`"),
            ("selective", "0", "selective_ac_option = `0`"),
            ("selective", "ops", "selective_ac_option = `ops`"),
        ] {
            let e = AcMode::parse(mode, option).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let every2 = AcMode::EveryNth(2).plan(3);
        assert_eq!(
            every2.blocks,
            [BlockSave::Input, BlockSave::Everything, BlockSave::Input]
        );
        // Two blocks keep Q, one shared buffer serves the block that recomputes it.
        assert_eq!(every2.copies(Act::Q), 2);
        let op = AcMode::Op.plan(4);
        assert_eq!((op.copies(Act::Q), op.copies(Act::Act)), (4, 1));
        let none = ActivationPlan::keep_everything(4);
        assert_eq!(
            (none.copies(Act::Act), none.needs_scratch(Act::Act)),
            (4, false)
        );
        assert_eq!(AcMode::Full.plan(4).copies(Act::Gate), 1);
    }
}
