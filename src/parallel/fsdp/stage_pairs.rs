//! A pipeline stage's gathered block weights held as bf16 pairs for its pass (`StagePairs`).
//!
//! Under a pipeline FSDP gathers every parameter a stage holds once for the whole pass over its
//! microbatches (`ShardedParams::per_pass`), as TorchTitan keeps a stage's parameters gathered
//! between microbatches. With bf16 mixed precision FSDP2 holds them in bf16: half the bytes of
//! f32. The blocks here compute in f32 on the CPU, so each block's weights are kept as bf16
//! pairs (exactly the gathered values: they arrived rounded to bf16) and unpacked into the
//! working set only while that block runs its forward or backward, then freed, as
//! `param_state::WholeParams` lends a block's compute copy. Weights that arrive as float8 codes
//! (dequantised values, not bf16-exact) stay as gathered.

use crate::backend::Backend;
use crate::memory_timeline::{self, Category};
use crate::model::ParamSet;

/// Per parameter: its gathered values as bf16 pairs while it is packed (see the module doc).
pub(super) struct StagePairs<B: Backend> {
    words: Vec<Option<B::Buf>>,
}

impl<B: Backend> StagePairs<B> {
    /// Nothing packed, for a model of `n_params` parameters.
    pub(super) fn new(n_params: usize) -> Self {
        StagePairs {
            words: (0..n_params).map(|_| None).collect(),
        }
    }

    /// The gathered tensors `ids` of `full` that `packable` selects, packed, their f32 values
    /// freed (empty ones, of blocks another stage runs, are left).
    pub(super) fn pack(
        &mut self,
        be: &B,
        full: &mut ParamSet<B>,
        ids: &[usize],
        packable: impl Fn(usize) -> bool,
    ) {
        for &i in ids {
            let n = be.len(&full.bufs[i]);
            if n == 0 || !packable(i) {
                continue;
            }
            let mut pairs = be.uninit(n.div_ceil(2));
            be.pack_bf16_pairs(&mut pairs, &full.bufs[i]);
            full.bufs[i] = be.zeros(0);
            memory_timeline::add(Category::GatheredBlocks, pairs_bytes(n) - 4 * n as i64);
            self.words[i] = Some(pairs);
        }
    }

    /// The packed tensors of `ids` (a block's) unpacked into `full`, for the block to compute.
    pub(super) fn lend(&self, be: &B, full: &mut ParamSet<B>, ids: &[usize], lens: &[usize]) {
        for &i in ids {
            if let Some(pairs) = self.packed(i) {
                let mut values = be.uninit(lens[i]);
                be.unpack_bf16_pairs(&mut values, pairs);
                memory_timeline::add(Category::GatheredBlocks, 4 * lens[i] as i64);
                full.bufs[i] = values;
            }
        }
    }

    /// The unpacked tensors of `ids` freed again (the packed ones stay).
    pub(super) fn take_back(&self, be: &B, full: &mut ParamSet<B>, ids: &[usize]) {
        for &i in ids.iter().filter(|&&i| self.packed(i).is_some()) {
            memory_timeline::add(Category::GatheredBlocks, -4 * be.len(&full.bufs[i]) as i64);
            full.bufs[i] = be.zeros(0);
        }
    }

    /// Frees every packed tensor (the pass is over); `lens` are the tensors' value counts.
    pub(super) fn free(&mut self, lens: &[usize]) {
        for (i, w) in self.words.iter_mut().enumerate() {
            if w.take().is_some() {
                memory_timeline::add(Category::GatheredBlocks, -pairs_bytes(lens[i]));
            }
        }
    }

    fn packed(&self, i: usize) -> Option<&B::Buf> {
        self.words.get(i).and_then(Option::as_ref)
    }
}

/// Bytes of `n` values as bf16 pairs.
fn pairs_bytes(n: usize) -> i64 {
    4 * n.div_ceil(2) as i64
}
