//! Token embedding lookup and its scatter-add backward. An id of `IGNORE_INDEX` is a token of
//! another rank's vocabulary shard: a zero row, and no gradient.
//!
//! Both check what they are given before touching memory (ids within the table, buffers long
//! enough) and panic with a message naming the kernel, the id and its position: token ids from
//! data are checked as errors before they reach a kernel (`Decoder::load_tokens`), so a failed check
//! here is a bug in titan, never undefined behaviour.

use rayon::prelude::*;

use super::COLUMN_BLOCK;
use crate::backend::IGNORE_INDEX;

/// Panics unless every id but `IGNORE_INDEX` is a row of a table of `table_len` floats of rows
/// of `dim`, and `rows_len` (the per-token buffer) holds `ids.len()` rows: the kernels' API
/// boundary, checked before any index.
fn check_shapes(kernel: &str, table_len: usize, rows_len: usize, ids: &[u32], dim: usize) {
    assert!(dim > 0, "{kernel}: the embedding width is 0");
    let vocab = table_len / dim;
    let need = ids.len().checked_mul(dim);
    assert!(
        need.is_some_and(|n| n <= rows_len),
        "{kernel}: {} ids of width {dim} need {} floats, the buffer holds {rows_len}",
        ids.len(),
        ids.len().saturating_mul(dim)
    );
    if let Some(t) = ids
        .iter()
        .position(|&id| id != IGNORE_INDEX && id as usize >= vocab)
    {
        panic!(
            "{kernel}: token id {} at position {t} is outside the embedding table of {vocab} rows",
            ids[t]
        );
    }
}

pub fn embedding_forward(out: &mut [f32], table: &[f32], ids: &[u32], dim: usize) {
    check_shapes("embedding_forward", table.len(), out.len(), ids, dim);
    out[..ids.len() * dim]
        .par_chunks_mut(dim)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            if id == IGNORE_INDEX {
                row.fill(0.0);
                return;
            }
            let id = id as usize;
            row.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        });
}

/// Each task owns a block of columns and walks the tokens in order, so repeated ids add up in the
/// same order whatever the thread count (bitwise determinism).
pub fn embedding_backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) {
    // The scatter below writes through a raw pointer: every id must be a row of `dtable`.
    check_shapes("embedding_backward", dtable.len(), dout.len(), ids, dim);
    let blocks = dim.div_ceil(COLUMN_BLOCK);
    let table = super::SendPtr(dtable.as_mut_ptr());
    (0..blocks).into_par_iter().for_each(|blk| {
        let c0 = blk * COLUMN_BLOCK;
        let c1 = (c0 + COLUMN_BLOCK).min(dim);
        for (t, &id) in ids.iter().enumerate().filter(|(_, &id)| id != IGNORE_INDEX) {
            let src = &dout[t * dim + c0..t * dim + c1];
            // SAFETY: column blocks are disjoint across tasks, and `check_shapes` proved
            // `id < dtable.len() / dim`, so the row lies inside `dtable`.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(table.get().add(id as usize * dim + c0), c1 - c0)
            };
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
    });
}
