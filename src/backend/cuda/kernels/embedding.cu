// Token embedding lookup and its scatter-add backward.

// One block per token; threads copy the row.
extern "C" __global__ void embedding_forward(float* out, const float* table, const u32* ids, int dim) {
    i64 t = blockIdx.x;
    const float* src = table + (i64)ids[t] * dim;
    float* dst = out + t * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

// One thread per column, walking the tokens in order: repeated ids add up in the same order as on
// the CPU and on every run (bitwise determinism, no atomics).
extern "C" __global__ void embedding_backward(float* dtable, const float* dout, const u32* ids,
                                              int tokens, int dim) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    for (int t = 0; t < tokens; ++t) dtable[(i64)ids[t] * dim + d] += dout[(i64)t * dim + d];
}
