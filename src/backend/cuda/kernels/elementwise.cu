// Memory-bound elementwise ops: fill, residual adds, scaling, SwiGLU forward and backward.

extern "C" __global__ void fill_f32(float* buf, float value, i64 n) {
    TITAN_FOR_EACH(i, n) buf[i] = value;
}

extern "C" __global__ void add_f32(float* out, const float* a, const float* b, i64 n) {
    TITAN_FOR_EACH(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void add_assign_f32(float* acc, const float* x, i64 n) {
    TITAN_FOR_EACH(i, n) acc[i] += x[i];
}

extern "C" __global__ void scale_f32(float* buf, float factor, i64 n) {
    TITAN_FOR_EACH(i, n) buf[i] *= factor;
}

// Row r of x ([rows, width]) times scales[r]: a mixture of experts' combine weights.
extern "C" __global__ void scale_rows_f32(float* x, const float* scales, i64 width, i64 n) {
    TITAN_FOR_EACH(i, n) x[i] *= scales[i / width];
}

// out[r] = the dot product of row r of a and of b ([rows, width] each): the gradient of a mixture of
// experts' routing weights. One warp per row (a warp leaves together, so the shuffle is safe).
extern "C" __global__ void row_dots_f32(float* out, const float* a, const float* b, i64 rows,
                                        i64 width) {
    i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) return;
    float acc = 0.0f;
    for (i64 c = lane; c < width; c += 32) acc += a[r * width + c] * b[r * width + c];
    acc = warp_sum(acc);
    if (lane == 0) out[r] = acc;
}

// `rows` runs of `cols` values from src (rows `src_stride` apart) to dst (`dst_stride` apart):
// rows along y, columns along x, each grid-strided.
extern "C" __global__ void copy_rows_f32(float* dst, i64 dst_stride, const float* src, i64 src_stride,
                                         i64 rows, i64 cols) {
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
        TITAN_FOR_EACH(c, cols) dst[r * dst_stride + c] = src[r * src_stride + c];
}

// The same runs added instead of copied (MLA: each head's share of the shared rotated key's
// gradient summed into it, one call per head). Destination rows never overlap, so each value has
// one writer.
extern "C" __global__ void add_rows_f32(float* dst, i64 dst_stride, const float* src, i64 src_stride,
                                        i64 rows, i64 cols) {
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y)
        TITAN_FOR_EACH(c, cols) dst[r * dst_stride + c] += src[r * src_stride + c];
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoidf(g) * u; }

// d silu(g)/dg = s(g) * (1 + g * (1 - s(g))).
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
    float s = sigmoidf(g);
    du = d * g * s;
    dg = d * u * s * (1.0f + g * (1.0f - s));
}

// out = silu(gate) * up, and out16 = its bf16 rounding when given; a null out or out16 is not
// written (a bf16-only output has no f32 storage). An input whose bf16 pointer (gate16, up16) is
// given is read from it instead (a GEMM output kept in bf16 alone). Four values per 16-byte access
// where every buffer allows (buffers start aligned; a view at an odd offset takes the one-by-one
// loop), the same arithmetic either way.
extern "C" __global__ void swiglu_forward(float* out, bf16_bits* out16, const float* gate,
                                          const float* up, const bf16_bits* gate16,
                                          const bf16_bits* up16, i64 n) {
    i64 done = 0;
    if (aligned_to(out, 16) && aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(out16, 8) &&
        aligned_to(gate16, 8) && aligned_to(up16, 8)) {
        TITAN_FOR_EACH(q, n / 4) {
            float_x4 g = load_values_x4(gate, gate16, q), u = load_values_x4(up, up16, q), o;
#pragma unroll
            for (int e = 0; e < 4; ++e) o.v[e] = swiglu(g.v[e], u.v[e]);
            if (out) ((float_x4*)out)[q] = o;
            if (out16) store_bf16_x4(out16 + 4 * q, o);
        }
        done = n / 4 * 4;
    }
    TITAN_FOR_EACH(j, n - done) {
        i64 i = done + j;
        float o = swiglu(load_value(gate, gate16, i), load_value(up, up16, i));
        if (out) out[i] = o;
        if (out16) out16[i] = bf16_of(o);
    }
}

// Overwrites dgate and dup (and their bf16 copies when given); a null f32 destination is not
// written (bf16-only gradients, which only GEMMs read). Inputs as in swiglu_forward (dout16 too);
// vectorised the same way.
extern "C" __global__ void swiglu_backward(float* dgate, float* dup, bf16_bits* dgate16,
                                           bf16_bits* dup16, const float* dout, const float* gate,
                                           const float* up, const bf16_bits* dout16,
                                           const bf16_bits* gate16, const bf16_bits* up16, i64 n) {
    i64 done = 0;
    if (aligned_to(dgate, 16) && aligned_to(dup, 16) && aligned_to(dout, 16) &&
        aligned_to(gate, 16) && aligned_to(up, 16) && aligned_to(dgate16, 8) &&
        aligned_to(dup16, 8) && aligned_to(dout16, 8) && aligned_to(gate16, 8) &&
        aligned_to(up16, 8)) {
        TITAN_FOR_EACH(q, n / 4) {
            float_x4 d = load_values_x4(dout, dout16, q), g = load_values_x4(gate, gate16, q),
                     u = load_values_x4(up, up16, q), dg, du;
#pragma unroll
            for (int e = 0; e < 4; ++e) swiglu_grad(d.v[e], g.v[e], u.v[e], dg.v[e], du.v[e]);
            if (dgate) ((float_x4*)dgate)[q] = dg;
            if (dup) ((float_x4*)dup)[q] = du;
            if (dgate16) store_bf16_x4(dgate16 + 4 * q, dg);
            if (dup16) store_bf16_x4(dup16 + 4 * q, du);
        }
        done = n / 4 * 4;
    }
    TITAN_FOR_EACH(j, n - done) {
        i64 i = done + j;
        float dg, du;
        swiglu_grad(load_value(dout, dout16, i), load_value(gate, gate16, i),
                    load_value(up, up16, i), dg, du);
        if (dgate) dgate[i] = dg;
        if (dup) dup[i] = du;
        if (dgate16) dgate16[i] = bf16_of(dg);
        if (dup16) dup16[i] = bf16_of(du);
    }
}

// gpt-oss's clamped SwiGLU of one pair (backend/clamped_swiglu.rs): g = min(gate, limit),
// u = clamp(up, -limit, limit), out = (u + 1) * g * sigmoid(alpha * g); its partial derivatives
// pass where each clamp's input is within its bounds, bounds included (PyTorch's clamp).
__device__ __forceinline__ void clamped_swiglu_one(float alpha, float limit, float gate, float up,
                                                   float& out, float& dg, float& du) {
    float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
    float s = 1.0f / (1.0f + expf(-alpha * g));
    float glu = g * s;
    out = (u + 1.0f) * glu;
    dg = gate <= limit ? (u + 1.0f) * (s + g * alpha * s * (1.0f - s)) : 0.0f;
    du = (up >= -limit && up <= limit) ? glu : 0.0f;
}

extern "C" __global__ void clamped_swiglu_forward(float* act, const float* gate, const float* up,
                                                  float alpha, float limit, i64 n) {
    TITAN_FOR_EACH(i, n) {
        float dg, du;
        clamped_swiglu_one(alpha, limit, gate[i], up[i], act[i], dg, du);
    }
}

extern "C" __global__ void clamped_swiglu_backward(float* dgate, float* dup, const float* dact,
                                                   const float* gate, const float* up,
                                                   float alpha, float limit, i64 n) {
    TITAN_FOR_EACH(i, n) {
        float out, dg, du;
        clamped_swiglu_one(alpha, limit, gate[i], up[i], out, dg, du);
        dgate[i] = dact[i] * dg;
        dup[i] = dact[i] * du;
    }
}
