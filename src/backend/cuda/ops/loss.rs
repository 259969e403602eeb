//! The fused output projection and cross-entropy: logits in row chunks (`gpu_loss_chunk_rows`),
//! the loss kernel, and the two gradient GEMMs per chunk; and the scratch memory this takes.

use crate::backend::{GemmOutput, GemmShape};
use cudarc::driver::{CudaSlice, CudaView, DevicePtrMut, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::gemm::GemmInput;
use crate::backend::cuda::{rows_config, CudaBackend, GemmPrecision};
use crate::backend::{LossSum, IGNORE_INDEX};

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cross_entropy_forward_backward_untimed(
        &self,
        h: &Buf,
        weight: &Buf,
        targets: &[u32],
        dim: usize,
        vocab: usize,
        grad_scale: f32,
        mut grads: Option<(&mut Buf, &mut Buf)>,
    ) -> LossSum {
        let rows = targets.len();
        check_loss_operands(h, weight, targets, dim, vocab, grads.as_ref());
        if rows == 0 {
            return LossSum { sum: 0.0, count: 0 };
        }
        let chunk = gpu_loss_chunk_rows(vocab).min(rows);
        // Each chunk's GEMM writes the rows the loss kernel then reads: in f32 here, made on first
        // use (a chunk whose logits stay in bf16 alone needs none) at that chunk's size (only the
        // last chunk is shorter).
        let mut logits: Option<CudaSlice<f32>> = None;
        let mut row_loss = self.alloc::<f32>(rows);
        let dev_targets = self.upload_ids(targets);
        let want_grad = grads.is_some() as i32;
        let v = vocab as i32;
        // With bf16 GEMMs the loss kernel also writes the logit gradients in bf16, which the two
        // backward GEMMs read as is (no conversion of the largest operand of the step).
        let mut grad16 = (grads.is_some() && self.precision() == GemmPrecision::BFloat16)
            .then(|| self.alloc_unzeroed::<u16>(chunk * vocab));
        let grad16_address = self.address_or_null(grad16.as_ref());
        for r0 in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - r0);
            let h_chunk = h.slice(r0 * dim..(r0 + n) * dim);
            // The gradient goes to bf16 alone when both backward GEMMs of this chunk read bf16;
            // else (no bf16, or cuBLASLt fell back to fp32 for a shape) to f32 too. With the bf16
            // activations on, the logits themselves are then written in bf16 alone, as PyTorch's
            // autocast keeps them: the kernel reads them there and writes the gradient over them.
            let bf16_only = grad16.is_some() && self.loss_gradient_in_bf16(n, dim, vocab);
            let grad16_only = if bf16_only { grad16_address } else { 0 };
            let logits_in_bf16 = bf16_only && self.loss_logits_in_bf16(n, dim, vocab);
            let logits_address = if logits_in_bf16 {
                let block = grad16.as_mut().expect("bf16_only implies the bf16 block");
                self.chunk_logits_in_bf16(block, &h_chunk, weight, n, dim, vocab);
                0
            } else {
                let block = logits.get_or_insert_with(|| self.alloc_unzeroed::<f32>(n * vocab));
                self.chunk_logits_in_f32(block, &h_chunk, weight, n, dim, vocab)
            };
            let mut loss_chunk = row_loss.slice_mut(r0..r0 + n);
            let t_chunk = dev_targets.slice(r0..r0 + n);
            launch!(
                self,
                "cross_entropy_rows",
                rows_config(n, 256),
                &logits_address,
                &mut loss_chunk,
                &t_chunk,
                &v,
                &grad_scale,
                &want_grad,
                &grad16_address,
                &grad16_only
            );
            if let Some((dh, dweight)) = grads.as_mut() {
                let mut dh_chunk = dh.slice_mut(r0 * dim..(r0 + n) * dim);
                let lc = GemmInput {
                    f32: logits_address,
                    bf16: grad16.is_some().then_some(grad16_address),
                    contents: None,
                    f32_stale: bf16_only,
                    fp8: None,
                };
                self.gemm(
                    &mut dh_chunk,
                    lc,
                    self.buf_input(weight),
                    GemmShape::new(n, vocab, dim),
                    GemmOutput::Accumulate,
                );
                // An empty gradient is a frozen output weight (LoRA): none is computed.
                if !dweight.is_empty() {
                    let mut dw = dweight.slice_mut(0..vocab * dim);
                    let hc = self.view_input(&h_chunk);
                    self.gemm(
                        &mut dw,
                        lc,
                        hc,
                        GemmShape::new(vocab, n, dim).a_transposed(),
                        GemmOutput::Accumulate,
                    );
                }
            }
        }
        self.sum_row_losses(&row_loss)
    }

    /// `Backend::cross_entropy_of_logits`: the loss kernel over logits given whole, in f32, their
    /// gradient written over them.
    pub(super) fn cross_entropy_of_logits_untimed(
        &self,
        logits: &mut Buf,
        targets: &[u32],
        vocab: usize,
        grad_scale: f32,
        want_grad: bool,
    ) -> LossSum {
        let rows = targets.len();
        check_len(
            "cross_entropy_of_logits",
            "logits",
            logits.len(),
            rows * vocab,
        );
        check_targets(targets, vocab);
        if rows == 0 {
            return LossSum { sum: 0.0, count: 0 };
        }
        let mut row_loss = self.alloc::<f32>(rows);
        let dev_targets = self.upload_ids(targets);
        let (v, want, no_bf16) = (vocab as i32, want_grad as i32, 0u64);
        launch!(
            self,
            "cross_entropy_rows",
            rows_config(rows, 256),
            logits,
            &mut row_loss,
            &dev_targets,
            &v,
            &grad_scale,
            &want,
            &no_bf16,
            &no_bf16
        );
        self.sum_row_losses(&row_loss)
    }

    /// One chunk's logits `h_chunk · weightᵀ` (`n` rows) written in bf16 alone, into the block
    /// where the loss kernel then writes their gradient over them.
    fn chunk_logits_in_bf16(
        &self,
        block: &mut CudaSlice<u16>,
        h_chunk: &CudaView<'_, f32>,
        weight: &Buf,
        n: usize,
        dim: usize,
        vocab: usize,
    ) {
        self.gemm
            .matmul_to_bf16(
                block,
                self.view_input(h_chunk),
                self.buf_input(weight),
                GemmShape::new(n, dim, vocab).b_transposed(),
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// One chunk's logits `h_chunk · weightᵀ` (`n` rows) in f32, at the start of `block`; returns
    /// their address for the loss kernel.
    fn chunk_logits_in_f32(
        &self,
        block: &mut CudaSlice<f32>,
        h_chunk: &CudaView<'_, f32>,
        weight: &Buf,
        n: usize,
        dim: usize,
        vocab: usize,
    ) -> u64 {
        let mut lc = block.slice_mut(..n * vocab);
        self.gemm(
            &mut lc,
            self.view_input(h_chunk),
            self.buf_input(weight),
            GemmShape::new(n, dim, vocab).b_transposed(),
            GemmOutput::Overwrite,
        );
        let (address, _sync) = lc.device_ptr_mut(&self.stream);
        address
    }

    /// The loss summed over the rows that count: the kernel marks an ignored target's row NaN.
    fn sum_row_losses(&self, row_loss: &CudaSlice<f32>) -> LossSum {
        let mut total = LossSum { sum: 0.0, count: 0 };
        self.add_row_losses(row_loss, &mut total);
        total
    }

    /// Adds the losses of the rows that count into `total`, in row order (NaN marks an ignored
    /// target's row).
    pub(super) fn add_row_losses(&self, row_loss: &CudaSlice<f32>, total: &mut LossSum) {
        let losses = self
            .to_host(row_loss)
            .unwrap_or_else(|e| panic!("CUDA: downloading the losses failed: {e}"));
        for l in losses {
            if !l.is_nan() {
                total.sum += l as f64;
                total.count += 1;
            }
        }
    }

    /// The body of `Backend::scratch_bytes`; the loss's logit block is most of it.
    pub(super) fn step_scratch_bytes(
        &self,
        tokens: usize,
        dim: usize,
        hidden: usize,
        vocab: usize,
    ) -> u64 {
        let chunk = gpu_loss_chunk_rows(vocab).min(tokens.max(1));
        // The loss's f32 logit block (none when the logits stay in bf16); with bf16 GEMMs its bf16
        // gradient, the two operand copies, at most the largest operands converted (the output
        // weight, an FFN activation), and the attention's bf16 copies of q, k, v and dout (each
        // at most tokens × dim).
        let last = tokens.max(1) % chunk;
        let f32_logits = |n: usize| {
            n > 0
                && !(self.loss_gradient_in_bf16(n, dim, vocab)
                    && self.loss_logits_in_bf16(n, dim, vocab))
        };
        let logits = if f32_logits(chunk) {
            chunk * vocab * 4
        } else if f32_logits(last) {
            last * vocab * 4
        } else {
            0
        };
        let bf16_operands = if self.precision() == GemmPrecision::BFloat16 {
            bf16_operand_scratch_bytes(tokens, dim, hidden, vocab)
        } else {
            0
        };
        logits as u64 + bf16_operands
    }

    /// Whether the loss's logit gradient for a chunk of `n` rows can live in bf16 alone: bf16
    /// GEMMs that read it in bf16 for both backward products.
    fn loss_gradient_in_bf16(&self, n: usize, dim: usize, vocab: usize) -> bool {
        self.precision() == GemmPrecision::BFloat16
            && [(n, vocab, dim, false), (vocab, n, dim, true)]
                .into_iter()
                .all(|(m, k, nn, ta)| {
                    self.gemm
                        .reads_bf16(GemmShape {
                            m,
                            k,
                            n: nn,
                            trans_a: ta,
                            trans_b: false,
                        })
                        .unwrap_or_else(|e| panic!("{e:#}"))
                })
    }

    /// Whether the loss's logits for a chunk of `n` rows are written in bf16 alone (with the bf16
    /// activations on, where cuBLASLt can write that product in bf16).
    fn loss_logits_in_bf16(&self, n: usize, dim: usize, vocab: usize) -> bool {
        self.activation_copies
            && self
                .gemm
                .writes_bf16(GemmShape::new(n, dim, vocab).b_transposed())
    }
}

/// The operands' lengths for `targets.len()` rows, and every target inside the vocabulary
/// (`IGNORE_INDEX` aside), checked on the host before any launch.
fn check_loss_operands(
    h: &Buf,
    weight: &Buf,
    targets: &[u32],
    dim: usize,
    vocab: usize,
    grads: Option<&(&mut Buf, &mut Buf)>,
) {
    let rows = targets.len();
    check_len("cross_entropy", "h", h.len(), rows * dim);
    check_len("cross_entropy", "weight", weight.len(), vocab * dim);
    if let Some((dh, dweight)) = grads {
        check_len("cross_entropy", "dh", dh.len(), rows * dim);
        if !dweight.is_empty() {
            check_len("cross_entropy", "dweight", dweight.len(), vocab * dim);
        }
    }
    check_targets(targets, vocab);
}

/// Every target inside the vocabulary (`IGNORE_INDEX` aside): data's are checked as errors
/// before they reach a kernel, so one outside is a titan bug.
fn check_targets(targets: &[u32], vocab: usize) {
    if let Some(&bad) = targets
        .iter()
        .find(|&&t| t != IGNORE_INDEX && t as usize >= vocab)
    {
        panic!("target id {bad} is outside the vocabulary of {vocab}");
    }
}

/// Rows per loss chunk on a GPU: a logit block of at most 512 Mi floats (2 GiB; 4096 rows of
/// Llama 3's 128k vocabulary: few chunks, so the output weight is converted to bf16 few times), at
/// least 128 rows so the three GEMMs per chunk stay large, and a multiple of 64 so every chunk's
/// rows start 256-byte aligned, as cuBLASLt's fast kernels assume.
fn gpu_loss_chunk_rows(vocab: usize) -> usize {
    ((512usize << 20) / vocab.max(1)).clamp(128, 4096) / 64 * 64
}

/// The scratch of bf16 GEMMs over a step of `tokens` rows: a loss chunk's bf16 logit gradient,
/// the two operand copies, at most the largest operands converted (the output weight, an FFN
/// activation), and the attention's bf16 copies of q, k, v and dout. Also what `titan plan`
/// counts for a GPU it sizes without having one.
pub fn bf16_operand_scratch_bytes(tokens: usize, dim: usize, hidden: usize, vocab: usize) -> u64 {
    let chunk = gpu_loss_chunk_rows(vocab).min(tokens.max(1));
    let largest = (vocab * dim).max(tokens * hidden);
    (chunk * vocab * 2 + 2 * largest * 2 + 4 * tokens * dim * 2) as u64
}
