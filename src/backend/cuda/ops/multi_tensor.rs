//! Host side of the multi-tensor kernels (kernels/multi_tensor.cu): the device tables that describe
//! a list of buffers for one launch (a base-address array per operand and the prefix sums of the
//! tensors' lengths), and the launches of AdamW, the bf16 compute copy and the sum of squares over
//! a whole parameter set. The optimizer step then costs three launches instead of one per tensor
//! and op, and the gradient norm waits for the GPU once instead of once per tensor.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{check_len, KernelArg};
use crate::backend::cuda::{CudaBackend, CudaBuf};
use crate::backend::AdamWStep;

/// Elements per block chunk (`TITAN_MT_CHUNK` in the kernel source).
const CHUNK: usize = 8192;
/// Blocks of the sum of squares: fixed, so its partials (and the result) do not depend on the GPU.
const SUM_BLOCKS: usize = 512;

/// One list of tensors on the device.
struct TensorList {
    /// Per operand, the base address of each tensor.
    pointers: Vec<CudaSlice<u64>>,
    /// `offsets[t]` = total length of tensors 0..t (n + 1 values).
    offsets: CudaSlice<i64>,
    count: i32,
    total: usize,
}

impl CudaBackend {
    /// The device tables for `operands[k][t]` (operand k of tensor t). Every operand of a tensor
    /// must hold as many floats as the first.
    fn tensor_list(&self, op: &str, operands: &[Vec<&CudaBuf>]) -> TensorList {
        let first = &operands[0];
        let mut offsets = Vec::with_capacity(first.len() + 1);
        let mut total = 0usize;
        offsets.push(0i64);
        for (t, buf) in first.iter().enumerate() {
            for (k, operand) in operands.iter().enumerate().skip(1) {
                assert_eq!(
                    operand.len(),
                    first.len(),
                    "{op}: operand lists differ in length"
                );
                check_len(
                    op,
                    &format!("operand {k} of tensor {t}"),
                    operand[t].len(),
                    buf.len(),
                );
            }
            total += buf.len();
            offsets.push(total as i64);
        }
        let upload = |what: &str, host: &[u64]| {
            self.stream
                .clone_htod(host)
                .unwrap_or_else(|e| panic!("CUDA: uploading the {what} of {op} failed: {e}"))
        };
        let pointers = operands
            .iter()
            .map(|list| {
                let addresses: Vec<u64> = list
                    .iter()
                    .map(|b| b.device_address(&self.stream))
                    .collect();
                upload("tensor addresses", &addresses)
            })
            .collect();
        let offsets = self
            .stream
            .clone_htod(&offsets)
            .unwrap_or_else(|e| panic!("CUDA: uploading the offsets of {op} failed: {e}"));
        TensorList {
            pointers,
            offsets,
            count: first.len() as i32,
            total,
        }
    }

    pub(super) fn adamw_all(
        &self,
        params: &mut [CudaBuf],
        grads: &[CudaBuf],
        exp_avg: &mut [CudaBuf],
        exp_avg_sq: &mut [CudaBuf],
        hp: AdamWStep,
    ) {
        let list = self.tensor_list(
            "adamw_step_all",
            &[
                params.iter().collect(),
                grads.iter().collect(),
                exp_avg.iter().collect(),
                exp_avg_sq.iter().collect(),
            ],
        );
        if list.total == 0 {
            return;
        }
        let (step_size, bias2_sqrt, decay) = hp.host_constants();
        launch!(
            self,
            "adamw_step_all",
            chunked_config(list.total, usize::MAX),
            &list.pointers[0],
            &list.pointers[1],
            &list.pointers[2],
            &list.pointers[3],
            &list.offsets,
            &list.count,
            &hp.beta1,
            &hp.beta2,
            &hp.eps,
            &step_size,
            &bias2_sqrt,
            &decay,
            &hp.grad_scale,
        );
    }

    pub(super) fn copy_rounded_all(&self, dst: &mut [CudaBuf], src: &[CudaBuf]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "copy_rounded_to_bf16_all: list lengths differ"
        );
        let list = self.tensor_list(
            "copy_rounded_to_bf16_all",
            &[src.iter().collect(), dst.iter().collect()],
        );
        if list.total == 0 {
            return;
        }
        launch!(
            self,
            "copy_rounded_to_bf16_all",
            chunked_config(list.total, usize::MAX),
            &list.pointers[1],
            &list.pointers[0],
            &list.offsets,
            &list.count,
        );
    }

    pub(super) fn sum_squares_list(&self, bufs: &[CudaBuf]) -> f64 {
        let list = self.tensor_list("sum_squares_all", &[bufs.iter().collect()]);
        if list.total == 0 {
            return 0.0;
        }
        let cfg = chunked_config(list.total, SUM_BLOCKS);
        let mut partials = self.alloc::<f64>(cfg.grid_dim.0 as usize);
        launch!(
            self,
            "sum_squares_all_partial",
            cfg,
            &mut partials,
            &list.pointers[0],
            &list.offsets,
            &list.count,
        );
        self.stream
            .clone_dtoh(&partials)
            .unwrap_or_else(|e| panic!("CUDA: downloading partial sums failed: {e}"))
            .iter()
            .sum()
    }
}

/// One block per chunk of the list, at most `max_blocks` (and 4096); blocks then stride.
fn chunked_config(total: usize, max_blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            total.div_ceil(CHUNK).clamp(1, max_blocks.min(4096)) as u32,
            1,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
