// Multi-tensor kernels: one launch over a whole list of tensors (every parameter of the model)
// instead of one launch per tensor. The list is a device array of base pointers per operand and
// the prefix sums of the tensors' lengths (`offsets`, n + 1 values), so element i of the list's
// concatenation lives in the tensor t with offsets[t] <= i < offsets[t + 1]. Blocks take fixed
// chunks of the concatenation; a thread finds its tensor by binary search once per chunk and then
// steps forward, so empty tensors and chunks that straddle tensors need no special case.

#define TITAN_MT_CHUNK 8192

// The last t in [0, n) with offsets[t] <= i: the tensor holding element i (skipping empty ones).
__device__ __forceinline__ int tensor_holding(const i64* offsets, int n, i64 i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (offsets[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Calls visit(t, j) for this thread's elements of the list, t the tensor and j the index inside it.
template <typename Visit>
__device__ __forceinline__ void for_each_listed(const i64* offsets, int n, Visit visit) {
    i64 total = offsets[n];
    for (i64 start = (i64)blockIdx.x * TITAN_MT_CHUNK; start < total;
         start += (i64)gridDim.x * TITAN_MT_CHUNK) {
        i64 end = min(start + (i64)TITAN_MT_CHUNK, total);
        i64 i = start + threadIdx.x;
        if (i >= end) continue;
        int t = tensor_holding(offsets, n, i);
        for (; i < end; i += blockDim.x) {
            while (i >= offsets[t + 1]) ++t;
            visit(t, i - offsets[t]);
        }
    }
}

extern "C" __global__ void adamw_step_all(float* const* p, const float* const* g, float* const* m,
                                          float* const* v, const i64* offsets, int n, float b1,
                                          float b2, float eps, float step_size, float bias2_sqrt,
                                          float decay, float l2, float grad_scale) {
    for_each_listed(offsets, n, [&](int t, i64 j) {
        adamw_update(p[t], g[t], m[t], v[t], j, b1, b2, eps, step_size, bias2_sqrt, decay, l2,
                     grad_scale);
    });
}

extern "C" __global__ void fill_all(float* const* dst, const i64* offsets, int n, float value) {
    for_each_listed(offsets, n, [&](int t, i64 j) { dst[t][j] = value; });
}

// dst[t][j] = src[t][j] rounded to bf16 (nearest even, NaN kept), stored as f32, and the same
// value's bf16 bits in bits[t][j] (the copy bf16 GEMMs read).
extern "C" __global__ void copy_rounded_to_bf16_all(float* const* dst, unsigned short* const* bits,
                                                    const float* const* src, const i64* offsets,
                                                    int n) {
    for_each_listed(offsets, n, [&](int t, i64 j) {
        float rounded = round_bf16(src[t][j]);
        dst[t][j] = rounded;
        bits[t][j] = (unsigned short)(__float_as_uint(rounded) >> 16);
    });
}

// Sum of squares of the whole list in f64: each block writes one partial (blocks own fixed chunks,
// so the partials do not depend on scheduling); the host adds them in order.
extern "C" __global__ void sum_squares_all_partial(double* partials, const float* const* x,
                                                   const i64* offsets, int n) {
    __shared__ double shared[32];
    double acc = 0.0;
    for_each_listed(offsets, n, [&](int t, i64 j) {
        double value = (double)x[t][j];
        acc += value * value;
    });
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    acc = warp_sum_f64(acc);
    if (lane == 0) shared[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        double total = warp_sum_f64(lane < warps ? shared[lane] : 0.0);
        if (lane == 0) partials[blockIdx.x] = total;
    }
}
