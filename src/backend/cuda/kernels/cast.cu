// Rounding f32 values to bf16 precision in place (round to nearest even, NaN kept), for the
// parameters of bf16 mixed precision.

__device__ __forceinline__ float round_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u | 0x00400000u) & 0xffff0000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

extern "C" __global__ void round_to_bf16(float* x, i64 n) {
    TITAN_FOR_EACH(i, n) x[i] = round_bf16(x[i]);
}

// f32 → bf16 bits (nearest even): the operands of bf16 GEMMs. Two values per thread step.
extern "C" __global__ void f32_to_bf16(u32* out_pairs, const float* in, i64 n) {
    TITAN_FOR_EACH(i, (n + 1) / 2) {
        u32 lo = __float_as_uint(round_bf16(in[2 * i])) >> 16;
        u32 hi = 2 * i + 1 < n ? __float_as_uint(round_bf16(in[2 * i + 1])) >> 16 : 0u;
        out_pairs[i] = lo | (hi << 16);
    }
}
