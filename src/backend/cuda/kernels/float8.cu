// Float8 casts for emulated float8 GEMMs (issue 28), bit for bit the CPU's
// (src/backend/float8/kernels.rs): amaxes as integer maxima over the values' bits (NaN, whose bits
// order above infinity's, propagates), and the rounding to e4m3/e5m2 by adding and subtracting a
// power of two whose f32 spacing is the format's at the value, so the f32 adder rounds to nearest
// even. The `_rn` intrinsics keep the compiler from contracting or reassociating that arithmetic.
// `format`: 0 e4m3, 1 e5m2. Also the FSDP float8 all-gather's codes, four to a word. The amaxes
// and the cast read an operand's f32 values, or its bf16 copy when it is kept in bf16 alone
// (`x16` not null).

struct Fp8Rounding {
    float max;
    // The f32 whose spacing is the format's subnormal spacing.
    float subnormal_magic;
    // Mantissa bits of an f32 the format does not have.
    u32 cut;
};

__device__ __forceinline__ Fp8Rounding fp8_rounding(int format) {
    Fp8Rounding e4m3 = {448.0f, 16384.0f, 20u};
    Fp8Rounding e5m2 = {57344.0f, 128.0f, 21u};
    return format == 0 ? e4m3 : e5m2;
}

// `a` (non-negative, at most max) rounded to the format, ties to even.
__device__ __forceinline__ float fp8_round_magnitude(Fp8Rounding r, float a) {
    u32 exponent = __float_as_uint(a) & 0x7f800000u;
    float c = fmaxf(__uint_as_float(exponent + (r.cut << 23)), r.subnormal_magic);
    return __fsub_rn(__fadd_rn(a, c), c);
}

// `v` quantised with scale `s`: round(clamp(v · s)), NaN kept.
__device__ __forceinline__ float fp8_quantized(Fp8Rounding r, float v, float s) {
    float scaled = __fmul_rn(v, s);
    if (scaled != scaled) return scaled;
    float clamped = fminf(fmaxf(scaled, -r.max), r.max);
    return copysignf(fp8_round_magnitude(r, fabsf(clamped)), clamped);
}

__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(TITAN_FULL_MASK, v, o));
    return v;
}

// The largest |x| of each block's share of x, as f32 bits, into partials[blockIdx.x] (the host
// takes the largest). blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void float8_amax_partial(u32* partials, const float* x, const bf16_bits* x16,
                                               i64 n) {
    __shared__ u32 shared[32];
    u32 m = 0;
    TITAN_FOR_EACH(i, n) m = max(m, abs_bits(load_value(x, x16, i)));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    m = warp_max_u32(m);
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    if (warp == 0) {
        u32 t = warp_max_u32(lane < warps ? shared[lane] : 0u);
        if (lane == 0) partials[blockIdx.x] = t;
    }
}

// The largest |x| of each row of x ([rows, cols]): one warp per row, TITAN_NORM_WARPS rows a block.
extern "C" __global__ void float8_amax_rows(float* out, const float* x, const bf16_bits* x16,
                                            i64 rows, i64 cols) {
    i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    u32 m = 0;
    if (row < rows) {
        for (i64 c = lane; c < cols; c += 32) m = max(m, abs_bits(load_value(x, x16, row * cols + c)));
    }
    m = warp_max_u32(m);
    if (row < rows && lane == 0) out[row] = __uint_as_float(m);
}

// The largest |x| of each column of x ([rows, cols]): a thread per column, walking down the rows
// (neighbouring threads read neighbouring values).
extern "C" __global__ void float8_amax_columns(float* out, const float* x, const bf16_bits* x16,
                                               i64 rows, i64 cols) {
    TITAN_FOR_EACH(c, cols) {
        u32 m = 0;
        for (i64 r = 0; r < rows; ++r) m = max(m, abs_bits(load_value(x, x16, r * cols + c)));
        out[c] = __uint_as_float(m);
    }
}

// ---- MXFP8 (src/backend/float8/mx.rs): e4m3 in blocks of 32, one E8M0 scale per block ----

// 2^e as an f32 from its bits (exact; e in [-149, 127], below -126 a subnormal).
__device__ __forceinline__ float mx_pow2(int e) {
    return e >= -126 ? __uint_as_float((u32)(e + 127) << 23) : __uint_as_float(1u << (e + 149));
}

// ceil(log2(x)) of a positive finite f32, exactly from its bits (mx.rs's ceil_log2).
__device__ __forceinline__ int mx_ceil_log2(float x) {
    u32 bits = __float_as_uint(x), field = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
    if (field == 0u) {
        int floor = 31 - __clz(mantissa);
        return floor - 149 + ((mantissa & (mantissa - 1u)) != 0u);
    }
    return (int)field - 127 + (mantissa != 0u);
}

// A block's scale from its amax's bits: the factor its values are multiplied by before the e4m3
// cast, and the one a cast value is multiplied by after (MxScaling::block_scale). `rceil`: RCEIL
// (descale = amax / 448, its exact ceil-log2), else FLOOR (the amax's exponent less 8).
struct MxScale {
    float multiplier, dequantize;
};
__device__ __forceinline__ MxScale mx_block_scale(u32 amax_bits, int rceil) {
    float amax = __uint_as_float(amax_bits);
    float nan = __int_as_float(0x7fc00000);
    int byte;
    if (amax != amax) {
        byte = 255;
    } else if (rceil) {
        float descale = __fdiv_rn(amax, 448.0f);
        int e = descale == 0.0f ? -127 : (amax_bits >= 0x7f800000u ? 127 : mx_ceil_log2(descale));
        byte = min(max(e, -127), 127) + 127;
    } else {
        int e = (int)((amax_bits >> 23) & 0xffu) - 127 - 8;
        byte = min(max(e, -127), 128) + 127;
    }
    MxScale s;
    if (byte == 255) {
        s.multiplier = nan;
        s.dequantize = nan;
        return s;
    }
    s.multiplier = byte == 0 ? (rceil ? 1.0f : mx_pow2(126)) : mx_pow2(127 - byte);
    s.dequantize = mx_pow2(byte - 127);
    return s;
}

// out = x ([rows, cols], from x16 when given) cast to MXFP8 and dequantised
// (float8::mx_fake_quantize_rows): `down_columns` 0: blocks of 32 along each row (cols a multiple
// of 32), one warp a block, TITAN_NORM_WARPS blocks a thread block; 1: blocks of 32 rows down each
// column (the last group of rows may be shorter: as if padded with zeros), a thread a block.
extern "C" __global__ void mx_fake_quantize(float* out, const float* x, const bf16_bits* x16,
                                            i64 rows, i64 cols, int down_columns, int rceil) {
    Fp8Rounding r = fp8_rounding(0);
    if (!down_columns) {
        i64 block = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        int lane = threadIdx.x & 31;
        bool live = block < rows * cols / 32;
        i64 i = block * 32 + lane;
        float v = live ? load_value(x, x16, i) : 0.0f;
        MxScale s = mx_block_scale(warp_max_u32(abs_bits(v)), rceil);
        if (live) out[i] = __fmul_rn(fp8_quantized(r, v, s.multiplier), s.dequantize);
        return;
    }
    i64 groups = (rows + 31) / 32;
    TITAN_FOR_EACH(t, groups * cols) {
        i64 g = t / cols, c = t % cols, end = min(32 * g + 32, rows);
        u32 m = 0;
        for (i64 row = 32 * g; row < end; ++row) m = max(m, abs_bits(load_value(x, x16, row * cols + c)));
        MxScale s = mx_block_scale(m, rceil);
        for (i64 row = 32 * g; row < end; ++row) {
            i64 i = row * cols + c;
            out[i] = __fmul_rn(fp8_quantized(r, load_value(x, x16, i), s.multiplier), s.dequantize);
        }
    }
}

// The 8-bit code of q, a value of the format (or NaN).
__device__ __forceinline__ u32 fp8_code(int format, float q) {
    u32 bits = __float_as_uint(q);
    u32 sign = (bits >> 24) & 0x80u;
    if (q != q) return sign | 0x7fu;
    int m = format == 0 ? 3 : 2, bias = format == 0 ? 7 : 15, min_exponent = 1 - bias;
    float a = fabsf(q);
    u32 magnitude;
    if (a < __uint_as_float((u32)(min_exponent + 127) << 23)) {
        // A subnormal: a whole number of the smallest spacing, 2^(min_exponent - m).
        magnitude = (u32)__fmul_rn(a, __uint_as_float((u32)(m - min_exponent + 127) << 23));
    } else {
        u32 exponent_field = (u32)((int)((bits >> 23) & 0xffu) - 127 + bias);
        magnitude = exponent_field << m | ((bits >> (23 - m)) & ((1u << m) - 1u));
    }
    return sign | magnitude;
}

// out = x ([rows, cols], n values) quantised with `scales` and dequantised: each value
// round(clamp(v · s)) · (1/s). `axis`: 0 one scale, 1 one per row, 2 one per column. When `codes`
// is not null it also receives each value's 8-bit code (what a float8 GEMM reads): row-major, or
// `[cols, rows]` when `transposed` (the GEMM's summed dimension contiguous).
extern "C" __global__ void float8_fake_quantize(float* out, const float* x, const bf16_bits* x16,
                                                const float* scales, i64 cols, int axis, int format,
                                                u8* codes, int transposed, i64 n) {
    Fp8Rounding r = fp8_rounding(format);
    i64 rows = n / cols;
    TITAN_FOR_EACH(i, n) {
        i64 row = i / cols, col = i % cols;
        float s = scales[axis == 0 ? 0 : (axis == 1 ? row : col)];
        float q = fp8_quantized(r, load_value(x, x16, i), s);
        out[i] = __fmul_rn(q, __frcp_rn(s));
        if (codes) codes[transposed ? col * rows + row : i] = (u8)fp8_code(format, q);
    }
}

// A float8 GEMM's product of codes ([m, n], one f32 sum of code products each) scaled back by
// the operands' reciprocal scales: out = addend + product · (inv_a · inv_b), inv_a one per row
// of the output (or one for all when !a_per_row), inv_b one per column (or one). `addend` may be
// null (nothing added) or `out` itself (accumulation); `product` may be `out` itself (each value
// is read before it is written).
extern "C" __global__ void float8_scale_product(float* out, const float* product,
                                                const float* addend, const float* inv_a,
                                                int a_per_row, const float* inv_b, int b_per_col,
                                                i64 n, i64 len) {
    TITAN_FOR_EACH(i, len) {
        float s = __fmul_rn(inv_a[a_per_row ? i / n : 0], inv_b[b_per_col ? i % n : 0]);
        float v = __fmul_rn(product[i], s);
        out[i] = addend ? __fadd_rn(addend[i], v) : v;
    }
}

// words[j] = the codes of x[4j..4j+4] quantised with `scale` (the first in the low byte; past n,
// zero codes).
extern "C" __global__ void float8_encode_words(u32* words, const float* x, float scale, int format,
                                               i64 n) {
    Fp8Rounding r = fp8_rounding(format);
    TITAN_FOR_EACH(j, (n + 3) / 4) {
        u32 w = 0;
        for (int k = 0; k < 4; ++k) {
            i64 i = 4 * j + k;
            if (i < n) w |= fp8_code(format, fp8_quantized(r, x[i], scale)) << (8 * k);
        }
        words[j] = w;
    }
}

// The value of a code.
__device__ __forceinline__ float fp8_value(int format, u32 code) {
    int m = format == 0 ? 3 : 2, bias = format == 0 ? 7 : 15;
    float sign = (code & 0x80u) ? -1.0f : 1.0f;
    u32 exponent_field = (code & 0x7fu) >> m, mantissa = code & ((1u << m) - 1u);
    u32 all_ones = (1u << (7 - m)) - 1u;
    if (format == 0 && exponent_field == all_ones && mantissa == 7u) return __int_as_float(0x7fc00000);
    if (format == 1 && exponent_field == all_ones) {
        return mantissa == 0u ? sign * __int_as_float(0x7f800000) : __int_as_float(0x7fc00000);
    }
    // Exact: at most 4 significant bits times a power of two.
    float magnitude = exponent_field == 0u
                          ? (float)mantissa * __uint_as_float((u32)(1 - bias - m + 127) << 23)
                          : (float)((1u << m) | mantissa) *
                                __uint_as_float((u32)((int)exponent_field - bias - m + 127) << 23);
    return sign * magnitude;
}

// out[i] = the value of code i of `words` (four to a word, the first in the low byte).
extern "C" __global__ void float8_decode_words(float* out, const u32* words, int format, i64 n) {
    TITAN_FOR_EACH(i, n) out[i] = fp8_value(format, (words[i / 4] >> (8 * (i % 4))) & 0xffu);
}
