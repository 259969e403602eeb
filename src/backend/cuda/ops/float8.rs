//! The float8 casts of emulated float8 GEMMs on the GPU (kernels/float8.cu, bit for bit the CPU's
//! `float8::kernels`): amaxes along an axis, the quantise-dequantise of an operand, and FSDP's
//! float8 all-gather codes. The scales come from the amaxes on the host (`scales_from_amaxes`,
//! the same code as the CPU's), after the caller may have agreed them over a group. An input kept
//! in bf16 alone goes through the host (`float8::*`), as the default ops do.

use cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{Buf, KernelArg};
use crate::backend::cuda::buffer::Fp8Copy;
use crate::backend::cuda::kernels::NORM_WARPS;
use crate::backend::cuda::{elementwise_config, CudaBackend};
use crate::backend::float8::{
    self, ContractedDim, Fp8Format, MxBlocks, MxCast, MxScaling, Quantization, ScaleAxis, MX_BLOCK,
};
use crate::backend::Backend;

/// Blocks of the tensorwise amax's first pass (the host takes the largest of their partials).
const AMAX_BLOCKS: usize = 256;

fn format_code(format: Fp8Format) -> i32 {
    match format {
        Fp8Format::E4M3 => 0,
        Fp8Format::E5M2 => 1,
    }
}

fn axis_code(axis: ScaleAxis) -> i32 {
    match axis {
        ScaleAxis::Tensor => 0,
        ScaleAxis::Rows => 1,
        ScaleAxis::Columns => 2,
    }
}

impl CudaBackend {
    /// The `(x, x16)` device addresses the cast kernels read an operand from: its f32 values, or
    /// (0 and) its bf16 copy when it is kept in bf16 alone.
    fn operand_addresses(&self, x: &Buf) -> [u64; 2] {
        match x.is_bf16_only() {
            true => [
                0,
                x.bf16_address(&self.stream)
                    .expect("a buffer kept in bf16 alone has its bf16 copy"),
            ],
            false => [x.device_address(&self.stream), 0],
        }
    }

    pub(super) fn float8_amaxes_untimed(
        &self,
        x: &Buf,
        rows: usize,
        cols: usize,
        axis: ScaleAxis,
    ) -> Vec<f32> {
        let n = rows * cols;
        assert_eq!(x.len(), n, "float8 amax: {rows}x{cols} needs {n} values");
        if n == 0 {
            return float8::amaxes(&[], rows, cols, axis);
        }
        let (rows_i, cols_i) = (rows as i64, cols as i64);
        let [x, x16] = self.operand_addresses(x);
        match axis {
            ScaleAxis::Tensor => {
                let mut partials = self.alloc::<u32>(AMAX_BLOCKS);
                let cfg = LaunchConfig {
                    grid_dim: (AMAX_BLOCKS as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let len = n as i64;
                launch!(
                    self,
                    "float8_amax_partial",
                    cfg,
                    &mut partials,
                    &x,
                    &x16,
                    &len
                );
                let partials = self
                    .to_host(&partials)
                    .unwrap_or_else(|e| panic!("CUDA: downloading float8 amaxes failed: {e}"));
                vec![f32::from_bits(partials.into_iter().max().unwrap_or(0))]
            }
            ScaleAxis::Rows => {
                let mut out = self.uninit(rows);
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(NORM_WARPS) as u32, 1, 1),
                    block_dim: (32 * NORM_WARPS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(
                    self,
                    "float8_amax_rows",
                    cfg,
                    &mut out,
                    &x,
                    &x16,
                    &rows_i,
                    &cols_i
                );
                self.download_untimed(&out)
            }
            ScaleAxis::Columns => {
                let mut out = self.uninit(cols);
                let cfg = elementwise_config(cols);
                launch!(
                    self,
                    "float8_amax_columns",
                    cfg,
                    &mut out,
                    &x,
                    &x16,
                    &rows_i,
                    &cols_i
                );
                self.download_untimed(&out)
            }
        }
    }

    /// With float8 GEMMs on (`fp8_gemms`), the result also carries its codes, laid out for a GEMM
    /// that sums over `contracted`, and the reciprocals of its scales (`Fp8Copy`).
    pub(super) fn float8_fake_quantized_untimed(
        &self,
        x: &Buf,
        cols: usize,
        q: Quantization,
        amaxes: &[f32],
        contracted: ContractedDim,
    ) -> Buf {
        let scales = float8::scales_from_amaxes(amaxes, q);
        let n = x.len();
        if n == 0 {
            return self.buffer(0);
        }
        let transposed = contracted == ContractedDim::Rows;
        // A float8 GEMM factors the scales out of its sums: one per tensor, or one per index of
        // the dimension it does not sum over (every recipe's rowwise scales are).
        let scales_factor_out = match q.axis {
            ScaleAxis::Tensor => true,
            ScaleAxis::Rows => !transposed,
            ScaleAxis::Columns => transposed,
        };
        let mut codes = (self.fp8_gemms && scales_factor_out).then(|| self.alloc_unzeroed::<u8>(n));
        let device_scales = self.upload_untimed(&scales);
        let mut out = self.uninit(n);
        let [x_address, x16_address] = self.operand_addresses(x);
        let (cols_i, axis, format) = (cols as i64, axis_code(q.axis), format_code(q.format));
        // The codes by address (0: none), as the kernel's nullable `u8*`.
        let codes_address = codes
            .as_mut()
            .map_or(0u64, |c| c.device_ptr_mut(&self.stream).0);
        let transposed_i = transposed as i32;
        launch_elementwise!(
            self,
            "float8_fake_quantize",
            n,
            &mut out,
            &x_address,
            &x16_address,
            &device_scales,
            &cols_i,
            &axis,
            &format,
            &codes_address,
            &transposed_i
        );
        if let Some(codes) = codes {
            let inverse: Vec<f32> = scales.iter().map(|s| 1.0 / s).collect();
            let inverse_scales = self.to_device(&inverse).unwrap_or_else(|e| {
                panic!(
                    "CUDA: uploading {} float8 scales failed: {e}",
                    inverse.len()
                )
            });
            out.keep_fp8_copy(Fp8Copy {
                codes,
                format: q.format,
                transposed,
                contiguous: if transposed { n / cols } else { cols },
                inverse_scales,
            });
        }
        out
    }

    /// `x` (`[rows, cols]`) cast to MXFP8 as `cast` says and dequantised, bit for bit the CPU's
    /// `float8::mx_fake_quantize_rows` (kernels/float8.cu `mx_fake_quantize`).
    pub(super) fn mx_fake_quantized_untimed(&self, x: &Buf, cols: usize, cast: MxCast) -> Buf {
        let n = x.len();
        if n == 0 {
            return self.buffer(0);
        }
        assert!(
            cols > 0 && n.is_multiple_of(cols),
            "MXFP8 cast: {n} values are not rows of {cols}"
        );
        let down_columns = cast.blocks == MxBlocks::DownColumns;
        assert!(
            down_columns || cols.is_multiple_of(MX_BLOCK),
            "MXFP8 cast: rows of {cols} values do not split into blocks of {MX_BLOCK}"
        );
        let [x_address, x16_address] = self.operand_addresses(x);
        let (rows_i, cols_i) = ((n / cols) as i64, cols as i64);
        let (down_i, rceil_i) = (
            down_columns as i32,
            (cast.scaling == MxScaling::Rceil) as i32,
        );
        let cfg = match down_columns {
            true => elementwise_config(n.div_ceil(cols).div_ceil(MX_BLOCK) * cols),
            false => LaunchConfig {
                grid_dim: ((n / MX_BLOCK).div_ceil(NORM_WARPS) as u32, 1, 1),
                block_dim: (32 * NORM_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        };
        let mut out = self.uninit(n);
        launch!(
            self,
            "mx_fake_quantize",
            cfg,
            &mut out,
            &x_address,
            &x16_address,
            &rows_i,
            &cols_i,
            &down_i,
            &rceil_i
        );
        out
    }

    pub(super) fn float8_encoded_untimed(&self, x: &Buf, scale: f32, format: Fp8Format) -> Buf {
        let n = x.len();
        let words = n.div_ceil(float8::CODES_PER_WORD);
        if x.is_bf16_only() {
            return self.upload_untimed(&float8::encode_words(
                &self.download_untimed(x),
                scale,
                format,
            ));
        }
        // The kernel writes the codes' words as u32 into the f32 buffer (bit patterns).
        let mut out = self.uninit(words);
        if words > 0 {
            let (code, len) = (format_code(format), n as i64);
            let cfg = elementwise_config(words);
            launch!(
                self,
                "float8_encode_words",
                cfg,
                &mut out,
                x,
                &scale,
                &code,
                &len
            );
        }
        out
    }

    pub(super) fn float8_decoded_untimed(&self, words: &Buf, format: Fp8Format) -> Buf {
        let n = words.len() * float8::CODES_PER_WORD;
        let mut out = self.uninit(n);
        let code = format_code(format);
        launch_elementwise!(self, "float8_decode_words", n, &mut out, words, &code);
        out
    }
}
