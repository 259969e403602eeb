//! `ResidualStream`: the residual stream at every block input a rank holds (`resid[l]` is block
//! `l`'s input; the last entry the final norm's), stored in f32 or, under bf16 mixed precision
//! (`ResidualDtype::BFloat16`), rounded to bf16 and packed two values to a word, as a bf16 block
//! output is in PyTorch. Packed, the stream is half the memory of the blocks' saved inputs (under
//! full activation checkpointing, nearly all a block keeps), and a pipeline stage sends the packed
//! words.
//!
//! The blocks compute in f32 either way: the block running reads its input unpacked into `input`
//! and writes its output into `output`, which `commit` rounds and packs into the next entry. Both
//! are transient (one pair per rank, lent with the other transient buffers under a pipeline).
//! In f32 the entries are read and written in place, with no copy.

use crate::backend::Backend;
use crate::model::activation_checkpoint::{ActivationPlan, ResidualDtype};

/// The residual stream of one workspace (see the module doc).
pub(super) struct ResidualStream<B: Backend> {
    /// Entry `l`: block `l`'s input, as stored (empty where the rank holds none).
    entries: Vec<B::Buf>,
    /// Values of one entry (this rank's rows × dim).
    values: usize,
    dtype: ResidualDtype,
    /// bf16: the unpacked values of entry `unpacked`, which the block running reads.
    input: B::Buf,
    unpacked: Option<usize>,
    /// bf16: the block running's output in f32, until `commit` stores it.
    output: B::Buf,
}

impl<B: Backend> ResidualStream<B> {
    /// The entries `plan` holds, of `values` each, with the unpacked pair when `transient`.
    pub(super) fn allocate(be: &B, plan: &ActivationPlan, values: usize, transient: bool) -> Self {
        let dtype = plan.residual;
        let stored = stored_len(dtype, values);
        let unpacked = |len| match dtype {
            ResidualDtype::BFloat16 if transient => be.zeros(len),
            _ => be.zeros(0),
        };
        ResidualStream {
            entries: (0..=plan.blocks.len())
                .map(|l| be.zeros(if plan.holds_block_input(l) { stored } else { 0 }))
                .collect(),
            values,
            dtype,
            input: unpacked(values),
            unpacked: None,
            output: unpacked(values),
        }
    }

    /// Length of one entry as stored (and sent between pipeline stages).
    pub(super) fn stored_len(&self) -> usize {
        stored_len(self.dtype, self.values)
    }

    /// Entry `l`'s values in f32.
    pub(super) fn read(&mut self, be: &B, l: usize) -> &B::Buf {
        match self.dtype {
            ResidualDtype::Float32 => &self.entries[l],
            ResidualDtype::BFloat16 => {
                self.unpack(be, l);
                &self.input
            }
        }
    }

    /// Block `l`'s input in f32 and the buffer its output goes to (stored by `commit(l + 1)`).
    pub(super) fn block_io(&mut self, be: &B, l: usize) -> (&B::Buf, &mut B::Buf) {
        match self.dtype {
            ResidualDtype::Float32 => {
                let (before, after) = self.entries.split_at_mut(l + 1);
                (&before[l], &mut after[0])
            }
            ResidualDtype::BFloat16 => {
                self.unpack(be, l);
                (&self.input, &mut self.output)
            }
        }
    }

    /// The buffer entry `l`'s f32 values are written to, stored by `commit(l)`.
    pub(super) fn write(&mut self, l: usize) -> &mut B::Buf {
        match self.dtype {
            ResidualDtype::Float32 => &mut self.entries[l],
            ResidualDtype::BFloat16 => &mut self.output,
        }
    }

    /// Stores what was written for entry `l` (bf16: rounded and packed; f32: already there).
    pub(super) fn commit(&mut self, be: &B, l: usize) {
        if self.dtype == ResidualDtype::BFloat16 {
            let stored = self.stored_len();
            if be.len(&self.entries[l]) != stored {
                self.entries[l] = be.uninit(stored);
            }
            be.pack_bf16_pairs(&mut self.entries[l], &self.output);
            if self.unpacked == Some(l) {
                self.unpacked = None;
            }
        }
    }

    /// Entry `l` as stored (what a pipeline stage sends).
    pub(super) fn stored(&self, l: usize) -> &B::Buf {
        &self.entries[l]
    }

    /// Sets entry `l` to `stored`, in the stored form (what a pipeline stage receives).
    pub(super) fn receive(&mut self, l: usize, stored: B::Buf) {
        self.entries[l] = stored;
        if self.unpacked == Some(l) {
            self.unpacked = None;
        }
    }

    /// Swaps the unpacked pair with `other`'s (`Workspace::trade_transient`).
    pub(super) fn trade_transient(&mut self, other: &mut Self) {
        std::mem::swap(&mut self.input, &mut other.input);
        std::mem::swap(&mut self.output, &mut other.output);
        self.unpacked = None;
        other.unpacked = None;
    }

    /// Values of every buffer (the estimate's unit test).
    #[cfg(test)]
    pub(super) fn allocated(&self, be: &B) -> usize {
        let pair = be.len(&self.input) + be.len(&self.output);
        self.entries.iter().map(|b| be.len(b)).sum::<usize>() + pair
    }

    fn unpack(&mut self, be: &B, l: usize) {
        if self.unpacked != Some(l) {
            be.unpack_bf16_pairs(&mut self.input, &self.entries[l]);
            self.unpacked = Some(l);
        }
    }
}

/// Length of a stored entry of `values` values: bf16 pairs take half the words (rounded up).
pub(super) fn stored_len(dtype: ResidualDtype, values: usize) -> usize {
    match dtype {
        ResidualDtype::Float32 => values,
        ResidualDtype::BFloat16 => values.div_ceil(2),
    }
}
