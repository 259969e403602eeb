// RMSNorm forward (saving 1/rms per row) and backward.

// One block per row.
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* x, const float* weight,
                                           int dim, float eps) {
    __shared__ float shared[32];
    i64 r = blockIdx.x;
    const float* xr = x + r * dim;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
    ss = block_sum(ss, shared);
    float rs = 1.0f / sqrtf(ss / (float)dim + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    float* o = out + r * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = xr[d] * rs * weight[d];
}

// dx += rstd * (dout*w - x * rstd * mean(dout*w*x) * rstd). One block per row.
extern "C" __global__ void rmsnorm_backward_dx(float* dx, const float* dout, const float* x,
                                               const float* weight, const float* rstd, int dim) {
    __shared__ float shared[32];
    i64 r = blockIdx.x;
    const float* xr = x + r * dim;
    const float* dy = dout + r * dim;
    float acc = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) acc += dy[d] * weight[d] * xr[d];
    acc = block_sum(acc, shared);
    float rs = rstd[r];
    float mean = acc * rs / (float)dim;
    float* g = dx + r * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x)
        g[d] += rs * (dy[d] * weight[d] - xr[d] * rs * mean);
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
