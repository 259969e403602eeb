//! What one run of a block reads, forward or backward: its projections in this rank's shapes
//! (`BlockLinears`), which ops a forward run computes (`Pass`), and the run's context
//! (`BlockRun`, `BackwardRun`), shared by the block's files (`block`, `backward`, `mla`).

use super::workspace::BlockActs;
use crate::backend::Backend;
use crate::model::activation_checkpoint::{Act, BlockSave};
use crate::model::float8_convert::Float8Conversion;
use crate::model::linear::Linear;
use crate::model::local_shapes::LocalShapes;
use crate::model::lora::{Adapter, AdapterGrads, LoraArgs, LoraIds};
use crate::model::parallel_linear::{AdapterGrad, Projection, ProjectionGrad, SequenceParallel};
use crate::model::params::{LayerIds, ParamSet};
use crate::model::projection::BlockProjection;

/// A block's projections in one rank's shapes (`LocalShapes::projection`: attention's
/// column-parallel ones and row-parallel `wo`, the feed-forward's column-parallel w1, w3 and
/// row-parallel w2), each computing in float8 where the conversion chose it.
#[derive(Clone, Copy)]
pub(super) struct BlockLinears {
    linears: [Option<Linear>; BlockProjection::ALL.len()],
    /// LoRA's rank and output scale (None without adapters).
    lora: Option<(usize, f32)>,
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
        BlockLinears {
            linears,
            lora: None,
        }
    }

    /// These projections with LoRA's rank and scale (`lora`: the model's `[lora]`).
    pub(super) fn with_lora(self, lora: Option<&LoraArgs>) -> Self {
        BlockLinears {
            lora: lora.map(|l| (l.rank, l.scale())),
            ..self
        }
    }

    /// The adapter whose factors are `ids` among the parameters `p`.
    fn adapter<'p, B: Backend>(&self, p: &'p [B::Buf], ids: LoraIds) -> Adapter<'p, B> {
        let (rank, scale) = self
            .lora
            .expect("a block with adapters knows LoRA's rank (a titan bug)");
        Adapter {
            a: &p[ids.a],
            b: &p[ids.b],
            rank,
            scale,
        }
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
    /// Which block runs (its features: `ModelArgs::window_at`).
    pub(super) layer: usize,
    pub(super) id: &'r LayerIds,
    pub(super) linears: BlockLinears,
    pub(super) sp: SequenceParallel<'r, B>,
    pub(super) batch: usize,
    pub(super) seq: usize,
    pub(super) save: BlockSave,
    pub(super) pass: Pass,
    /// Whether a mixture of experts gathers its auxiliary-loss statistics (not in generation).
    pub(super) aux_stats: bool,
    /// bf16 mixed precision: each activation is rounded to bf16 where it is produced
    /// (`BlockActs::round`), as PyTorch's bf16 ops store theirs.
    pub(super) rounds_to_bf16: bool,
}

impl<'r, B: Backend> BlockRun<'r, B> {
    /// Whether this run computes `act`.
    pub(super) fn redo(&self, act: Act) -> bool {
        self.pass != Pass::RecomputeMissing || !self.save.keeps(act)
    }

    /// The block's projection `p`.
    pub(super) fn linear(&self, p: BlockProjection) -> Linear {
        self.linears.get(p)
    }

    /// Under bf16 mixed precision, the activations of `which` that this run computes rounded to
    /// bf16 in place, right after the op that produced them (PyTorch's bf16 ops store their
    /// outputs in bf16): the ops after it, a recompute and the backward then read the values the
    /// block keeps packed. An f32 run leaves them.
    pub(super) fn round(&self, acts: &mut BlockActs<'_, B>, which: &[Act]) {
        if !self.rounds_to_bf16 {
            return;
        }
        for &act in which.iter().filter(|&&a| self.redo(a)) {
            let buf = acts.get_mut(act);
            if self.be.len(buf) > 0 {
                self.be.round_to_bf16(buf);
            }
        }
    }

    /// Projection `p`'s forward into `y`: its linear, weight, LoRA adapter and bias.
    pub(super) fn projection<'y>(&self, p: BlockProjection, y: &'y mut B::Buf) -> Projection<'y, B>
    where
        'r: 'y,
    {
        let id = self.id.projection(p).expect("the block has the projection");
        let lora = self
            .id
            .adapter(p)
            .map(|ids| self.linears.adapter(self.p, ids));
        let bias = self.id.bias(p).map(|b| &self.p[b]);
        Projection::new(self.linear(p), &self.p[id], y)
            .with_lora(lora)
            .with_bias(bias)
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
    pub(super) layer: usize,
    pub(super) id: &'r LayerIds,
    pub(super) linears: BlockLinears,
    pub(super) sp: SequenceParallel<'r, B>,
    pub(super) batch: usize,
    pub(super) seq: usize,
}

impl<'r, B: Backend> BackwardRun<'r, B> {
    /// The block's projection `p`.
    pub(super) fn linear(&self, p: BlockProjection) -> Linear {
        self.linears.get(p)
    }

    /// The backward of each projection `p` with its output gradient `dy`: the weight, where its
    /// gradient goes (empty when frozen), its LoRA adapter's factors and gradients, and its
    /// bias's gradient, all borrowed from `grads` at once.
    pub(super) fn projection_grads<'g, const N: usize>(
        &self,
        grads: &'g mut ParamSet<B>,
        each: [(BlockProjection, &'g B::Buf); N],
    ) -> [ProjectionGrad<'g, B>; N]
    where
        'r: 'g,
    {
        let mut slots: Vec<Option<&'g mut B::Buf>> = grads.bufs.iter_mut().map(Some).collect();
        let mut take = |i: usize| {
            slots[i]
                .take()
                .expect("a block's projections and adapters are distinct parameters")
        };
        each.map(|(p, dy)| {
            let id = self.id.projection(p).expect("the block has the projection");
            let dw = take(id);
            let lora = self.id.adapter(p).map(|ids| AdapterGrad {
                adapter: self.linears.adapter(self.p, ids),
                grads: AdapterGrads {
                    da: take(ids.a),
                    db: take(ids.b),
                },
                ids,
            });
            let db = self.id.bias(p).map(&mut take);
            ProjectionGrad::new(self.linear(p), dy, &self.p[id], dw, id)
                .with_lora(lora)
                .with_bias(db)
        })
    }
}

/// A norm weight's gradient buffer `grad`, or when the weight is frozen (LoRA: an empty
/// gradient) a spare one of `width` zeros in `spare`: the norm's backward computes its weight's
/// gradient in the same pass as its input's, and a frozen weight's is dropped.
pub(super) fn frozen_or<'g, B: Backend>(
    be: &B,
    grad: &'g mut B::Buf,
    spare: &'g mut Option<B::Buf>,
    width: usize,
) -> &'g mut B::Buf {
    if be.len(grad) > 0 {
        grad
    } else {
        spare.insert(be.zeros(width))
    }
}
