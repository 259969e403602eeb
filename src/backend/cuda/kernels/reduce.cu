// Sum of squares in f64: each block writes one partial; the host adds the partials in order, so
// the result does not depend on scheduling (deterministic).

extern "C" __global__ void sum_squares_partial(double* partials, const float* x, i64 n) {
    __shared__ double shared[32];
    double acc = 0.0;
    TITAN_FOR_EACH(i, n) {
        double v = (double)x[i];
        acc += v * v;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    acc = warp_sum_f64(acc);
    if (lane == 0) shared[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        double t = warp_sum_f64(lane < warps ? shared[lane] : 0.0);
        if (lane == 0) partials[blockIdx.x] = t;
    }
}
