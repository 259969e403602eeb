//! Host side of the multi-tensor kernels (kernels/multi_tensor.cu): the device tables that describe
//! a list of buffers for one launch (a base-address array per operand and the prefix sums of the
//! tensors' lengths), and the launches of AdamW, the bf16 compute copy (with its bf16 twin for the
//! GEMMs, see `CudaBuf`) and the sum of squares over a whole parameter set. The optimizer step then costs three launches instead of one per tensor
//! and op, and the gradient norm waits for the GPU once instead of once per tensor.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::KernelArg;
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
    /// The device tables for a list of `lens.len()` tensors, `addresses[k][t]` the base address of
    /// operand k of tensor t; None when the tensors hold nothing (no launch needed).
    fn tensor_list(&self, op: &str, lens: &[usize], addresses: &[Vec<u64>]) -> Option<TensorList> {
        let mut offsets = Vec::with_capacity(lens.len() + 1);
        offsets.push(0i64);
        let mut total = 0usize;
        for &n in lens {
            total += n;
            offsets.push(total as i64);
        }
        if total == 0 {
            return None;
        }
        let pointers = addresses
            .iter()
            .map(|list| {
                self.to_device(list).unwrap_or_else(|e| {
                    panic!("CUDA: uploading the tensor addresses of {op} failed: {e}")
                })
            })
            .collect();
        let offsets = self
            .to_device(&offsets)
            .unwrap_or_else(|e| panic!("CUDA: uploading the offsets of {op} failed: {e}"));
        Some(TensorList {
            pointers,
            offsets,
            count: lens.len() as i32,
            total,
        })
    }

    /// The lengths of `first`'s tensors, after checking that every other list has as many tensors,
    /// each exactly as long as its counterpart in `first`.
    fn list_lengths(op: &str, first: &[CudaBuf], others: &[&[CudaBuf]]) -> Vec<usize> {
        for (k, other) in others.iter().enumerate() {
            assert_eq!(
                other.len(),
                first.len(),
                "{op}: operand lists differ in length"
            );
            for (t, (a, b)) in first.iter().zip(other.iter()).enumerate() {
                assert_eq!(
                    b.len(),
                    a.len(),
                    "{op}: operand {} of tensor {t} holds {} floats, the first operand {}",
                    k + 1,
                    b.len(),
                    a.len()
                );
            }
        }
        first.iter().map(CudaBuf::len).collect()
    }

    /// Addresses of buffers the launch only reads.
    fn addresses(&self, list: &[CudaBuf]) -> Vec<u64> {
        list.iter()
            .map(|b| b.device_address(&self.stream))
            .collect()
    }

    /// Addresses of buffers the launch writes (which drops their bf16 copies and bumps their
    /// versions, see `CudaBuf`).
    fn addresses_to_write(&self, list: &mut [CudaBuf]) -> Vec<u64> {
        list.iter_mut()
            .map(|b| b.device_address_mut(&self.stream))
            .collect()
    }

    pub(super) fn fill_list(&self, bufs: &mut [CudaBuf], value: f32) {
        let lens = Self::list_lengths("fill_all", bufs, &[]);
        let addresses = [self.addresses_to_write(bufs)];
        let Some(list) = self.tensor_list("fill_all", &lens, &addresses) else {
            return;
        };
        launch!(
            self,
            "fill_all",
            chunked_config(list.total, usize::MAX),
            &list.pointers[0],
            &list.offsets,
            &list.count,
            &value,
        );
    }

    pub(super) fn adamw_all(
        &self,
        params: &mut [CudaBuf],
        grads: &[CudaBuf],
        exp_avg: &mut [CudaBuf],
        exp_avg_sq: &mut [CudaBuf],
        hp: AdamWStep,
    ) {
        let lens = Self::list_lengths("adamw_step_all", params, &[grads, exp_avg, exp_avg_sq]);
        let addresses = [
            self.addresses_to_write(params),
            self.addresses(grads),
            self.addresses_to_write(exp_avg),
            self.addresses_to_write(exp_avg_sq),
        ];
        let Some(list) = self.tensor_list("adamw_step_all", &lens, &addresses) else {
            return;
        };
        let (step_size, bias2_sqrt, decay, l2) = hp.host_constants();
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
            &l2,
            &hp.grad_scale,
        );
    }

    /// `dst[t]` = `src[t]` rounded to bf16 (kept in f32), and the same values as bf16 in each
    /// `dst[t]`'s bf16 copy, which bf16 GEMMs then read instead of converting the weights.
    pub(super) fn copy_rounded_all(&self, dst: &mut [CudaBuf], src: &[CudaBuf]) {
        let lens = Self::list_lengths("copy_rounded_to_bf16_all", src, &[dst]);
        let copies: Vec<CudaSlice<u16>> = dst
            .iter_mut()
            .map(|b| b.take_bf16_storage(|capacity| self.alloc::<u16>(capacity)))
            .collect();
        let copy_addresses = copies
            .iter()
            .map(|c| {
                let (ptr, _sync) = c.device_ptr(&self.stream);
                ptr
            })
            .collect();
        let addresses = [self.addresses(dst), copy_addresses, self.addresses(src)];
        if let Some(list) = self.tensor_list("copy_rounded_to_bf16_all", &lens, &addresses) {
            launch!(
                self,
                "copy_rounded_to_bf16_all",
                chunked_config(list.total, usize::MAX),
                &list.pointers[0],
                &list.pointers[1],
                &list.pointers[2],
                &list.offsets,
                &list.count,
            );
        }
        for (buf, copy) in dst.iter_mut().zip(copies) {
            buf.keep_bf16_copy(copy);
        }
    }

    pub(super) fn sum_squares_list(&self, bufs: &[CudaBuf]) -> f64 {
        let lens = Self::list_lengths("sum_squares_all", bufs, &[]);
        let Some(list) = self.tensor_list("sum_squares_all", &lens, &[self.addresses(bufs)]) else {
            return 0.0;
        };
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
        self.to_host(&partials)
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
