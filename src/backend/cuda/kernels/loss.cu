// Cross-entropy over one chunk of logit rows. Each row's loss goes to row_loss (NaN marks an ignored
// target); with want_grad the gradient grad_scale * (softmax - onehot), ready to be pushed back
// through the output projection by two GEMMs, replaces the row, and when grad_bf16 is not null
// goes there rounded to bf16 too, so bf16 GEMMs read it without a conversion pass. When the host
// knows both GEMMs read bf16 it passes the same pointer as bf16_only: the f32 row is then not
// written back (half of a chunk's traffic). A null `logits` means the logits themselves are in
// grad_bf16 (a GEMM wrote them in bf16) and the gradient replaces them there.

#define TITAN_IGNORE_INDEX 0xffffffffu

// One block per row.
extern "C" __global__ void cross_entropy_rows(float* logits, float* row_loss, const u32* targets,
                                              int vocab, float grad_scale, int want_grad,
                                              bf16_bits* grad_bf16, const bf16_bits* bf16_only) {
    __shared__ float shared[32];
    i64 r = blockIdx.x;
    float* row = logits ? logits + r * vocab : nullptr;
    bf16_bits* row16 = grad_bf16 ? grad_bf16 + r * vocab : nullptr;
    // Logit j: the f32 row, or the bf16 one when the logits are kept in bf16 alone.
    auto logit = [&](int j) { return row ? row[j] : f32_of_bf16(row16[j]); };
    u32 t = targets[r];
    if (t == TITAN_IGNORE_INDEX || t >= (u32)vocab) {
        // Out-of-range targets are refused on the host before the launch; NaN is the ignore marker.
        if (threadIdx.x == 0) row_loss[r] = __int_as_float(0x7fc00000);
        if (want_grad)
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
                if (row16) row16[j] = 0;
                if (row && !bf16_only) row[j] = 0.0f;
            }
        return;
    }
    // One pass for the maximum and the sum of exponentials: each thread keeps a running maximum and
    // rescales its sum when it grows (online softmax), then the block combines them.
    float tm = TITAN_NEG_INF, tz = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float x = logit(j);
        if (x > tm) {
            tz = tz * expf(tm - x) + 1.0f;
            tm = x;
        } else if (x != TITAN_NEG_INF) {
            tz += expf(x - tm);
        }
    }
    float m = block_max(tm, shared);
    float z = block_sum(tm == TITAN_NEG_INF ? 0.0f : tz * expf(tm - m), shared);
    float target_logit = logit(t);
    __syncthreads();
    if (threadIdx.x == 0) row_loss[r] = m + logf(z) - target_logit;
    if (want_grad) {
        float inv = grad_scale / z;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            float gj = expf(logit(j) - m) * inv;
            if (j == (int)t) gj -= grad_scale;
            if (row16) row16[j] = bf16_of(gj);
            if (row && !bf16_only) row[j] = gj;
        }
    }
}
