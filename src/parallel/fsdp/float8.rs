//! FSDP's float8 all-gather (`[quantize.linear.float8] enable_fsdp_float8_all_gather`, torchao's
//! float8 weights under FSDP2, tensorwise recipe): each rank casts its shard of a converted
//! linear's weight to e4m3 with the scale of the whole weight and all-gathers the 8-bit codes (a
//! quarter of the fp32 shard's bytes, `float8::encode_words`); the gathered codes are dequantised
//! into the full weight, which the linear's GEMMs read as it is
//! (`Linear::weight_gathered_in_float8`).
//!
//! The scale is the whole weight's: the shards' amaxes are agreed (largest, NaN kept) over the
//! shard group, through its queue, and, for a weight tensor parallelism splits, over the
//! tensor-parallel group. Every value is then cast exactly as the tensorwise linear casts its
//! gathered weight, `round(clamp(w · s)) · (1/s)`, so the step's numbers are those without the
//! option, bit for bit (fp32 parameters; under bf16 mixed precision the codes are cast from the
//! fp32 shards, as torchao casts the sharded master weight).
//!
//! When: before each forward-backward pass (one small all-gather of amaxes per pass), or with
//! `precompute_float8_dynamic_scale_for_fsdp` once per weight update (the first pass after the
//! optimizer step agrees every weight's scale; the passes after it reuse them).

use std::sync::Arc;

use anyhow::{bail, Result};

use super::{Fsdp, StartedGather};
use crate::backend::float8::{scale_from_amax, Fp8Format, ScaleAxis, CODES_PER_WORD};
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::model::ParamSet;
use crate::parallel::amax::{all_reduce_amax, infinity_as_nan, nan_as_infinity};

/// The format the weights travel in (the tensorwise recipe's for `W`).
const FORMAT: Fp8Format = Fp8Format::E4M3;

/// Which weights FSDP gathers in float8, and their scales for the current weights.
pub struct Float8Gather {
    /// Whether each parameter gathers as float8 codes.
    gathered: Vec<bool>,
    /// The group tensor parallelism splits the weights over (their scales are the whole
    /// weight's); None without.
    tensor_parallel: Option<Arc<dyn ProcessGroup>>,
    precompute: bool,
    /// Each parameter's scale (by id; 1 for the others), None until agreed for these weights.
    scales: Option<Vec<f32>>,
    /// Scale agreements so far: one per pass, or one per weight update with `precompute`.
    pub agreements: u64,
}

impl Float8Gather {
    /// The weights `weights` (parameter ids, of `n_params`) gathered in float8, their amaxes also
    /// agreed over `tensor_parallel`, their scales agreed once per weight update when
    /// `precompute`.
    pub fn new(
        n_params: usize,
        weights: &[usize],
        tensor_parallel: Option<Arc<dyn ProcessGroup>>,
        precompute: bool,
    ) -> Self {
        let mut gathered = vec![false; n_params];
        for &i in weights {
            gathered[i] = true;
        }
        Float8Gather {
            gathered,
            tensor_parallel,
            precompute,
            scales: None,
            agreements: 0,
        }
    }
}

impl<B: Backend> Fsdp<B> {
    /// Gathers the weights `gather` names as float8 from the next pass on. They are linears'
    /// weights (the blocks', and a float8 head's unless tied to the embedding), all in the first
    /// shard group (never routed experts).
    pub fn gather_in_float8(&mut self, gather: Float8Gather) {
        assert!(
            (0..self.numel.len()).all(|i| !gather.gathered[i] || self.group_of[i] == 0),
            "FSDP float8 all-gather: a routed expert's weight among the linears (a titan bug)"
        );
        self.float8 = Some(gather);
    }

    /// Whether parameter `i` travels as float8 codes.
    pub(super) fn gathers_in_float8(&self, i: usize) -> bool {
        self.float8.as_ref().is_some_and(|g| g.gathered[i])
    }

    /// The weights this rank holds changed (the optimizer step): scales agreed for the old
    /// ones no longer hold.
    pub fn weights_changed(&mut self) {
        if let Some(g) = self.float8.as_mut() {
            g.scales = None;
        }
    }

    /// Before a pass: the float8 weights' scales agreed, unless precomputed ones still hold.
    /// Every rank of the shard group calls this at the same point, with no collective in flight.
    pub(super) fn prepare_float8_scales(&mut self, be: &B) -> Result<()> {
        let Some(g) = self.float8.as_ref() else {
            return Ok(());
        };
        if g.precompute && g.scales.is_some() {
            return Ok(());
        }
        let ids: Vec<usize> = (0..self.numel.len())
            .filter(|&i| g.gathered[i] && self.numel[i] > 0)
            .collect();
        let local: Vec<f32> = ids
            .iter()
            .map(|&i| {
                be.float8_amaxes(
                    &self.shards.bufs[i],
                    1,
                    self.shard_len[i],
                    ScaleAxis::Tensor,
                )[0]
            })
            .collect();
        let amaxes = self.agree_amaxes(be, local)?;
        let g = self.float8.as_mut().expect("checked above");
        let mut scales = vec![1f32; self.numel.len()];
        for (&i, &a) in ids.iter().zip(&amaxes) {
            scales[i] = scale_from_amax(a, FORMAT);
        }
        g.scales = Some(scales);
        g.agreements += 1;
        Ok(())
    }

    /// The largest of each of `local` (this rank's shards' amaxes) over the shard group and,
    /// for split weights, the tensor-parallel group; NaN when any rank's is. Over the shard
    /// group the exchange is an all-gather through its queue (the only user of its connections).
    fn agree_amaxes(&mut self, be: &B, mut local: Vec<f32>) -> Result<Vec<f32>> {
        let n = local.len();
        if n == 0 {
            return Ok(local);
        }
        if !self.pending.is_empty() {
            bail!("FSDP: float8 scales agreed with collectives in flight (a titan bug)");
        }
        // A maximum drops NaN: it travels as +inf and comes back as NaN (as `all_reduce_amax`).
        nan_as_infinity(&mut local);
        let queue = &mut self.groups[0].queue;
        queue.start_gather(be, be.upload(&local))?;
        let all = be.download(&queue.finish_oldest(be)?);
        let mut agreed = vec![0f32; n];
        for part in all.chunks(n) {
            for (a, &v) in agreed.iter_mut().zip(part) {
                *a = a.max(v);
            }
        }
        infinity_as_nan(&mut agreed);
        if let Some(tp) = self.float8.as_ref().and_then(|g| g.tensor_parallel.clone()) {
            all_reduce_amax(tp.as_ref(), &mut agreed)?;
        }
        Ok(agreed)
    }

    /// The scale of float8 weight `i` for the current weights.
    fn float8_scale(&self, i: usize) -> Result<f32> {
        match self.float8.as_ref().and_then(|g| g.scales.as_ref()) {
            Some(scales) => Ok(scales[i]),
            None => {
                bail!("FSDP: a float8 weight gathered before its scale was agreed (a titan bug)")
            }
        }
    }

    /// This rank's shards of the float8 weights `ids` as codes, back to back, each shard starting
    /// a word of its own.
    pub(super) fn pack_float8(&self, be: &B, ids: &[usize]) -> Result<B::Buf> {
        let words: usize = ids.iter().map(|&i| codes_words(self.shard_len[i])).sum();
        let mut packed = be.uninit(words);
        let mut at = 0;
        for &i in ids {
            let codes = be.float8_encoded(&self.shards.bufs[i], self.float8_scale(i)?, FORMAT);
            let n = codes_words(self.shard_len[i]);
            be.copy_range(&mut packed, at, &codes, 0, n);
            at += n;
        }
        Ok(packed)
    }

    /// The full float8 weights of a finished gather of codes (`output`, every rank's packed
    /// codes in rank order) into `full`, dequantised with their scales.
    pub(super) fn unpack_float8(
        &self,
        be: &B,
        started: &StartedGather,
        output: &B::Buf,
        full: &mut ParamSet<B>,
    ) -> Result<()> {
        let values = be.float8_decoded(output, FORMAT);
        self.unpack_values(be, started, &values, full, |i| {
            Some(codes_words(self.shard_len[i]) * CODES_PER_WORD)
        });
        for &i in &started.ids {
            be.scale(&mut full.bufs[i], self.float8_scale(i)?.recip());
        }
        Ok(())
    }
}

/// Words of codes a shard of `len` values packs into.
fn codes_words(len: usize) -> usize {
    len.div_ceil(CODES_PER_WORD)
}
