// Causal grouped-query attention on tensor cores, for the training shape (queries and keys the same
// sequence) with head_dim 64 or 128, used when GEMMs run in bf16. With documents (`doc_pos`, each
// query's position in its document, [batch, seq]; null: one document per sequence) a query sees
// only the keys of its own document: the forward and dQ passes start at their first query's
// document (first keys never decrease from query to query), the dK/dV pass stops after the last
// query of its last key's document, and only tiles a document boundary or the diagonal crosses are
// masked. The fused backward takes no documents (the host runs the split passes for them). The operands of every product are
// bf16 and multiplied by `mma.sync.m16n8k16` with fp32 accumulation; the online softmax, the saved
// log-sum-exp and every accumulator stay fp32 (the forward's row sums are of the bf16-rounded P
// that multiplies V, added up by one more MMA per tile). Same layouts and results (to bf16 precision) as
// attention.cu, same flash-attention structure: tiles of 64 keys (or queries) staged in shared
// memory, no [seq, seq] matrix, a backward that recomputes the probabilities and needs no atomics
// (a fused one-pass backward with atomic dQ additions is the opt-in alternative, at the end).
//
// A block is 4 warps (8 in the fused backward's `w8` kernels); each warp owns 16 rows (queries in
// the forward and dQ, keys in dK/dV), or in the head_dim 64 forward 32 rows, so each B fragment
// loaded from shared memory feeds twice the MMAs (`attention_forward_tc64x2`: 128 queries per
// block, 255 registers, no spills). The
// fragments follow PTX's m16n8k16 layout: with g = lane / 4 and t = lane % 4, a thread holds rows g
// and g + 8 and columns 2t, 2t + 1 (+ 8) of A, rows 2t, 2t + 1 (+ 8) of column g of B, and columns
// 2t, 2t + 1 of rows g, g + 8 of C. A product's C fragments are repacked as the next product's A
// fragments (the probabilities P feed P·V without leaving registers); B fragments come from shared
// memory by ldmatrix.
//
// Inputs are bf16 copies (the host rounds q, k, v and dout once per call): tiles then stream into
// shared memory by cp.async, two stages deep for head_dim 64 so the next tile loads while this one
// is multiplied (head_dim 128 has room for one stage under the 48 KiB static limit; the fused
// backward takes dynamic shared memory above it). Shared tiles
// are bf16, row-major, rows padded by 8 elements so that the 8 rows of an ldmatrix fall on
// distinct banks. Needs sm_80 or newer; older devices trap (the host never
// launches these there).

#define TITAN_TC_ROWS 64
// A first key below every key (no document start to respect).
#define TITAN_TC_NO_FIRST (-(1 << 30))
// Threads per block of every kernel but the fused `w8` ones (4 warps of 16 rows); the host
// launches exactly this many.
#define TITAN_TC_THREADS 128

// Row `r`, columns c and c + 1 of a global bf16 matrix (zero past `rows`).
__device__ __forceinline__ u32 global_pair(const bf16_bits* base, i64 stride, int r, int rows,
                                           int c) {
    if (r >= rows) return 0u;
    return *(const u32*)(base + (i64)r * stride + c);
}

// N C fragments (accumulators) set to zero.
template <int N>
__device__ __forceinline__ void zero_fragments(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

// The dK/dV and fused passes visit (head, query tile) pairs in order, the query tiles of one head
// of the group after another: this counts them instead of dividing.
struct QueryTileCursor {
    int head = 0, tile = 0;
    // The next pair's head (within the group) and tile; `tiles` per head.
    __device__ __forceinline__ void next(int tiles, int& head_out, int& tile_out) {
        head_out = head;
        tile_out = tile;
        if (++tile == tiles) {
            tile = 0;
            ++head;
        }
    }
};

// Rows r0 .. r0 + ROWS - 1 of a global bf16 matrix into a shared tile, queued as 16-byte cp.async
// copies (visible after async_wait and a barrier); rows past `rows` are zero. Every block of a
// kernel has THREADS threads, so each thread's copies are known at compile time.
template <int D, int THREADS = TITAN_TC_THREADS, int ROWS = TITAN_TC_ROWS>
__device__ __forceinline__ void load_tile(bf16_bits* s, const bf16_bits* base, i64 stride, int r0,
                                          int rows) {
    constexpr int S = D + 8, CHUNKS = D / 8, ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(ROWS % ROWS_PER_PASS == 0, "whole copies per thread");
    int r = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * 8;
    u32 dst = shared_address(s + r * S + c);
    const bf16_bits* src = base + (i64)(r0 + r) * stride + c;
    if (r0 + ROWS <= rows) {
        // Every tile but the sequence's last: no row to check.
#pragma unroll
        for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i)
            copy_async_16(dst + (u32)(i * ROWS_PER_PASS * S) * 2,
                          src + (i64)i * ROWS_PER_PASS * stride, true);
        return;
    }
#pragma unroll
    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
        bool inside = r0 + r + i * ROWS_PER_PASS < rows;
        const bf16_bits* row = src + (i64)i * ROWS_PER_PASS * stride;
        copy_async_16(dst + (u32)(i * ROWS_PER_PASS * S) * 2, inside ? row : base, inside);
    }
}

// Key tile `tile` of K and V into shared buffer `buf` (the forward's and dQ pass's pipeline stage),
// committed as one cp.async group.
template <int D>
__device__ __forceinline__ void stage_keys_values(bf16_bits* ks, bf16_bits* vs, const bf16_bits* kb,
                                                  const bf16_bits* vb, i64 kv_stride, int tile,
                                                  int buf, int seq) {
    constexpr int TILE = TITAN_TC_ROWS * (D + 8);
    load_tile<D>(ks + buf * TILE, kb, kv_stride, tile * TITAN_TC_ROWS, seq);
    load_tile<D>(vs + buf * TILE, vb, kv_stride, tile * TITAN_TC_ROWS, seq);
    async_commit();
}

// acc[M][8][4] = A · Bᵀ over D for M 16-row blocks of A (fragments in registers), Bᵀ the 64-row
// shared tile; one ldmatrix brings the B fragments of two n-tiles, used by all M blocks (so more
// rows per warp read the tile fewer times). Addresses are one per-lane base plus constants.
template <int D, int M = 1>
__device__ __forceinline__ void product_with_tile_rows(float (*acc)[8][4], const u32 (*a)[D / 16][4],
                                                       const bf16_bits* tile) {
    constexpr int S = D + 8;
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    u32 lane_row = shared_address(tile + ((m >> 1) * 8 + r) * S + (m & 1) * 8);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][2 * np][e] = acc[mt][2 * np + 1][e] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 b[4];
            load_matrices<false>(b, lane_row + (u32)(np * 16 * S + kk * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                const u32* f = a[mt][kk];
                mma_bf16(acc[mt][2 * np], f[0], f[1], f[2], f[3], b[0], b[1]);
                mma_bf16(acc[mt][2 * np + 1], f[0], f[1], f[2], f[3], b[2], b[3]);
            }
        }
    }
}

// bf16 1.0 in both halves: a B fragment of ones, so that one more MMA adds up P's rows.
#define TITAN_BF16X2_ONES 0x3f803f80u

// out[M][D/8][4] += P · tile for M 16-row blocks, P the 16x64 C fragments `p[mt]` of an earlier
// product (repacked as A), tile a 64-row shared tile used as B (its rows are the shared dimension);
// one transposing ldmatrix brings the B fragments of two d-tiles for all M blocks. With `row_sums`,
// also row_sums[mt] += P · ones: every column of that C fragment is the row's sum of the same
// bf16-rounded P, on the tensor cores instead of 32 additions and 4 shuffles per row pair.
template <int D, int M = 1>
__device__ __forceinline__ void accumulate_times_tile(float (*out)[D / 8][4], float (*p)[8][4],
                                                      const bf16_bits* tile,
                                                      float (*row_sums)[4] = nullptr) {
    constexpr int S = D + 8;
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    u32 lane_row = shared_address(tile + ((m & 1) * 8 + r) * S + (m >> 1) * 8);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        u32 a[M][4];
#pragma unroll
        for (int mt = 0; mt < M; ++mt) {
            a[mt][0] = pack_bf16(p[mt][2 * kk][0], p[mt][2 * kk][1]);
            a[mt][1] = pack_bf16(p[mt][2 * kk][2], p[mt][2 * kk][3]);
            a[mt][2] = pack_bf16(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
            a[mt][3] = pack_bf16(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b[4];
            load_matrices<true>(b, lane_row + (u32)(kk * 16 * S + dp * 16) * 2);
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                mma_bf16(out[mt][2 * dp], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[0], b[1]);
                mma_bf16(out[mt][2 * dp + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[2], b[3]);
            }
        }
        if (row_sums) {
#pragma unroll
            for (int mt = 0; mt < M; ++mt)
                mma_bf16(row_sums[mt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], TITAN_BF16X2_ONES,
                         TITAN_BF16X2_ONES);
        }
    }
}

// A fragments of rows r, r + 8 (this thread's g rows) of a global bf16 matrix, over D columns.
template <int D>
__device__ __forceinline__ void load_row_fragments(u32 (*a)[4], const bf16_bits* base, i64 stride, int r,
                                                   int rows, int t) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        int c = kk * 16 + 2 * t;
        a[kk][0] = global_pair(base, stride, r, rows, c);
        a[kk][1] = global_pair(base, stride, r + 8, rows, c);
        a[kk][2] = global_pair(base, stride, r, rows, c + 8);
        a[kk][3] = global_pair(base, stride, r + 8, rows, c + 8);
    }
}

// Writes C fragments acc[D/8][4] (rows r, r + 8) to a global fp32 matrix, times row factors, and
// their bf16 rounding to the same positions of `base16` when it is not null.
template <int D>
__device__ __forceinline__ void store_row_fragments(float* base, i64 stride, int r, int rows, int t,
                                                    const float (*acc)[4], float f0, float f1,
                                                    bf16_bits* base16 = nullptr) {
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        int c = dn * 8 + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int row = r + 8 * half;
            if (row >= rows) continue;
            float f = half ? f1 : f0, lo = acc[dn][2 * half] * f, hi = acc[dn][2 * half + 1] * f;
            base[(i64)row * stride + c] = lo;
            base[(i64)row * stride + c + 1] = hi;
            if (base16) *(u32*)(base16 + (i64)row * stride + c) = bf16_pair(lo, hi);
        }
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(TITAN_FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(TITAN_FULL_MASK, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(TITAN_FULL_MASK, v, 1);
    return v + __shfl_xor_sync(TITAN_FULL_MASK, v, 2);
}

// The query tile of a forward or dQ block. Later queries see more keys, so the grid hands them out
// first (blocks start roughly in index order) and the short tiles fill the end of the launch
// instead of leaving a few long ones running alone.
__device__ __forceinline__ int longest_first_query_tile() { return gridDim.x - 1 - blockIdx.x; }

// Stages of the tile pipelines: two for head_dim 64, one for 128 (shared memory).
#define TITAN_TC_STAGES(D) ((D) <= 64 ? 2 : 1)

// The tile pipeline around the use of tile `it` of `n_tiles`: `stage(i, buffer)` queues tile i into
// buffer 0 or 1 and commits it. With two stages the next tile loads while this one is used; with
// one, after it. `tile_begin` returns the buffer holding tile `it`, ready for every warp.
template <int STAGES, typename Stage>
__device__ __forceinline__ int tile_begin(Stage& stage, int it, int n_tiles) {
    int cur = STAGES == 2 ? (it & 1) : 0;
    if (STAGES == 2 && it + 1 < n_tiles) {
        stage(it + 1, cur ^ 1);
        async_wait<1>();
    } else {
        async_wait<0>();
    }
    __syncthreads();
    return cur;
}

template <int STAGES, typename Stage>
__device__ __forceinline__ void tile_end(Stage& stage, int it, int n_tiles) {
    __syncthreads();
    if (STAGES == 1 && it + 1 < n_tiles) stage(it + 1, 0);
}

// log2(e): the softmax runs in base 2, so each probability is one fused multiply-add and one
// exp2 (scores times scale·log2(e), minus the row's maximum or log-sum-exp in the same units).
#define TITAN_LOG2E 1.4426950408889634f

// Causal visibility inside the diagonal tile (the one tile whose keys and queries overlap; every
// earlier tile is wholly visible, so only this one pays for a mask). `row` and `col` are positions
// within the 64-row tile: keys at or before the query are visible.
__device__ __forceinline__ bool visible_on_diagonal(int query_in_tile, int key_in_tile) {
    return key_in_tile <= query_in_tile;
}

// The same with documents: a key sees its query when it is at or before it and at or after the
// query's first key (`first_in_tile`, in the same coordinates; without documents at or below 0).
__device__ __forceinline__ bool visible_in_tile(int query_in_tile, int first_in_tile,
                                                int key_in_tile) {
    return key_in_tile <= query_in_tile && key_in_tile >= first_in_tile;
}

// Two rows' first keys (a thread's rows g and g + 8), relative to a tile.
struct FirstKeys {
    int x, y;
};

// The first key query `i` of sequence `b` sees: its document's start (0 without documents); a row
// past `seq` (never stored) takes the last query's.
__device__ __forceinline__ int tc_first_key(const unsigned* doc_pos, int b, int seq, int i) {
    if (!doc_pos) return 0;
    i = min(i, seq - 1);
    return i - (int)doc_pos[(i64)b * seq + i];
}

// How far (in base-2 exponent) a row's maximum may grow past the reference its probabilities are
// taken against before the output is rescaled: probabilities then stay below 2^8, harmless in fp32
// and bf16, and most tiles after the first few skip the rescaling altogether.
#define TITAN_RESCALE_SLACK_LOG2 8.0f

// One tile of the forward's online softmax for this thread's rows g and g + 8 (`row_in_tile` is
// row g's position in the tile): turns the raw scores s into unnormalised probabilities in place,
// exp2((s - m)·scale·log2e) against each row's reference maximum m (raw-score units). m moves to
// the row maximum only when that is more than TITAN_RESCALE_SLACK_LOG2 above it, and then the output
// o and the row sums (accumulated by the P·V products, see accumulate_times_tile) are rescaled;
// the decision is made for the whole warp, so a warp whose rows all stay within the slack skips
// the rescaling's multiplications and exponentials. `slack` is the slack in raw-score units.
template <int D, bool DIAGONAL>
__device__ __forceinline__ void online_softmax_tile(float (*s)[4], float (*o)[4], float* sums,
                                                    float& m0, float& m1, float scale_log2,
                                                    float slack, int row_in_tile, FirstKeys first,
                                                    int t) {
    float mx0 = TITAN_NEG_INF, mx1 = TITAN_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (DIAGONAL) {
                int c = nt * 8 + 2 * t + e;
                if (!visible_in_tile(row_in_tile, first.x, c)) s[nt][e] = TITAN_NEG_INF;
                if (!visible_in_tile(row_in_tile + 8, first.y, c)) s[nt][2 + e] = TITAN_NEG_INF;
            }
            mx0 = fmaxf(mx0, s[nt][e]);
            mx1 = fmaxf(mx1, s[nt][2 + e]);
        }
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
    // A row without a reference yet (m = -inf) takes its first visible maximum; -inf + slack stays
    // -inf, so a row that still sees no key keeps m = -inf.
    bool grow = mx0 > m0 + slack || mx1 > m1 + slack;
    if (__any_sync(TITAN_FULL_MASK, grow)) {
        float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
        // exp2(-inf) = 0 clears a row's (empty) past; a row still at -inf multiplies by 1.
        float corr0 = new0 == TITAN_NEG_INF ? 1.0f : exp2_approx((m0 - new0) * scale_log2);
        float corr1 = new1 == TITAN_NEG_INF ? 1.0f : exp2_approx((m1 - new1) * scale_log2);
        m0 = new0;
        m1 = new1;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            o[dn][0] *= corr0;
            o[dn][1] *= corr0;
            o[dn][2] *= corr1;
            o[dn][3] *= corr1;
        }
        sums[0] *= corr0;
        sums[1] *= corr0;
        sums[2] *= corr1;
        sums[3] *= corr1;
    }
    // A row with no visible key yet keeps max -inf; subtracting 0 then keeps exp2 at 0, not NaN.
    float base0 = m0 == TITAN_NEG_INF ? 0.0f : m0 * scale_log2;
    float base1 = m1 == TITAN_NEG_INF ? 0.0f : m1 * scale_log2;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[nt][e] = exp2_approx(fmaf(s[nt][e], scale_log2, -base0));
            s[nt][2 + e] = exp2_approx(fmaf(s[nt][2 + e], scale_log2, -base1));
        }
    }
}

// One block per 64·M queries of one head: 4 warps of 16·M rows (M = 2 halves the shared-memory
// reads per MMA at the cost of registers; head_dim 64 only).
template <int D, int M>
__device__ __forceinline__ void attention_forward_tc(float* out, bf16_bits* out16, float* lse,
                                                     const bf16_bits* q, const bf16_bits* k,
                                                     const bf16_bits* v, int seq, int n_heads,
                                                     int n_kv_heads, float scale,
                                                     const unsigned* doc_pos) {
    constexpr int S = D + 8, TILE = TITAN_TC_ROWS * S, STAGES = TITAN_TC_STAGES(D);
    constexpr int WARP_ROWS = 16 * M, BLOCK_ROWS = TITAN_TC_ROWS * M;
    __shared__ __align__(16) bf16_bits ks[STAGES * TILE];
    __shared__ __align__(16) bf16_bits vs[STAGES * TILE];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int q0 = longest_first_query_tile() * BLOCK_ROWS, h = blockIdx.y, b = blockIdx.z;
    int kvh = h / (n_heads / n_kv_heads);
    i64 q_stride = (i64)n_heads * D, kv_stride = (i64)n_kv_heads * D;
    const bf16_bits* kb = k + (i64)b * seq * kv_stride + (i64)kvh * D;
    const bf16_bits* vb = v + (i64)b * seq * kv_stride + (i64)kvh * D;
    // Row g of block mt of this warp is warp_row + 16·mt + g (and + 8).
    int warp_row = q0 + warp * WARP_ROWS;
    float scale_log2 = scale * TITAN_LOG2E, slack = TITAN_RESCALE_SLACK_LOG2 / scale_log2;
    u32 qa[M][D / 16][4];
    // Per 16-row block: the output, each row's reference maximum, and the row sums of P (every
    // column of the C fragment holds its row's sum).
    float o[M][D / 8][4], sums[M][4];
    float m0[M], m1[M];
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
        load_row_fragments<D>(qa[mt], q + (i64)b * seq * q_stride + (i64)h * D, q_stride,
                              warp_row + 16 * mt + g, seq, t);
        zero_fragments<D / 8>(o[mt]);
        m0[mt] = m1[mt] = TITAN_NEG_INF;
        sums[mt][0] = sums[mt][1] = sums[mt][2] = sums[mt][3] = 0.0f;
    }
    // Key tiles from the block's first query's document up to the block's last query. Keys past
    // `seq` (zero-filled) only fall in tiles that overlap the block's queries, after every valid
    // query, so the causal mask hides them.
    int n_tiles = (min(seq, q0 + BLOCK_ROWS) + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS;
    int first_tile = tc_first_key(doc_pos, b, seq, q0) / TITAN_TC_ROWS;
    // The warp's earliest and latest first keys (its first and last rows'), and each row's.
    int warp_first = tc_first_key(doc_pos, b, seq, warp_row);
    int warp_last_first = tc_first_key(doc_pos, b, seq, warp_row + WARP_ROWS - 1);
    FirstKeys row_first[M];
#pragma unroll
    for (int mt = 0; mt < M; ++mt)
        row_first[mt] = FirstKeys{tc_first_key(doc_pos, b, seq, warp_row + 16 * mt + g),
                                  tc_first_key(doc_pos, b, seq, warp_row + 16 * mt + g + 8)};
    int visits = n_tiles - first_tile;
    auto stage = [&](int i, int buf) {
        stage_keys_values<D>(ks, vs, kb, vb, kv_stride, first_tile + i, buf, seq);
    };
    stage(0, 0);
    for (int it = 0; it < visits; ++it) {
        int cur = tile_begin<STAGES>(stage, it, visits);
        int j0 = (first_tile + it) * TITAN_TC_ROWS;
        // A warp whose rows all precede the tile, or whose documents all start after it, sees
        // none of it; one whose rows all follow it within their documents sees all of it;
        // otherwise the diagonal or a document start crosses the tile and it is masked. Without
        // documents and with M = 1 only the last tile is masked and no warp skips one.
        bool seen = (M == 1 || j0 < warp_row + WARP_ROWS) && j0 + TITAN_TC_ROWS > warp_first;
        if (seen) {
            float s[M][8][4];
            product_with_tile_rows<D, M>(s, qa, ks + cur * TILE);
            bool crossed = M == 1 ? it + 1 == visits : j0 + TITAN_TC_ROWS - 1 > warp_row;
            bool masked = crossed || j0 < warp_last_first;
#pragma unroll
            for (int mt = 0; mt < M; ++mt) {
                int row_in_tile = warp_row + 16 * mt + g - j0;
                FirstKeys first{row_first[mt].x - j0, row_first[mt].y - j0};
                if (masked)
                    online_softmax_tile<D, true>(s[mt], o[mt], sums[mt], m0[mt], m1[mt],
                                                 scale_log2, slack, row_in_tile, first, t);
                else
                    online_softmax_tile<D, false>(s[mt], o[mt], sums[mt], m0[mt], m1[mt],
                                                  scale_log2, slack, row_in_tile, first, t);
            }
            accumulate_times_tile<D, M>(o, s, vs + cur * TILE, sums);
        }
        tile_end<STAGES>(stage, it, visits);
    }
    float* ob = out + (i64)b * seq * q_stride + (i64)h * D;
    bf16_bits* ob16 = out16 ? out16 + (i64)b * seq * q_stride + (i64)h * D : nullptr;
#pragma unroll
    for (int mt = 0; mt < M; ++mt) {
        int r0 = warp_row + 16 * mt + g, r1 = r0 + 8;
        float l0 = sums[mt][0], l1 = sums[mt][2];
        store_row_fragments<D>(ob, q_stride, r0, seq, t, o[mt], 1.0f / l0, 1.0f / l1, ob16);
        if (t == 0) {
            float* lb = lse + ((i64)b * n_heads + h) * seq;
            if (r0 < seq) lb[r0] = m0[mt] * scale + logf(l0);
            if (r1 < seq) lb[r1] = m1[mt] * scale + logf(l1);
        }
    }
}

// The dQ pass's scores → dS/scale for one key tile, in place in s: p = exp2(s·scale·log2e − lse
// in base 2), dS = p (dP − delta). The caller applies `scale` once, to dQ.
template <bool DIAGONAL>
__device__ __forceinline__ void dq_scores_to_ds(float (*s)[4], const float (*dp)[4],
                                                float scale_log2, float lse2_0, float lse2_1,
                                                float dl0, float dl1, int row_in_tile, FirstKeys first,
                                                int t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float p0 = exp2_approx(fmaf(s[nt][e], scale_log2, -lse2_0));
            float p1 = exp2_approx(fmaf(s[nt][2 + e], scale_log2, -lse2_1));
            if (DIAGONAL) {
                int c = nt * 8 + 2 * t + e;
                if (!visible_in_tile(row_in_tile, first.x, c)) p0 = 0.0f;
                if (!visible_in_tile(row_in_tile + 8, first.y, c)) p1 = 0.0f;
            }
            s[nt][e] = p0 * (dp[nt][e] - dl0);
            s[nt][2 + e] = p1 * (dp[nt][2 + e] - dl1);
        }
    }
}

// dq_i = scale · Σ_j p_ij (dp_ij − delta_i) k_j over the causal keys; one block per 64 queries of
// one head. Overwrites dq.
template <int D>
__device__ __forceinline__ void attention_backward_dq_tc(float* dq, const bf16_bits* dout, const bf16_bits* q,
                                                         const bf16_bits* k, const bf16_bits* v, const float* lse,
                                                         const float* delta, int seq, int n_heads,
                                                         int n_kv_heads, float scale,
                                                         const unsigned* doc_pos) {
    constexpr int S = D + 8, TILE = TITAN_TC_ROWS * S, STAGES = TITAN_TC_STAGES(D);
    __shared__ __align__(16) bf16_bits ks[STAGES * TILE];
    __shared__ __align__(16) bf16_bits vs[STAGES * TILE];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int q_tile = longest_first_query_tile(), q0 = q_tile * TITAN_TC_ROWS, h = blockIdx.y,
        b = blockIdx.z;
    int kvh = h / (n_heads / n_kv_heads);
    i64 q_stride = (i64)n_heads * D, kv_stride = (i64)n_kv_heads * D;
    i64 q_off = (i64)b * seq * q_stride + (i64)h * D;
    const bf16_bits* kb = k + (i64)b * seq * kv_stride + (i64)kvh * D;
    const bf16_bits* vb = v + (i64)b * seq * kv_stride + (i64)kvh * D;
    int row_in_tile = warp * 16 + g, r0 = q0 + row_in_tile, r1 = r0 + 8;
    float scale_log2 = scale * TITAN_LOG2E;
    u32 qa[D / 16][4], da[D / 16][4];
    load_row_fragments<D>(qa, q + q_off, q_stride, r0, seq, t);
    load_row_fragments<D>(da, dout + q_off, q_stride, r0, seq, t);
    const float* lse_bh = lse + ((i64)b * n_heads + h) * seq;
    const float* delta_bh = delta + ((i64)b * n_heads + h) * seq;
    // Rows past `seq` compute values that are never stored.
    float lse2_0 = r0 < seq ? lse_bh[r0] * TITAN_LOG2E : 0.0f;
    float lse2_1 = r1 < seq ? lse_bh[r1] * TITAN_LOG2E : 0.0f;
    float dl0 = r0 < seq ? delta_bh[r0] : 0.0f, dl1 = r1 < seq ? delta_bh[r1] : 0.0f;
    float acc[D / 8][4];
    zero_fragments<D / 8>(acc);
    // Key tiles from the first query's document to the diagonal one.
    int first_tile = tc_first_key(doc_pos, b, seq, q0) / TITAN_TC_ROWS;
    int visits = q_tile + 1 - first_tile;
    int warp_last_first = tc_first_key(doc_pos, b, seq, q0 + warp * 16 + 15);
    FirstKeys row_first{tc_first_key(doc_pos, b, seq, r0), tc_first_key(doc_pos, b, seq, r1)};
    auto stage = [&](int i, int buf) {
        stage_keys_values<D>(ks, vs, kb, vb, kv_stride, first_tile + i, buf, seq);
    };
    stage(0, 0);
    for (int it = 0; it < visits; ++it) {
        int cur = tile_begin<STAGES>(stage, it, visits);
        int j0 = (first_tile + it) * TITAN_TC_ROWS;
        float s[8][4], dp[8][4];
        product_with_tile_rows<D>(&s, &qa, ks + cur * TILE);
        product_with_tile_rows<D>(&dp, &da, vs + cur * TILE);
        // Rows and first keys relative to the key tile (the diagonal tile's j0 is q0).
        int row_rel = r0 - j0;
        FirstKeys first{row_first.x - j0, row_first.y - j0};
        if (it + 1 < visits && j0 >= warp_last_first)
            dq_scores_to_ds<false>(s, dp, scale_log2, lse2_0, lse2_1, dl0, dl1, row_rel, first, t);
        else
            dq_scores_to_ds<true>(s, dp, scale_log2, lse2_0, lse2_1, dl0, dl1, row_rel, first, t);
        accumulate_times_tile<D>(&acc, &s, ks + cur * TILE);
        tile_end<STAGES>(stage, it, visits);
    }
    store_row_fragments<D>(dq + q_off, q_stride, r0, seq, t, acc, scale, scale);
}

// The dK/dV pass's transposed scores (rows: this thread's keys g and g + 8, columns: the tile's
// queries) → probabilities in p and, with WANT_K, dS/scale in dp. `lse2` holds each query's
// log-sum-exp in base 2 (+inf past `seq`, so those queries get p = 0), `delta` its delta.
template <bool WANT_K, bool DIAGONAL>
__device__ __forceinline__ void dkdv_scores(float (*p)[4], float (*dp)[4], const float* lse2,
                                            const float* delta, float scale_log2, int key_in_tile,
                                            int t, const int* first = nullptr, int query_base = 0) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            int c = nt * 8 + 2 * t + e;
            float p0 = exp2_approx(fmaf(p[nt][e], scale_log2, -lse2[c]));
            float p1 = exp2_approx(fmaf(p[nt][2 + e], scale_log2, -lse2[c]));
            if (DIAGONAL) {
                // Queries at query_base + c of the key tile, their first keys (relative to it)
                // in `first` when there are documents.
                int f = first ? first[c] : TITAN_TC_NO_FIRST;
                if (!visible_in_tile(query_base + c, f, key_in_tile)) p0 = 0.0f;
                if (!visible_in_tile(query_base + c, f, key_in_tile + 8)) p1 = 0.0f;
            }
            if (WANT_K) {
                dp[nt][e] = p0 * (dp[nt][e] - delta[c]);
                dp[nt][2 + e] = p1 * (dp[nt][2 + e] - delta[c]);
            }
            p[nt][e] = p0;
            p[nt][2 + e] = p1;
        }
    }
}

// One stage of the dK/dV and fused passes' pipeline: head h's queries and output gradients from
// query i0 on into buffer `buf`, with their log-sum-exp (base 2) and delta rows, committed as one
// cp.async group. Queries past `seq` are zero with lse2 = +inf, so they get p = 0.
template <int D, int THREADS>
__device__ __forceinline__ void stage_query_tile(bf16_bits* qs, bf16_bits* do_tile, float* lse2_s,
                                                 float* delta_s, const bf16_bits* q,
                                                 const bf16_bits* dout, const float* lse,
                                                 const float* delta, int b, int h, int i0,
                                                 int seq, int n_heads, int buf,
                                                 int* first_s = nullptr,
                                                 const unsigned* doc_pos = nullptr, int k0 = 0) {
    constexpr int TILE = TITAN_TC_ROWS * (D + 8);
    i64 q_stride = (i64)n_heads * D, head_off = (i64)b * seq * q_stride + (i64)h * D;
    load_tile<D, THREADS>(qs + buf * TILE, q + head_off, q_stride, i0, seq);
    load_tile<D, THREADS>(do_tile + buf * TILE, dout + head_off, q_stride, i0, seq);
    if (threadIdx.x < TITAN_TC_ROWS) {
        int i = i0 + threadIdx.x;
        i64 row = ((i64)b * n_heads + h) * seq + i;
        lse2_s[buf * TITAN_TC_ROWS + threadIdx.x] = i < seq ? lse[row] * TITAN_LOG2E : -TITAN_NEG_INF;
        delta_s[buf * TITAN_TC_ROWS + threadIdx.x] = i < seq ? delta[row] : 0.0f;
        // Each query's first key relative to the key block's first key `k0` (documents only).
        if (first_s) first_s[buf * TITAN_TC_ROWS + threadIdx.x] = tc_first_key(doc_pos, b, seq, i) - k0;
    }
    async_commit();
}

// dv_j = Σ p_ij dout_i and dk_j = scale · Σ p_ij (dp_ij − delta_i) q_i over the group's heads and
// the causal queries i >= j; one block per 64 keys of one kv head, visiting (head, query tile)
// pairs as one pipelined sequence. With WANT_K or WANT_V false the pass skips that output
// (head_dim 128 makes two passes so the accumulators fit in registers).
template <int D, bool WANT_K, bool WANT_V>
__device__ __forceinline__ void attention_backward_dkdv_tc(float* dk, float* dv, const bf16_bits* dout,
                                                           const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,
                                                           const float* lse, const float* delta,
                                                           int seq, int n_heads, int n_kv_heads,
                                                           float scale, const unsigned* doc_pos) {
    constexpr int S = D + 8, TILE = TITAN_TC_ROWS * S, STAGES = TITAN_TC_STAGES(D);
    __shared__ __align__(16) bf16_bits qs[STAGES * TILE];
    __shared__ __align__(16) bf16_bits do_tile[STAGES * TILE];
    __shared__ float lse2_s[STAGES * TITAN_TC_ROWS];
    __shared__ float delta_s[STAGES * TITAN_TC_ROWS];
    __shared__ int first_s[STAGES * TITAN_TC_ROWS];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int k0 = blockIdx.x * TITAN_TC_ROWS, kvh = blockIdx.y, b = blockIdx.z;
    i64 kv_stride = (i64)n_kv_heads * D;
    i64 kv_off = (i64)b * seq * kv_stride + (i64)kvh * D;
    int key_in_tile = warp * 16 + g, r0 = k0 + key_in_tile;
    float scale_log2 = scale * TITAN_LOG2E;
    u32 ka[D / 16][4], va[D / 16][4];
    load_row_fragments<D>(ka, k + kv_off, kv_stride, r0, seq, t);
    if (WANT_K) load_row_fragments<D>(va, v + kv_off, kv_stride, r0, seq, t);
    float acc_k[D / 8][4], acc_v[D / 8][4];
    zero_fragments<D / 8>(acc_k);
    zero_fragments<D / 8>(acc_v);
    int group = n_heads / n_kv_heads;
    // The queries that see a key of this block: from k0 to the last of the document holding the
    // block's last key (first keys never decrease, so a binary search finds it).
    int q_end = seq;
    if (doc_pos) {
        int last_key = min(k0 + TITAN_TC_ROWS, seq) - 1, lo = last_key, hi = seq - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (tc_first_key(doc_pos, b, seq, mid) <= last_key) lo = mid; else hi = mid - 1;
        }
        q_end = lo + 1;
    }
    int q_tiles = (q_end - k0 + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS;
    int n_tiles = group * q_tiles;
    // The warp's first key: a query tile whose latest first key lies after it is masked.
    int warp_key = k0 + warp * 16;
    QueryTileCursor staged;
    auto stage = [&](int, int buf) {
        int head, tile;
        staged.next(q_tiles, head, tile);
        stage_query_tile<D, TITAN_TC_THREADS>(qs, do_tile, lse2_s, delta_s, q, dout, lse, delta, b,
                                              kvh * group + head, k0 + tile * TITAN_TC_ROWS, seq,
                                              n_heads, buf, doc_pos ? first_s : nullptr, doc_pos,
                                              k0);
    };
    stage(0, 0);
    QueryTileCursor visiting;
    for (int it = 0; it < n_tiles; ++it) {
        int cur = tile_begin<STAGES>(stage, it, n_tiles);
        const bf16_bits* q_tile = qs + cur * TILE;
        const bf16_bits* d_tile = do_tile + cur * TILE;
        const float* lse2_t = lse2_s + cur * TITAN_TC_ROWS;
        const float* delta_t = delta_s + cur * TITAN_TC_ROWS;
        float p[8][4], dp[8][4];
        product_with_tile_rows<D>(&p, &ka, q_tile);
        if (WANT_K) product_with_tile_rows<D>(&dp, &va, d_tile);
        // Each head's first query tile is the diagonal one (its queries start at k0); a later one
        // is masked when a query of it starts its document after the warp's first key.
        int head, query_tile;
        visiting.next(q_tiles, head, query_tile);
        int i0 = k0 + query_tile * TITAN_TC_ROWS;
        bool crossed = doc_pos && tc_first_key(doc_pos, b, seq, i0 + TITAN_TC_ROWS - 1) > warp_key;
        const int* first_t = doc_pos ? first_s + cur * TITAN_TC_ROWS : nullptr;
        int query_base = query_tile * TITAN_TC_ROWS;
        if (query_tile != 0 && !crossed)
            dkdv_scores<WANT_K, false>(p, dp, lse2_t, delta_t, scale_log2, key_in_tile, t);
        else
            dkdv_scores<WANT_K, true>(p, dp, lse2_t, delta_t, scale_log2, key_in_tile, t,
                                      first_t, query_base);
        if (WANT_V) accumulate_times_tile<D>(&acc_v, &p, d_tile);
        if (WANT_K) accumulate_times_tile<D>(&acc_k, &dp, q_tile);
        tile_end<STAGES>(stage, it, n_tiles);
    }
    if (WANT_K) store_row_fragments<D>(dk + kv_off, kv_stride, r0, seq, t, acc_k, scale, scale);
    if (WANT_V) store_row_fragments<D>(dv + kv_off, kv_stride, r0, seq, t, acc_v, 1.0f, 1.0f);
}

// ---- Fused backward: dQ, dK and dV in one pass ----
//
// FlashAttention-2's backward: each block owns 16·WARPS keys of one kv head and visits the group's
// (head, query tile) pairs as the dK/dV pass does, but also hands each tile's dS to the queries:
// the warps write dS (bf16) to shared memory, and after one barrier each warp multiplies a 16-query
// slice of it by the block's keys and adds the result to dQ in global memory with atomic vector
// additions (dq is zeroed by the host first). Five products per tile instead of the split passes'
// seven (eight at head_dim 128), and each probability is computed once instead of twice or three
// times. By default the key blocks take turns at each query tile (`wait_turn`, lowest block
// first), so the additions come in a fixed order and dQ is the same on every run; without the
// counters (`unordered`) they race, which waits less but changes dQ's last bits from run to run.
//
// At head_dim 64 each warp keeps its keys' and values' A fragments in registers; at 128 the dK and
// dV accumulators alone take 128 registers, so the fragments are read from the block's key and
// value tiles in shared memory for every product instead, and the query tiles have one stage.
//
// Dynamic shared memory (TensorCoreBackward::fused_shared_bytes on the host): the stages of query
// and output-gradient tiles, the block's keys (and values at 128), its dS tile, and the stages of
// log-sum-exp and delta.
template <int D, int WARPS>
struct FusedBackwardLayout {
    static constexpr int S = D + 8, KEYS = 16 * WARPS, TILE = TITAN_TC_ROWS * S;
    static constexpr int STAGES = TITAN_TC_STAGES(D);
    static constexpr bool KV_SHARED = D > 64;
    // dS rows are keys, columns the tile's 64 queries (padded by 8, as every tile).
    static constexpr int DS_STRIDE = TITAN_TC_ROWS + 8;
    static constexpr int Q_OFFSET = 0, DO_OFFSET = STAGES * TILE, K_OFFSET = 2 * STAGES * TILE;
    static constexpr int V_OFFSET = K_OFFSET + KEYS * S;
    static constexpr int DS_OFFSET = V_OFFSET + (KV_SHARED ? KEYS * S : 0);
    static constexpr int BF16_ELEMENTS = DS_OFFSET + KEYS * DS_STRIDE;
    static constexpr int BYTES = BF16_ELEMENTS * 2 + 2 * STAGES * TITAN_TC_ROWS * 4;
};

// acc[8][4] = A · Bᵀ over D for this warp's 16 rows of A read from a shared tile (`a_rows`, its
// first row) and Bᵀ the 64-row shared tile `tile`: product_with_tile_rows with the A fragments
// loaded per step of the shared dimension instead of held in registers.
template <int D>
__device__ __forceinline__ void product_with_shared_rows(float (*acc)[4], const bf16_bits* a_rows,
                                                         const bf16_bits* tile) {
    constexpr int S = D + 8;
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    u32 a_row = shared_address(a_rows + ((m & 1) * 8 + r) * S + (m >> 1) * 8);
    u32 b_row = shared_address(tile + ((m >> 1) * 8 + r) * S + (m & 1) * 8);
    zero_fragments<8>(acc);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[4];
        load_matrices<false>(a, a_row + (u32)(kk * 16) * 2);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            u32 b[4];
            load_matrices<false>(b, b_row + (u32)(np * 16 * S + kk * 16) * 2);
            mma_bf16(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
    }
}

// This warp's rows of dS (rows g and g + 8 of the C fragments `ds`) into the shared dS tile.
__device__ __forceinline__ void store_ds_rows(bf16_bits* ds_rows, int stride, const float (*ds)[4],
                                              int g, int t) {
    u32* row0 = (u32*)(ds_rows + g * stride);
    u32* row1 = (u32*)(ds_rows + (g + 8) * stride);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        row0[nt * 4 + t] = pack_bf16(ds[nt][0], ds[nt][1]);
        row1[nt * 4 + t] = pack_bf16(ds[nt][2], ds[nt][3]);
    }
}

// acc[COLS/8][4] = dS[queries q_row0 .. + 15, all KEYS keys] · K[keys, columns col0 .. + COLS - 1],
// both from shared memory: dS stored key-major (so its A fragments load transposed) and K
// row-major (its B fragments too, as in accumulate_times_tile).
template <int D, int KEYS, int COLS>
__device__ __forceinline__ void ds_times_keys(float (*acc)[4], const bf16_bits* ds, int ds_stride,
                                              const bf16_bits* ks, int q_row0, int col0) {
    constexpr int S = D + 8;
    int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
    u32 a_row = shared_address(ds + ((m >> 1) * 8 + r) * ds_stride + q_row0 + (m & 1) * 8);
    u32 b_row = shared_address(ks + ((m & 1) * 8 + r) * S + (m >> 1) * 8 + col0);
    zero_fragments<COLS / 8>(acc);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
        u32 a[4];
        load_matrices<true>(a, a_row + (u32)(kk * 16 * ds_stride) * 2);
#pragma unroll
        for (int np = 0; np < COLS / 16; ++np) {
            u32 b[4];
            load_matrices<true>(b, b_row + (u32)(kk * 16 * S + np * 16) * 2);
            mma_bf16(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
    }
}

// `dq_order` (b × n_heads × ⌈seq/64⌉ zeroed turn counters and one ticket counter, or null)
// orders the dQ additions.
template <int D, int WARPS>
__device__ __forceinline__ void attention_backward_fused_tc(
    float* dq, float* dk, float* dv, const bf16_bits* dout, const bf16_bits* q, const bf16_bits* k,
    const bf16_bits* v, const float* lse, const float* delta, int* dq_order, int seq, int n_heads,
    int n_kv_heads, float scale) {
    using L = FusedBackwardLayout<D, WARPS>;
    constexpr int THREADS = 32 * WARPS, KEYS = L::KEYS, TILE = L::TILE, STAGES = L::STAGES;
    constexpr bool KV_SHARED = L::KV_SHARED;
    // The dQ products: 4 slices of 16 queries, each split in WARPS / 4 column ranges.
    constexpr int DQ_COLS = D / (WARPS / 4);
    static_assert(WARPS % 4 == 0 && DQ_COLS % 16 == 0, "whole dQ slices per warp");
    bf16_bits* smem = (bf16_bits*)dynamic_shared_memory();
    bf16_bits* qs = smem + L::Q_OFFSET;
    bf16_bits* do_tile = smem + L::DO_OFFSET;
    bf16_bits* ks = smem + L::K_OFFSET;
    bf16_bits* vs = smem + L::V_OFFSET;
    bf16_bits* ds = smem + L::DS_OFFSET;
    float* lse2_s = (float*)(smem + L::BF16_ELEMENTS);
    float* delta_s = lse2_s + STAGES * TITAN_TC_ROWS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // With turns, the block's (key block, kv head, batch) comes from its ticket in start order
    // (x fastest, as blockIdx), so the lower key blocks it waits for have started; the ticket
    // counter follows the turn counters.
    int n_query_tiles = (seq + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS;
    int key_block = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    if (dq_order) {
        int ticket = block_ticket(dq_order + (i64)gridDim.z * n_heads * n_query_tiles);
        key_block = ticket % gridDim.x;
        kvh = ticket / gridDim.x % gridDim.y;
        b = ticket / (gridDim.x * gridDim.y);
    }
    int k0 = key_block * KEYS;
    i64 q_stride = (i64)n_heads * D, kv_stride = (i64)n_kv_heads * D;
    i64 kv_off = (i64)b * seq * kv_stride + (i64)kvh * D;
    int warp_key0 = k0 + warp * 16, r0 = warp_key0 + g;
    float scale_log2 = scale * TITAN_LOG2E;
    // At head_dim 64 the warp's key and value rows as A fragments; at 128 they stay in shared
    // memory (the arrays are then unused and take no registers).
    u32 ka[KV_SHARED ? 1 : D / 16][4], va[KV_SHARED ? 1 : D / 16][4];
    if (!KV_SHARED) {
        load_row_fragments<KV_SHARED ? 16 : D>(ka, k + kv_off, kv_stride, r0, seq, t);
        load_row_fragments<KV_SHARED ? 16 : D>(va, v + kv_off, kv_stride, r0, seq, t);
    }
    float acc_k[D / 8][4], acc_v[D / 8][4];
    zero_fragments<D / 8>(acc_k);
    zero_fragments<D / 8>(acc_v);
    int group = n_heads / n_kv_heads;
    int q_tiles = (seq - k0 + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS;
    int n_tiles = group * q_tiles;
    QueryTileCursor staged;
    auto stage = [&](int, int buf) {
        int head, tile;
        staged.next(q_tiles, head, tile);
        stage_query_tile<D, THREADS>(qs, do_tile, lse2_s, delta_s, q, dout, lse, delta, b,
                                     kvh * group + head, k0 + tile * TITAN_TC_ROWS, seq, n_heads,
                                     buf);
    };
    // The block's keys (and values) travel with the first stage (same cp.async group).
    load_tile<D, THREADS, KEYS>(ks, k + kv_off, kv_stride, k0, seq);
    if (KV_SHARED) load_tile<D, THREADS, KEYS>(vs, v + kv_off, kv_stride, k0, seq);
    stage(0, 0);
    int dq_row0 = (warp & 3) * 16, dq_col0 = (warp >> 2) * DQ_COLS;
    bf16_bits* ds_rows = ds + warp * 16 * L::DS_STRIDE;
    const bf16_bits* k_rows = ks + warp * 16 * L::S;
    const bf16_bits* v_rows = vs + warp * 16 * L::S;
    for (int it = 0, query_tile = 0, head = kvh * group; it < n_tiles; ++it) {
        int cur = tile_begin<STAGES>(stage, it, n_tiles);
        const bf16_bits* q_tile = qs + cur * TILE;
        const bf16_bits* d_tile = do_tile + cur * TILE;
        int i0 = k0 + query_tile * TITAN_TC_ROWS;
        // Row g's key sits at this position relative to the tile's first query.
        int key_offset = warp_key0 - i0;
        if (key_offset >= TITAN_TC_ROWS) {
            // Every key of this warp comes after every query of the tile: dS is zero.
            float zero[8][4] = {};
            store_ds_rows(ds_rows, L::DS_STRIDE, zero, g, t);
        } else {
            const float* lse2_t = lse2_s + cur * TITAN_TC_ROWS;
            const float* delta_t = delta_s + cur * TITAN_TC_ROWS;
            float p[8][4], dp[8][4];
            if (KV_SHARED) {
                product_with_shared_rows<D>(p, k_rows, q_tile);
                product_with_shared_rows<D>(dp, v_rows, d_tile);
            } else {
                product_with_tile_rows<KV_SHARED ? 16 : D>(&p, &ka, q_tile);
                product_with_tile_rows<KV_SHARED ? 16 : D>(&dp, &va, d_tile);
            }
            if (key_offset + 15 <= 0)
                dkdv_scores<true, false>(p, dp, lse2_t, delta_t, scale_log2, key_offset + g, t);
            else
                dkdv_scores<true, true>(p, dp, lse2_t, delta_t, scale_log2, key_offset + g, t);
            store_ds_rows(ds_rows, L::DS_STRIDE, dp, g, t);
            accumulate_times_tile<D>(&acc_v, &p, d_tile);
            accumulate_times_tile<D>(&acc_k, &dp, q_tile);
        }
        __syncthreads();
        float acc_q[DQ_COLS / 8][4];
        ds_times_keys<D, KEYS, DQ_COLS>(acc_q, ds, L::DS_STRIDE, ks, dq_row0, dq_col0);
        int qr0 = i0 + dq_row0 + g, qr1 = qr0 + 8;
        float* dq_head = dq + (i64)b * seq * q_stride + (i64)head * D + dq_col0 + 2 * t;
        // Ordered: the key blocks add into this query tile one after another, lowest first (every
        // lower block visits it), so dQ's sums are the same on every run.
        int* turn = dq_order ? dq_order + ((i64)b * n_heads + head) * n_query_tiles + i0 / TITAN_TC_ROWS
                             : nullptr;
        if (turn) wait_turn(turn, key_block);
#pragma unroll
        for (int dn = 0; dn < DQ_COLS / 8; ++dn) {
            if (qr0 < seq)
                atomic_add_pair(dq_head + (i64)qr0 * q_stride + dn * 8, acc_q[dn][0] * scale,
                                acc_q[dn][1] * scale);
            if (qr1 < seq)
                atomic_add_pair(dq_head + (i64)qr1 * q_stride + dn * 8, acc_q[dn][2] * scale,
                                acc_q[dn][3] * scale);
        }
        if (turn) pass_turn(turn);
        if (++query_tile == q_tiles) {
            query_tile = 0;
            ++head;
        }
        // The barrier also keeps the dS tile until every warp has read it.
        tile_end<STAGES>(stage, it, n_tiles);
    }
    store_row_fragments<D>(dk + kv_off, kv_stride, r0, seq, t, acc_k, scale, scale);
    store_row_fragments<D>(dv + kv_off, kv_stride, r0, seq, t, acc_v, 1.0f, 1.0f);
}

// Entry points for head_dim 64 and 128.
#define TITAN_TC_FORWARD(name, D, M)                                                              \
    extern "C" __global__ void name(float* out, bf16_bits* out16, float* lse, const bf16_bits* q, \
                                    const bf16_bits* k, const bf16_bits* v, int seq, int n_heads, \
                                    int n_kv_heads, float scale, const unsigned* doc_pos) {       \
        attention_forward_tc<D, M>(out, out16, lse, q, k, v, seq, n_heads, n_kv_heads, scale,     \
                                   doc_pos);                                                      \
    }
#define TITAN_TC_DQ(name, D)                                                                      \
    extern "C" __global__ void name(float* dq, const bf16_bits* dout, const bf16_bits* q,         \
                                    const bf16_bits* k, const bf16_bits* v, const float* lse,     \
                                    const float* delta, int seq, int n_heads, int n_kv_heads,     \
                                    float scale, const unsigned* doc_pos) {                       \
        attention_backward_dq_tc<D>(dq, dout, q, k, v, lse, delta, seq, n_heads, n_kv_heads,      \
                                    scale, doc_pos);                                              \
    }
#define TITAN_TC_DKDV(name, D, WANT_K, WANT_V)                                                    \
    extern "C" __global__ void name(float* dk, float* dv, const bf16_bits* dout,                  \
                                    const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,   \
                                    const float* lse, const float* delta, int seq, int n_heads,   \
                                    int n_kv_heads, float scale, const unsigned* doc_pos) {       \
        attention_backward_dkdv_tc<D, WANT_K, WANT_V>(dk, dv, dout, q, k, v, lse, delta, seq,     \
                                                      n_heads, n_kv_heads, scale, doc_pos);       \
    }

#define TITAN_TC_FUSED(name, D, WARPS)                                                            \
    extern "C" __global__ void name(float* dq, float* dk, float* dv, const bf16_bits* dout,       \
                                    const bf16_bits* q, const bf16_bits* k, const bf16_bits* v,   \
                                    const float* lse, const float* delta, int* dq_order,          \
                                    int seq, int n_heads, int n_kv_heads, float scale) {          \
        attention_backward_fused_tc<D, WARPS>(dq, dk, dv, dout, q, k, v, lse, delta, dq_order,    \
                                              seq, n_heads, n_kv_heads, scale);                   \
    }

TITAN_TC_FORWARD(attention_forward_tc64, 64, 1)
TITAN_TC_FORWARD(attention_forward_tc64x2, 64, 2)
TITAN_TC_FORWARD(attention_forward_tc128, 128, 1)
TITAN_TC_DQ(attention_backward_dq_tc64, 64)
TITAN_TC_DQ(attention_backward_dq_tc128, 128)
TITAN_TC_DKDV(attention_backward_dkdv_tc64, 64, true, true)
TITAN_TC_DKDV(attention_backward_dk_tc128, 128, true, false)
TITAN_TC_DKDV(attention_backward_dv_tc128, 128, false, true)
TITAN_TC_FUSED(attention_backward_fused_tc64, 64, 4)
TITAN_TC_FUSED(attention_backward_fused_tc64w8, 64, 8)
TITAN_TC_FUSED(attention_backward_fused_tc128, 128, 4)
TITAN_TC_FUSED(attention_backward_fused_tc128w8, 128, 8)
