// Causal grouped-query attention in the flash-attention manner: keys are visited in tiles of 32 with
// an online softmax, the log-sum-exp of each query row is saved, and no [seq, seq] matrix is ever
// stored. One warp owns one query row (forward, dQ) or one key row (dK, dV): lane j scores key (or
// query) j of the tile, then the lanes switch to splitting head_dim to accumulate the output row.
// The backward recomputes the probabilities from the saved log-sum-exp and needs no atomics, so it
// is deterministic.
//
// Layouts: q, out, dout [batch, q_len, n_heads, head_dim]; k, v [batch, kv_cap, n_kv_heads, head_dim];
// lse, delta [batch, n_heads, q_len]. head_dim <= TITAN_ATTN_MAX_D.
//
// The mask (backend::AttnMask): query i, at key index q_offset + i, sees the keys from
// attn_first_key(i) to itself. doc_pos (null: none) holds each query's position in its document
// [batch, q_len], so it sees nothing before its document's start; window (0: none) limits it to its
// last `window` keys. First keys never move back from query to query, so the key-major dK/dV pass
// stops at the first query that cannot see its key. A query that sees no key (a block of ring
// attention wholly before its document) gets a zero output and a log-sum-exp of -inf.

#define TITAN_ATTN_WARPS 4
#define TITAN_ATTN_MAX_D 256
#define TITAN_ATTN_PER_LANE (TITAN_ATTN_MAX_D / 32)

__device__ __forceinline__ float dot_shared_global(const float* a, const float* b, int d) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc += a[c] * b[c];
    return acc;
}

// acc[c] (this lane's dims lane + 32c) += sum over the tile's keys jj of weight_jj · row_jj[d], where
// lane jj holds weight_jj and row_jj starts at base + (j0 + jj) · stride.
__device__ __forceinline__ void warp_accumulate_rows(float* acc, float weight, const float* base,
                                                     int j0, int width, i64 stride, int head_dim,
                                                     int lane) {
    for (int jj = 0; jj < width; ++jj) {
        float w = __shfl_sync(TITAN_FULL_MASK, weight, jj);
        const float* row = base + (i64)(j0 + jj) * stride;
#pragma unroll
        for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) {
            int d = lane + 32 * c;
            if (d < head_dim) acc[c] += w * row[d];
        }
    }
}

__device__ __forceinline__ int attn_first_key(const unsigned* doc_pos, int window, int b, int q_len,
                                               int q_offset, int i) {
    int at = q_offset + i, first = 0;
    if (doc_pos) first = max(at - (int)doc_pos[(i64)b * q_len + i], 0);
    if (window > 0) first = max(first, at + 1 - window);
    return first;
}

extern "C" __global__ void attention_forward(float* out, float* lse, const float* q, const float* k,
                                             const float* v, int q_len, int kv_len, int kv_cap,
                                             int n_heads, int n_kv_heads, int head_dim, int q_offset,
                                             float scale, const unsigned* doc_pos, int window) {
    __shared__ float q_rows[TITAN_ATTN_WARPS][TITAN_ATTN_MAX_D];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = blockIdx.x * TITAN_ATTN_WARPS + warp;
    int h = blockIdx.y, b = blockIdx.z;
    if (i >= q_len) return;
    int kvh = h / (n_heads / n_kv_heads);
    const float* qi = q + (((i64)b * q_len + i) * n_heads + h) * head_dim;
    float* qs = q_rows[warp];
    for (int c = lane; c < head_dim; c += 32) qs[c] = qi[c];
    __syncwarp();
    int n_keys = min(q_offset + i + 1, kv_len);
    int first = attn_first_key(doc_pos, window, b, q_len, q_offset, i);
    i64 kv_stride = (i64)n_kv_heads * head_dim;
    const float* kb = k + (i64)b * kv_cap * kv_stride + (i64)kvh * head_dim;
    const float* vb = v + (i64)b * kv_cap * kv_stride + (i64)kvh * head_dim;
    float acc[TITAN_ATTN_PER_LANE];
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) acc[c] = 0.0f;
    float row_max = TITAN_NEG_INF, row_sum = 0.0f;
    for (int j0 = first; j0 < n_keys; j0 += 32) {
        int j = j0 + lane;
        float s = TITAN_NEG_INF;
        if (j < n_keys) s = dot_shared_global(qs, kb + (i64)j * kv_stride, head_dim) * scale;
        float new_max = fmaxf(row_max, warp_max(s));
        float correction = row_max == TITAN_NEG_INF ? 0.0f : expf(row_max - new_max);
        float p = j < n_keys ? expf(s - new_max) : 0.0f;
        row_sum = row_sum * correction + warp_sum(p);
        row_max = new_max;
#pragma unroll
        for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) acc[c] *= correction;
        warp_accumulate_rows(acc, p, vb, j0, min(32, n_keys - j0), kv_stride, head_dim, lane);
    }
    float inv = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    float* oi = out + (((i64)b * q_len + i) * n_heads + h) * head_dim;
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) {
        int d = lane + 32 * c;
        if (d < head_dim) oi[d] = acc[c] * inv;
    }
    if (lane == 0) lse[((i64)b * n_heads + h) * q_len + i] = row_max + logf(row_sum);
}

// delta[b,h,i] = dot(dout_i, out_i): the row term of the softmax backward.
extern "C" __global__ void attention_backward_delta(float* delta, const float* dout, const float* out,
                                                    int q_len, int n_heads, int head_dim) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = blockIdx.x * TITAN_ATTN_WARPS + warp;
    int h = blockIdx.y, b = blockIdx.z;
    if (i >= q_len) return;
    i64 row = (((i64)b * q_len + i) * n_heads + h) * head_dim;
    float acc = 0.0f;
    for (int d = lane; d < head_dim; d += 32) acc += dout[row + d] * out[row + d];
    acc = warp_sum(acc);
    if (lane == 0) delta[((i64)b * n_heads + h) * q_len + i] = acc;
}

// dq_i = scale * sum_j p_ij (dp_ij - delta_i) k_j, with p_ij = exp(q_i.k_j * scale - lse_i) and
// dp_ij = dout_i . v_j. One warp per query row; overwrites dq.
extern "C" __global__ void attention_backward_dq(float* dq, const float* dout, const float* q,
                                                 const float* k, const float* v, const float* lse,
                                                 const float* delta, int q_len, int kv_len,
                                                 int q_offset, int n_heads, int n_kv_heads,
                                                 int head_dim, float scale, const unsigned* doc_pos,
                                                 int window) {
    __shared__ float q_rows[TITAN_ATTN_WARPS][TITAN_ATTN_MAX_D];
    __shared__ float do_rows[TITAN_ATTN_WARPS][TITAN_ATTN_MAX_D];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = blockIdx.x * TITAN_ATTN_WARPS + warp;
    int h = blockIdx.y, b = blockIdx.z;
    if (i >= q_len) return;
    int kvh = h / (n_heads / n_kv_heads);
    i64 row = (((i64)b * q_len + i) * n_heads + h) * head_dim;
    float* qs = q_rows[warp];
    float* dos = do_rows[warp];
    for (int c = lane; c < head_dim; c += 32) {
        qs[c] = q[row + c];
        dos[c] = dout[row + c];
    }
    __syncwarp();
    i64 stat = ((i64)b * n_heads + h) * q_len + i;
    float row_lse = lse[stat], row_delta = delta[stat];
    i64 kv_stride = (i64)n_kv_heads * head_dim;
    const float* kb = k + (i64)b * kv_len * kv_stride + (i64)kvh * head_dim;
    const float* vb = v + (i64)b * kv_len * kv_stride + (i64)kvh * head_dim;
    float acc[TITAN_ATTN_PER_LANE];
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) acc[c] = 0.0f;
    int n_keys = min(q_offset + i + 1, kv_len);
    int first = attn_first_key(doc_pos, window, b, q_len, q_offset, i);
    for (int j0 = first; j0 < n_keys; j0 += 32) {
        int j = j0 + lane;
        float ds = 0.0f;
        if (j < n_keys) {
            float p = expf(dot_shared_global(qs, kb + (i64)j * kv_stride, head_dim) * scale - row_lse);
            float dp = dot_shared_global(dos, vb + (i64)j * kv_stride, head_dim);
            ds = p * (dp - row_delta) * scale;
        }
        warp_accumulate_rows(acc, ds, kb, j0, min(32, n_keys - j0), kv_stride, head_dim, lane);
    }
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) {
        int d = lane + 32 * c;
        if (d < head_dim) dq[row + d] = acc[c];
    }
}

// dv_j = sum over the group's heads and i >= j of p_ij dout_i; dk_j = scale * sum p_ij (dp_ij -
// delta_i) q_i. One warp per key row of one kv head; overwrites dk and dv.
extern "C" __global__ void attention_backward_dkdv(float* dk, float* dv, const float* dout,
                                                   const float* q, const float* k, const float* v,
                                                   const float* lse, const float* delta,
                                                   int q_len, int kv_len, int q_offset, int n_heads,
                                                   int n_kv_heads, int head_dim, float scale,
                                                   const unsigned* doc_pos, int window) {
    __shared__ float k_rows[TITAN_ATTN_WARPS][TITAN_ATTN_MAX_D];
    __shared__ float v_rows[TITAN_ATTN_WARPS][TITAN_ATTN_MAX_D];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j = blockIdx.x * TITAN_ATTN_WARPS + warp;
    int kvh = blockIdx.y, b = blockIdx.z;
    if (j >= kv_len) return;
    i64 kv_row = (((i64)b * kv_len + j) * n_kv_heads + kvh) * head_dim;
    float* ks = k_rows[warp];
    float* vs = v_rows[warp];
    for (int c = lane; c < head_dim; c += 32) {
        ks[c] = k[kv_row + c];
        vs[c] = v[kv_row + c];
    }
    __syncwarp();
    float acc_k[TITAN_ATTN_PER_LANE], acc_v[TITAN_ATTN_PER_LANE];
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) acc_k[c] = acc_v[c] = 0.0f;
    int group = n_heads / n_kv_heads;
    i64 q_stride = (i64)n_heads * head_dim;
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const float* qb = q + (i64)b * q_len * q_stride + (i64)h * head_dim;
        const float* dob = dout + (i64)b * q_len * q_stride + (i64)h * head_dim;
        const float* lse_h = lse + ((i64)b * n_heads + h) * q_len;
        const float* delta_h = delta + ((i64)b * n_heads + h) * q_len;
        // Query i (at position q_offset + i) sees key j from i = j - q_offset on, up to the first
        // query whose document (or window) starts after j.
        for (int i0 = max(j - q_offset, 0);
             i0 < q_len && attn_first_key(doc_pos, window, b, q_len, q_offset, i0) <= j; i0 += 32) {
            int i = i0 + lane;
            float p = 0.0f, ds = 0.0f;
            if (i < q_len && attn_first_key(doc_pos, window, b, q_len, q_offset, i) <= j) {
                p = expf(dot_shared_global(ks, qb + (i64)i * q_stride, head_dim) * scale - lse_h[i]);
                float dp = dot_shared_global(vs, dob + (i64)i * q_stride, head_dim);
                ds = p * (dp - delta_h[i]) * scale;
            }
            int width = min(32, q_len - i0);
            for (int ii = 0; ii < width; ++ii) {
                float pi = __shfl_sync(TITAN_FULL_MASK, p, ii);
                float dsi = __shfl_sync(TITAN_FULL_MASK, ds, ii);
                const float* qi = qb + (i64)(i0 + ii) * q_stride;
                const float* doi = dob + (i64)(i0 + ii) * q_stride;
#pragma unroll
                for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) {
                    int d = lane + 32 * c;
                    if (d < head_dim) {
                        acc_v[c] += pi * doi[d];
                        acc_k[c] += dsi * qi[d];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < TITAN_ATTN_PER_LANE; ++c) {
        int d = lane + 32 * c;
        if (d < head_dim) {
            dk[kv_row + d] = acc_k[c];
            dv[kv_row + d] = acc_v[c];
        }
    }
}

// Ring attention's merge of a block of keys into the running result: per query row,
// lse' = log(e^lse + e^part_lse) and out' = out·e^(lse − lse') + part_out·e^(part_lse − lse').
// One thread per (batch, query, head) row.
extern "C" __global__ void attention_merge(float* out, float* lse, const float* part_out,
                                           const float* part_lse, int batch, int q_len, int n_heads,
                                           int head_dim) {
    i64 row = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= (i64)batch * q_len * n_heads) return;
    int h = (int)(row % n_heads);
    i64 bi = row / n_heads;
    int i = (int)(bi % q_len), b = (int)(bi / q_len);
    i64 at = ((i64)b * n_heads + h) * q_len + i;
    float mine = lse[at], theirs = part_lse[at];
    float merged = fmaxf(mine, theirs) + log1pf(expf(-fabsf(mine - theirs)));
    float keep = expf(mine - merged), take = expf(theirs - merged);
    float* o = out + row * head_dim;
    const float* p = part_out + row * head_dim;
    for (int d = 0; d < head_dim; ++d) o[d] = o[d] * keep + p[d] * take;
    lse[at] = merged;
}

// Attention sinks (gpt-oss) folded into a finished attention: per query row,
// lse' = log(e^lse + e^sinks[h]) and out' = out·e^(lse − lse') (attention_merge with an empty block
// of logit sinks[h]). A row that saw no key (lse −inf) keeps its zero output. One thread per
// (batch, query, head) row.
extern "C" __global__ void attention_sinks(float* out, float* lse, const float* sinks, int batch,
                                           int q_len, int n_heads, int head_dim) {
    i64 row = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= (i64)batch * q_len * n_heads) return;
    int h = (int)(row % n_heads);
    i64 bi = row / n_heads;
    int i = (int)(bi % q_len), b = (int)(bi / q_len);
    i64 at = ((i64)b * n_heads + h) * q_len + i;
    float mine = lse[at], sink = sinks[h];
    float merged = fmaxf(mine, sink) + log1pf(expf(-fabsf(mine - sink)));
    float keep = expf(mine - merged);
    float* o = out + row * head_dim;
    for (int d = 0; d < head_dim; ++d) o[d] *= keep;
    lse[at] = merged;
}

// The sinks' gradient, added into dsinks: dsinks[h] -= Σ_rows e^(sinks[h] − lse')·(dout·out') over
// the rows of head h. One block of ATTN_SINK_THREADS per head, its threads striding over the rows,
// summed in shared memory.
#define ATTN_SINK_THREADS 256
extern "C" __global__ void attention_sinks_grad(float* dsinks, const float* dout, const float* out,
                                                const float* lse, const float* sinks, int batch,
                                                int q_len, int n_heads, int head_dim) {
    __shared__ float part[ATTN_SINK_THREADS];
    int h = blockIdx.x;
    float acc = 0.0f;
    for (i64 r = threadIdx.x; r < (i64)batch * q_len; r += blockDim.x) {
        int b = (int)(r / q_len), i = (int)(r % q_len);
        i64 row = (r * n_heads + h) * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += dout[row + d] * out[row + d];
        acc += expf(sinks[h] - lse[((i64)b * n_heads + h) * q_len + i]) * dot;
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = ATTN_SINK_THREADS / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsinks[h] -= part[0];
}
