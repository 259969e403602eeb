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

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// out = silu(gate) * up
extern "C" __global__ void swiglu_forward(float* out, const float* gate, const float* up, i64 n) {
    TITAN_FOR_EACH(i, n) {
        float g = gate[i];
        out[i] = g * sigmoidf(g) * up[i];
    }
}

// Overwrites dgate and dup; d silu(g)/dg = s(g) * (1 + g * (1 - s(g))).
extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* dout,
                                           const float* gate, const float* up, i64 n) {
    TITAN_FOR_EACH(i, n) {
        float g = gate[i], s = sigmoidf(g), d = dout[i];
        dup[i] = d * g * s;
        dgate[i] = d * up[i] * s * (1.0f + g * (1.0f - s));
    }
}
