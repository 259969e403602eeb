//! The vocabulary-parallel loss's steps on one rank's shard of the vocabulary (tensor
//! parallelism's loss parallel, `parallel::tp`): each rank holds `vocab` logits of every row,
//! starting at vocabulary id `offset`. The row maxima, then the sums of exponentials and the
//! target logits, are combined over the tensor-parallel group between the steps, so no rank ever
//! holds a whole row; the sums of exponentials accumulate in f64 and travel as f32.

use rayon::prelude::*;

use crate::backend::{LossSum, VocabShard, IGNORE_INDEX};

/// Each row's maximum over the shard (`logits` `[rows, vocab]`).
pub fn row_max(logits: &[f32], shard: VocabShard) -> Vec<f32> {
    logits
        .par_chunks(shard.vocab)
        .map(|row| row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)))
        .collect()
}

/// With each row's maximum over the whole vocabulary: the shard's sum of `exp(logit − max)` and
/// the target's logit when it lies in the shard (else 0), `[rows, 2]`.
pub fn row_sums(logits: &[f32], max: &[f32], targets: &[u32], shard: VocabShard) -> Vec<f32> {
    let VocabShard { vocab, offset } = shard;
    let mut sums = vec![0.0f32; 2 * targets.len()];
    sums.par_chunks_mut(2)
        .zip(logits.par_chunks(vocab))
        .enumerate()
        .for_each(|(r, (out, row))| {
            out[0] = row
                .iter()
                .map(|&x| ((x - max[r]) as f64).exp())
                .sum::<f64>() as f32;
            let t = targets[r] as usize;
            if targets[r] != IGNORE_INDEX && (offset..offset + vocab).contains(&t) {
                out[1] = row[t - offset];
            }
        });
    sums
}

/// The shard's loss step: what `Backend::vocab_shard_loss` does, on host buffers.
pub fn add_losses(
    logits: &mut [f32],
    (max, sums): (&[f32], &[f32]),
    targets: &[u32],
    shard: VocabShard,
    (grad_scale, want_grad): (f32, bool),
    total: &mut LossSum,
) {
    let VocabShard { vocab, offset } = shard;
    for (r, &t) in targets.iter().enumerate() {
        if t != IGNORE_INDEX {
            total.sum += (sums[2 * r] as f64).ln() + max[r] as f64 - sums[2 * r + 1] as f64;
            total.count += 1;
        }
    }
    if !want_grad {
        return;
    }
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .enumerate()
        .for_each(|(r, (row, &t))| {
            if t == IGNORE_INDEX {
                row.fill(0.0);
                return;
            }
            let (max, sum) = (max[r], sums[2 * r] as f64);
            let scale = grad_scale as f64 / sum;
            for x in row.iter_mut() {
                *x = (((*x - max) as f64).exp() * scale) as f32;
            }
            let t = t as usize;
            if (offset..offset + vocab).contains(&t) {
                row[t - offset] -= grad_scale;
            }
        });
}
