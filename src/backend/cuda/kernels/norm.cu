// RMSNorm forward (saving 1/rms per row) and backward.

// One warp per row, TITAN_NORM_WARPS rows per block: a row of a few thousand floats keeps a warp's
// loads in flight with no block-wide barrier (one block of up to 1024 threads per row spent its
// time in the block reduction). Rows whose length is a multiple of 4, on 16-byte aligned buffers,
// move four floats per access; the second pass over a row finds it in L1.
#define TITAN_NORM_WARPS 4

__device__ __forceinline__ bool norm_rows_vectorised(int dim, const void* a, const void* b,
                                                     const void* c) {
    return (dim & 3) == 0 && aligned_to(a, 16) && aligned_to(b, 16) && aligned_to(c, 16);
}

// out16, when not null, gets out's bf16 rounding; a null out is not written (a bf16-only output).
extern "C" __global__ void rmsnorm_forward(float* out, bf16_bits* out16, float* rstd, const float* x,
                                           const float* weight, int rows, int dim, float eps) {
    i64 r = (i64)blockIdx.x * TITAN_NORM_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    const float* xr = x + r * dim;
    bool vec = norm_rows_vectorised(dim, x, out, weight) && aligned_to(out16, 8);
    bf16_bits* o16 = out16 ? out16 + r * dim : nullptr;
    float* o = out ? out + r * dim : nullptr;
    float ss = 0.0f;
    if (vec) {
        for (int d = lane * 4; d < dim; d += 128) {
            float_x4 v = *(const float_x4*)(xr + d);
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += v.v[e] * v.v[e];
        }
    } else {
        for (int d = lane; d < dim; d += 32) ss += xr[d] * xr[d];
    }
    ss = warp_sum(ss);
    float rs = 1.0f / sqrtf(ss / (float)dim + eps);
    if (lane == 0) rstd[r] = rs;
    if (vec) {
        for (int d = lane * 4; d < dim; d += 128) {
            float_x4 v = *(const float_x4*)(xr + d), w = *(const float_x4*)(weight + d), y;
#pragma unroll
            for (int e = 0; e < 4; ++e) y.v[e] = v.v[e] * rs * w.v[e];
            if (o) *(float_x4*)(o + d) = y;
            if (o16) store_bf16_x4(o16 + d, y);
        }
    } else {
        for (int d = lane; d < dim; d += 32) {
            float y = xr[d] * rs * weight[d];
            if (o) o[d] = y;
            if (o16) o16[d] = bf16_of(y);
        }
    }
}

// dx += rstd * (dout*w - x * rstd * mean(dout*w*x) * rstd), and dx16 = the sum's bf16 rounding
// when not null. One warp per row, as the forward.
extern "C" __global__ void rmsnorm_backward_dx(float* dx, bf16_bits* dx16, const float* dout,
                                               const float* x, const float* weight,
                                               const float* rstd, int rows, int dim) {
    i64 r = (i64)blockIdx.x * TITAN_NORM_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31;
    const float* xr = x + r * dim;
    const float* dy = dout + r * dim;
    float* g = dx + r * dim;
    bool vec = norm_rows_vectorised(dim, x, dout, weight) && aligned_to(dx, 16) &&
               aligned_to(dx16, 8);
    bf16_bits* g16 = dx16 ? dx16 + r * dim : nullptr;
    float acc = 0.0f;
    if (vec) {
        for (int d = lane * 4; d < dim; d += 128) {
            float_x4 a = *(const float_x4*)(dy + d), w = *(const float_x4*)(weight + d),
                     v = *(const float_x4*)(xr + d);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc += a.v[e] * w.v[e] * v.v[e];
        }
    } else {
        for (int d = lane; d < dim; d += 32) acc += dy[d] * weight[d] * xr[d];
    }
    acc = warp_sum(acc);
    float rs = rstd[r];
    float mean = acc * rs / (float)dim;
    if (vec) {
        for (int d = lane * 4; d < dim; d += 128) {
            float_x4 a = *(const float_x4*)(dy + d), w = *(const float_x4*)(weight + d),
                     v = *(const float_x4*)(xr + d), out = *(float_x4*)(g + d);
#pragma unroll
            for (int e = 0; e < 4; ++e) out.v[e] += rs * (a.v[e] * w.v[e] - v.v[e] * rs * mean);
            *(float_x4*)(g + d) = out;
            if (g16) store_bf16_x4(g16 + d, out);
        }
    } else {
        for (int d = lane; d < dim; d += 32) {
            g[d] += rs * (dy[d] * weight[d] - xr[d] * rs * mean);
            if (g16) g16[d] = bf16_of(g[d]);
        }
    }
}

// dweight[d] += sum over rows of dout*x*rstd, in two deterministic passes so that every SM works:
// partial[c][d] sums the rows of chunk c in order (grid: column blocks x chunks), then each column
// adds its chunks in order.
extern "C" __global__ void rmsnorm_dweight_partial(float* partial, const float* dout, const float* x,
                                                   const float* rstd, int rows, int dim,
                                                   int rows_per_chunk) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    int r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
    float acc = 0.0f;
    for (int r = r0; r < r1; ++r) acc += dout[(i64)r * dim + d] * x[(i64)r * dim + d] * rstd[r];
    partial[(i64)blockIdx.y * dim + d] = acc;
}

extern "C" __global__ void rmsnorm_dweight_reduce(float* dweight, const float* partial, int chunks,
                                                  int dim) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float acc = 0.0f;
    for (int c = 0; c < chunks; ++c) acc += partial[(i64)c * dim + d];
    dweight[d] += acc;
}
