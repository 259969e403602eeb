// Helpers shared by every titan kernel. Header-free on purpose: NVRTC compiles this program with no
// CUDA toolkit headers, so a machine needs only libnvrtc to build the kernels.

#define TITAN_FULL_MASK 0xffffffffu
#define TITAN_NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef unsigned char u8;
typedef long long i64;
// bf16 values as their 16 bits (CUDA's __nv_bfloat16 lives in a header NVRTC does not have here).
typedef unsigned short bf16_bits;

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

// f32 rounded to bf16 precision (nearest even; NaN stays NaN), kept in f32.
__device__ __forceinline__ float round_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

__device__ __forceinline__ bf16_bits bf16_of(float f) {
    return (bf16_bits)(__float_as_uint(round_bf16(f)) >> 16);
}

// Two values rounded to bf16 in one word, `lo` in the low half.
__device__ __forceinline__ u32 bf16_pair(float lo, float hi) {
    return (__float_as_uint(round_bf16(lo)) >> 16) | (__float_as_uint(round_bf16(hi)) & 0xffff0000u);
}

__device__ __forceinline__ float f32_of_bf16(bf16_bits h) { return __uint_as_float((u32)h << 16); }

// An activation that may live in bf16 alone: value `i` from `h` when it is given, else from `f`.
__device__ __forceinline__ float load_value(const float* f, const bf16_bits* h, i64 i) {
    return h ? f32_of_bf16(h[i]) : f[i];
}

// Values 4q..4q+3 of such an activation (`f` 16-byte aligned, or `h` 8-byte aligned).
__device__ __forceinline__ float_x4 load_values_x4(const float* f, const bf16_bits* h, i64 q) {
    if (!h) return ((const float_x4*)f)[q];
    u32_x2 w = ((const u32_x2*)h)[q];
    float_x4 v;
    v.v[0] = __uint_as_float(w.v[0] << 16);
    v.v[1] = __uint_as_float(w.v[0] & 0xffff0000u);
    v.v[2] = __uint_as_float(w.v[1] << 16);
    v.v[3] = __uint_as_float(w.v[1] & 0xffff0000u);
    return v;
}

// Four values rounded to bf16 at `out` (8-byte aligned): a buffer's bf16 copy written beside its
// f32 values by the kernel that computes them (see CudaBuf), so bf16 GEMMs need no conversion pass.
__device__ __forceinline__ void store_bf16_x4(bf16_bits* out, const float_x4& v) {
    u32_x2 w;
    w.v[0] = bf16_pair(v.v[0], v.v[1]);
    w.v[1] = bf16_pair(v.v[2], v.v[3]);
    *(u32_x2*)out = w;
}
