// The sequence-wise auxiliary balance loss on the device (`Backend::moe_aux_figures`,
// `moe_aux_balance`, `moe_aux_score_grads`), the definitions of backend/moe_aux.rs: local row t is
// in sequence (first + t) / seq. Each figure is one thread's sum over its sequence's rows in row
// order, the CPU's order, with the same f32 operations, so the figures are the CPU's bit for bit
// whenever the scores are. No atomics.

// figures = [counts (n·E) | normalised score sums (n·E) | tokens (n)], one thread per
// (sequence, expert); the expert-0 thread also counts the sequence's rows.
extern "C" __global__ void moe_aux_figures(float* figures, const u32* experts, const float* scores,
                                           i64 tokens, i64 first, i64 seq, int n, int E, int K,
                                           int sigmoid) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * E) return;
    i64 b = i / E;
    int e = (int)(i % E);
    i64 lo = b * seq - first, hi = (b + 1) * seq - first;
    lo = lo < 0 ? 0 : lo;
    hi = hi > tokens ? tokens : hi;
    float count = 0.0f, sum = 0.0f;
    for (i64 t = lo; t < hi; ++t) {
        for (int j = 0; j < K; ++j) count += experts[t * K + j] == (u32)e ? 1.0f : 0.0f;
        const float* s = scores + t * E;
        float norm = s[e];
        if (sigmoid) {
            float total = 0.0f;
            for (int x = 0; x < E; ++x) total += s[x];
            norm = s[e] / total;
        }
        sum += norm;
    }
    figures[b * E + e] = count;
    figures[(i64)n * E + b * E + e] = sum;
    if (e == 0) figures[2 * (i64)n * E + b] = hi > lo ? (float)(hi - lo) : 0.0f;
}

// balance = [f (n·E) | L_b (n)] from the summed figures, one thread per sequence:
// f_e = E / (k·T) · count_e, L_b = Σ_e f_e · sum_e / T in expert order.
extern "C" __global__ void moe_aux_balance(float* balance, const float* figures, int n, int E,
                                           int K) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const float* counts = figures + (i64)b * E;
    const float* sums = figures + (i64)n * E + (i64)b * E;
    float t = fmaxf(figures[2 * (i64)n * E + b], 1.0f);
    float scale = (float)E / ((float)K * t);
    float value = 0.0f;
    for (int x = 0; x < E; ++x) {
        float f = __fmul_rn(scale, counts[x]);
        balance[(i64)b * E + x] = f;
        value = __fadd_rn(value, __fdiv_rn(__fmul_rn(f, sums[x]), t));
    }
    balance[(i64)n * E + b] = value;
}

// The gradient of scale · Σ_b L_b with respect to each local row's normalised scores,
// grads[t, e] = (scale / T_b) · f[b, e], one thread per (row, expert).
extern "C" __global__ void moe_aux_score_grads(float* grads, const float* balance,
                                               const float* figures, i64 tokens, i64 first,
                                               i64 seq, int n, int E, float scale) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * E) return;
    i64 t = i / E;
    i64 b = (first + t) / seq;
    float per_token = scale / fmaxf(figures[2 * (i64)n * E + b], 1.0f);
    grads[i] = __fmul_rn(per_token, balance[b * E + i % E]);
}
