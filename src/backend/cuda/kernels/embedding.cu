// Token embedding lookup and its scatter-add backward.

// One block per token; threads copy the row. The id 0xFFFFFFFF (IGNORE_INDEX: a token of another
// rank's vocabulary shard) gives a zero row.
extern "C" __global__ void embedding_forward(float* out, const float* table, const u32* ids, int dim) {
    i64 t = blockIdx.x;
    float* dst = out + t * dim;
    if (ids[t] == 0xFFFFFFFFu) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = 0.0f;
        return;
    }
    const float* src = table + (i64)ids[t] * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}

// The tokens grouped by id on the host: group g is table row rows[g], and its tokens are
// order[starts[g]] .. order[starts[g + 1] - 1] in increasing position. One block per (group, 256
// columns); each thread adds its column of the group's tokens in that order, so repeated ids add up
// in the same order as on the CPU and on every run (bitwise determinism, no atomics), and every
// distinct id of the batch works in parallel.
extern "C" __global__ void embedding_backward(float* dtable, const float* dout, const u32* rows,
                                              const u32* starts, const u32* order, int dim) {
    int g = blockIdx.x, d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float* row = dtable + (i64)rows[g] * dim + d;
    float acc = *row;
    for (u32 i = starts[g]; i < starts[g + 1]; ++i) acc += dout[(i64)order[i] * dim + d];
    *row = acc;
}
