// A mixture of experts' grouped GEMMs (Backend::grouped_matmul, grouped_weight_grad): expert e's
// rows offsets[e]..offsets[e + 1] times its own weight, the offsets read here on the device, so
// the host never waits for the experts' row counts. Each expert's weight (or gradient) is its own
// buffer; the launch passes their addresses by value (`GgAddresses`, 2 KiB of the 4 KiB a kernel's
// parameters may take), so nothing is uploaded either.
//
// f32 operands, f32 accumulation, each output a sum over k in order within 16-wide steps: a plain
// shared-memory tiling (64 x 64 outputs per block of 256 threads, 4 x 4 per thread), written for
// correctness first; no tensor cores yet.

#define TITAN_GG_TILE 64
#define TITAN_GG_STEP 16
#define TITAN_GG_THREADS 256
#define TITAN_GG_MAX_EXPERTS 256

struct GgAddresses {
    unsigned long long at[TITAN_GG_MAX_EXPERTS];
};

// The expert and first row of the row tile `slot` of a launch: the experts' tiles laid end to end
// (ceil(rows_e / 64) each); -1 past the last (the grid is sized for the most tiles any split of
// the rows can need).
__device__ int gg_row_tile(const u32* offsets, int E, int slot, int* row0) {
    for (int e = 0; e < E; ++e) {
        int tiles = (int)((offsets[e + 1] - offsets[e] + TITAN_GG_TILE - 1) / TITAN_GG_TILE);
        if (slot < tiles) {
            *row0 = (int)offsets[e] + slot * TITAN_GG_TILE;
            return e;
        }
        slot -= tiles;
    }
    return -1;
}

// acc[i][j] += a_tile[kk][ty * 4 + i] * b_tile[kk][tx * 4 + j] over one step.
__device__ __forceinline__ void gg_step(float acc[4][4], float (*a)[TITAN_GG_TILE + 1],
                                        float (*b)[TITAN_GG_TILE + 1], int ty, int tx) {
    for (int kk = 0; kk < TITAN_GG_STEP; ++kk) {
        float av[4], bv[4];
        for (int i = 0; i < 4; ++i) av[i] = a[kk][ty * 4 + i];
        for (int j = 0; j < 4; ++j) bv[j] = b[kk][tx * 4 + j];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
}

// out[r, :] (+)= a[r, :k] . op(W_e) for each row r of expert e; W_e stored [n, k] and read
// transposed when trans_b (x . W^T), else [k, n] (dy . W). Grid: (ceil(n / 64), row tiles).
extern "C" __global__ void grouped_gemm(float* out, const float* a,
                                        GgAddresses weights, const u32* offsets,
                                        int E, int k, int n, int trans_b, int accumulate) {
    __shared__ float a_tile[TITAN_GG_STEP][TITAN_GG_TILE + 1];
    __shared__ float b_tile[TITAN_GG_STEP][TITAN_GG_TILE + 1];
    int row0 = 0;
    int e = gg_row_tile(offsets, E, (int)blockIdx.y, &row0);
    if (e < 0) return;
    int end = (int)offsets[e + 1], col0 = (int)blockIdx.x * TITAN_GG_TILE;
    const float* w = (const float*)weights.at[e];
    int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < k; k0 += TITAN_GG_STEP) {
        for (int i = tid; i < TITAN_GG_TILE * TITAN_GG_STEP; i += TITAN_GG_THREADS) {
            int r = i / TITAN_GG_STEP, kk = i % TITAN_GG_STEP;
            int row = row0 + r, kc = k0 + kk;
            a_tile[kk][r] = (row < end && kc < k) ? a[(i64)row * k + kc] : 0.0f;
            int c = trans_b ? r : i % TITAN_GG_TILE;
            int kb = trans_b ? kk : i / TITAN_GG_TILE;
            int col = col0 + c, kw = k0 + kb;
            float v = 0.0f;
            if (col < n && kw < k) v = trans_b ? w[(i64)col * k + kw] : w[(i64)kw * n + col];
            b_tile[kb][c] = v;
        }
        __syncthreads();
        gg_step(acc, a_tile, b_tile, ty, tx);
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        int row = row0 + ty * 4 + i;
        if (row >= end) continue;
        for (int j = 0; j < 4; ++j) {
            int col = col0 + tx * 4 + j;
            if (col >= n) continue;
            float* o = out + (i64)row * n + col;
            *o = accumulate ? *o + acc[i][j] : acc[i][j];
        }
    }
}

// grads[e][o, i] += sum over expert e's rows r of dy[r, o] * x[r, i] (dy: [rows, n_out], x:
// [rows, k_in]). Grid: (ceil(k_in / 64), ceil(n_out / 64), E); a null gradient is skipped.
extern "C" __global__ void grouped_weight_grad(GgAddresses grads, const float* dy,
                                               const float* x, const u32* offsets, int n_out,
                                               int k_in) {
    __shared__ float d_tile[TITAN_GG_STEP][TITAN_GG_TILE + 1];
    __shared__ float x_tile[TITAN_GG_STEP][TITAN_GG_TILE + 1];
    int e = (int)blockIdx.z;
    float* g = (float*)grads.at[e];
    int from = (int)offsets[e], end = (int)offsets[e + 1];
    if (g == 0 || from == end) return;
    int o0 = (int)blockIdx.y * TITAN_GG_TILE, i0 = (int)blockIdx.x * TITAN_GG_TILE;
    int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4] = {};
    for (int r0 = from; r0 < end; r0 += TITAN_GG_STEP) {
        for (int i = tid; i < TITAN_GG_TILE * TITAN_GG_STEP; i += TITAN_GG_THREADS) {
            int r = i / TITAN_GG_TILE, c = i % TITAN_GG_TILE, row = r0 + r;
            int o = o0 + c, xi = i0 + c;
            d_tile[r][c] = (row < end && o < n_out) ? dy[(i64)row * n_out + o] : 0.0f;
            x_tile[r][c] = (row < end && xi < k_in) ? x[(i64)row * k_in + xi] : 0.0f;
        }
        __syncthreads();
        gg_step(acc, d_tile, x_tile, ty, tx);
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        int o = o0 + ty * 4 + i;
        if (o >= n_out) continue;
        for (int j = 0; j < 4; ++j) {
            int xi = i0 + tx * 4 + j;
            if (xi < k_in) g[(i64)o * k_in + xi] += acc[i][j];
        }
    }
}
