//! `Backend` for `CudaBackend`: argument checks on the host, then one launch per kernel (or a
//! cuBLASLt call). A CUDA failure in the middle of a step cannot be recovered, so it panics with the
//! op's name and the driver's error.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::gemm::{launch_to_bf16, GemmInput};
use super::kernels::{ATTN_MAX_HEAD_DIM, ATTN_WARPS, NORM_WARPS};
use super::{
    elementwise_config, row_threads, rows_config, AttentionKernels, CudaBackend, CudaBuf,
    GemmPrecision, TensorCoreBackward, FUSED_BACKWARD_KERNELS,
};
use crate::backend::{AdamWStep, AttnShape, Backend, LossSum, IGNORE_INDEX};

type Buf = CudaBuf;

/// What `launch!` hands to cudarc for each argument: a `CudaBuf` becomes its device slice, and
/// everything cudarc takes directly (slices, views, scalars) passes through.
trait KernelArg {
    type Arg;
    fn kernel_arg(self) -> Self::Arg;
}

impl<'a> KernelArg for &'a CudaBuf {
    type Arg = &'a CudaSlice<f32>;
    fn kernel_arg(self) -> Self::Arg {
        self.data()
    }
}

impl<'a> KernelArg for &'a mut CudaBuf {
    type Arg = &'a mut CudaSlice<f32>;
    fn kernel_arg(self) -> Self::Arg {
        self.data_mut()
    }
}

macro_rules! pass_through {
    ($($t:ty),* ; mut $($m:ty),*) => {
        $(impl KernelArg for &$t {
            type Arg = Self;
            fn kernel_arg(self) -> Self {
                self
            }
        })*
        $(impl KernelArg for &mut $m {
            type Arg = Self;
            fn kernel_arg(self) -> Self {
                self
            }
        })*
    };
}
pass_through!(
    i32, i64, u64, f32, CudaSlice<u16>, CudaSlice<u32>, CudaSlice<u64>, CudaSlice<i64>, CudaSlice<f32>,
    CudaSlice<f64>, CudaView<'_, f32>, CudaView<'_, u32>;
    mut CudaSlice<f32>, CudaSlice<f64>, CudaViewMut<'_, f32>
);

/// Launches elementwise kernel `$name` over `$n` values (nothing when there are none); the kernel's
/// last argument is the count.
macro_rules! launch_elementwise {
    ($be:expr, $name:literal, $n:expr, $($arg:expr),+ $(,)?) => {{
        let n: usize = $n;
        if n > 0 {
            let len = n as i64;
            launch!($be, $name, elementwise_config(n), $($arg),+, &len);
        }
    }};
}

/// Launches kernel `$name` with `$cfg` and the given arguments (device buffers by reference,
/// scalars as references to locals of the kernel's C type).
macro_rules! launch {
    ($be:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let mut builder = $be.stream.launch_builder($be.function($name));
        $( builder.arg(KernelArg::kernel_arg($arg)); )+
        // SAFETY: the argument list matches the kernel's C signature in kernels/*.cu, and the host
        // checks above keep every index inside the buffers.
        unsafe { builder.launch($cfg) }
            .unwrap_or_else(|e| panic!("CUDA kernel `{}` failed: {e}", $name));
    }};
}

mod multi_tensor;

fn check_len(op: &str, what: &str, have: usize, need: usize) {
    assert!(
        have >= need,
        "{op}: `{what}` holds {have} floats but the shapes need {need}"
    );
}

/// The operand lengths of an `m×k · k×n` product into `out`.
fn check_matmul(op: &str, a: &Buf, b: &Buf, out: &Buf, m: usize, k: usize, n: usize) {
    check_len(op, "a", a.len(), m * k);
    check_len(op, "b", b.len(), k * n);
    check_len(op, "out", out.len(), m * n);
}

impl CudaBackend {
    /// The bodies of `fill` and `copy_into_at`, for ops that use them inside their own timing.
    fn fill_untimed(&self, buf: &mut Buf, value: f32) {
        let n = buf.len();
        launch_elementwise!(self, "fill_f32", n, buf, &value);
    }

    fn copy_at_untimed(&self, dst: &mut Buf, offset: usize, src: &Buf) {
        self.copy_range_untimed(dst, offset, src, 0, src.len());
    }

    /// `dst[dst_offset..+len] = src[src_offset..+len]` on the device (the body of `copy_range`).
    fn copy_range_untimed(
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

    /// Begins a kernel's write of all `written` values of `out`: storage for the bf16 copy it
    /// writes beside them (see CudaBuf) when the backend keeps such copies (`activation_copies`:
    /// GEMMs in bf16) and the kernel covers the whole buffer, and the kernel's two destinations:
    /// f32 (null for a bf16-only buffer, which only kernels that skip a null f32 output take:
    /// `f32_optional`) and bf16 (null without a copy). `keep_twin` records the copy once the
    /// kernel is queued.
    fn begin_output(
        &self,
        out: &mut Buf,
        written: usize,
        op: &str,
        f32_optional: bool,
    ) -> (Option<CudaSlice<u16>>, u64, u64) {
        let twin = (self.activation_copies && written == out.len() && written > 0)
            .then(|| out.take_bf16_storage(|capacity| self.alloc_unzeroed::<u16>(capacity)));
        let bf16_only = out.is_bf16_only();
        assert!(
            !bf16_only || (f32_optional && twin.is_some()),
            "{op}: a bf16-only output must be written whole, by a kernel that takes a null f32 \
             destination"
        );
        let out32 = if bf16_only {
            0
        } else {
            out.device_address_mut(&self.stream)
        };
        let out16 = self.address_or_null(twin.as_ref());
        (twin, out32, out16)
    }

    /// An input of a kernel that reads activations kept in bf16 alone: (f32 address, null), or
    /// (null, bf16 address) for a bf16-only buffer. A buffer with f32 values is read in f32 even
    /// when it has a bf16 copy, so results do not depend on the copies.
    fn activation_input(&self, buf: &Buf) -> (u64, u64) {
        if buf.is_bf16_only() {
            let bf16 = buf
                .bf16_address(&self.stream)
                .expect("a bf16-only buffer holds its values in bf16");
            (0, bf16)
        } else {
            (buf.device_address(&self.stream), 0)
        }
    }

    /// A kernel argument for optional device memory: its address, or null.
    fn address_or_null<T>(&self, memory: Option<&CudaSlice<T>>) -> u64 {
        memory.map_or(0, |m| m.device_ptr(&self.stream).0)
    }

    fn keep_twin(buf: &mut Buf, twin: Option<CudaSlice<u16>>) {
        if let Some(t) = twin {
            buf.keep_bf16_copy(t);
        }
    }

    fn elementwise_len(&self, op: &str, bufs: &[(&str, usize)]) -> usize {
        let n = bufs[0].1;
        for (what, len) in bufs {
            assert_eq!(*len, n, "{op}: `{what}` has {len} floats, expected {n}");
        }
        n
    }

    /// A GEMM input that is a view (no bf16 copy).
    fn view_input(&self, view: &impl DevicePtr<f32>) -> GemmInput {
        GemmInput::f32(view, &self.stream)
    }

    /// A whole buffer as a GEMM input, with its bf16 copy when it has one and its contents' name
    /// (a bf16-only buffer has no f32 values to fall back on).
    fn buf_input(&self, buf: &Buf) -> GemmInput {
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
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        a: GemmInput,
        b: GemmInput,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) {
        self.gemm
            .matmul(out, a, b, m, k, n, trans_a, trans_b, accumulate)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// `out = op(a)·op(b)` into an output kept in bf16 alone: cuBLASLt writes bf16 where it has an
    /// algorithm for it (`Gemm::writes_bf16`), else the f32 product goes through scratch and is
    /// rounded by one more pass (the product rounded to bf16 either way, though the two cuBLASLt
    /// algorithms may sum in different orders).
    #[allow(clippy::too_many_arguments)]
    fn matmul_to_bf16_only(
        &self,
        out: &mut Buf,
        a: &Buf,
        b: &Buf,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
    ) {
        let mut storage = out.take_bf16_storage(|capacity| self.alloc_unzeroed::<u16>(capacity));
        let (a, b) = (self.buf_input(a), self.buf_input(b));
        if k == 0 {
            self.stream
                .memset_zeros(&mut storage)
                .unwrap_or_else(|e| panic!("CUDA memset: {e}"));
        } else if self.gemm.writes_bf16(m, k, n, trans_a, trans_b) {
            self.gemm
                .matmul_to_bf16(&mut storage, a, b, m, k, n, trans_a, trans_b)
                .unwrap_or_else(|e| panic!("{e:#}"));
        } else {
            let mut product = self.alloc_unzeroed::<f32>(m * n);
            self.gemm(&mut product, a, b, m, k, n, trans_a, trans_b, false);
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

    /// Whether the loss's logit gradient for a chunk of `n` rows can live in bf16 alone: bf16
    /// GEMMs that read it in bf16 for both backward products.
    fn loss_gradient_in_bf16(&self, n: usize, dim: usize, vocab: usize) -> bool {
        self.precision() == GemmPrecision::BFloat16
            && [(n, vocab, dim, false), (vocab, n, dim, true)]
                .into_iter()
                .all(|(m, k, nn, ta)| {
                    self.gemm
                        .reads_bf16(m, k, nn, ta, false)
                        .unwrap_or_else(|e| panic!("{e:#}"))
                })
    }

    /// Whether the loss's logits for a chunk of `n` rows are written in bf16 alone (with the bf16
    /// activations on, where cuBLASLt can write that product in bf16).
    fn loss_logits_in_bf16(&self, n: usize, dim: usize, vocab: usize) -> bool {
        self.activation_copies && self.gemm.writes_bf16(n, dim, vocab, false, true)
    }

    /// Token ids of an embedding table of `vocab` rows on the device (None when there are none);
    /// an id outside the table panics, as on the CPU.
    fn upload_table_ids(&self, ids: &[u32], vocab: usize) -> Option<CudaSlice<u32>> {
        check_table_ids(ids, vocab);
        (!ids.is_empty()).then(|| self.upload_ids(ids))
    }

    fn upload_ids(&self, ids: &[u32]) -> cudarc::driver::CudaSlice<u32> {
        self.stream
            .clone_htod(ids)
            .unwrap_or_else(|e| panic!("CUDA: uploading {} token ids failed: {e}", ids.len()))
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_rotate(
        &self,
        x: &mut Buf,
        cos: &Buf,
        sin: &Buf,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        pos_offset: usize,
        direction: f32,
    ) {
        assert!(
            head_dim.is_multiple_of(2),
            "rope: head_dim {head_dim} is odd; RoPE rotates pairs"
        );
        let pairs = batch * seq * heads * head_dim / 2;
        check_len("rope", "x", x.len(), pairs * 2);
        check_len("rope", "cos", cos.len(), (pos_offset + seq) * head_dim / 2);
        check_len("rope", "sin", sin.len(), (pos_offset + seq) * head_dim / 2);
        if pairs == 0 {
            return;
        }
        let (n, s, h, d, p) = (
            pairs as i64,
            seq as i32,
            heads as i32,
            head_dim as i32,
            pos_offset as i32,
        );
        let (twin, x32, x16) = self.begin_output(x, pairs * 2, "rope", false);
        launch!(
            self,
            "rope_rotate",
            elementwise_config(pairs),
            &x32,
            &x16,
            cos,
            sin,
            &n,
            &s,
            &h,
            &d,
            &p,
            &direction
        );
        Self::keep_twin(x, twin);
    }
}

impl Backend for CudaBackend {
    type Buf = Buf;

    fn name(&self) -> &'static str {
        "cuda"
    }
    fn zeros(&self, len: usize) -> Buf {
        self.buffer(len)
    }
    fn uninit(&self, len: usize) -> Buf {
        CudaBuf::new(self.alloc_unzeroed::<f32>(len), len)
    }
    fn zeros_bf16_activation(&self, len: usize) -> Buf {
        if !self.activation_copies || len == 0 {
            return self.buffer(len);
        }
        CudaBuf::bf16_only(
            self.alloc::<u16>(len.div_ceil(2) * 2),
            self.alloc::<f32>(1),
            len,
        )
    }
    fn bf16_activation_f32_bytes(&self) -> u64 {
        if self.activation_copies {
            0
        } else {
            4
        }
    }
    fn upload(&self, data: &[f32]) -> Buf {
        let _timer = self.profiler.time_on("upload", self);
        if data.is_empty() {
            return self.buffer(0);
        }
        let data_dev = self
            .stream
            .clone_htod(data)
            .unwrap_or_else(|e| panic!("CUDA: uploading {} floats failed: {e}", data.len()));
        CudaBuf::new(data_dev, data.len())
    }
    fn download(&self, buf: &Buf) -> Vec<f32> {
        let _timer = self.profiler.time_on("download", self);
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
            let mut out = self.stream.clone_dtoh(&values).unwrap_or_else(fail);
            out.truncate(n);
            return out;
        }
        self.stream.clone_dtoh(buf.data()).unwrap_or_else(fail)
    }
    fn len(&self, buf: &Buf) -> usize {
        buf.len()
    }
    fn fill(&self, buf: &mut Buf, value: f32) {
        let _timer = self.profiler.time_on("fill", self);
        self.fill_untimed(buf, value);
    }
    fn copy_from(&self, dst: &mut Buf, src: &Buf) {
        let _timer = self.profiler.time_on("copy_from", self);
        assert_eq!(dst.len(), src.len(), "copy_from: lengths differ");
        self.copy_at_untimed(dst, 0, src);
    }
    fn copy_into_at(&self, dst: &mut Buf, offset: usize, src: &Buf) {
        let _timer = self.profiler.time_on("copy_into_at", self);
        self.copy_at_untimed(dst, offset, src);
    }
    fn copy_range(
        &self,
        dst: &mut Buf,
        dst_offset: usize,
        src: &Buf,
        src_offset: usize,
        len: usize,
    ) {
        let _timer = self.profiler.time_on("copy_range", self);
        self.copy_range_untimed(dst, dst_offset, src, src_offset, len);
    }

    fn copy_rows(
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
        let _timer = self.profiler.time_on("copy_rows", self);
        if rows == 0 || cols == 0 {
            return;
        }
        assert!(
            rows == 1 || dst_stride >= cols,
            "copy_rows: destination rows of {cols} values {dst_stride} apart overlap"
        );
        let last = |offset: usize, stride: usize| offset + (rows - 1) * stride + cols;
        check_len("copy_rows", "dst", dst.len(), last(dst_offset, dst_stride));
        check_len("copy_rows", "src", src.len(), last(src_offset, src_stride));
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
            "copy_rows_f32",
            cfg,
            &to,
            &dst_stride,
            &from,
            &src_stride,
            &n_rows,
            &n_cols
        );
    }

    fn matmul(
        &self,
        out: &mut Buf,
        a: &Buf,
        b: &Buf,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) {
        let _timer = self.profiler.time_on("matmul", self);
        check_matmul("matmul", a, b, out, m, k, n);
        if out.is_bf16_only() {
            assert!(
                !accumulate && out.len() == m * n,
                "matmul: a bf16-only output must be written whole, not accumulated (a titan bug)"
            );
            return self.matmul_to_bf16_only(out, a, b, m, k, n, trans_a, trans_b);
        }
        if k == 0 {
            // An empty sum: `out` keeps its values (accumulate) or becomes zero.
            if !accumulate {
                self.fill_untimed(out, 0.0);
            }
            return;
        }
        let (a, b) = (self.buf_input(a), self.buf_input(b));
        self.gemm(out.data_mut(), a, b, m, k, n, trans_a, trans_b, accumulate);
    }

    fn matmul_add(
        &self,
        out: &mut Buf,
        residual: &Buf,
        a: &Buf,
        b: &Buf,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
    ) {
        let _timer = self.profiler.time_on("matmul", self);
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
            .matmul_add(out.data_mut(), addend, a, b, m, k, n, trans_a, trans_b)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    fn embedding_forward(&self, out: &mut Buf, table: &Buf, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time_on("embedding_forward", self);
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
    fn embedding_backward(&self, dtable: &mut Buf, dout: &Buf, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time_on("embedding_backward", self);
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

    fn rmsnorm_forward(
        &self,
        out: &mut Buf,
        rstd: &mut Buf,
        x: &Buf,
        weight: &Buf,
        dim: usize,
        eps: f32,
    ) {
        let _timer = self.profiler.time_on("rmsnorm_forward", self);
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
    fn rmsnorm_backward(
        &self,
        dx: &mut Buf,
        dweight: &mut Buf,
        dout: &Buf,
        x: &Buf,
        weight: &Buf,
        rstd: &Buf,
        dim: usize,
    ) {
        let _timer = self.profiler.time_on("rmsnorm_backward", self);
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

    fn rope_forward(
        &self,
        x: &mut Buf,
        cos: &Buf,
        sin: &Buf,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        pos_offset: usize,
    ) {
        let _timer = self.profiler.time_on("rope_forward", self);
        self.rope_rotate(x, cos, sin, batch, seq, heads, head_dim, pos_offset, 1.0);
    }
    fn rope_backward(
        &self,
        dx: &mut Buf,
        cos: &Buf,
        sin: &Buf,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
    ) {
        let _timer = self.profiler.time_on("rope_backward", self);
        self.rope_rotate(dx, cos, sin, batch, seq, heads, head_dim, 0, -1.0);
    }

    fn attention_forward(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        s: AttnShape,
    ) {
        let _timer = self.profiler.time_on("attention_forward", self);
        check_attention_shape(&s);
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let kv_floats = s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim;
        check_len("attention_forward", "q", q.len(), q_floats);
        check_len("attention_forward", "out", out.len(), q_floats);
        check_len("attention_forward", "k", k.len(), kv_floats);
        check_len("attention_forward", "v", v.len(), kv_floats);
        check_len(
            "attention_forward",
            "lse",
            lse.len(),
            s.batch * s.n_heads * s.q_len,
        );
        if q_floats == 0 {
            return;
        }
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        if let Some(kernels) = self.tensor_core_attention(&s) {
            let (seq, h, kvh) = (s.q_len as i32, s.n_heads as i32, s.n_kv_heads as i32);
            let cfg = tensor_core_config(s.q_len, s.n_heads, s.batch, kernels.forward_rows);
            let (q, k, v) = (
                self.to_bf16(q, q_floats),
                self.to_bf16(k, kv_floats),
                self.to_bf16(v, kv_floats),
            );
            let (twin, out32, out16) = self.begin_output(out, q_floats, "attention_forward", false);
            launch!(
                self,
                kernels.forward,
                cfg,
                &out32,
                &out16,
                lse,
                &q.address,
                &k.address,
                &v.address,
                &seq,
                &h,
                &kvh,
                &scale
            );
            Self::keep_twin(out, twin);
            return;
        }
        let (ql, kl, kc, h, kvh, d, off) = (
            s.q_len as i32,
            s.kv_len as i32,
            s.kv_capacity as i32,
            s.n_heads as i32,
            s.n_kv_heads as i32,
            s.head_dim as i32,
            s.q_offset as i32,
        );
        let cfg = attention_config(s.q_len, s.n_heads, s.batch);
        launch!(
            self,
            "attention_forward",
            cfg,
            out,
            lse,
            q,
            k,
            v,
            &ql,
            &kl,
            &kc,
            &h,
            &kvh,
            &d,
            &off,
            &scale
        );
    }
    fn attention_backward(
        &self,
        dq: &mut Buf,
        dk: &mut Buf,
        dv: &mut Buf,
        dout: &Buf,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        out: &Buf,
        lse: &Buf,
        s: AttnShape,
    ) {
        let _timer = self.profiler.time_on("attention_backward", self);
        check_attention_shape(&s);
        assert!(
            s.kv_capacity == s.kv_len,
            "attention_backward: keys with spare capacity (a KV cache) have no backward"
        );
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let kv_floats = s.batch * s.kv_len * s.n_kv_heads * s.head_dim;
        for (what, len, need) in [
            ("dq", dq.len(), q_floats),
            ("dout", dout.len(), q_floats),
            ("q", q.len(), q_floats),
            ("out", out.len(), q_floats),
            ("dk", dk.len(), kv_floats),
            ("dv", dv.len(), kv_floats),
            ("k", k.len(), kv_floats),
            ("v", v.len(), kv_floats),
            ("lse", lse.len(), s.batch * s.n_heads * s.q_len),
        ] {
            check_len("attention_backward", what, len, need);
        }
        if q_floats == 0 {
            return;
        }
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let mut delta = self.alloc::<f32>(s.batch * s.n_heads * s.q_len);
        let (seq, h, kvh, d) = (
            s.q_len as i32,
            s.n_heads as i32,
            s.n_kv_heads as i32,
            s.head_dim as i32,
        );
        let per_query = attention_config(s.q_len, s.n_heads, s.batch);
        launch!(
            self,
            "attention_backward_delta",
            per_query,
            &mut delta,
            dout,
            out,
            &seq,
            &h,
            &d
        );
        if let Some(kernels) = self.tensor_core_attention(&s) {
            let (dout, q, k, v) = (
                self.to_bf16(dout, q_floats),
                self.to_bf16(q, q_floats),
                self.to_bf16(k, kv_floats),
                self.to_bf16(v, kv_floats),
            );
            match kernels.backward {
                TensorCoreBackwardKernels::Split { dq: dq_pass, dkdv } => {
                    let per_query = tensor_core_config(s.q_len, s.n_heads, s.batch, 64);
                    let per_key = tensor_core_config(s.q_len, s.n_kv_heads, s.batch, 64);
                    let (dout, q, k, v) = (&dout.address, &q.address, &k.address, &v.address);
                    launch!(
                        self, dq_pass, per_query, dq, dout, q, k, v, lse, &delta, &seq, &h, &kvh,
                        &scale
                    );
                    for pass in dkdv {
                        launch!(
                            self, pass, per_key, &mut *dk, &mut *dv, dout, q, k, v, lse, &delta,
                            &seq, &h, &kvh, &scale
                        );
                    }
                }
                TensorCoreBackwardKernels::Fused {
                    kernel,
                    warps,
                    ordered,
                } => {
                    self.fill_untimed(dq, 0.0);
                    // One zeroed counter per (batch, head, 64-query tile) for the turns, and
                    // one last for the blocks' tickets (attention_tc.cu, `dq_order`).
                    let counters = s.batch * s.n_heads * s.q_len.div_ceil(64) + 1;
                    let turns = ordered.then(|| self.alloc::<i32>(counters));
                    let turns_address = self.address_or_null(turns.as_ref());
                    let cfg = LaunchConfig {
                        grid_dim: (
                            s.q_len.div_ceil(16 * warps) as u32,
                            s.n_kv_heads as u32,
                            s.batch as u32,
                        ),
                        block_dim: (32 * warps as u32, 1, 1),
                        shared_mem_bytes: TensorCoreBackward::fused_shared_bytes(s.head_dim, warps)
                            as u32,
                    };
                    launch!(
                        self,
                        kernel,
                        cfg,
                        &mut *dq,
                        &mut *dk,
                        &mut *dv,
                        &dout.address,
                        &q.address,
                        &k.address,
                        &v.address,
                        lse,
                        &delta,
                        &turns_address,
                        &seq,
                        &h,
                        &kvh,
                        &scale
                    );
                }
            }
            return;
        }
        let (kv_len, q_offset) = (s.kv_len as i32, s.q_offset as i32);
        launch!(
            self,
            "attention_backward_dq",
            per_query,
            dq,
            dout,
            q,
            k,
            v,
            lse,
            &delta,
            &seq,
            &kv_len,
            &q_offset,
            &h,
            &kvh,
            &d,
            &scale
        );
        let per_key = attention_config(s.kv_len, s.n_kv_heads, s.batch);
        launch!(
            self,
            "attention_backward_dkdv",
            per_key,
            dk,
            dv,
            dout,
            q,
            k,
            v,
            lse,
            &delta,
            &seq,
            &kv_len,
            &q_offset,
            &h,
            &kvh,
            &d,
            &scale
        );
    }

    fn attention_merge(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        part_out: &Buf,
        part_lse: &Buf,
        s: AttnShape,
    ) {
        let _timer = self.profiler.time_on("attention_merge", self);
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let rows = s.batch * s.q_len * s.n_heads;
        for (what, len, need) in [
            ("out", out.len(), q_floats),
            ("part_out", part_out.len(), q_floats),
            ("lse", lse.len(), rows),
            ("part_lse", part_lse.len(), rows),
        ] {
            check_len("attention_merge", what, len, need);
        }
        if rows == 0 {
            return;
        }
        let (b, ql, h, d) = (
            s.batch as i32,
            s.q_len as i32,
            s.n_heads as i32,
            s.head_dim as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "attention_merge",
            cfg,
            out,
            lse,
            part_out,
            part_lse,
            &b,
            &ql,
            &h,
            &d
        );
    }

    fn swiglu_forward(&self, out: &mut Buf, gate: &Buf, up: &Buf) {
        let _timer = self.profiler.time_on("swiglu_forward", self);
        let n = self.elementwise_len(
            "swiglu_forward",
            &[("out", out.len()), ("gate", gate.len()), ("up", up.len())],
        );
        let ((gate32, gate16), (up32, up16)) =
            (self.activation_input(gate), self.activation_input(up));
        let (twin, out32, out16) = self.begin_output(out, n, "swiglu_forward", true);
        launch_elementwise!(
            self,
            "swiglu_forward",
            n,
            &out32,
            &out16,
            &gate32,
            &up32,
            &gate16,
            &up16
        );
        Self::keep_twin(out, twin);
    }
    fn swiglu_backward(&self, dgate: &mut Buf, dup: &mut Buf, dout: &Buf, gate: &Buf, up: &Buf) {
        let _timer = self.profiler.time_on("swiglu_backward", self);
        let n = self.elementwise_len(
            "swiglu_backward",
            &[
                ("dgate", dgate.len()),
                ("dup", dup.len()),
                ("dout", dout.len()),
                ("gate", gate.len()),
                ("up", up.len()),
            ],
        );
        let (dout32, dout16) = self.activation_input(dout);
        let ((gate32, gate16), (up32, up16)) =
            (self.activation_input(gate), self.activation_input(up));
        let (dgate_twin, dgate32, dgate16) = self.begin_output(dgate, n, "swiglu_backward", true);
        let (dup_twin, dup32, dup16) = self.begin_output(dup, n, "swiglu_backward", true);
        launch_elementwise!(
            self,
            "swiglu_backward",
            n,
            &dgate32,
            &dup32,
            &dgate16,
            &dup16,
            &dout32,
            &gate32,
            &up32,
            &dout16,
            &gate16,
            &up16
        );
        Self::keep_twin(dgate, dgate_twin);
        Self::keep_twin(dup, dup_twin);
    }

    fn add(&self, out: &mut Buf, a: &Buf, b: &Buf) {
        let _timer = self.profiler.time_on("add", self);
        let n = self.elementwise_len("add", &[("out", out.len()), ("a", a.len()), ("b", b.len())]);
        launch_elementwise!(self, "add_f32", n, out, a, b);
    }
    fn add_assign(&self, acc: &mut Buf, x: &Buf) {
        let _timer = self.profiler.time_on("add_assign", self);
        let n = self.elementwise_len("add_assign", &[("acc", acc.len()), ("x", x.len())]);
        launch_elementwise!(self, "add_assign_f32", n, acc, x);
    }
    fn add_range(&self, acc: &mut Buf, acc_offset: usize, x: &Buf, x_offset: usize, len: usize) {
        let _timer = self.profiler.time_on("add_assign", self);
        check_len("add_range", "acc", acc.len(), acc_offset + len);
        check_len("add_range", "x", x.len(), x_offset + len);
        let mut window = acc.slice_mut(acc_offset..acc_offset + len);
        let part = x.slice(x_offset..x_offset + len);
        launch_elementwise!(self, "add_assign_f32", len, &mut window, &part);
    }
    fn scale(&self, buf: &mut Buf, factor: f32) {
        let _timer = self.profiler.time_on("scale", self);
        let n = buf.len();
        launch_elementwise!(self, "scale_f32", n, buf, &factor);
    }
    fn scale_rows(&self, buf: &mut Buf, scales: &[f32], width: usize) {
        let _timer = self.profiler.time_on("scale_rows", self);
        check_len("scale_rows", "buf", buf.len(), scales.len() * width);
        let scales = self.upload(scales);
        let width = width as i64;
        launch_elementwise!(self, "scale_rows_f32", buf.len(), buf, &scales, &width);
    }
    fn row_dots(&self, a: &Buf, b: &Buf, width: usize) -> Vec<f32> {
        let _timer = self.profiler.time_on("row_dots", self);
        let rows = a.len() / width.max(1);
        check_len("row_dots", "a", a.len(), rows * width);
        check_len("row_dots", "b", b.len(), rows * width);
        let mut out = self.alloc::<f32>(rows.max(1));
        if rows > 0 {
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let (rows_arg, width_arg) = (rows as i64, width as i64);
            launch!(
                self,
                "row_dots_f32",
                cfg,
                &mut out,
                a,
                b,
                &rows_arg,
                &width_arg
            );
        }
        let mut host = self
            .stream
            .clone_dtoh(&out)
            .unwrap_or_else(|e| panic!("CUDA: reading row dots back failed: {e}"));
        host.truncate(rows);
        host
    }

    fn cross_entropy_forward_backward(
        &self,
        h: &Buf,
        weight: &Buf,
        targets: &[u32],
        dim: usize,
        vocab: usize,
        grad_scale: f32,
        mut grads: Option<(&mut Buf, &mut Buf)>,
    ) -> LossSum {
        let _timer = self
            .profiler
            .time_on("cross_entropy_forward_backward", self);
        let rows = targets.len();
        check_len("cross_entropy", "h", h.len(), rows * dim);
        check_len("cross_entropy", "weight", weight.len(), vocab * dim);
        if let Some((dh, dweight)) = grads.as_ref() {
            check_len("cross_entropy", "dh", dh.len(), rows * dim);
            check_len("cross_entropy", "dweight", dweight.len(), vocab * dim);
        }
        if let Some(&bad) = targets
            .iter()
            .find(|&&t| t != IGNORE_INDEX && t as usize >= vocab)
        {
            panic!("target id {bad} is outside the vocabulary of {vocab}");
        }
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
                self.gemm
                    .matmul_to_bf16(
                        block,
                        self.view_input(&h_chunk),
                        self.buf_input(weight),
                        n,
                        dim,
                        vocab,
                        false,
                        true,
                    )
                    .unwrap_or_else(|e| panic!("{e:#}"));
                0
            } else {
                let block = logits.get_or_insert_with(|| self.alloc_unzeroed::<f32>(n * vocab));
                let mut lc = block.slice_mut(..n * vocab);
                self.gemm(
                    &mut lc,
                    self.view_input(&h_chunk),
                    self.buf_input(weight),
                    n,
                    dim,
                    vocab,
                    false,
                    true,
                    false,
                );
                let (address, _sync) = lc.device_ptr_mut(&self.stream);
                address
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
                };
                self.gemm(
                    &mut dh_chunk,
                    lc,
                    self.buf_input(weight),
                    n,
                    vocab,
                    dim,
                    false,
                    false,
                    true,
                );
                let mut dw = dweight.slice_mut(0..vocab * dim);
                let hc = self.view_input(&h_chunk);
                self.gemm(&mut dw, lc, hc, vocab, n, dim, true, false, true);
            }
        }
        let losses = self
            .stream
            .clone_dtoh(&row_loss)
            .unwrap_or_else(|e| panic!("CUDA: downloading the losses failed: {e}"));
        let mut total = LossSum { sum: 0.0, count: 0 };
        for l in losses {
            if !l.is_nan() {
                total.sum += l as f64;
                total.count += 1;
            }
        }
        total
    }

    fn adamw_step(
        &self,
        param: &mut Buf,
        grad: &Buf,
        exp_avg: &mut Buf,
        exp_avg_sq: &mut Buf,
        hp: AdamWStep,
    ) {
        let _timer = self.profiler.time_on("adamw_step", self);
        let n = self.elementwise_len(
            "adamw_step",
            &[
                ("param", param.len()),
                ("grad", grad.len()),
                ("exp_avg", exp_avg.len()),
                ("exp_avg_sq", exp_avg_sq.len()),
            ],
        );
        let (step_size, bias2_sqrt, decay) = hp.host_constants();
        launch_elementwise!(
            self,
            "adamw_step",
            n,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            &hp.beta1,
            &hp.beta2,
            &hp.eps,
            &step_size,
            &bias2_sqrt,
            &decay,
            &hp.grad_scale,
        );
    }

    fn fill_all(&self, bufs: &mut [Buf], value: f32) {
        let _timer = self.profiler.time_on("fill_all", self);
        self.fill_list(bufs, value);
    }

    fn adamw_step_all(
        &self,
        params: &mut [Buf],
        grads: &[Buf],
        exp_avg: &mut [Buf],
        exp_avg_sq: &mut [Buf],
        hp: AdamWStep,
    ) {
        let _timer = self.profiler.time_on("adamw_step_all", self);
        self.adamw_all(params, grads, exp_avg, exp_avg_sq, hp);
    }

    fn sum_squares_all(&self, bufs: &[Buf]) -> f64 {
        let _timer = self.profiler.time_on("sum_squares_all", self);
        self.sum_squares_list(bufs)
    }

    fn copy_rounded_to_bf16_all(&self, dst: &mut [Buf], src: &[Buf]) {
        let _timer = self.profiler.time_on("copy_rounded_to_bf16_all", self);
        self.copy_rounded_all(dst, src);
    }

    fn sum_squares(&self, buf: &Buf) -> f64 {
        let _timer = self.profiler.time_on("sum_squares", self);
        let n = buf.len();
        if n == 0 {
            return 0.0;
        }
        const BLOCKS: usize = 256;
        let mut partials = self.alloc::<f64>(BLOCKS);
        let cfg = LaunchConfig {
            grid_dim: (BLOCKS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let len = n as i64;
        launch!(self, "sum_squares_partial", cfg, &mut partials, buf, &len);
        self.stream
            .clone_dtoh(&partials)
            .unwrap_or_else(|e| panic!("CUDA: downloading partial sums failed: {e}"))
            .iter()
            .sum()
    }

    fn round_to_bf16(&self, buf: &mut Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        let n = buf.len();
        launch_elementwise!(self, "round_to_bf16", n, buf);
    }
    fn pack_bf16_pairs(&self, words: &mut Buf, src: &Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        let n = src.len();
        check_len("pack_bf16_pairs", "words", words.len() * 2, n);
        // f32_to_bf16 writes the pairs as u32 words, the layout of tensor::pack_bf16_pairs.
        let (out, input) = (
            words.device_address_mut(&self.stream),
            src.device_address(&self.stream),
        );
        launch_elementwise!(self, "f32_to_bf16", n, &out, &input);
    }
    fn unpack_bf16_pairs(&self, out: &mut Buf, words: &Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        let n = out.len();
        check_len("unpack_bf16_pairs", "words", words.len() * 2, n);
        let input = words.device_address(&self.stream);
        launch_elementwise!(self, "bf16_pairs_to_f32", n, out, &input);
    }

    fn synchronize(&self) {
        CudaBackend::synchronize(self).unwrap_or_else(|e| panic!("{e:#}"));
    }
    fn device_peak_memory(&self) -> Option<u64> {
        self.peak_memory_bytes()
    }
    fn peak_tflops(&self) -> Option<f64> {
        super::specs::peak_tflops(self.device_name(), self.precision())
    }
    fn scratch_bytes(&self, tokens: usize, dim: usize, hidden: usize, vocab: usize) -> u64 {
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
            let largest = (vocab * dim).max(tokens * hidden);
            chunk * vocab * 2 + 2 * largest * 2 + 4 * tokens * dim * 2
        } else {
            0
        };
        (logits + bf16_operands) as u64
    }
    fn activation_copy_bytes(&self) -> u64 {
        if self.activation_copies {
            2
        } else {
            0
        }
    }
    fn device_free_memory(&self) -> Option<u64> {
        self.memory_info().map(|(_, free)| free as u64)
    }
    fn compute_copy_bytes_per_param(&self) -> u64 {
        4 + 2
    }
}

/// Rows per loss chunk on a GPU: a logit block of at most 512 Mi floats (2 GiB; 4096 rows of
/// Llama 3's 128k vocabulary: few chunks, so the output weight is converted to bf16 few times), at
/// least 128 rows so the three GEMMs per chunk stay large, and a multiple of 64 so every chunk's
/// rows start 256-byte aligned, as cuBLASLt's fast kernels assume.
fn gpu_loss_chunk_rows(vocab: usize) -> usize {
    ((512usize << 20) / vocab.max(1)).clamp(128, 4096) / 64 * 64
}

fn check_attention_shape(s: &AttnShape) {
    assert!(
        s.head_dim <= ATTN_MAX_HEAD_DIM,
        "attention: head_dim {} is above the CUDA kernels' limit of {ATTN_MAX_HEAD_DIM}",
        s.head_dim
    );
    assert!(
        s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: {} heads are not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    assert!(
        s.kv_len <= s.kv_capacity,
        "attention: kv_len {} is above the capacity {}",
        s.kv_len,
        s.kv_capacity
    );
}

/// The tensor-core attention kernels for one head dimension (kernels/attention_tc.cu). They read
/// bf16 copies of their inputs, made per call.
struct TensorCoreAttention {
    forward: &'static str,
    /// Query rows per block of the forward (64, or 128 with 32 rows per warp).
    forward_rows: usize,
    backward: TensorCoreBackwardKernels,
}

enum TensorCoreBackwardKernels {
    /// A dQ pass, then one pass computing dK and dV, or two (head_dim 128, so the accumulators
    /// fit in registers).
    Split {
        dq: &'static str,
        dkdv: &'static [&'static str],
    },
    /// One pass adding into a zeroed dQ; `warps` warps of 16 keys per block, taking turns at each
    /// query tile when `ordered`.
    Fused {
        kernel: &'static str,
        warps: usize,
        ordered: bool,
    },
}

impl TensorCoreBackwardKernels {
    /// The kernels of `choice` at `head_dim`: the given split passes, or the fused kernel when the
    /// device gives a block the shared memory it needs (`shared_memory_per_block`; else the split
    /// passes, which fit everywhere).
    fn choose(
        choice: TensorCoreBackward,
        head_dim: usize,
        shared_memory_per_block: usize,
        dq: &'static str,
        dkdv: &'static [&'static str],
    ) -> Self {
        if let TensorCoreBackward::Fused { warps, ordered } = choice {
            let fits = TensorCoreBackward::fused_fits(head_dim, warps, shared_memory_per_block);
            let kernel = FUSED_BACKWARD_KERNELS
                .into_iter()
                .find(|&(_, d, w)| d == head_dim && w == warps);
            if let (true, Some((kernel, _, _))) = (fits, kernel) {
                return TensorCoreBackwardKernels::Fused {
                    kernel,
                    warps,
                    ordered,
                };
            }
        }
        TensorCoreBackwardKernels::Split { dq, dkdv }
    }
}

impl CudaBackend {
    /// The tensor-core kernels when they apply: the backend allows them (`attention`, chosen in
    /// `CudaBackend::new`), head_dim is 64 or 128, and the shape is training's (no KV cache).
    fn tensor_core_attention(&self, s: &AttnShape) -> Option<TensorCoreAttention> {
        let training_shape = s.q_offset == 0 && s.kv_len == s.q_len && s.kv_capacity == s.q_len;
        let AttentionKernels::TensorCores {
            wide_forward,
            backward,
        } = self.attention
        else {
            return None;
        };
        if !training_shape {
            return None;
        }
        match s.head_dim {
            64 => Some(TensorCoreAttention {
                forward: if wide_forward {
                    "attention_forward_tc64x2"
                } else {
                    "attention_forward_tc64"
                },
                forward_rows: if wide_forward { 128 } else { 64 },
                backward: TensorCoreBackwardKernels::choose(
                    backward,
                    64,
                    self.shared_memory_per_block,
                    "attention_backward_dq_tc64",
                    &["attention_backward_dkdv_tc64"],
                ),
            }),
            128 => Some(TensorCoreAttention {
                forward: "attention_forward_tc128",
                forward_rows: 64,
                backward: TensorCoreBackwardKernels::choose(
                    backward,
                    128,
                    self.shared_memory_per_block,
                    "attention_backward_dq_tc128",
                    &["attention_backward_dk_tc128", "attention_backward_dv_tc128"],
                ),
            }),
            _ => None,
        }
    }

    /// The first `len` values of `x` in bf16 (nearest even), for kernels that read bf16: the
    /// buffer's own bf16 copy when a kernel wrote one (see CudaBuf), else a conversion.
    fn to_bf16(&self, x: &Buf, len: usize) -> Bf16Operand {
        if let Some(address) = x.bf16_address(&self.stream) {
            return Bf16Operand {
                address,
                _converted: None,
            };
        }
        // The conversion writes every pair, the odd count's padding included.
        let mut out = self.alloc_unzeroed::<u16>(len.div_ceil(2) * 2);
        let src = x.device_address(&self.stream);
        launch_to_bf16(
            &self.stream,
            self.function("f32_to_bf16"),
            &mut out,
            src,
            len,
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let address = {
            let (ptr, _sync) = out.device_ptr(&self.stream);
            ptr
        };
        Bf16Operand {
            address,
            _converted: Some(out),
        }
    }
}

/// A bf16 operand of a kernel: its device address, and the conversion's memory when it was made
/// for this call (held until the launch is queued; the pool frees it in stream order).
struct Bf16Operand {
    address: u64,
    _converted: Option<CudaSlice<u16>>,
}

/// `block_rows` rows (4 warps of 16 or 32) per block for the tensor-core kernels.
fn tensor_core_config(rows: usize, heads: usize, batch: usize, block_rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(block_rows) as u32, heads as u32, batch as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
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

/// One warp per row: `rows` rows per (head, batch), `ATTN_WARPS` rows per block.
fn attention_config(rows: usize, heads: usize, batch: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ATTN_WARPS) as u32, heads as u32, batch as u32),
        block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
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
