// The tensor-core instructions titan's kernels use, each behind one inline function: bf16 packing,
// `mma.sync.m16n8k16`, `ldmatrix` and `cp.async`. Kept apart from the kernels so that the CPU
// emulator of tests/cuda_emu can put its own definitions of exactly these functions in their place
// and run the kernels on the host. Needs sm_80 or newer; on older devices each one traps (the host
// never launches tensor-core kernels there).

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TITAN_TC_AVAILABLE 1
#endif

// Two floats rounded to bf16 (nearest even) in one register: `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
#ifdef TITAN_TC_AVAILABLE
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    r = 0;
#endif
    return r;
}

// c += a · b for one 16x8x16 tile.
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#ifdef TITAN_TC_AVAILABLE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}

// 32-bit shared-memory address of a generic pointer into shared memory (for ldmatrix).
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 bf16 matrices from shared memory, one row address (shared_address) per lane (lanes 8i..8i+7 address
// matrix i's rows); register i gets matrix i's fragment: row g, columns 2t, 2t + 1, or with TRANS
// rows 2t, 2t + 1 of column g.
template <bool TRANS>
__device__ __forceinline__ void load_matrices(u32* r, u32 row_address) {
#ifdef TITAN_TC_AVAILABLE
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(row_address));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(row_address));
    }
#else
    asm volatile("trap;");
#endif
}

// cp.async bookkeeping: close the group of copies issued so far; wait until at most N groups are
// still in flight. No-ops for copies made synchronously.
__device__ __forceinline__ void async_commit() {
#ifdef TITAN_TC_AVAILABLE
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void async_wait() {
#ifdef TITAN_TC_AVAILABLE
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// One 16-byte copy from global memory to a shared address (shared_address), queued (visible after
// async_wait and a barrier). With `valid` false it writes 16 zero bytes and reads nothing (PTX's
// src-size 0), so a tile's edge needs no branch.
__device__ __forceinline__ void copy_async_16(u32 shared_dst, const bf16_bits* global_src,
                                              bool valid) {
#ifdef TITAN_TC_AVAILABLE
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_dst),
                 "l"(global_src), "r"(valid ? 16u : 0u)
                 : "memory");
#else
    asm volatile("trap;");
#endif
}

// The block's dynamic shared memory (the launch's shared_mem_bytes; above 48 KiB the host first
// raises the kernel's limit, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
    extern __shared__ __align__(16) unsigned char titan_dynamic_shared[];
    return titan_dynamic_shared;
}

// p[0] += a, p[1] += b in global memory, atomically per element (`p` 8-byte aligned): one vector
// reduction on sm_90, two scalar ones before. The order of concurrent additions is not fixed, so
// sums of more than two terms can differ in the last bits from run to run.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

// This block's place in the order blocks actually started, from a zeroed counter: a block that
// waits only for blocks with smaller tickets waits for blocks already running, whatever order the
// hardware starts them in (so turn-taking cannot deadlock).
__device__ __forceinline__ int block_ticket(int* counter) {
    __shared__ int ticket;
    if (threadIdx.x == 0)
        asm volatile("atom.global.add.s32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    __syncthreads();
    return ticket;
}

// Turn-taking between blocks through a counter in global memory (the fused attention backward's
// ordered dQ additions): `wait_turn` holds the block until *turn == mine (thread 0 polls with
// acquire loads), `pass_turn` makes the block's global writes visible device-wide and then adds 1.
// Every block waited for must hold a smaller `block_ticket`.
__device__ __forceinline__ void wait_turn(const int* turn, int mine) {
    if (threadIdx.x == 0) {
        int v;
        do {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(turn) : "memory");
        } while (v != mine);
    }
    __syncthreads();
}

__device__ __forceinline__ void pass_turn(int* turn) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(turn) : "memory");
}

// 2^x by the special-function unit (relative error about 2^-22; -inf gives 0). Any sm_50+ GPU.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
