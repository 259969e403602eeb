// Rounding f32 values to bf16 precision in place (round to nearest even, NaN kept), for the
// parameters of bf16 mixed precision, and f32 → bf16 bits for bf16 GEMM operands (the rounding
// itself is in common.cuh).

extern "C" __global__ void round_to_bf16(float* x, i64 n) {
    TITAN_FOR_EACH(i, n) x[i] = round_bf16(x[i]);
}

// f32 → bf16 bits (nearest even): the operands of bf16 GEMMs. Four values per step (a 16-byte load,
// an 8-byte store) where the buffers allow, then two per step; an odd count's last pair is padded
// with zero.
extern "C" __global__ void f32_to_bf16(u32* out_pairs, const float* in, i64 n) {
    i64 done = 0;
    if (aligned_to(in, 16) && aligned_to(out_pairs, 8)) {
        TITAN_FOR_EACH(q, n / 4) {
            float_x4 v = ((const float_x4*)in)[q];
            u32_x2 o;
            o.v[0] = bf16_pair(v.v[0], v.v[1]);
            o.v[1] = bf16_pair(v.v[2], v.v[3]);
            ((u32_x2*)out_pairs)[q] = o;
        }
        done = n / 4 * 4;
    }
    TITAN_FOR_EACH(j, (n - done + 1) / 2) {
        i64 i = done / 2 + j;
        out_pairs[i] = bf16_pair(in[2 * i], 2 * i + 1 < n ? in[2 * i + 1] : 0.0f);
    }
}

// out[i] = value i of bf16 pairs (value 2j in the low half of word j): the inverse of f32_to_bf16.
extern "C" __global__ void bf16_pairs_to_f32(float* out, const u32* words, i64 n) {
    TITAN_FOR_EACH(i, n) {
        u32 w = words[i / 2];
        out[i] = __uint_as_float((i % 2 == 0 ? w & 0xffffu : w >> 16) << 16);
    }
}
