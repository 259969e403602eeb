//! `Backend` for `CudaBackend`: argument checks on the host, then one launch per kernel (or a
//! cuBLASLt call). A CUDA failure in the middle of a step cannot be recovered, so it panics with the
//! op's name and the driver's error.
//!
//! This file holds what every op's launch shares (`launch!` and the conversion of its arguments,
//! the length checks) and the trait impl, which times each op and hands it to its body in its
//! family's file (`<op>_untimed`, which other ops also call inside their own timing): `copy`,
//! `bf16`, `matmul`, `embedding`, `norm`, `rope`, `attention`, `elementwise`, `loss`, `adamw`, and
//! `multi_tensor` for the ops over whole parameter lists.

use crate::backend::{GemmOutput, GemmShape, RopeShape};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};

use super::{CudaBackend, CudaBuf};
use crate::backend::clamped_swiglu::Clamp;
use crate::backend::float8::{ContractedDim, Fp8Format, MxCast, Quantization, ScaleAxis};
use crate::backend::grouped_gemm::{self as host_grouped, GroupedGemm};
use crate::backend::host_routing;
use crate::backend::moe_aux::SequenceSpan;
use crate::backend::routing::{DispatchOrder, RoutedTokens, RouterArgs};
use crate::backend::{
    AdamWStep, AttnGrads, AttnInputs, AttnSaved, AttnShape, Backend, LossSum, VocabShard,
};

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
    mut CudaSlice<f32>, CudaSlice<f64>, CudaSlice<u32>, CudaViewMut<'_, f32>
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

mod adamw;
mod attention;
mod attention_sinks;
mod bf16;
mod copy;
mod elementwise;
mod embedding;
mod float8;
mod grouped_gemm;
pub(super) mod loss;
mod matmul;
mod moe_aux;
mod multi_tensor;
mod norm;
mod rope;
mod routing;
mod vocab_shard;

fn check_len(op: &str, what: &str, have: usize, need: usize) {
    assert!(
        have >= need,
        "{op}: `{what}` holds {have} floats but the shapes need {need}"
    );
}

impl CudaBackend {
    /// A kernel argument for optional device memory: its address, or null.
    fn address_or_null<T>(&self, memory: Option<&CudaSlice<T>>) -> u64 {
        memory.map_or(0, |m| m.device_ptr(&self.stream).0)
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
        self.upload_untimed(data)
    }
    fn download(&self, buf: &Buf) -> Vec<f32> {
        let _timer = self.profiler.time_on("download", self);
        self.download_untimed(buf)
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
        self.copy_rows_untimed(
            dst, dst_offset, dst_stride, src, src_offset, src_stride, rows, cols,
        );
    }

    fn add_rows(
        &self,
        acc: &mut Buf,
        acc_offset: usize,
        acc_stride: usize,
        x: &Buf,
        x_offset: usize,
        x_stride: usize,
        rows: usize,
        cols: usize,
    ) {
        let _timer = self.profiler.time_on("add_rows", self);
        let (dst, src) = ((acc, acc_offset, acc_stride), (x, x_offset, x_stride));
        self.add_rows_untimed(dst, src, rows, cols);
    }

    fn matmul(&self, out: &mut Buf, a: &Buf, b: &Buf, shape: GemmShape, output: GemmOutput) {
        let _timer = self.profiler.time_on("matmul", self);
        self.matmul_untimed(out, a, b, shape, output);
    }

    fn matmul_add(&self, out: &mut Buf, residual: &Buf, a: &Buf, b: &Buf, shape: GemmShape) {
        let _timer = self.profiler.time_on("matmul", self);
        self.matmul_add_untimed(out, residual, a, b, shape);
    }

    fn embedding_forward(&self, out: &mut Buf, table: &Buf, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time_on("embedding_forward", self);
        self.embedding_forward_untimed(out, table, ids, dim);
    }
    fn gather_rows(&self, out: &mut Buf, table: &Buf, ids: &Buf, width: usize) {
        let _timer = self.profiler.time_on("gather_rows", self);
        self.gather_rows_untimed(out, table, ids, width);
    }
    fn moe_route(&self, logits: &Buf, bias: Option<&Buf>, args: &RouterArgs) -> RoutedTokens<Buf> {
        let _timer = self.profiler.time_on("moe_route", self);
        match routing::fits_kernels(args.num_experts, args.top_k) {
            true => self.moe_route_untimed(logits, bias, args),
            false => host_routing::route(self, logits, bias, args),
        }
    }
    fn moe_route_backward(
        &self,
        args: &RouterArgs,
        scores_experts: (&Buf, &Buf),
        dweights: &Buf,
        aux_grads: Option<&Buf>,
    ) -> Buf {
        let _timer = self.profiler.time_on("moe_route_backward", self);
        match routing::fits_kernels(args.num_experts, args.top_k) {
            true => self.moe_route_backward_untimed(args, scores_experts, dweights, aux_grads),
            false => host_routing::route_backward(self, args, scores_experts, dweights, aux_grads),
        }
    }
    fn moe_dispatch_order(
        &self,
        experts: &Buf,
        experts_top_k: (usize, usize),
    ) -> DispatchOrder<Buf> {
        let _timer = self.profiler.time_on("moe_dispatch_order", self);
        match routing::fits_kernels(experts_top_k.0, experts_top_k.1) {
            true => self.moe_dispatch_order_untimed(experts, experts_top_k),
            false => host_routing::dispatch_order(self, experts, experts_top_k),
        }
    }
    fn moe_combine(
        &self,
        out: &mut Buf,
        rows: &Buf,
        row_of_slot: &Buf,
        top_k_width: (usize, usize),
    ) {
        let _timer = self.profiler.time_on("moe_combine", self);
        match routing::fits_kernels(0, top_k_width.0) {
            true => self.moe_combine_untimed(out, rows, row_of_slot, top_k_width),
            false => host_routing::combine(self, out, rows, row_of_slot, top_k_width),
        }
    }
    fn grouped_matmul(
        &self,
        out: &mut Buf,
        a: &Buf,
        weights_offsets: (&[&Buf], &Buf),
        g: GroupedGemm,
    ) {
        let _timer = self.profiler.time_on("grouped_matmul", self);
        match weights_offsets.0.len() <= grouped_gemm::MAX_EXPERTS {
            true => self.grouped_matmul_untimed(out, a, weights_offsets, g),
            false => host_grouped::matmul(self, out, a, weights_offsets, g),
        }
    }
    fn grouped_weight_grad(
        &self,
        grads: &mut [&mut Buf],
        dy_x: (&Buf, &Buf),
        offsets: &Buf,
        n_out_k_in: (usize, usize),
    ) {
        let _timer = self.profiler.time_on("grouped_weight_grad", self);
        match grads.len() <= grouped_gemm::MAX_EXPERTS {
            true => self.grouped_weight_grad_untimed(grads, dy_x, offsets, n_out_k_in),
            false => host_grouped::weight_grad(self, grads, dy_x, offsets, n_out_k_in),
        }
    }
    fn moe_count_load(&self, counts: &mut Buf, offsets: &Buf, at: usize) {
        let _timer = self.profiler.time_on("moe_count_load", self);
        self.moe_count_load_untimed(counts, offsets, at);
    }
    fn moe_aux_figures(
        &self,
        experts_scores: (&Buf, &Buf),
        args: &RouterArgs,
        span: SequenceSpan,
    ) -> Buf {
        let _timer = self.profiler.time_on("moe_aux_figures", self);
        self.moe_aux_figures_untimed(experts_scores, args, span)
    }
    fn moe_aux_balance(&self, figures: &Buf, args: &RouterArgs, sequences: usize) -> Buf {
        let _timer = self.profiler.time_on("moe_aux_balance", self);
        self.moe_aux_balance_untimed(figures, args, sequences)
    }
    fn moe_aux_score_grads(
        &self,
        balance_figures: (&Buf, &Buf),
        args: &RouterArgs,
        span_tokens: (SequenceSpan, usize),
        scale: f32,
    ) -> Buf {
        let _timer = self.profiler.time_on("moe_aux_score_grads", self);
        self.moe_aux_score_grads_untimed(balance_figures, args, span_tokens, scale)
    }
    fn embedding_backward(&self, dtable: &mut Buf, dout: &Buf, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time_on("embedding_backward", self);
        self.embedding_backward_untimed(dtable, dout, ids, dim);
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
        self.rmsnorm_forward_untimed(out, rstd, x, weight, dim, eps);
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
        self.rmsnorm_backward_untimed(dx, dweight, dout, x, weight, rstd, dim);
    }

    fn rope_forward(&self, x: &mut Buf, cos: &Buf, sin: &Buf, shape: RopeShape) {
        let _timer = self.profiler.time_on("rope_forward", self);
        self.rope_rotate(x, cos, sin, shape, 1.0);
    }
    fn rope_backward(&self, dx: &mut Buf, cos: &Buf, sin: &Buf, shape: RopeShape) {
        let _timer = self.profiler.time_on("rope_backward", self);
        self.rope_rotate(dx, cos, sin, shape, -1.0);
    }

    fn attention_forward(&self, out: &mut Buf, lse: &mut Buf, x: AttnInputs<'_, Buf>) {
        let _timer = self.profiler.time_on("attention_forward", self);
        self.attention_forward_untimed(out, lse, x);
    }
    fn attention_backward(
        &self,
        grads: AttnGrads<'_, Buf>,
        dout: &Buf,
        x: AttnInputs<'_, Buf>,
        saved: AttnSaved<'_, Buf>,
    ) {
        let _timer = self.profiler.time_on("attention_backward", self);
        self.attention_backward_untimed(grads, dout, x, saved);
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
        self.attention_merge_untimed(out, lse, part_out, part_lse, s);
    }

    fn attention_sinks_forward(&self, out: &mut Buf, lse: &mut Buf, sinks: &Buf, s: AttnShape) {
        let _timer = self.profiler.time_on("attention_sinks_forward", self);
        self.attention_sinks_forward_untimed(out, lse, sinks, s);
    }
    fn attention_sinks_backward(
        &self,
        dsinks: &mut Buf,
        dout: &Buf,
        saved: AttnSaved<'_, Buf>,
        sinks: &Buf,
        s: AttnShape,
    ) {
        let _timer = self.profiler.time_on("attention_sinks_backward", self);
        self.attention_sinks_backward_untimed(dsinks, dout, saved, sinks, s);
    }

    fn swiglu_forward(&self, out: &mut Buf, gate: &Buf, up: &Buf) {
        let _timer = self.profiler.time_on("swiglu_forward", self);
        self.swiglu_forward_untimed(out, gate, up);
    }
    fn swiglu_backward(&self, dgate: &mut Buf, dup: &mut Buf, dout: &Buf, gate: &Buf, up: &Buf) {
        let _timer = self.profiler.time_on("swiglu_backward", self);
        self.swiglu_backward_untimed(dgate, dup, dout, gate, up);
    }
    fn clamped_swiglu_forward(&self, act: &mut Buf, gate_up: (&Buf, &Buf), clamp: Clamp) {
        let _timer = self.profiler.time_on("clamped_swiglu_forward", self);
        self.clamped_swiglu_forward_untimed(act, gate_up, clamp);
    }
    fn clamped_swiglu_backward(
        &self,
        dgate_dup: (&mut Buf, &mut Buf),
        dact: &Buf,
        gate_up: (&Buf, &Buf),
        clamp: Clamp,
    ) {
        let _timer = self.profiler.time_on("clamped_swiglu_backward", self);
        self.clamped_swiglu_backward_untimed(dgate_dup, dact, gate_up, clamp);
    }

    fn add(&self, out: &mut Buf, a: &Buf, b: &Buf) {
        let _timer = self.profiler.time_on("add", self);
        self.add_untimed(out, a, b);
    }
    fn add_assign(&self, acc: &mut Buf, x: &Buf) {
        let _timer = self.profiler.time_on("add_assign", self);
        self.add_assign_untimed(acc, x);
    }
    fn add_range(&self, acc: &mut Buf, acc_offset: usize, x: &Buf, x_offset: usize, len: usize) {
        let _timer = self.profiler.time_on("add_assign", self);
        self.add_range_untimed(acc, acc_offset, x, x_offset, len);
    }
    fn scale(&self, buf: &mut Buf, factor: f32) {
        let _timer = self.profiler.time_on("scale", self);
        self.scale_untimed(buf, factor);
    }
    fn scale_rows(&self, buf: &mut Buf, scales: &[f32], width: usize) {
        let _timer = self.profiler.time_on("scale_rows", self);
        self.scale_rows_untimed(buf, scales, width);
    }
    fn scale_rows_by(&self, buf: &mut Buf, scales: &Buf, width: usize) {
        let _timer = self.profiler.time_on("scale_rows", self);
        self.scale_rows_by_untimed(buf, scales, width);
    }
    fn row_dots(&self, a: &Buf, b: &Buf, width: usize) -> Buf {
        let _timer = self.profiler.time_on("row_dots", self);
        self.row_dots_untimed(a, b, width)
    }

    fn cross_entropy_forward_backward(
        &self,
        h: &Buf,
        weight: &Buf,
        targets: &[u32],
        dim: usize,
        vocab: usize,
        grad_scale: f32,
        grads: Option<(&mut Buf, &mut Buf)>,
    ) -> LossSum {
        let _timer = self
            .profiler
            .time_on("cross_entropy_forward_backward", self);
        self.cross_entropy_forward_backward_untimed(
            h, weight, targets, dim, vocab, grad_scale, grads,
        )
    }

    fn cross_entropy_of_logits(
        &self,
        logits: &mut Buf,
        targets: &[u32],
        vocab: usize,
        grad_scale: f32,
        want_grad: bool,
    ) -> LossSum {
        let _timer = self.profiler.time_on("cross_entropy_of_logits", self);
        self.cross_entropy_of_logits_untimed(logits, targets, vocab, grad_scale, want_grad)
    }

    fn vocab_shard_row_max(&self, logits: &Buf, shard: VocabShard) -> Buf {
        let _timer = self.profiler.time_on("vocab_shard_row_max", self);
        self.vocab_shard_row_max_untimed(logits, shard)
    }

    fn vocab_shard_row_sums(
        &self,
        logits: &Buf,
        max: &Buf,
        targets: &[u32],
        shard: VocabShard,
    ) -> Buf {
        let _timer = self.profiler.time_on("vocab_shard_row_sums", self);
        self.vocab_shard_row_sums_untimed(logits, max, targets, shard)
    }

    fn vocab_shard_loss(
        &self,
        logits: &mut Buf,
        stats: (&Buf, &Buf),
        targets: &[u32],
        shard: VocabShard,
        grad: (f32, bool),
        total: &mut LossSum,
    ) {
        let _timer = self.profiler.time_on("vocab_shard_loss", self);
        self.vocab_shard_loss_untimed(logits, stats, targets, shard, grad, total)
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
        self.adamw_step_untimed(param, grad, exp_avg, exp_avg_sq, hp);
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
        self.sum_squares_untimed(buf)
    }

    fn float8_amaxes(&self, x: &Buf, rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
        let _timer = self.profiler.time_on("float8_amax", self);
        self.float8_amaxes_untimed(x, rows, cols, axis)
    }
    fn float8_fake_quantized(
        &self,
        x: &Buf,
        cols: usize,
        q: Quantization,
        amaxes: &[f32],
        contracted: ContractedDim,
    ) -> Buf {
        let _timer = self.profiler.time_on("float8_fake_quantize", self);
        self.float8_fake_quantized_untimed(x, cols, q, amaxes, contracted)
    }
    fn keeps_float8_codes(&self) -> bool {
        self.fp8_gemms()
    }
    fn float8_gemm_counts(&self) -> Option<(u64, u64)> {
        self.fp8_gemms().then(|| self.fp8_gemm_counts())
    }
    fn mx_fake_quantized(&self, x: &Buf, cols: usize, cast: MxCast) -> Buf {
        let _timer = self.profiler.time_on("mx_fake_quantize", self);
        self.mx_fake_quantized_untimed(x, cols, cast)
    }
    fn float8_encoded(&self, x: &Buf, scale: f32, format: Fp8Format) -> Buf {
        let _timer = self.profiler.time_on("float8_encode", self);
        self.float8_encoded_untimed(x, scale, format)
    }
    fn float8_decoded(&self, words: &Buf, format: Fp8Format) -> Buf {
        let _timer = self.profiler.time_on("float8_decode", self);
        self.float8_decoded_untimed(words, format)
    }

    fn round_to_bf16(&self, buf: &mut Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        self.round_to_bf16_untimed(buf);
    }
    fn pack_bf16_pairs(&self, words: &mut Buf, src: &Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        self.pack_bf16_pairs_untimed(words, src);
    }
    fn unpack_bf16_pairs(&self, out: &mut Buf, words: &Buf) {
        let _timer = self.profiler.time_on("round_to_bf16", self);
        self.unpack_bf16_pairs_untimed(out, words);
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
        self.step_scratch_bytes(tokens, dim, hidden, vocab)
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
