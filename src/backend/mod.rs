//! The backend trait: every kernel titan runs, forward and backward, on one kind of device.
//!
//! Layers above (model, train) only see `Backend` and its buffer type, so the CPU backend (the
//! reference, always tested) and a CUDA backend are interchangeable. Shapes are explicit; buffers
//! are contiguous row-major f32; token ids live on the host (a device backend uploads them), and a
//! mixture of experts' ids (chosen experts, row orders) in buffers as `u32` bits (`routing`).

mod attention_types;
pub mod clamped_swiglu;
pub mod cpu;
pub mod crosscheck;
pub mod cuda;
pub mod float8;
pub mod grouped_gemm;
mod host_routing;
pub mod moe_aux;
pub mod profile;
pub mod routing;
mod shapes;
pub mod transfers;

pub use attention_types::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape};
use clamped_swiglu::Clamp;
use float8::{ContractedDim, Fp8Format, MxCast, Quantization, ScaleAxis};
use grouped_gemm::GroupedGemm;
use moe_aux::SequenceSpan;
use routing::{DispatchOrder, RoutedTokens, RouterArgs};
pub use shapes::{GemmOutput, GemmShape, RopeShape};

/// AdamW hyper-parameters for one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step count, for bias correction.
    pub step: u64,
    /// Factor the gradient is multiplied by before the update: gradient clipping's `max_norm /
    /// norm`, or 1. The gradient buffers themselves are left as they are.
    pub grad_scale: f32,
    /// How `weight_decay` applies: decoupled from the gradient (AdamW) or added to it as an L2
    /// term, `g + weight_decay·p`, before the moments (Adam, as `torch.optim.Adam`).
    pub decay: WeightDecay,
}

/// How an Adam step applies weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDecay {
    /// AdamW: `p ← p·(1 − lr·wd) − …`.
    #[default]
    Decoupled,
    /// Adam: the gradient becomes `g + wd·p` (after clipping's scale).
    L2,
}

impl AdamWStep {
    /// The per-step constants every AdamW kernel takes: the step size `lr / (1 − beta1^t)`, the
    /// square root of the second bias correction `1 − beta2^t`, the decay factor `1 − lr·wd`
    /// (1 for Adam) and the L2 coefficient added to the gradient (0 for AdamW), computed on the
    /// host so that every backend rounds them alike.
    pub fn host_constants(&self) -> (f32, f32, f32, f32) {
        let bias1 = 1.0 - (self.beta1 as f64).powi(self.step as i32);
        let bias2 = 1.0 - (self.beta2 as f64).powi(self.step as i32);
        let step_size = (self.lr as f64 / bias1) as f32;
        let bias2_sqrt = bias2.sqrt() as f32;
        let (decay, l2) = match self.decay {
            WeightDecay::Decoupled => (1.0 - self.lr * self.weight_decay, 0.0),
            WeightDecay::L2 => (1.0, self.weight_decay),
        };
        (step_size, bias2_sqrt, decay, l2)
    }
}

/// Sum of cross-entropies and the number of targets that counted (ids equal to `IGNORE_INDEX` do not).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSum {
    pub sum: f64,
    pub count: usize,
}

impl From<LossSum> for (f64, u64) {
    fn from(l: LossSum) -> Self {
        (l.sum, l.count as u64)
    }
}

/// One rank's shard of the vocabulary under tensor parallelism's loss parallel: `vocab` logits of
/// every row, for vocabulary ids `offset..offset + vocab`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabShard {
    pub vocab: usize,
    pub offset: usize,
}

/// Target id that contributes neither loss nor gradient.
pub const IGNORE_INDEX: u32 = u32::MAX;

pub trait Backend: Send + Sync + 'static {
    type Buf: Send + Sync;

    fn name(&self) -> &'static str;

    // ---- memory ----
    fn zeros(&self, len: usize) -> Self::Buf;
    /// A buffer of `len` values that the caller writes in full before anything reads it (a
    /// collective's output, a packing or unpacking target): a device skips the zeroing pass.
    /// Here `zeros`.
    fn uninit(&self, len: usize) -> Self::Buf {
        self.zeros(len)
    }
    /// An activation that is only written whole, by a GEMM or by RMSNorm's or SwiGLU's kernels,
    /// and only read by GEMMs and SwiGLU: a device may keep it in bf16 alone
    /// (`bf16_activation_f32_bytes`); elsewhere plain `zeros`.
    fn zeros_bf16_activation(&self, len: usize) -> Self::Buf {
        self.zeros(len)
    }
    /// Bytes per value of f32 storage that `zeros_bf16_activation` buffers take (4, or 0 when they
    /// live in bf16 alone, counted with `activation_copy_bytes`).
    fn bf16_activation_f32_bytes(&self) -> u64 {
        4
    }
    fn upload(&self, data: &[f32]) -> Self::Buf;
    fn download(&self, buf: &Self::Buf) -> Vec<f32>;
    /// `upload` of data the caller gives up: a host backend keeps the vector (no copy).
    fn upload_owned(&self, data: Vec<f32>) -> Self::Buf {
        self.upload(&data)
    }
    /// `download` of a buffer the caller gives up: a host backend hands its vector over.
    fn download_owned(&self, buf: Self::Buf) -> Vec<f32> {
        self.download(&buf)
    }
    fn len(&self, buf: &Self::Buf) -> usize;
    fn fill(&self, buf: &mut Self::Buf, value: f32);
    fn copy_from(&self, dst: &mut Self::Buf, src: &Self::Buf);
    /// A buffer of its own holding `buf`'s values.
    fn copied(&self, buf: &Self::Buf) -> Self::Buf {
        let mut copy = self.uninit(self.len(buf));
        self.copy_from(&mut copy, buf);
        copy
    }
    /// Copies `src` into `dst[offset..offset+len(src)]`.
    fn copy_into_at(&self, dst: &mut Self::Buf, offset: usize, src: &Self::Buf);
    /// `dst[dst_offset..+len] = src[src_offset..+len]` (FSDP's packing of shards and gradients).
    fn copy_range(
        &self,
        dst: &mut Self::Buf,
        dst_offset: usize,
        src: &Self::Buf,
        src_offset: usize,
        len: usize,
    );
    /// `rows` runs of `cols` values, run `r` from `src[src_offset + r·src_stride..]` to
    /// `dst[dst_offset + r·dst_stride..]`: FSDP's packing and unpacking of one tensor's chunks for
    /// every rank in one call. Here one `copy_range` per row; a device does it in one launch.
    #[allow(clippy::too_many_arguments)]
    fn copy_rows(
        &self,
        dst: &mut Self::Buf,
        dst_offset: usize,
        dst_stride: usize,
        src: &Self::Buf,
        src_offset: usize,
        src_stride: usize,
        rows: usize,
        cols: usize,
    ) {
        for r in 0..rows {
            self.copy_range(
                dst,
                dst_offset + r * dst_stride,
                src,
                src_offset + r * src_stride,
                cols,
            );
        }
    }

    // ---- linear algebra ----
    /// `out[m,n] (+)= op(a)[m,k] · op(b)[k,n]` (see `GemmShape`); with `GemmOutput::Accumulate`
    /// the product is added.
    fn matmul(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        shape: GemmShape,
        output: GemmOutput,
    );

    /// `out[m,n] = residual[m,n] + op(a)[m,k] · op(b)[k,n]`, operands as in `matmul`: a residual
    /// connection. Here a copy and an accumulating `matmul`; a device has its GEMM read `residual`
    /// as the addend instead of copying it first.
    fn matmul_add(
        &self,
        out: &mut Self::Buf,
        residual: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        shape: GemmShape,
    ) {
        self.copy_from(out, residual);
        self.matmul(out, a, b, shape, GemmOutput::Accumulate);
    }

    // ---- embedding ----
    /// `out[t] = table[ids[t]]`; an id of `IGNORE_INDEX` (a token outside this rank's vocabulary
    /// shard) gives a zero row.
    fn embedding_forward(&self, out: &mut Self::Buf, table: &Self::Buf, ids: &[u32], dim: usize);
    /// `dtable[ids[t]] += dout[t]`, nothing for `IGNORE_INDEX`.
    fn embedding_backward(&self, dtable: &mut Self::Buf, dout: &Self::Buf, ids: &[u32], dim: usize);

    // ---- RMSNorm ----
    /// `out = x / rms(x) * weight` per row; `rstd` receives `1/rms` per row for the backward.
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::Buf,
        x: &Self::Buf,
        weight: &Self::Buf,
        dim: usize,
        eps: f32,
    );
    /// Adds the input gradient into `dx` and the weight gradient into `dweight`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dweight: &mut Self::Buf,
        dout: &Self::Buf,
        x: &Self::Buf,
        weight: &Self::Buf,
        rstd: &Self::Buf,
        dim: usize,
    );

    // ---- RoPE (interleaved pairs), in place on `[batch, seq, heads, head_dim]` ----
    /// `cos`/`sin` are `[max_seq, head_dim/2]`; token `s` uses row `shape.pos_offset + s`.
    fn rope_forward(&self, x: &mut Self::Buf, cos: &Self::Buf, sin: &Self::Buf, shape: RopeShape);
    /// The rotation by the opposite angles (the rotation is orthogonal).
    fn rope_backward(&self, dx: &mut Self::Buf, cos: &Self::Buf, sin: &Self::Buf, shape: RopeShape);

    // ---- causal (document-, window-masked) grouped-query attention ----
    /// Writes `out` `[batch, q_len, n_heads, head_dim]` and `lse` `[batch, n_heads, q_len]`. A
    /// query that sees no key of the call (a block of keys wholly masked for it) gets a zero
    /// output and a log-sum-exp of −∞, which `attention_merge` folds in as nothing.
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        x: AttnInputs<'_, Self::Buf>,
    );
    /// Overwrites the gradients (keys without spare capacity: `kv_capacity == kv_len`). `saved`
    /// is the forward's over *all* keys the queries attend to, so that a block of keys (context
    /// parallelism) gets its exact share of the gradients.
    fn attention_backward(
        &self,
        grads: AttnGrads<'_, Self::Buf>,
        dout: &Self::Buf,
        x: AttnInputs<'_, Self::Buf>,
        saved: AttnSaved<'_, Self::Buf>,
    );

    /// Folds attention over another block of keys into `out`/`lse` (shapes as the forward's for
    /// `shape`'s queries): `lse' = log(e^lse + e^part_lse)`, `out' = out·e^(lse − lse') +
    /// part_out·e^(part_lse − lse')`, the online softmax across blocks (ring attention).
    fn attention_merge(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        part_out: &Self::Buf,
        part_lse: &Self::Buf,
        shape: AttnShape,
    );

    /// Attention sinks (gpt-oss: a logit `sinks[h]` per head with a zero value) folded into a
    /// finished attention: per row `lse' = log(e^lse + e^sinks[h])`, `out' = out·e^(lse − lse')`
    /// (a merge with an empty block of keys). Attention's plain backward on `out'`/`lse'` is exact.
    fn attention_sinks_forward(
        &self,
        out: &mut Self::Buf,
        lse: &mut Self::Buf,
        sinks: &Self::Buf,
        shape: AttnShape,
    );
    /// Adds `∂L/∂sinks[h] = −Σ_rows e^(sinks[h] − lse')·(dout·out')` (over head `h`'s rows; `saved`:
    /// the forward's results with the sinks) into `dsinks` (`[n_heads]`).
    fn attention_sinks_backward(
        &self,
        dsinks: &mut Self::Buf,
        dout: &Self::Buf,
        saved: AttnSaved<'_, Self::Buf>,
        sinks: &Self::Buf,
        shape: AttnShape,
    );

    // ---- SwiGLU: out = silu(gate) * up ----
    fn swiglu_forward(&self, out: &mut Self::Buf, gate: &Self::Buf, up: &Self::Buf);
    fn swiglu_backward(
        &self,
        dgate: &mut Self::Buf,
        dup: &mut Self::Buf,
        dout: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    );
    /// gpt-oss's clamped SwiGLU (`clamped_swiglu`), `act = f(gate, up)`; here through the host.
    fn clamped_swiglu_forward(
        &self,
        act: &mut Self::Buf,
        gate_up: (&Self::Buf, &Self::Buf),
        clamp: Clamp,
    ) {
        clamped_swiglu::host_forward(self, act, gate_up, clamp)
    }
    /// Its backward: `dgate`, `dup` from `dact`.
    fn clamped_swiglu_backward(
        &self,
        dgate_dup: (&mut Self::Buf, &mut Self::Buf),
        dact: &Self::Buf,
        gate_up: (&Self::Buf, &Self::Buf),
        clamp: Clamp,
    ) {
        clamped_swiglu::host_backward(self, dgate_dup, dact, gate_up, clamp)
    }

    // ---- elementwise ----
    /// `out = a + b`.
    fn add(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf);
    /// `acc += x`.
    fn add_assign(&self, acc: &mut Self::Buf, x: &Self::Buf);
    /// `acc[acc_offset..+len] += x[x_offset..+len]` (FSDP adding a reduced gradient shard).
    fn add_range(
        &self,
        acc: &mut Self::Buf,
        acc_offset: usize,
        x: &Self::Buf,
        x_offset: usize,
        len: usize,
    );
    /// `rows` runs of `cols` values, run `r` of `x` (from `x_offset + r·x_stride`) added into
    /// `acc` (at `acc_offset + r·acc_stride`): `copy_rows` adding (MLA summing its heads' shares
    /// of the shared rotated key's gradient). Here one `add_range` per row.
    #[allow(clippy::too_many_arguments)]
    fn add_rows(
        &self,
        acc: &mut Self::Buf,
        acc_offset: usize,
        acc_stride: usize,
        x: &Self::Buf,
        x_offset: usize,
        x_stride: usize,
        rows: usize,
        cols: usize,
    ) {
        for r in 0..rows {
            self.add_range(
                acc,
                acc_offset + r * acc_stride,
                x,
                x_offset + r * x_stride,
                cols,
            );
        }
    }
    fn scale(&self, buf: &mut Self::Buf, factor: f32);
    /// Row `r` of `buf` (`[rows, width]`) times `scales[r]` (a mixture-of-experts combine).
    /// Here through the host; a backend that runs MoE on its device overrides it.
    fn scale_rows(&self, buf: &mut Self::Buf, scales: &[f32], width: usize) {
        let mut host = self.download(buf);
        for (row, s) in host.chunks_mut(width).zip(scales) {
            row.iter_mut().for_each(|x| *x *= s);
        }
        *buf = self.upload_owned(host);
    }
    /// `scale_rows` with the scales in a buffer (`[rows]`).
    fn scale_rows_by(&self, buf: &mut Self::Buf, scales: &Self::Buf, width: usize) {
        self.scale_rows(buf, &self.download(scales), width);
    }
    /// The dot product of each row of `a` with the same row of `b` (`[rows, width]` each), `[rows]`:
    /// the gradient of a mixture-of-experts routing weight. Here through the host.
    fn row_dots(&self, a: &Self::Buf, b: &Self::Buf, width: usize) -> Self::Buf {
        let (a, b) = (self.download(a), self.download(b));
        let dots = a.chunks(width).zip(b.chunks(width));
        self.upload_owned(
            dots.map(|(x, y)| x.iter().zip(y).map(|(x, y)| x * y).sum())
                .collect(),
        )
    }

    // ---- Mixture of experts: routing and dispatch (`routing`; ids as u32 bits in buffers) ----
    // These default to the host (`host_routing`); a device overrides them so that a block's
    // routing never leaves it.
    /// Every token's top-k experts and weights from the router's `logits` `[tokens, experts]`;
    /// `bias` `[experts]` shifts the choice (`routing::route`).
    fn moe_route(
        &self,
        logits: &Self::Buf,
        bias: Option<&Self::Buf>,
        args: &RouterArgs,
    ) -> RoutedTokens<Self::Buf> {
        host_routing::route(self, logits, bias, args)
    }
    /// The logits' gradient from the weights' (`dweights`, one per token and choice) and, with
    /// the auxiliary loss, the normalised scores' (`routing::route_backward`).
    fn moe_route_backward(
        &self,
        args: &RouterArgs,
        scores_experts: (&Self::Buf, &Self::Buf),
        dweights: &Self::Buf,
        aux_grads: Option<&Self::Buf>,
    ) -> Self::Buf {
        host_routing::route_backward(self, args, scores_experts, dweights, aux_grads)
    }
    /// The chosen `experts`' rows grouped by expert (`routing::dispatch_order`).
    fn moe_dispatch_order(
        &self,
        experts: &Self::Buf,
        experts_top_k: (usize, usize),
    ) -> DispatchOrder<Self::Buf> {
        host_routing::dispatch_order(self, experts, experts_top_k)
    }
    /// `out[r] = table[ids[r]]` for rows of `width` (`embedding_forward` with ids in a buffer).
    fn gather_rows(&self, out: &mut Self::Buf, table: &Self::Buf, ids: &Self::Buf, width: usize) {
        let ids = routing::ids_of_bits(&self.download(ids));
        self.embedding_forward(out, table, &ids, width);
    }
    /// `out[t] += rows[r]` for each of token `t`'s `top_k` dispatched rows (`row_of_slot`), in
    /// increasing `r` (`routing::combine`).
    fn moe_combine(
        &self,
        out: &mut Self::Buf,
        rows: &Self::Buf,
        row_of_slot: &Self::Buf,
        top_k_width: (usize, usize),
    ) {
        host_routing::combine(self, out, rows, row_of_slot, top_k_width)
    }
    /// `counts[at + e] += offsets[e + 1] - offsets[e]` for every expert (f32 counts, exact to
    /// 2^24): a step's expert load, counted where the dispatch order is.
    fn moe_count_load(&self, counts: &mut Self::Buf, offsets: &Self::Buf, at: usize) {
        host_routing::count_load(self, counts, offsets, at)
    }
    /// The auxiliary loss's per-sequence figures of this rank's rows, `[counts | normalised
    /// score sums | tokens]` (`moe_aux::figures`), from the routing's chosen experts and scores.
    fn moe_aux_figures(
        &self,
        experts_scores: (&Self::Buf, &Self::Buf),
        args: &RouterArgs,
        span: SequenceSpan,
    ) -> Self::Buf {
        moe_aux::host_figures(self, experts_scores, args, span)
    }
    /// `[f | L_b]` from the figures summed over the ranks sharing the sequences
    /// (`moe_aux::balance`).
    fn moe_aux_balance(
        &self,
        figures: &Self::Buf,
        args: &RouterArgs,
        sequences: usize,
    ) -> Self::Buf {
        moe_aux::host_balance(self, figures, args, sequences)
    }
    /// The gradient of `scale · Σ_b L_b` with respect to each of `tokens` local rows' normalised
    /// scores, `[tokens, E]` (`moe_aux::score_grads`).
    fn moe_aux_score_grads(
        &self,
        balance_figures: (&Self::Buf, &Self::Buf),
        args: &RouterArgs,
        span_tokens: (SequenceSpan, usize),
        scale: f32,
    ) -> Self::Buf {
        moe_aux::host_score_grads(self, balance_figures, args, span_tokens, scale)
    }
    /// Expert `e`'s rows `offsets[e]..offsets[e + 1]` of `out` (+)= the same rows of `a` times
    /// `op(weights[e])` (`grouped_gemm`); here with the offsets on the host.
    fn grouped_matmul(
        &self,
        out: &mut Self::Buf,
        a: &Self::Buf,
        weights_offsets: (&[&Self::Buf], &Self::Buf),
        g: GroupedGemm,
    ) {
        grouped_gemm::matmul(self, out, a, weights_offsets, g)
    }
    /// `grads[e]` (`[n_out, k_in]`) += expert `e`'s rows of `dy`, transposed, times its rows of
    /// `x`: the experts' weight gradients (`grouped_gemm`); here with the offsets on the host.
    fn grouped_weight_grad(
        &self,
        grads: &mut [&mut Self::Buf],
        dy_x: (&Self::Buf, &Self::Buf),
        offsets: &Self::Buf,
        n_out_k_in: (usize, usize),
    ) {
        grouped_gemm::weight_grad(self, grads, dy_x, offsets, n_out_k_in)
    }

    // ---- float8 (issue 28: emulated float8 GEMMs read fake-quantised operands) ----
    /// The amaxes of `x` (`[rows, cols]`) along `axis` (`float8::amaxes`), on the host: the
    /// scales they give may first be agreed over a group (an operand split across ranks).
    /// Here through the host; the CPU overrides it with a threaded pass.
    fn float8_amaxes(&self, x: &Self::Buf, rows: usize, cols: usize, axis: ScaleAxis) -> Vec<f32> {
        float8::amaxes(&self.download(x), rows, cols, axis)
    }
    /// `x` (`[rows, cols]`) quantised with `q` and the scales of `amaxes`, then dequantised:
    /// the operand an emulated float8 GEMM reads (`float8::fake_quantize_rows`). `contracted` is
    /// the dimension the GEMM that reads it sums over: a backend with float8 GEMMs (CUDA) also
    /// keeps the codes, laid out for that GEMM; the values are the same either way.
    fn float8_fake_quantized(
        &self,
        x: &Self::Buf,
        cols: usize,
        q: Quantization,
        amaxes: &[f32],
        _contracted: ContractedDim,
    ) -> Self::Buf {
        let host = self.download(x);
        let mut out = vec![0f32; host.len()];
        let scales = float8::scales_from_amaxes(amaxes, q);
        float8::fake_quantize_rows(&mut out, &host, cols, 0, &scales, q);
        self.upload_owned(out)
    }
    /// Whether `float8_fake_quantized` also keeps the codes, which this backend's GEMMs then
    /// multiply in float8 (CUDA with float8 GEMMs on). A weight FSDP gathered in float8 is then
    /// cast again (its values are already on the float8 grid, so the cast gives back its codes)
    /// instead of being read as values.
    fn keeps_float8_codes(&self) -> bool {
        false
    }
    /// With float8 GEMMs: how many ran so far, and how many GEMMs of float8 operands multiplied
    /// their dequantised values instead (a shape or layout the float8 kernels do not take).
    fn float8_gemm_counts(&self) -> Option<(u64, u64)> {
        None
    }
    /// `x` (`[rows, cols]`) cast to MXFP8 as `cast` says and dequantised
    /// (`float8::mx_fake_quantize_rows`; its blocks' dimension a multiple of 32).
    fn mx_fake_quantized(&self, x: &Self::Buf, cols: usize, cast: MxCast) -> Self::Buf {
        let host = self.download(x);
        let mut out = vec![0f32; host.len()];
        float8::mx_fake_quantize_rows(&mut out, &host, cols, cast);
        self.upload_owned(out)
    }

    /// `x` quantised to `format` with one `scale` (as `float8_fake_quantized` before it
    /// dequantises) as 8-bit codes, four to a word (`float8::encode_words`): what FSDP's float8
    /// all-gather sends.
    fn float8_encoded(&self, x: &Self::Buf, scale: f32, format: Fp8Format) -> Self::Buf {
        self.upload_owned(float8::encode_words(&self.download(x), scale, format))
    }
    /// The fp8 values of the codes in `words`, four per word (`float8::decode_words`).
    fn float8_decoded(&self, words: &Self::Buf, format: Fp8Format) -> Self::Buf {
        self.upload_owned(float8::decode_words(&self.download(words), format))
    }

    // ---- loss ----
    /// Cross-entropy of `logits = h · weightᵀ` (`h` `[rows, dim]`, `weight` `[vocab, dim]`) against
    /// `targets`, computed over row chunks so the full `[rows, vocab]` logits never exist. With
    /// `grads`, adds `grad_scale · ∂(sum of losses)/∂h` into `dh` and likewise into `dweight`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_forward_backward(
        &self,
        h: &Self::Buf,
        weight: &Self::Buf,
        targets: &[u32],
        dim: usize,
        vocab: usize,
        grad_scale: f32,
        grads: Option<(&mut Self::Buf, &mut Self::Buf)>,
    ) -> LossSum;
    /// Cross-entropy of each row of `logits` (`[rows, vocab]`, computed by the caller) against
    /// `targets` (every one inside the vocabulary or `IGNORE_INDEX`); with `want_grad` each row
    /// becomes `grad_scale · ∂(sum of losses)/∂logits`, else the logits are left scratch.
    fn cross_entropy_of_logits(
        &self,
        logits: &mut Self::Buf,
        targets: &[u32],
        vocab: usize,
        grad_scale: f32,
        want_grad: bool,
    ) -> LossSum {
        let mut host = self.download(logits);
        let loss =
            cpu::loss::cross_entropy_of_logits(&mut host, targets, vocab, grad_scale, want_grad);
        *logits = self.upload_owned(host);
        loss
    }
    /// The vocabulary-parallel loss, first step: each row's maximum over this rank's shard of
    /// the vocabulary (`logits` `[rows, shard.vocab]`), `[rows]`. The three steps default to the
    /// host; a device runs them where the logits are (`cpu::vocab_shard` defines them).
    fn vocab_shard_row_max(&self, logits: &Self::Buf, shard: VocabShard) -> Self::Buf {
        self.upload_owned(cpu::vocab_shard::row_max(&self.download(logits), shard))
    }
    /// Second step, given each row's maximum over the whole vocabulary: the shard's sum of
    /// `exp(logit − max)` and the target's logit when the target lies in the shard (else 0),
    /// `[rows, 2]`, to be summed over the shards.
    fn vocab_shard_row_sums(
        &self,
        logits: &Self::Buf,
        max: &Self::Buf,
        targets: &[u32],
        shard: VocabShard,
    ) -> Self::Buf {
        let (logits, max) = (self.download(logits), self.download(max));
        self.upload_owned(cpu::vocab_shard::row_sums(&logits, &max, targets, shard))
    }
    /// Last step, given the whole vocabulary's statistics (`max`, and `sums` summed over the
    /// shards): adds each counted row's cross-entropy into `total`, in row order; with
    /// `want_grad` the logits become `grad_scale · (softmax − one-hot(target))` on this shard
    /// (zero for an ignored target), else they are left as they are.
    fn vocab_shard_loss(
        &self,
        logits: &mut Self::Buf,
        (max, sums): (&Self::Buf, &Self::Buf),
        targets: &[u32],
        shard: VocabShard,
        grad: (f32, bool),
        total: &mut LossSum,
    ) {
        let mut host = self.download(logits);
        let (max, sums) = (self.download(max), self.download(sums));
        cpu::vocab_shard::add_losses(&mut host, (&max, &sums), targets, shard, grad, total);
        if grad.1 {
            *logits = self.upload_owned(host);
        }
    }
    /// Logits of the given rows of `h` (`[rows, dim]`) against `weight` `[vocab, dim]`.
    fn logits(
        &self,
        out: &mut Self::Buf,
        h: &Self::Buf,
        weight: &Self::Buf,
        rows: usize,
        dim: usize,
        vocab: usize,
    ) {
        self.matmul(
            out,
            h,
            weight,
            GemmShape::new(rows, dim, vocab).b_transposed(),
            GemmOutput::Overwrite,
        );
    }

    // ---- optimizer ----
    /// Fused AdamW with decoupled weight decay, in place.
    fn adamw_step(
        &self,
        param: &mut Self::Buf,
        grad: &Self::Buf,
        exp_avg: &mut Self::Buf,
        exp_avg_sq: &mut Self::Buf,
        hp: AdamWStep,
    );
    /// Sum of squares in f64, reduced in a fixed order (deterministic).
    fn sum_squares(&self, buf: &Self::Buf) -> f64;
    /// `fill` on every buffer of the list: one launch on a device (zeroing all gradients).
    fn fill_all(&self, bufs: &mut [Self::Buf], value: f32) {
        for b in bufs {
            self.fill(b, value);
        }
    }
    /// AdamW over a list of tensors (`params[i]` with `grads[i]` and its moments): on a device, one
    /// launch for the whole list instead of one per tensor. Same arithmetic as `adamw_step`.
    fn adamw_step_all(
        &self,
        params: &mut [Self::Buf],
        grads: &[Self::Buf],
        exp_avg: &mut [Self::Buf],
        exp_avg_sq: &mut [Self::Buf],
        hp: AdamWStep,
    ) {
        assert!(
            grads.len() == params.len()
                && exp_avg.len() == params.len()
                && exp_avg_sq.len() == params.len(),
            "adamw_step_all: the tensor lists differ in length"
        );
        for (((p, g), m), v) in params.iter_mut().zip(grads).zip(exp_avg).zip(exp_avg_sq) {
            self.adamw_step(p, g, m, v, hp);
        }
    }
    /// The sum of squares of every buffer in the list, in f64, deterministic (the same grouping of
    /// the additions on every run: here each buffer's `sum_squares` added in list order; a device
    /// reduces the whole list in fixed chunks and waits once).
    fn sum_squares_all(&self, bufs: &[Self::Buf]) -> f64 {
        bufs.iter().map(|b| self.sum_squares(b)).sum()
    }
    /// `dst[i] = src[i]` rounded to bf16 (kept in f32) for every pair: the bf16 compute copy of the
    /// parameters, in one launch on a device.
    fn copy_rounded_to_bf16_all(&self, dst: &mut [Self::Buf], src: &[Self::Buf]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "copy_rounded_to_bf16_all: list lengths differ"
        );
        for (d, s) in dst.iter_mut().zip(src) {
            self.copy_from(d, s);
            self.round_to_bf16(d);
        }
    }
    /// Rounds every value to the nearest bf16 (ties to even; NaN stays NaN), kept in f32: the
    /// parameters that bf16 mixed precision computes with.
    fn round_to_bf16(&self, buf: &mut Self::Buf);
    /// `words` (⌈len(src)/2⌉ values) = `src` rounded to bf16, two per f32 word as
    /// `tensor::pack_bf16_pairs` lays them out: FSDP's bf16 gathers.
    fn pack_bf16_pairs(&self, words: &mut Self::Buf, src: &Self::Buf);
    /// `out[i]` = value i of `words` packed that way (len(out) ≤ 2·len(words)).
    fn unpack_bf16_pairs(&self, out: &mut Self::Buf, words: &Self::Buf);

    // ---- device ----
    /// Waits until every queued kernel has finished (device backends queue work; the CPU does not).
    fn synchronize(&self) {}
    /// Peak bytes of device memory held by this backend's buffers, where the device tracks it
    /// (None on the CPU, whose peak is the process's resident memory).
    fn device_peak_memory(&self) -> Option<u64> {
        None
    }
    /// Bytes of working memory this backend's kernels take for a training step of `tokens` tokens
    /// beyond the model's own buffers (the loss's logit block, operand copies), for the memory check.
    fn scratch_bytes(&self, _tokens: usize, _dim: usize, _hidden: usize, _vocab: usize) -> u64 {
        0
    }
    /// Bytes per value of the bf16 copies that this backend's norm, attention and SwiGLU kernels
    /// write beside their outputs for the GEMMs that read them (0: none; on CUDA with bf16 GEMMs,
    /// 2). The memory check counts them over `workspace_copied_floats`.
    fn activation_copy_bytes(&self) -> u64 {
        0
    }
    /// Bytes per parameter of the bf16 compute copy that `copy_rounded_to_bf16_all` keeps: the f32
    /// rounded values, plus on a device the bf16 twin its GEMMs read.
    fn compute_copy_bytes_per_param(&self) -> u64 {
        4
    }
    /// The device's datasheet peak TFLOP/s at the precision in use, for MFU (None when unknown, and
    /// on the CPU, whose default comes from the thread count).
    fn peak_tflops(&self) -> Option<f64> {
        None
    }
    /// Free device memory in bytes (None on the CPU).
    fn device_free_memory(&self) -> Option<u64> {
        None
    }
    /// Whether independent ops gain from being called from several host threads at once (the
    /// CPU's kernels run on the calling threads; a GPU's one stream runs them in order anyway).
    fn overlaps_host_calls(&self) -> bool {
        false
    }
}
