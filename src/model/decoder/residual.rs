//! `ResidualStream`: the residual stream at every block input a rank holds (`resid[l]` is block
//! `l`'s input; the last entry the final norm's), stored in f32 or, under bf16 mixed precision
//! (`ActivationDtype::BFloat16`), rounded to bf16 and packed two values to a word, as a bf16 block
//! output is in PyTorch. Packed, the stream is half the memory of the blocks' saved inputs (under
//! full activation checkpointing, nearly all a block keeps), and a pipeline stage sends the packed
//! words.
//!
//! The blocks compute in f32 either way: the block running reads its input unpacked into `input`
//! and writes its output into `output`, which `commit` rounds and packs into the next entry. Both
//! are transient (one pair per rank, lent with the other transient buffers under a pipeline).
//! In f32 the entries are read and written in place, with no copy.

use crate::backend::Backend;
use crate::model::activation_checkpoint::{ActivationDtype, ActivationPlan};

/// The residual stream of one workspace (see the module doc).
pub(super) struct ResidualStream<B: Backend> {
    /// Entry `l`: block `l`'s input, as stored (empty where the rank holds none).
    entries: Vec<B::Buf>,
    /// Values of one entry (this rank's rows × dim).
    values: usize,
    dtype: ActivationDtype,
    /// bf16: the unpacked values of entry `unpacked`, which the block running reads.
    input: B::Buf,
    unpacked: Option<usize>,
    /// bf16: the block running's output in f32, until `commit` stores it.
    output: B::Buf,
}

impl<B: Backend> ResidualStream<B> {
    /// The entries `plan` holds, of `values` each, with the unpacked pair when `transient`.
    pub(super) fn allocate(be: &B, plan: &ActivationPlan, values: usize, transient: bool) -> Self {
        let dtype = plan.dtype;
        let stored = stored_len(dtype, values);
        let unpacked = |len| match dtype {
            ActivationDtype::BFloat16 if transient => be.zeros(len),
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
            ActivationDtype::Float32 => &self.entries[l],
            ActivationDtype::BFloat16 => {
                self.unpack(be, l);
                &self.input
            }
        }
    }

    /// Block `l`'s input in f32 and the buffer its output goes to (stored by `commit(l + 1)`).
    pub(super) fn block_io(&mut self, be: &B, l: usize) -> (&B::Buf, &mut B::Buf) {
        match self.dtype {
            ActivationDtype::Float32 => {
                let (before, after) = self.entries.split_at_mut(l + 1);
                (&before[l], &mut after[0])
            }
            ActivationDtype::BFloat16 => {
                self.unpack(be, l);
                (&self.input, &mut self.output)
            }
        }
    }

    /// The buffer entry `l`'s f32 values are written to, stored by `commit(l)`.
    pub(super) fn write(&mut self, l: usize) -> &mut B::Buf {
        match self.dtype {
            ActivationDtype::Float32 => &mut self.entries[l],
            ActivationDtype::BFloat16 => &mut self.output,
        }
    }

    /// Stores what was written for entry `l` (bf16: rounded and packed; f32: already there).
    pub(super) fn commit(&mut self, be: &B, l: usize) {
        if self.dtype == ActivationDtype::BFloat16 {
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
pub(super) fn stored_len(dtype: ActivationDtype, values: usize) -> usize {
    match dtype {
        ActivationDtype::Float32 => values,
        ActivationDtype::BFloat16 => values.div_ceil(2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::activation_checkpoint::AcMode;
    use crate::model::decoder::{Decoder, Workspace};
    use crate::model::init_params;
    use crate::model::local_shapes::LocalShapes;

    /// In bf16 each block's output is stored in bf16 (rounding it again changes nothing), at half
    /// the words, near the f32 stream's (the block computes from bf16-rounded activations, so
    /// not exactly its rounding); the loss stays close to f32's. With full checkpointing the
    /// recompute reads the stored input, so the backward sees what the forward saw.
    #[test]
    fn a_bf16_stream_stores_each_block_output_rounded_at_half_the_words() {
        let be = CpuBackend::new();
        let args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        let (batch, seq) = (2, 16);
        let model = Decoder::new(&be, args.clone(), seq).unwrap();
        // The weights as bf16 mixed precision computes with them: the embedding's rows, so block
        // 0's input, are bf16 values either way.
        let mut params = init_params(&be, &args, 7);
        params.bufs.iter_mut().for_each(|b| be.round_to_bf16(b));
        let tokens: Vec<u32> = (0..batch * (seq + 1))
            .map(|i| (i * 37 % args.vocab_size) as u32)
            .collect();
        let m = LocalShapes::whole(&args);
        let run = |dtype| {
            let plan = AcMode::Full.plan(args.n_layers).with_dtype(dtype);
            let mut ws = Workspace::planned(&be, &m, batch, seq, plan);
            let loss = model.loss(&be, &params, &mut ws, &tokens).unwrap();
            (loss.sum / loss.count as f64, ws)
        };
        let (exact, mut f32_ws) = run(ActivationDtype::Float32);
        let (rounded, mut bf16_ws) = run(ActivationDtype::BFloat16);
        let values = batch * seq * args.dim;
        assert_eq!(be.len(bf16_ws.resid.stored(1)), values / 2);
        assert_eq!(be.len(f32_ws.resid.stored(1)), values);
        let exact_out = f32_ws.resid.read(&be, 1).clone();
        let stored = bf16_ws.resid.read(&be, 1).clone();
        let mut again = stored.clone();
        be.round_to_bf16(&mut again);
        assert!(stored == again, "block 0's output is stored in bf16");
        let scale = exact_out.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let worst = stored
            .iter()
            .zip(&exact_out)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst > 0.0 && worst < 0.02 * scale,
            "block 0's output: bf16 {worst} from f32's (largest value {scale})"
        );
        let last = bf16_ws.resid.read(&be, args.n_layers).clone();
        let mut again = last.clone();
        be.round_to_bf16(&mut again);
        assert!(last == again, "the last block's output is stored in bf16");
        assert_ne!(exact, rounded, "the rounding is real");
        assert!(
            (exact - rounded).abs() < 1e-2 * exact,
            "{exact} vs {rounded}"
        );
    }
}
