// A mixture of experts' routing on the device (`Backend::moe_route`, `moe_route_backward`,
// `moe_dispatch_order`, `moe_combine`), the definitions of backend/routing.rs: ids are u32 values
// in f32 buffers (their bit patterns), so a block's routing never leaves the GPU.
//
// Routing is one thread per token over at most TITAN_MOE_MAX_EXPERTS experts: a few hundred
// numbers against the experts' GEMMs. The top-k is a repeated arg-max on the order the CPU sorts
// by (f32 total order, descending; the lower index first on a tie), so the choice is the CPU's
// whenever the scores are. The dispatch order is a stable counting sort without atomics: per
// chunk of slots, each expert's count (one thread per expert reading the chunk from shared
// memory), one block scanning them into each (chunk, expert)'s first row, and each expert's
// thread placing its chunk's rows in slot order.

#define TITAN_MOE_MAX_EXPERTS 512
#define TITAN_MOE_MAX_TOP_K 32
#define TITAN_MOE_CHUNK 1024

// A key whose unsigned order is f32's total order (Rust's `total_cmp`).
__device__ __forceinline__ u32 moe_order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Group-limited routing: all but the `limited` best of `groups` groups masked to -inf in
// `select`. A group's score is its best expert's (softmax) or its best two's sum (sigmoid).
__device__ void moe_limit_groups(float* select, int E, int groups, int limited, int sigmoid) {
    int per = E / groups;
    float group_score[TITAN_MOE_MAX_EXPERTS];
    for (int g = 0; g < groups; ++g) {
        int best = -1, second = -1;
        for (int x = g * per; x < (g + 1) * per; ++x) {
            u32 key = moe_order_key(select[x]);
            if (best < 0 || key > moe_order_key(select[best])) {
                second = best;
                best = x;
            } else if (second < 0 || key > moe_order_key(select[second])) {
                second = x;
            }
        }
        group_score[g] = select[best];
        if (sigmoid && second >= 0) group_score[g] = select[best] + select[second];
    }
    for (int g = 0; g < groups; ++g) {
        u32 key = moe_order_key(group_score[g]);
        int rank = 0;
        for (int h = 0; h < groups; ++h) {
            u32 other = moe_order_key(group_score[h]);
            rank += other > key || (other == key && h < g);
        }
        if (rank >= limited)
            for (int x = g * per; x < (g + 1) * per; ++x) select[x] = TITAN_NEG_INF;
    }
}

// One thread per token: scores (softmax or sigmoid of the logits), the choice by score plus
// `bias` (may be null) within the best groups, and the chosen weights (renormalised with `norm`,
// times `scale`). `experts` receives u32 ids.
extern "C" __global__ void moe_route(u32* experts, float* weights, float* scores,
                                     const float* logits, const float* bias, int tokens, int E,
                                     int K, int sigmoid, int norm, float scale, int groups,
                                     int limited) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (i64)t * E;
    float* s = scores + (i64)t * E;
    if (sigmoid) {
        for (int x = 0; x < E; ++x) s[x] = 1.0f / (1.0f + expf(-l[x]));
    } else {
        float max = TITAN_NEG_INF, sum = 0.0f;
        for (int x = 0; x < E; ++x) max = fmaxf(max, l[x]);
        for (int x = 0; x < E; ++x) {
            s[x] = expf(l[x] - max);
            sum += s[x];
        }
        for (int x = 0; x < E; ++x) s[x] /= sum;
    }
    float select[TITAN_MOE_MAX_EXPERTS];
    for (int x = 0; x < E; ++x) select[x] = bias ? s[x] + bias[x] : s[x];
    if (groups > 0) moe_limit_groups(select, E, groups, limited, sigmoid);
    bool taken[TITAN_MOE_MAX_EXPERTS];
    for (int x = 0; x < E; ++x) taken[x] = false;
    u32* chosen = experts + (i64)t * K;
    float total = 0.0f;
    for (int j = 0; j < K; ++j) {
        int best = -1;
        for (int x = 0; x < E; ++x)
            if (!taken[x] && (best < 0 || moe_order_key(select[x]) > moe_order_key(select[best])))
                best = x;
        taken[best] = true;
        chosen[j] = (u32)best;
        total += s[best];
    }
    total += 1e-20f;
    for (int j = 0; j < K; ++j) {
        float w = s[chosen[j]];
        weights[(i64)t * K + j] = (norm ? w / total : w) * scale;
    }
}

// One thread per token: the logits' gradient from the chosen weights' (`dweights`) and, when
// `aux` is not null, the normalised scores' (the auxiliary loss's), as routing::route_backward.
extern "C" __global__ void moe_route_backward(float* dlogits, const float* scores,
                                              const u32* experts, const float* dweights,
                                              const float* aux, int tokens, int E, int K,
                                              int sigmoid, int norm, float scale) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* s = scores + (i64)t * E;
    const u32* chosen = experts + (i64)t * K;
    const float* dw = dweights + (i64)t * K;
    float* dl = dlogits + (i64)t * E;
    float z = 0.0f;
    for (int j = 0; j < K; ++j) z += s[chosen[j]];
    z += 1e-20f;
    if (!sigmoid && norm && !aux) {
        // Softmax renormalised over the chosen: exactly zero for the others.
        float dot = 0.0f;
        for (int j = 0; j < K; ++j) dot += dw[j] * s[chosen[j]] / z;
        for (int x = 0; x < E; ++x) dl[x] = 0.0f;
        for (int j = 0; j < K; ++j) dl[chosen[j]] = scale * s[chosen[j]] / z * (dw[j] - dot);
        return;
    }
    float ds[TITAN_MOE_MAX_EXPERTS];
    for (int x = 0; x < E; ++x) ds[x] = 0.0f;
    if (norm) {
        float dot = 0.0f;
        for (int j = 0; j < K; ++j) dot += dw[j] * s[chosen[j]];
        for (int j = 0; j < K; ++j) ds[chosen[j]] += scale * (dw[j] / z - dot / (z * z));
    } else {
        for (int j = 0; j < K; ++j) ds[chosen[j]] += scale * dw[j];
    }
    if (aux) {
        const float* g = aux + (i64)t * E;
        if (sigmoid) {
            // s'_x = s_x / S: ∂/∂s_x = (g_x − Σ g·s') / S.
            float total = 0.0f, dot = 0.0f;
            for (int x = 0; x < E; ++x) total += s[x];
            for (int x = 0; x < E; ++x) dot += g[x] * (s[x] / total);
            for (int x = 0; x < E; ++x) ds[x] += (g[x] - dot) / total;
        } else {
            for (int x = 0; x < E; ++x) ds[x] += g[x];
        }
    }
    if (sigmoid) {
        for (int x = 0; x < E; ++x) dl[x] = ds[x] * s[x] * (1.0f - s[x]);
    } else {
        float dot = 0.0f;
        for (int x = 0; x < E; ++x) dot += ds[x] * s[x];
        for (int x = 0; x < E; ++x) dl[x] = s[x] * (ds[x] - dot);
    }
}

// Block c's chunk of the slots' experts, from slot `first`, into shared `chunk` (every thread of
// the block calls it); returns the chunk's length.
__device__ int moe_load_chunk(u32* chunk, const u32* experts, i64 first, i64 n) {
    int len = (int)min((i64)TITAN_MOE_CHUNK, n - first);
    for (int i = threadIdx.x; i < len; i += blockDim.x) chunk[i] = experts[first + i];
    __syncthreads();
    return len;
}

// Dispatch order, pass 1: block c counts each expert's slots in chunk c (`counts[c·E + e]`).
extern "C" __global__ void moe_chunk_counts(u32* counts, const u32* experts, i64 n, int E) {
    __shared__ u32 chunk[TITAN_MOE_CHUNK];
    i64 first = (i64)blockIdx.x * TITAN_MOE_CHUNK;
    int len = moe_load_chunk(chunk, experts, first, n);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        u32 count = 0;
        for (int i = 0; i < len; ++i) count += chunk[i] == (u32)e;
        counts[(i64)blockIdx.x * E + e] = count;
    }
}

// Pass 2, one block: each expert's first row (`offsets`, E + 1), and each (chunk, expert)'s
// (`bases[c·E + e]`): expert-major, then chunk order, so rows keep slot order within an expert.
extern "C" __global__ void moe_offsets(u32* offsets, u32* bases, const u32* counts, int chunks,
                                       int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        u32 total = 0;
        for (int c = 0; c < chunks; ++c) total += counts[(i64)c * E + e];
        offsets[e + 1] = total;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        u32 at = offsets[e];
        for (int c = 0; c < chunks; ++c) {
            bases[(i64)c * E + e] = at;
            at += counts[(i64)c * E + e];
        }
    }
}

// Pass 3: block c places chunk c's slots, each expert's thread walking the chunk in slot order:
// row r = the slot's place, rows[r] its token, slots[r] the slot, row_of_slot[slot] = r.
extern "C" __global__ void moe_place(u32* rows, u32* slots, u32* row_of_slot, const u32* experts,
                                     const u32* bases, i64 n, int E, int K) {
    __shared__ u32 chunk[TITAN_MOE_CHUNK];
    i64 first = (i64)blockIdx.x * TITAN_MOE_CHUNK;
    int len = moe_load_chunk(chunk, experts, first, n);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        u32 r = bases[(i64)blockIdx.x * E + e];
        for (int i = 0; i < len; ++i) {
            if (chunk[i] != (u32)e) continue;
            i64 slot = first + i;
            rows[r] = (u32)(slot / K);
            slots[r] = (u32)slot;
            row_of_slot[slot] = r;
            ++r;
        }
    }
}

// The combine, one block per token: out[t] += rows[r] for the token's K rows (`row_of_slot`) in
// increasing r, each thread a column: the CPU's order, no atomics.
extern "C" __global__ void moe_combine(float* out, const float* rows, const u32* row_of_slot,
                                       int K, int width) {
    i64 t = blockIdx.x;
    u32 order[TITAN_MOE_MAX_TOP_K];
    for (int j = 0; j < K; ++j) {
        u32 r = row_of_slot[t * K + j];
        int i = j;
        for (; i > 0 && order[i - 1] > r; --i) order[i] = order[i - 1];
        order[i] = r;
    }
    float* o = out + t * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float acc = o[c];
        for (int j = 0; j < K; ++j) acc += rows[(i64)order[j] * width + c];
        o[c] = acc;
    }
}

// A step's expert load: counts[at + e] += offsets[e + 1] - offsets[e], one thread per expert.
extern "C" __global__ void moe_count_load(float* counts, const u32* offsets, i64 at, int E) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < E) counts[at + e] += (float)(offsets[e + 1] - offsets[e]);
}
