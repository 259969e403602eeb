//! The CPU backend: the reference implementation of every kernel, fast enough to train on.
//!
//! GEMMs go to the `gemm` crate; everything else is written here because each op is fused with its
//! neighbours (norm with its reciprocal RMS, loss with the output projection, flash-style attention)
//! and no crate offers those shapes. Work is split over rayon threads in fixed chunks, so results are
//! bitwise identical for any thread count.

mod adamw;
mod attention;
mod elementwise;
mod embedding;
pub mod fastmath;
mod float8_rows;
pub mod loss;
mod matmul;
mod norm;
pub mod peak;
pub mod rope;
pub mod rope_scaling;
mod rows;
pub(crate) mod simd;
pub mod vocab_shard;

use crate::backend::{GemmOutput, GemmShape, RopeShape};
use std::sync::Mutex;

use rayon::prelude::*;

pub use super::profile::OpProfiler;

use super::clamped_swiglu::{self, Clamp};
use super::float8::{ContractedDim, MxCast, Quantization, ScaleAxis};
use super::grouped_gemm::{self, GroupedGemm};
use super::moe_aux::{self, SequenceSpan};
use super::routing::{self, DispatchOrder, RoutedTokens, RouterArgs};
use super::transfers::TransferCounter;
use super::{AdamWStep, AttnGrads, AttnInputs, AttnSaved, AttnShape, Backend, LossSum, VocabShard};

/// Columns per task in column-blocked reductions (norm weight and embedding gradients).
pub(crate) const COLUMN_BLOCK: usize = 64;

/// A raw pointer that rayon tasks may share when each writes a disjoint part of the buffer.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    #[inline(always)]
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

#[derive(Default)]
pub struct CpuBackend {
    /// Logit block of the fused loss, grown once and reused every step.
    loss_scratch: Mutex<Vec<f32>>,
    pub profiler: OpProfiler,
    /// Uploads and downloads, counted as a GPU would make them (`backend::transfers`).
    pub transfers: TransferCounter,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend that times every kernel call (see `OpProfiler::report`).
    pub fn profiled() -> Self {
        CpuBackend {
            profiler: OpProfiler::enabled(),
            ..Self::default()
        }
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn overlaps_host_calls(&self) -> bool {
        true
    }
    fn scratch_bytes(&self, _tokens: usize, _dim: usize, _hidden: usize, vocab: usize) -> u64 {
        loss::scratch_floats(vocab) as u64 * 4
    }
    fn zeros(&self, len: usize) -> Vec<f32> {
        vec![0.0; len]
    }
    fn upload(&self, data: &[f32]) -> Vec<f32> {
        self.transfers.record(data.len());
        data.to_vec()
    }
    fn download(&self, buf: &Vec<f32>) -> Vec<f32> {
        self.transfers.record(buf.len());
        buf.clone()
    }
    fn scale_rows(&self, buf: &mut Vec<f32>, scales: &[f32], width: usize) {
        buf.par_chunks_mut(width)
            .zip(scales)
            .for_each(|(row, s)| row.iter_mut().for_each(|x| *x *= s));
    }
    fn float8_amaxes(&self, x: &Vec<f32>, rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
        let _timer = self.profiler.time("float8_amax");
        float8_rows::amaxes(x, rows, cols, axis)
    }
    fn float8_fake_quantized(
        &self,
        x: &Vec<f32>,
        cols: usize,
        q: Quantization,
        amaxes: &[f32],
        _contracted: ContractedDim,
    ) -> Vec<f32> {
        let _timer = self.profiler.time("float8_fake_quantize");
        float8_rows::fake_quantized(x, cols, q, amaxes)
    }
    fn mx_fake_quantized(&self, x: &Vec<f32>, cols: usize, cast: MxCast) -> Vec<f32> {
        let _timer = self.profiler.time("mx_fake_quantize");
        float8_rows::mx_fake_quantized(x, cols, cast)
    }
    fn row_dots(&self, a: &Vec<f32>, b: &Vec<f32>, width: usize) -> Vec<f32> {
        a.par_chunks(width)
            .zip(b.par_chunks(width))
            .map(|(x, y)| fastmath::dot(x, y))
            .collect()
    }
    fn scale_rows_by(&self, buf: &mut Vec<f32>, scales: &Vec<f32>, width: usize) {
        self.scale_rows(buf, scales, width);
    }
    fn moe_route(
        &self,
        logits: &Vec<f32>,
        bias: Option<&Vec<f32>>,
        args: &RouterArgs,
    ) -> RoutedTokens<Vec<f32>> {
        let _timer = self.profiler.time("moe_route");
        let r = routing::route(args, logits, bias.map(Vec::as_slice));
        RoutedTokens {
            experts: routing::ids_to_bits(&r.experts),
            weights: r.weights,
            scores: r.scores,
        }
    }
    fn moe_route_backward(
        &self,
        args: &RouterArgs,
        (scores, experts): (&Vec<f32>, &Vec<f32>),
        dweights: &Vec<f32>,
        aux_grads: Option<&Vec<f32>>,
    ) -> Vec<f32> {
        let _timer = self.profiler.time("moe_route_backward");
        let chosen = routing::ids_of_bits(experts);
        routing::route_backward(
            args,
            (scores, &chosen),
            dweights,
            aux_grads.map(Vec::as_slice),
        )
    }
    fn moe_dispatch_order(
        &self,
        experts: &Vec<f32>,
        (e, k): (usize, usize),
    ) -> DispatchOrder<Vec<f32>> {
        let _timer = self.profiler.time("moe_dispatch_order");
        routing::dispatch_order(&routing::ids_of_bits(experts), e, k)
            .map(|ids| routing::ids_to_bits(&ids))
    }
    fn gather_rows(&self, out: &mut Vec<f32>, table: &Vec<f32>, ids: &Vec<f32>, width: usize) {
        let _timer = self.profiler.time("gather_rows");
        embedding::embedding_forward(out, table, &routing::ids_of_bits(ids), width);
    }
    fn moe_combine(
        &self,
        out: &mut Vec<f32>,
        rows: &Vec<f32>,
        row_of_slot: &Vec<f32>,
        (k, width): (usize, usize),
    ) {
        let _timer = self.profiler.time("moe_combine");
        routing::combine(out, rows, &routing::ids_of_bits(row_of_slot), k, width);
    }
    fn clamped_swiglu_forward(
        &self,
        act: &mut Vec<f32>,
        (gate, up): (&Vec<f32>, &Vec<f32>),
        clamp: Clamp,
    ) {
        let _timer = self.profiler.time("clamped_swiglu_forward");
        clamped_swiglu::forward(act, gate, up, clamp);
    }
    fn clamped_swiglu_backward(
        &self,
        (dgate, dup): (&mut Vec<f32>, &mut Vec<f32>),
        dact: &Vec<f32>,
        (gate, up): (&Vec<f32>, &Vec<f32>),
        clamp: Clamp,
    ) {
        let _timer = self.profiler.time("clamped_swiglu_backward");
        clamped_swiglu::backward((dgate, dup), dact, (gate, up), clamp);
    }
    fn moe_count_load(&self, counts: &mut Vec<f32>, offsets: &Vec<f32>, at: usize) {
        routing::count_load(counts, &routing::ids_of_bits(offsets), at);
    }
    fn moe_aux_figures(
        &self,
        (experts, scores): (&Vec<f32>, &Vec<f32>),
        args: &RouterArgs,
        span: SequenceSpan,
    ) -> Vec<f32> {
        moe_aux::figures(args, (&routing::ids_of_bits(experts), scores), span)
    }
    fn moe_aux_balance(&self, figures: &Vec<f32>, args: &RouterArgs, sequences: usize) -> Vec<f32> {
        moe_aux::balance(args, figures, sequences)
    }
    fn moe_aux_score_grads(
        &self,
        (balance, figures): (&Vec<f32>, &Vec<f32>),
        args: &RouterArgs,
        span_tokens: (SequenceSpan, usize),
        scale: f32,
    ) -> Vec<f32> {
        moe_aux::score_grads(args, (balance, figures), span_tokens, scale)
    }
    fn grouped_matmul(
        &self,
        out: &mut Vec<f32>,
        a: &Vec<f32>,
        (weights, offsets): (&[&Vec<f32>], &Vec<f32>),
        g: GroupedGemm,
    ) {
        let _timer = self.profiler.time("grouped_matmul");
        grouped_gemm::cpu_matmul(out, a, (weights, offsets), g, matmul::matmul_threads);
    }
    fn grouped_weight_grad(
        &self,
        grads: &mut [&mut Vec<f32>],
        dy_x: (&Vec<f32>, &Vec<f32>),
        offsets: &Vec<f32>,
        n_out_k_in: (usize, usize),
    ) {
        let _timer = self.profiler.time("grouped_weight_grad");
        let dy_x = (dy_x.0.as_slice(), dy_x.1.as_slice());
        grouped_gemm::cpu_weight_grad(grads, dy_x, offsets, n_out_k_in, matmul::matmul_threads);
    }
    fn upload_owned(&self, data: Vec<f32>) -> Vec<f32> {
        self.transfers.record(data.len());
        data
    }
    fn download_owned(&self, buf: Vec<f32>) -> Vec<f32> {
        self.transfers.record(buf.len());
        buf
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn fill(&self, buf: &mut Vec<f32>, value: f32) {
        let _timer = self.profiler.time("fill");
        buf.fill(value);
    }
    fn copy_from(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        let _timer = self.profiler.time("copy_from");
        dst.copy_from_slice(src);
    }
    fn copy_into_at(&self, dst: &mut Vec<f32>, offset: usize, src: &Vec<f32>) {
        dst[offset..offset + src.len()].copy_from_slice(src);
    }
    fn copy_range(
        &self,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        src: &Vec<f32>,
        src_offset: usize,
        len: usize,
    ) {
        dst[dst_offset..dst_offset + len].copy_from_slice(&src[src_offset..src_offset + len]);
    }
    fn matmul(
        &self,
        out: &mut Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
        shape: GemmShape,
        output: GemmOutput,
    ) {
        let _timer = self.profiler.time("matmul");
        matmul::matmul(out, a, b, shape, output);
    }
    fn embedding_forward(&self, out: &mut Vec<f32>, table: &Vec<f32>, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time("embedding_forward");
        embedding::embedding_forward(out, table, ids, dim);
    }
    fn embedding_backward(&self, dtable: &mut Vec<f32>, dout: &Vec<f32>, ids: &[u32], dim: usize) {
        let _timer = self.profiler.time("embedding_backward");
        embedding::embedding_backward(dtable, dout, ids, dim);
    }
    fn rmsnorm_forward(
        &self,
        out: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        dim: usize,
        eps: f32,
    ) {
        let _timer = self.profiler.time("rmsnorm_forward");
        norm::rmsnorm_forward(out, rstd, x, weight, dim, eps);
    }
    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dweight: &mut Vec<f32>,
        dout: &Vec<f32>,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        rstd: &Vec<f32>,
        dim: usize,
    ) {
        let _timer = self.profiler.time("rmsnorm_backward");
        norm::rmsnorm_backward(dx, dweight, dout, x, weight, rstd, dim);
    }
    fn rope_forward(&self, x: &mut Vec<f32>, cos: &Vec<f32>, sin: &Vec<f32>, shape: RopeShape) {
        let _timer = self.profiler.time("rope_forward");
        rope::rope_forward(x, cos, sin, shape);
    }
    fn rope_backward(&self, dx: &mut Vec<f32>, cos: &Vec<f32>, sin: &Vec<f32>, shape: RopeShape) {
        let _timer = self.profiler.time("rope_backward");
        rope::rope_backward(dx, cos, sin, shape);
    }
    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        x: AttnInputs<'_, Vec<f32>>,
    ) {
        let _timer = self.profiler.time("attention_forward");
        attention::attention_forward(out, lse, x);
    }
    fn attention_backward(
        &self,
        grads: AttnGrads<'_, Vec<f32>>,
        dout: &Vec<f32>,
        x: AttnInputs<'_, Vec<f32>>,
        saved: AttnSaved<'_, Vec<f32>>,
    ) {
        let _timer = self.profiler.time("attention_backward");
        attention::attention_backward(grads, dout, x, saved);
    }
    fn attention_merge(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        part_out: &Vec<f32>,
        part_lse: &Vec<f32>,
        shape: AttnShape,
    ) {
        let _timer = self.profiler.time("attention_merge");
        attention::attention_merge(out, lse, part_out, part_lse, shape);
    }
    fn attention_sinks_forward(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        sinks: &Vec<f32>,
        shape: AttnShape,
    ) {
        let _timer = self.profiler.time("attention_sinks_forward");
        attention::attention_sinks_forward(out, lse, sinks, shape);
    }
    fn attention_sinks_backward(
        &self,
        dsinks: &mut Vec<f32>,
        dout: &Vec<f32>,
        saved: AttnSaved<'_, Vec<f32>>,
        sinks: &Vec<f32>,
        shape: AttnShape,
    ) {
        let _timer = self.profiler.time("attention_sinks_backward");
        attention::attention_sinks_backward(dsinks, dout, saved, sinks, shape);
    }
    fn swiglu_forward(&self, out: &mut Vec<f32>, gate: &Vec<f32>, up: &Vec<f32>) {
        let _timer = self.profiler.time("swiglu_forward");
        elementwise::swiglu_forward(out, gate, up);
    }
    fn swiglu_backward(
        &self,
        dgate: &mut Vec<f32>,
        dup: &mut Vec<f32>,
        dout: &Vec<f32>,
        gate: &Vec<f32>,
        up: &Vec<f32>,
    ) {
        let _timer = self.profiler.time("swiglu_backward");
        elementwise::swiglu_backward(dgate, dup, dout, gate, up);
    }
    fn add(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) {
        let _timer = self.profiler.time("add");
        elementwise::add(out, a, b);
    }
    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) {
        let _timer = self.profiler.time("add_assign");
        elementwise::add_assign(acc, x);
    }
    fn add_range(
        &self,
        acc: &mut Vec<f32>,
        acc_offset: usize,
        x: &Vec<f32>,
        x_offset: usize,
        len: usize,
    ) {
        let _timer = self.profiler.time("add_assign");
        elementwise::add_assign(
            &mut acc[acc_offset..acc_offset + len],
            &x[x_offset..x_offset + len],
        );
    }
    fn scale(&self, buf: &mut Vec<f32>, factor: f32) {
        let _timer = self.profiler.time("scale");
        elementwise::scale(buf, factor);
    }
    fn cross_entropy_of_logits(
        &self,
        logits: &mut Vec<f32>,
        targets: &[u32],
        vocab: usize,
        grad_scale: f32,
        want_grad: bool,
    ) -> LossSum {
        let _timer = self.profiler.time("cross_entropy_of_logits");
        loss::cross_entropy_of_logits(logits, targets, vocab, grad_scale, want_grad)
    }
    fn vocab_shard_row_max(&self, logits: &Vec<f32>, shard: VocabShard) -> Vec<f32> {
        let _timer = self.profiler.time("vocab_shard_row_max");
        vocab_shard::row_max(logits, shard)
    }
    fn vocab_shard_row_sums(
        &self,
        logits: &Vec<f32>,
        max: &Vec<f32>,
        targets: &[u32],
        shard: VocabShard,
    ) -> Vec<f32> {
        let _timer = self.profiler.time("vocab_shard_row_sums");
        vocab_shard::row_sums(logits, max, targets, shard)
    }
    fn vocab_shard_loss(
        &self,
        logits: &mut Vec<f32>,
        (max, sums): (&Vec<f32>, &Vec<f32>),
        targets: &[u32],
        shard: VocabShard,
        grad: (f32, bool),
        total: &mut LossSum,
    ) {
        let _timer = self.profiler.time("vocab_shard_loss");
        vocab_shard::add_losses(logits, (max, sums), targets, shard, grad, total);
    }
    fn cross_entropy_forward_backward(
        &self,
        h: &Vec<f32>,
        weight: &Vec<f32>,
        targets: &[u32],
        dim: usize,
        vocab: usize,
        grad_scale: f32,
        grads: Option<(&mut Vec<f32>, &mut Vec<f32>)>,
    ) -> LossSum {
        let _timer = self.profiler.time("cross_entropy_forward_backward");
        let mut scratch = self.loss_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let need = loss::scratch_floats(vocab);
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        let grads = grads.map(|(a, b)| (a.as_mut_slice(), b.as_mut_slice()));
        loss::cross_entropy_forward_backward(
            h,
            weight,
            targets,
            dim,
            vocab,
            grad_scale,
            grads,
            &mut scratch,
        )
    }
    fn adamw_step(
        &self,
        param: &mut Vec<f32>,
        grad: &Vec<f32>,
        exp_avg: &mut Vec<f32>,
        exp_avg_sq: &mut Vec<f32>,
        hp: AdamWStep,
    ) {
        let _timer = self.profiler.time("adamw_step");
        adamw::adamw_step(param, grad, exp_avg, exp_avg_sq, hp);
    }
    fn sum_squares(&self, buf: &Vec<f32>) -> f64 {
        let _timer = self.profiler.time("sum_squares");
        elementwise::sum_squares(buf)
    }
    fn pack_bf16_pairs(&self, words: &mut Vec<f32>, src: &Vec<f32>) {
        let _timer = self.profiler.time("pack_bf16_pairs");
        elementwise::pack_bf16_pairs(words, src);
    }
    fn unpack_bf16_pairs(&self, out: &mut Vec<f32>, words: &Vec<f32>) {
        let _timer = self.profiler.time("unpack_bf16_pairs");
        elementwise::unpack_bf16_pairs(out, words);
    }
    fn round_to_bf16(&self, buf: &mut Vec<f32>) {
        let _timer = self.profiler.time("round_to_bf16");
        elementwise::round_to_bf16(buf);
    }
}
