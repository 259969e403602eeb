//! Matrix products over cuBLASLt (`gemm.rs`): `matmul` and `matmul_add`, the GEMM inputs made
//! from buffers and views, and products into outputs kept in bf16 alone.

use crate::backend::{GemmOutput, GemmShape};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{check_len, Buf};
use crate::backend::cuda::gemm::{launch_to_bf16, Fp8Input, GemmInput};
use crate::backend::cuda::CudaBackend;

/// The operand lengths of an `m×k · k×n` product into `out`.
fn check_matmul(op: &str, a: &Buf, b: &Buf, out: &Buf, m: usize, k: usize, n: usize) {
    check_len(op, "a", a.len(), m * k);
    check_len(op, "b", b.len(), k * n);
    check_len(op, "out", out.len(), m * n);
}

impl CudaBackend {
    /// A GEMM input that is a view (no bf16 copy).
    pub(super) fn view_input(&self, view: &impl DevicePtr<f32>) -> GemmInput {
        GemmInput::f32(view, &self.stream)
    }

    /// A whole buffer as a GEMM input, with its bf16 copy when it has one and its contents' name
    /// (a bf16-only buffer has no f32 values to fall back on).
    pub(super) fn buf_input(&self, buf: &Buf) -> GemmInput {
        let bf16_only = buf.is_bf16_only();
        GemmInput {
            f32: if bf16_only {
                0
            } else {
                buf.device_address(&self.stream)
            },
            bf16: buf.bf16_address(&self.stream),
            contents: Some(buf.contents()),
            f32_stale: bf16_only,
            fp8: buf.fp8().map(|copy| Fp8Input {
                codes: copy.codes.device_ptr(&self.stream).0,
                format: copy.format,
                transposed: copy.transposed,
                contiguous: copy.contiguous,
                len: buf.len(),
                inverse_scales: copy.inverse_scales.device_ptr(&self.stream).0,
                scale_count: copy.inverse_scales.len(),
            }),
        }
    }

    pub(super) fn gemm(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        a: GemmInput,
        b: GemmInput,
        shape: GemmShape,
        output: GemmOutput,
    ) {
        self.gemm
            .matmul(out, a, b, shape, output)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// `out = op(a)·op(b)` into an output kept in bf16 alone: cuBLASLt writes bf16 where it has an
    /// algorithm for it (`Gemm::writes_bf16`), else the f32 product goes through scratch and is
    /// rounded by one more pass (the product rounded to bf16 either way, though the two cuBLASLt
    /// algorithms may sum in different orders).
    fn matmul_to_bf16_only(&self, out: &mut Buf, a: &Buf, b: &Buf, shape: GemmShape) {
        let GemmShape { m, k, n, .. } = shape;
        let mut storage = out.take_bf16_storage(|capacity| self.alloc_unzeroed::<u16>(capacity));
        let (a, b) = (self.buf_input(a), self.buf_input(b));
        if k == 0 {
            self.stream
                .memset_zeros(&mut storage)
                .unwrap_or_else(|e| panic!("CUDA memset: {e}"));
        } else if self.gemm.writes_bf16(shape) {
            self.gemm
                .matmul_to_bf16(&mut storage, a, b, shape)
                .unwrap_or_else(|e| panic!("{e:#}"));
        } else {
            let mut product = self.alloc_unzeroed::<f32>(m * n);
            self.gemm(&mut product, a, b, shape, GemmOutput::Overwrite);
            let (src, _sync) = product.device_ptr(&self.stream);
            launch_to_bf16(
                &self.stream,
                self.function("f32_to_bf16"),
                &mut storage,
                src,
                m * n,
            )
            .unwrap_or_else(|e| panic!("{e:#}"));
        }
        out.keep_bf16_copy(storage);
    }

    pub(super) fn matmul_untimed(
        &self,
        out: &mut Buf,
        a: &Buf,
        b: &Buf,
        shape: GemmShape,
        output: GemmOutput,
    ) {
        let GemmShape { m, k, n, .. } = shape;
        let accumulate = output.accumulates();
        check_matmul("matmul", a, b, out, m, k, n);
        if out.is_bf16_only() {
            assert!(
                !accumulate && out.len() == m * n,
                "matmul: a bf16-only output must be written whole, not accumulated (a titan bug)"
            );
            return self.matmul_to_bf16_only(out, a, b, shape);
        }
        if k == 0 {
            // An empty sum: `out` keeps its values (accumulate) or becomes zero.
            if !accumulate {
                self.fill_untimed(out, 0.0);
            }
            return;
        }
        let (a, b) = (self.buf_input(a), self.buf_input(b));
        self.gemm(out.data_mut(), a, b, shape, output);
    }

    pub(super) fn matmul_add_untimed(
        &self,
        out: &mut Buf,
        residual: &Buf,
        a: &Buf,
        b: &Buf,
        shape: GemmShape,
    ) {
        let GemmShape { m, k, n, .. } = shape;
        check_matmul("matmul_add", a, b, out, m, k, n);
        assert!(
            !out.is_bf16_only(),
            "matmul_add: a residual sum is kept in f32 (a titan bug)"
        );
        check_len("matmul_add", "residual", residual.len(), m * n);
        if k == 0 || m == 0 || n == 0 {
            // No product to add (the GEMM would not run): the output is the residual.
            self.copy_range_untimed(out, 0, residual, 0, m * n);
            return;
        }
        let addend = residual.device_address(&self.stream);
        let (a, b) = (self.buf_input(a), self.buf_input(b));
        self.gemm
            .matmul_add(out.data_mut(), addend, a, b, shape)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
}
