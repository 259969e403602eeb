//! Token embeddings: the table lookup, and its backward, for which the host groups the tokens by
//! id (`TokenGroups`) so that each table row adds its tokens' gradient rows in token order: the
//! CPU's order, on every run, with no atomics.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::{row_threads, rows_config, CudaBackend};

impl CudaBackend {
    /// Token ids of an embedding table of `vocab` rows on the device (None when there are none);
    /// an id outside the table panics, as on the CPU.
    fn upload_table_ids(&self, ids: &[u32], vocab: usize) -> Option<CudaSlice<u32>> {
        check_table_ids(ids, vocab);
        (!ids.is_empty()).then(|| self.upload_ids(ids))
    }

    pub(super) fn embedding_forward_untimed(
        &self,
        out: &mut Buf,
        table: &Buf,
        ids: &[u32],
        dim: usize,
    ) {
        check_len("embedding_forward", "out", out.len(), ids.len() * dim);
        let Some(dev_ids) = self.upload_table_ids(ids, table.len() / dim) else {
            return;
        };
        let d = dim as i32;
        launch!(
            self,
            "embedding_forward",
            rows_config(ids.len(), row_threads(dim).min(256)),
            out,
            table,
            &dev_ids,
            &d
        );
    }

    /// `out[r] = table[ids[r]]` with the ids already on the device (a mixture of experts'
    /// dispatch order, in range by construction: `moe_dispatch_order` writes them).
    pub(super) fn gather_rows_untimed(&self, out: &mut Buf, table: &Buf, ids: &Buf, width: usize) {
        let rows = ids.len();
        check_len("gather_rows", "out", out.len(), rows * width);
        if rows == 0 || width == 0 {
            return;
        }
        let d = width as i32;
        launch!(
            self,
            "embedding_forward",
            rows_config(rows, row_threads(width).min(256)),
            out,
            table,
            ids,
            &d
        );
    }

    pub(super) fn embedding_backward_untimed(
        &self,
        dtable: &mut Buf,
        dout: &Buf,
        ids: &[u32],
        dim: usize,
    ) {
        check_len("embedding_backward", "dout", dout.len(), ids.len() * dim);
        check_table_ids(ids, dtable.len() / dim.max(1));
        if ids.is_empty() || dim == 0 {
            return;
        }
        let groups = TokenGroups::of(ids);
        if groups.rows.is_empty() {
            return;
        }
        let (rows, starts, order) = (
            self.upload_ids(&groups.rows),
            self.upload_ids(&groups.starts),
            self.upload_ids(&groups.order),
        );
        let d = dim as i32;
        let cfg = LaunchConfig {
            grid_dim: (groups.rows.len() as u32, dim.div_ceil(256) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "embedding_backward",
            cfg,
            dtable,
            dout,
            &rows,
            &starts,
            &order,
            &d
        );
    }
}

/// Panics, as the CPU does, when an id is outside an embedding table of `vocab` rows
/// (`IGNORE_INDEX`, another rank's token, is not).
fn check_table_ids(ids: &[u32], vocab: usize) {
    let outside = |&&id: &&u32| id != crate::backend::IGNORE_INDEX && id as usize >= vocab;
    if let Some(&bad) = ids.iter().find(outside) {
        panic!("token id {bad} is outside the embedding table of {vocab} rows");
    }
}

/// Token positions grouped by id for the embedding backward: group g is table row `rows[g]`, with
/// tokens `order[starts[g]..starts[g + 1]]` in increasing position (a stable sort by id). Tokens
/// of `IGNORE_INDEX` (another rank's vocabulary) are in no group.
struct TokenGroups {
    rows: Vec<u32>,
    starts: Vec<u32>,
    order: Vec<u32>,
}

impl TokenGroups {
    fn of(ids: &[u32]) -> Self {
        let mut order: Vec<u32> = (0..ids.len() as u32)
            .filter(|&t| ids[t as usize] != crate::backend::IGNORE_INDEX)
            .collect();
        order.sort_by_key(|&t| ids[t as usize]);
        let (mut rows, mut starts) = (Vec::new(), Vec::new());
        for (i, &t) in order.iter().enumerate() {
            let id = ids[t as usize];
            if rows.last() != Some(&id) {
                rows.push(id);
                starts.push(i as u32);
            }
        }
        starts.push(order.len() as u32);
        TokenGroups {
            rows,
            starts,
            order,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TokenGroups;

    #[test]
    fn token_groups_keep_positions_in_order_within_each_id() {
        let g = TokenGroups::of(&[5, 2, 5, 9, 2, 5]);
        assert_eq!(g.rows, vec![2, 5, 9]);
        assert_eq!(g.starts, vec![0, 2, 5, 6]);
        assert_eq!(g.order, vec![1, 4, 0, 2, 5, 3]);
        let skip = crate::backend::IGNORE_INDEX;
        let g = TokenGroups::of(&[skip, 2, skip, 2]);
        assert_eq!(
            (g.rows, g.starts, g.order),
            (vec![2], vec![0, 2], vec![1, 3])
        );
    }
}
