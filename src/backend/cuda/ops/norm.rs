//! RMSNorm forward and backward: one warp per row; the weight gradient is summed over fixed chunks
//! of rows, then across the chunks, so every SM has work and the order never changes.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::kernels::NORM_WARPS;
use crate::backend::cuda::CudaBackend;

impl CudaBackend {
    pub(super) fn rmsnorm_forward_untimed(
        &self,
        out: &mut Buf,
        rstd: &mut Buf,
        x: &Buf,
        weight: &Buf,
        dim: usize,
        eps: f32,
    ) {
        let rows = x.len() / dim;
        check_len("rmsnorm_forward", "out", out.len(), rows * dim);
        check_len("rmsnorm_forward", "rstd", rstd.len(), rows);
        check_len("rmsnorm_forward", "weight", weight.len(), dim);
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let (twin, out32, out16) = self.begin_output(out, rows * dim, "rmsnorm_forward", true);
        launch!(
            self,
            "rmsnorm_forward",
            norm_rows_config(rows),
            &out32,
            &out16,
            rstd,
            x,
            weight,
            &r,
            &d,
            &eps
        );
        Self::keep_twin(out, twin);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_backward_untimed(
        &self,
        dx: &mut Buf,
        dweight: &mut Buf,
        dout: &Buf,
        x: &Buf,
        weight: &Buf,
        rstd: &Buf,
        dim: usize,
    ) {
        let rows = x.len() / dim;
        check_len("rmsnorm_backward", "dx", dx.len(), rows * dim);
        check_len("rmsnorm_backward", "dout", dout.len(), rows * dim);
        check_len("rmsnorm_backward", "rstd", rstd.len(), rows);
        check_len("rmsnorm_backward", "dweight", dweight.len(), dim);
        if rows == 0 {
            return;
        }
        let (r, d) = (rows as i32, dim as i32);
        let (twin, dx32, dx16) = self.begin_output(dx, rows * dim, "rmsnorm_backward", false);
        launch!(
            self,
            "rmsnorm_backward_dx",
            norm_rows_config(rows),
            &dx32,
            &dx16,
            dout,
            x,
            weight,
            rstd,
            &r,
            &d
        );
        Self::keep_twin(dx, twin);
        const ROWS_PER_CHUNK: usize = 128;
        let chunks = rows.div_ceil(ROWS_PER_CHUNK);
        let mut partial = self.alloc::<f32>(chunks * dim);
        let column_blocks = dim.div_ceil(128) as u32;
        let (c, rpc) = (chunks as i32, ROWS_PER_CHUNK as i32);
        let per_chunk = LaunchConfig {
            grid_dim: (column_blocks, chunks as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "rmsnorm_dweight_partial",
            per_chunk,
            &mut partial,
            dout,
            x,
            rstd,
            &r,
            &d,
            &rpc
        );
        let per_column = LaunchConfig {
            grid_dim: (column_blocks, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "rmsnorm_dweight_reduce",
            per_column,
            dweight,
            &partial,
            &c,
            &d
        );
    }
}

/// The RMSNorm kernels: one warp per row, `NORM_WARPS` rows per block.
fn norm_rows_config(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(NORM_WARPS) as u32, 1, 1),
        block_dim: ((NORM_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
