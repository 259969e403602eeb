// Helpers shared by every titan kernel. Header-free on purpose: NVRTC compiles this program with no
// CUDA toolkit headers, so a machine needs only libnvrtc to build the kernels.

#define TITAN_FULL_MASK 0xffffffffu
#define TITAN_NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(TITAN_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(TITAN_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(TITAN_FULL_MASK, v, o);
    return v;
}

// Sum over the whole block, returned to every thread. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? shared32[lane] : 0.0f);
}

__device__ __forceinline__ float block_max(float v, float* shared32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? shared32[lane] : TITAN_NEG_INF);
}

// Grid-stride loop over n elements.
#define TITAN_FOR_EACH(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Four floats moved by one 16-byte access (and two 32-bit words by one 8-byte access): memory-bound
// kernels keep more bytes in flight per thread that way. (CUDA's float4 lives in a header NVRTC
// does not have here.)
struct __align__(16) float_x4 {
    float v[4];
};
struct __align__(8) u32_x2 {
    u32 v[2];
};

__device__ __forceinline__ bool aligned_to(const void* p, unsigned long long bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}
