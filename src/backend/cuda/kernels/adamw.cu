// Fused AdamW with decoupled weight decay; step_size = lr / (1 - beta1^t) and
// bias2_sqrt = sqrt(1 - beta2^t) are computed on the host in f64, as on the CPU.

extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v, float b1, float b2,
                                      float eps, float step_size, float bias2_sqrt, float decay, i64 n) {
    TITAN_FOR_EACH(i, n) {
        float gi = g[i];
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bias2_sqrt + eps;
        p[i] = p[i] * decay - step_size * mi / denom;
    }
}
