// Fused AdamW with decoupled weight decay; step_size = lr / (1 - beta1^t) and
// bias2_sqrt = sqrt(1 - beta2^t) are computed on the host in f64, as on the CPU.

// One element's update; the gradient is multiplied by grad_scale (clipping) first, then (Adam)
// gets the L2 term l2·p (0 for AdamW, whose decay is the factor `decay`).
__device__ __forceinline__ void adamw_update(float* p, const float* g, float* m, float* v, i64 i,
                                             float b1, float b2, float eps, float step_size,
                                             float bias2_sqrt, float decay, float l2,
                                             float grad_scale) {
    float gi = g[i] * grad_scale;
    if (l2 != 0.0f) gi = fmaf(l2, p[i], gi);
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float denom = sqrtf(vi) / bias2_sqrt + eps;
    p[i] = p[i] * decay - step_size * mi / denom;
}

extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v, float b1, float b2,
                                      float eps, float step_size, float bias2_sqrt, float decay,
                                      float l2, float grad_scale, i64 n) {
    TITAN_FOR_EACH(i, n) {
        adamw_update(p, g, m, v, i, b1, b2, eps, step_size, bias2_sqrt, decay, l2, grad_scale);
    }
}
