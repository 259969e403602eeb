//! Token embedding lookup and its scatter-add backward. An id of `IGNORE_INDEX` is a token of
//! another rank's vocabulary shard: a zero row, and no gradient.

use rayon::prelude::*;

use super::COLUMN_BLOCK;
use crate::backend::IGNORE_INDEX;

pub fn embedding_forward(out: &mut [f32], table: &[f32], ids: &[u32], dim: usize) {
    let vocab = table.len() / dim;
    out[..ids.len() * dim]
        .par_chunks_mut(dim)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            if id == IGNORE_INDEX {
                row.fill(0.0);
                return;
            }
            let id = id as usize;
            assert!(
                id < vocab,
                "token id {id} is outside the embedding table of {vocab} rows"
            );
            row.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        });
}

/// Each task owns a block of columns and walks the tokens in order, so repeated ids add up in the
/// same order whatever the thread count (bitwise determinism).
pub fn embedding_backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) {
    let blocks = dim.div_ceil(COLUMN_BLOCK);
    let table = super::SendPtr(dtable.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|blk| {
        let c0 = blk * COLUMN_BLOCK;
        let c1 = (c0 + COLUMN_BLOCK).min(dim);
        for (t, &id) in ids.iter().enumerate().filter(|(_, &id)| id != IGNORE_INDEX) {
            let src = &dout[t * dim + c0..t * dim + c1];
            // SAFETY: column blocks are disjoint across tasks.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(table.get().add(id as usize * dim + c0), c1 - c0)
            };
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
    });
}
