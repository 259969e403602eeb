//! Values into and out of device buffers: uploads and downloads, fills, and device-side copies
//! (whole buffers, ranges, strided rows). Other ops call the untimed bodies here inside their
//! own timing.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, DriverError, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::{elementwise_config, CudaBackend, CudaBuf};

impl CudaBackend {
    /// A copy of `host` on the device, counted (`backend::transfers`).
    pub(super) fn to_device<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, DriverError> {
        self.transfers
            .record_bytes(std::mem::size_of_val(host) as u64);
        self.stream.clone_htod(host)
    }

    /// A copy of `device` on the host, counted (`backend::transfers`).
    pub(super) fn to_host<T: DeviceRepr, S: DevicePtr<T>>(
        &self,
        device: &S,
    ) -> Result<Vec<T>, DriverError> {
        self.transfers
            .record_bytes((device.len() * std::mem::size_of::<T>()) as u64);
        self.stream.clone_dtoh(device)
    }

    pub(super) fn upload_untimed(&self, data: &[f32]) -> Buf {
        if data.is_empty() {
            return self.buffer(0);
        }
        let data_dev = self
            .to_device(data)
            .unwrap_or_else(|e| panic!("CUDA: uploading {} floats failed: {e}", data.len()));
        CudaBuf::new(data_dev, data.len())
    }

    pub(super) fn download_untimed(&self, buf: &Buf) -> Vec<f32> {
        if buf.is_empty() {
            return Vec::new();
        }
        let fail = |e| panic!("CUDA: downloading {} floats failed: {e}", buf.len());
        if buf.is_bf16_only() {
            // The bf16 values, widened on the device.
            let mut values = self.alloc_unzeroed::<f32>(buf.len());
            let words = buf
                .bf16_address(&self.stream)
                .expect("a bf16-only buffer has its copy");
            let n = buf.len();
            launch_elementwise!(self, "bf16_pairs_to_f32", n, &mut values, &words);
            let mut out = self.to_host(&values).unwrap_or_else(fail);
            out.truncate(n);
            return out;
        }
        self.to_host(buf.data()).unwrap_or_else(fail)
    }

    /// The bodies of `fill` and `copy_into_at`, for ops that use them inside their own timing.
    pub(super) fn fill_untimed(&self, buf: &mut Buf, value: f32) {
        let n = buf.len();
        launch_elementwise!(self, "fill_f32", n, buf, &value);
    }

    pub(super) fn copy_at_untimed(&self, dst: &mut Buf, offset: usize, src: &Buf) {
        self.copy_range_untimed(dst, offset, src, 0, src.len());
    }

    /// `dst[dst_offset..+len] = src[src_offset..+len]` on the device (the body of `copy_range`).
    pub(super) fn copy_range_untimed(
        &self,
        dst: &mut Buf,
        dst_offset: usize,
        src: &Buf,
        src_offset: usize,
        len: usize,
    ) {
        check_len("copy_range", "dst", dst.len(), dst_offset + len);
        check_len("copy_range", "src", src.len(), src_offset + len);
        if len == 0 {
            return;
        }
        let mut window = dst.slice_mut(dst_offset..dst_offset + len);
        self.stream
            .memcpy_dtod(&src.slice(src_offset..src_offset + len), &mut window)
            .unwrap_or_else(|e| panic!("CUDA: device copy failed: {e}"));
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn copy_rows_untimed(
        &self,
        dst: &mut Buf,
        dst_offset: usize,
        dst_stride: usize,
        src: &Buf,
        src_offset: usize,
        src_stride: usize,
        rows: usize,
        cols: usize,
    ) {
        let runs = StridedRuns {
            kernel: "copy_rows_f32",
            rows,
            cols,
        };
        self.strided_rows(
            runs,
            (dst, dst_offset, dst_stride),
            (src, src_offset, src_stride),
        );
    }

    /// `rows` runs of `cols` values, run `r` of `src` added into `dst` (`Backend::add_rows`).
    pub(super) fn add_rows_untimed(
        &self,
        dst: (&mut Buf, usize, usize),
        src: (&Buf, usize, usize),
        rows: usize,
        cols: usize,
    ) {
        let runs = StridedRuns {
            kernel: "add_rows_f32",
            rows,
            cols,
        };
        self.strided_rows(runs, dst, src);
    }

    /// `runs.kernel` (`copy_rows_f32` or `add_rows_f32`) over `runs.rows` runs of `runs.cols`
    /// values, `(buffer, offset, stride)` each side.
    fn strided_rows(
        &self,
        runs: StridedRuns,
        (dst, dst_offset, dst_stride): (&mut Buf, usize, usize),
        (src, src_offset, src_stride): (&Buf, usize, usize),
    ) {
        let StridedRuns { kernel, rows, cols } = runs;
        if rows == 0 || cols == 0 {
            return;
        }
        assert!(
            rows == 1 || dst_stride >= cols,
            "{kernel}: destination rows of {cols} values {dst_stride} apart overlap"
        );
        let last = |offset: usize, stride: usize| offset + (rows - 1) * stride + cols;
        check_len(kernel, "dst", dst.len(), last(dst_offset, dst_stride));
        check_len(kernel, "src", src.len(), last(src_offset, src_stride));
        let to = dst.device_address_mut(&self.stream) + 4 * dst_offset as u64;
        let from = src.device_address(&self.stream) + 4 * src_offset as u64;
        let (dst_stride, src_stride) = (dst_stride as i64, src_stride as i64);
        let (n_rows, n_cols) = (rows as i64, cols as i64);
        // Rows along y; the columns' blocks shared out so the whole grid stays elementwise-sized.
        let mut cfg = elementwise_config(cols);
        let grid_rows = rows.min(65_535) as u32;
        cfg.grid_dim = (cfg.grid_dim.0.div_ceil(grid_rows).max(1), grid_rows, 1);
        launch!(
            self,
            kernel,
            cfg,
            &to,
            &dst_stride,
            &from,
            &src_stride,
            &n_rows,
            &n_cols
        );
    }

    /// Token ids on the device (embedding rows, loss targets).
    pub(super) fn upload_ids(&self, ids: &[u32]) -> cudarc::driver::CudaSlice<u32> {
        self.to_device(ids)
            .unwrap_or_else(|e| panic!("CUDA: uploading {} token ids failed: {e}", ids.len()))
    }
}

/// Which strided-rows kernel runs, over how many runs of how many values.
struct StridedRuns {
    kernel: &'static str,
    rows: usize,
    cols: usize,
}
