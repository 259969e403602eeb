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

// The vocabulary-parallel loss (tensor parallelism's loss parallel): each rank holds its shard of
// the vocabulary, `vocab` logits of every row starting at vocabulary id `offset`. Three kernels,
// one block per row, with the row statistics combined over the tensor-parallel group between
// them (the maxima by a max, the sums by a sum), so no rank holds a whole row.

// Each row's maximum over the shard.
extern "C" __global__ void vocab_shard_row_max(const float* logits, float* row_max, int vocab) {
    __shared__ float shared[32];
    const float* row = logits + (i64)blockIdx.x * vocab;
    float m = TITAN_NEG_INF;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m, shared);
    if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

// With each row's maximum over the whole vocabulary: the shard's sum of exp(logit - max), and the
// target's logit when the target lies in the shard (else 0), as sums[2 r] and sums[2 r + 1].
extern "C" __global__ void vocab_shard_row_sums(const float* logits, const float* row_max,
                                                const u32* targets, int vocab, int offset,
                                                float* sums) {
    __shared__ float shared[32];
    i64 r = blockIdx.x;
    const float* row = logits + r * vocab;
    float m = row_max[r];
    float z = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) z += expf(row[j] - m);
    z = block_sum(z, shared);
    if (threadIdx.x == 0) {
        u32 t = targets[r];
        bool here = t != TITAN_IGNORE_INDEX && t >= (u32)offset && t - (u32)offset < (u32)vocab;
        sums[2 * r] = z;
        sums[2 * r + 1] = here ? row[t - (u32)offset] : 0.0f;
    }
}

// With each row's statistics over the whole vocabulary (max; sums: the sum of exponentials and
// the target's logit): the row's loss (NaN marks an ignored target) and, with want_grad, the
// shard of grad_scale * (softmax - onehot) over the logits.
extern "C" __global__ void vocab_shard_loss_rows(float* logits, const float* row_max,
                                                 const float* sums, const u32* targets, int vocab,
                                                 int offset, float grad_scale, int want_grad,
                                                 float* row_loss) {
    i64 r = blockIdx.x;
    float* row = logits + r * vocab;
    u32 t = targets[r];
    if (t == TITAN_IGNORE_INDEX) {
        if (threadIdx.x == 0) row_loss[r] = __int_as_float(0x7fc00000);
        if (want_grad)
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) row[j] = 0.0f;
        return;
    }
    float m = row_max[r], z = sums[2 * r];
    if (threadIdx.x == 0) row_loss[r] = logf(z) + m - sums[2 * r + 1];
    if (!want_grad) return;
    float inv = grad_scale / z;
    int target_here =
        t >= (u32)offset && t - (u32)offset < (u32)vocab ? (int)(t - (u32)offset) : -1;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float g = expf(row[j] - m) * inv;
        if (j == target_here) g -= grad_scale;
        row[j] = g;
    }
}
