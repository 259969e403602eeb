//! Cross-entropy fused with the output projection, over chunks of rows.
//!
//! Each chunk computes its logits with one GEMM, turns them into softmax gradients in place, and
//! immediately pushes them back through the projection (two more GEMMs), so peak memory is one
//! `[chunk_rows, vocab]` block instead of the `[tokens, vocab]` logits (2 GiB for Llama 3 at 4k
//! tokens). The chunk holds at most `CHUNK_FLOATS` logits (32 MiB: 64 rows of Llama 3's 128k
//! vocabulary, 256 rows of the debug model's 2k). Chunking rows rather than the vocabulary keeps
//! each row's softmax exact in one pass; vocabulary chunks would need the logits computed twice.
//!
//! The cross-entropy of logits computed elsewhere (`cross_entropy_of_logits`: a float8 output
//! head, whose casts need the whole logit gradient) shares the per-chunk loss loop.

use crate::backend::{GemmOutput, GemmShape};
use rayon::prelude::*;

use super::{matmul::matmul, rows::cross_entropy_row};
use crate::backend::{LossSum, IGNORE_INDEX};

const MAX_CHUNK_ROWS: usize = 256;
const CHUNK_FLOATS: usize = 8 << 20;

/// Rows per chunk for a vocabulary size.
pub fn chunk_rows(vocab: usize) -> usize {
    (CHUNK_FLOATS / vocab.max(1)).clamp(16, MAX_CHUNK_ROWS)
}

/// Floats of scratch the loss needs for a vocabulary size.
pub fn scratch_floats(vocab: usize) -> usize {
    chunk_rows(vocab) * (vocab + 1)
}

/// The loss kernel's API boundary: every buffer long enough for its shape and every target but
/// `IGNORE_INDEX` inside the vocabulary, checked before any GEMM or index (a panic naming the
/// target and its row: targets from data are checked as errors before they reach a kernel).
fn check_shapes(
    h: &[f32],
    weight: &[f32],
    targets: &[u32],
    dim: usize,
    vocab: usize,
    grads: &Option<(&mut [f32], &mut [f32])>,
    scratch: &[f32],
) {
    let rows = targets.len();
    let (h_need, w_need) = (rows.saturating_mul(dim), vocab.saturating_mul(dim));
    let fits = |what: &str, len: usize, need: usize| {
        assert!(
            len >= need,
            "cross_entropy: {what} holds {len} floats, its shape needs {need} ({rows} rows, width {dim}, vocabulary {vocab})"
        );
    };
    fits("h", h.len(), h_need);
    fits("the output weight", weight.len(), w_need);
    fits("the scratch", scratch.len(), scratch_floats(vocab));
    if let Some((dh, dweight)) = grads {
        fits("dh", dh.len(), h_need);
        if !dweight.is_empty() {
            fits("the output weight's gradient", dweight.len(), w_need);
        }
    }
    if let Some(r) = targets
        .iter()
        .position(|&t| t != IGNORE_INDEX && t as usize >= vocab)
    {
        panic!(
            "cross_entropy: target id {} at row {r} is outside the vocabulary of {vocab}",
            targets[r]
        );
    }
}

/// `scratch` must hold `scratch_floats(vocab)` floats.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_forward_backward(
    h: &[f32],
    weight: &[f32],
    targets: &[u32],
    dim: usize,
    vocab: usize,
    grad_scale: f32,
    mut grads: Option<(&mut [f32], &mut [f32])>,
    scratch: &mut [f32],
) -> LossSum {
    check_shapes(h, weight, targets, dim, vocab, &grads, scratch);
    let rows = targets.len();
    let chunk = chunk_rows(vocab);
    let (logits, row_loss) = scratch.split_at_mut(chunk * vocab);
    let mut total = LossSum { sum: 0.0, count: 0 };
    for r0 in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - r0);
        let hc = &h[r0 * dim..(r0 + n) * dim];
        let tc = &targets[r0..r0 + n];
        let lc = &mut logits[..n * vocab];
        matmul(
            lc,
            hc,
            weight,
            GemmShape::new(n, dim, vocab).b_transposed(),
            GemmOutput::Overwrite,
        );
        let want_grad = grads.is_some();
        let rows_loss = &mut row_loss[..n];
        add_logit_losses(
            lc,
            tc,
            vocab,
            (grad_scale, want_grad),
            rows_loss,
            &mut total,
        );
        if let Some((dh, dweight)) = grads.as_mut() {
            matmul(
                &mut dh[r0 * dim..(r0 + n) * dim],
                lc,
                weight,
                GemmShape::new(n, vocab, dim),
                GemmOutput::Accumulate,
            );
            // An empty gradient is a frozen output weight (LoRA): none is computed.
            if !dweight.is_empty() {
                matmul(
                    dweight,
                    lc,
                    hc,
                    GemmShape::new(vocab, n, dim).a_transposed(),
                    GemmOutput::Accumulate,
                );
            }
        }
    }
    total
}

/// The cross-entropy of each row of `logits` (`[rows, vocab]`) against `targets`, added into
/// `total` in row order; with `want_grad` each row becomes `grad_scale · ∂(loss)/∂logits` (zero
/// for an ignored target), else it is left scratch. `row_loss` holds a float per row.
pub fn add_logit_losses(
    logits: &mut [f32],
    targets: &[u32],
    vocab: usize,
    (grad_scale, want_grad): (f32, bool),
    row_loss: &mut [f32],
    total: &mut LossSum,
) {
    logits
        .par_chunks_mut(vocab)
        .zip(row_loss.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|((row, loss), &t)| {
            if t == IGNORE_INDEX {
                *loss = f32::NAN; // marker: not counted
                if want_grad {
                    row.fill(0.0);
                }
                return;
            }
            *loss = cross_entropy_row(row, t as usize, grad_scale, want_grad);
        });
    for &l in row_loss.iter() {
        if !l.is_nan() {
            total.sum += l as f64;
            total.count += 1;
        }
    }
}

/// `add_logit_losses` over a whole block of logits, whose every target (`IGNORE_INDEX` aside) is
/// inside the vocabulary (a panic naming it otherwise: targets from data are checked as errors
/// before they reach a kernel).
pub fn cross_entropy_of_logits(
    logits: &mut [f32],
    targets: &[u32],
    vocab: usize,
    grad_scale: f32,
    want_grad: bool,
) -> LossSum {
    let rows = targets.len();
    assert!(
        logits.len() >= rows.saturating_mul(vocab),
        "cross_entropy_of_logits: the logits hold {} floats, {rows} rows of vocabulary {vocab} need {}",
        logits.len(),
        rows.saturating_mul(vocab)
    );
    if let Some(r) = targets
        .iter()
        .position(|&t| t != IGNORE_INDEX && t as usize >= vocab)
    {
        panic!(
            "cross_entropy_of_logits: target id {} at row {r} is outside the vocabulary of {vocab}",
            targets[r]
        );
    }
    let mut total = LossSum { sum: 0.0, count: 0 };
    let mut row_loss = vec![0f32; rows];
    let logits = &mut logits[..rows * vocab];
    add_logit_losses(
        logits,
        targets,
        vocab,
        (grad_scale, want_grad),
        &mut row_loss,
        &mut total,
    );
    total
}
