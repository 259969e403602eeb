//! What one run of a block reads, forward or backward: its projections in this rank's shapes
//! (`BlockLinears`), which ops a forward run computes (`Pass`), and the run's context
//! (`BlockRun`, `BackwardRun`), shared by the block's files (`block`, `backward`, `mla`).

use crate::backend::Backend;
use crate::model::activation_checkpoint::{Act, BlockSave};
use crate::model::float8_convert::Float8Conversion;
use crate::model::linear::Linear;
use crate::model::local_shapes::LocalShapes;
use crate::model::parallel_linear::SequenceParallel;
use crate::model::params::LayerIds;
use crate::model::projection::BlockProjection;

/// A block's projections in one rank's shapes (`LocalShapes::projection`: attention's
/// column-parallel ones and row-parallel `wo`, the feed-forward's column-parallel w1, w3 and
/// row-parallel w2), each computing in float8 where the conversion chose it.
#[derive(Clone, Copy)]
pub(super) struct BlockLinears {
    linears: [Option<Linear>; BlockProjection::ALL.len()],
}

impl BlockLinears {
    /// Block `layer`'s projections in this rank's shapes, each in float8 where `float8` converted
    /// it.
    pub(super) fn of(m: &LocalShapes, float8: &Float8Conversion, layer: usize) -> Self {
        let linears = BlockProjection::ALL.map(|p| {
            let (d_in, d_out) = m.projection(p, layer)?;
            Some(
                Linear::new(d_in, d_out)
                    .in_float8(float8.recipe(layer, p))
                    .weight_gathered_in_float8(float8.weights_gathered_in_float8),
            )
        });
        BlockLinears { linears }
    }

    /// Projection `p`, which the block has (its parameters say so: `LayerIds`).
    pub(super) fn get(&self, p: BlockProjection) -> Linear {
        self.linears[p.index()]
            .unwrap_or_else(|| panic!("the block has no projection {} (a titan bug)", p.name()))
    }
}

/// Which of a block's forward ops a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// The forward (training, validation, generation): every op, each activation kept where the
    /// block's save policy says (a mixture of experts' only if the block keeps more than its
    /// input).
    Forward,
    /// Before the backward of a block that kept only its input: the whole forward again, a
    /// mixture of experts' activations kept for the backward (its output, the next block's input,
    /// is written again with the same values).
    RecomputeAll,
    /// Before the backward of a block that kept its expensive ops: only the ops whose outputs it
    /// did not keep, in the forward's order; its output is not needed again.
    RecomputeMissing,
}

/// What every op of one block's run reads.
pub(super) struct BlockRun<'r, B: Backend> {
    pub(super) be: &'r B,
    pub(super) p: &'r [B::Buf],
    pub(super) id: &'r LayerIds,
    pub(super) linears: BlockLinears,
    pub(super) sp: SequenceParallel<'r, B>,
    pub(super) batch: usize,
    pub(super) seq: usize,
    pub(super) save: BlockSave,
    pub(super) pass: Pass,
    /// Whether a mixture of experts gathers its auxiliary-loss statistics (not in generation).
    pub(super) aux_stats: bool,
}

impl<B: Backend> BlockRun<'_, B> {
    /// Whether this run computes `act`.
    pub(super) fn redo(&self, act: Act) -> bool {
        self.pass != Pass::RecomputeMissing || !self.save.keeps(act)
    }

    /// The block's projection `p`.
    pub(super) fn linear(&self, p: BlockProjection) -> Linear {
        self.linears.get(p)
    }

    /// Whether this run writes the block's output (the feed-forward's last projection and the
    /// experts).
    pub(super) fn writes_output(&self) -> bool {
        self.pass != Pass::RecomputeMissing
    }
}

/// What every op of one block's backward reads.
pub(super) struct BackwardRun<'r, B: Backend> {
    pub(super) be: &'r B,
    pub(super) p: &'r [B::Buf],
    pub(super) id: &'r LayerIds,
    pub(super) linears: BlockLinears,
    pub(super) sp: SequenceParallel<'r, B>,
    pub(super) batch: usize,
    pub(super) seq: usize,
}

impl<B: Backend> BackwardRun<'_, B> {
    /// The block's projection `p`.
    pub(super) fn linear(&self, p: BlockProjection) -> Linear {
        self.linears.get(p)
    }
}
