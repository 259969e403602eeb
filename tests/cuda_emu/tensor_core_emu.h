// The functions of kernels/tensor_core.cuh, emulated on the CPU for emu.h, following the PTX ISA's
// fragment layouts for `mma.m16n8k16` (bf16, row.col), `ldmatrix.m8n8.x4` and the `cp.async` group
// rules. With g = lane / 4 and t = lane % 4: A (16x16) a0 = row g cols 2t,2t+1; a1 = row g+8; a2 =
// row g cols 2t+8,2t+9; a3 = row g+8 cols 2t+8,2t+9. B (16x8) b0 = rows 2t,2t+1 of col g; b1 = rows
// 2t+8,2t+9. C (16x8) c0,c1 = row g cols 2t,2t+1; c2,c3 = row g+8. The lower-indexed element of a
// pair sits in the low 16 bits.
//
// Asynchronous copies land either when issued or at the latest moment PTX allows (the
// `cp.async.wait_group` that covers them), so a kernel that reads a tile before waiting for it, or
// refills a buffer other warps still read, computes wrong results here too.

#pragma once

#include "emu.h"

typedef unsigned short bf16_bits;

namespace emu {

inline uint16_t bf16_round(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

inline float bf16_value(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float low_half(uint32_t w) { return bf16_value((uint16_t)(w & 0xffffu)); }
inline float high_half(uint32_t w) { return bf16_value((uint16_t)(w >> 16)); }

}  // namespace emu

inline u32 pack_bf16(float lo, float hi) {
    return ((u32)emu::bf16_round(hi) << 16) | emu::bf16_round(lo);
}

inline void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    uint32_t* mine = emu::g_block->words[threadIdx.x];
    mine[0] = a0;
    mine[1] = a1;
    mine[2] = a2;
    mine[3] = a3;
    mine[4] = b0;
    mine[5] = b1;
    emu::warp_barrier();
    float a[16][16], b[16][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        const uint32_t* w = emu::g_block->words[emu::mailbox(lane)];
        unsigned g = lane >> 2, t = lane & 3;
        a[g][2 * t] = emu::low_half(w[0]);
        a[g][2 * t + 1] = emu::high_half(w[0]);
        a[g + 8][2 * t] = emu::low_half(w[1]);
        a[g + 8][2 * t + 1] = emu::high_half(w[1]);
        a[g][2 * t + 8] = emu::low_half(w[2]);
        a[g][2 * t + 9] = emu::high_half(w[2]);
        a[g + 8][2 * t + 8] = emu::low_half(w[3]);
        a[g + 8][2 * t + 9] = emu::high_half(w[3]);
        b[2 * t][g] = emu::low_half(w[4]);
        b[2 * t + 1][g] = emu::high_half(w[4]);
        b[2 * t + 8][g] = emu::low_half(w[5]);
        b[2 * t + 9][g] = emu::high_half(w[5]);
    }
    emu::warp_barrier();
    unsigned lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; ++e) {
        float acc = c[e];
        for (int k = 0; k < 16; ++k) acc += a[rows[e]][k] * b[k][cols[e]];
        c[e] = acc;
    }
}

namespace emu {

// Shared addresses are 32-bit offsets from this anchor: every `__shared__` array is a static of
// the same program, well within 2 GiB of it.
inline char g_shared_anchor;

inline const void* shared_pointer(u32 address) {
    return (const void*)((uintptr_t)&g_shared_anchor + (uintptr_t)(intptr_t)(int32_t)address);
}

}  // namespace emu

inline u32 shared_address(const void* p) {
    intptr_t offset = (intptr_t)((uintptr_t)p - (uintptr_t)&emu::g_shared_anchor);
    if (offset != (intptr_t)(int32_t)offset) {
        std::fprintf(stderr, "emu: shared pointer too far from the anchor\n");
        std::exit(2);
    }
    return (u32)(int32_t)offset;
}

template <bool TRANS>
inline void load_matrices(u32* r, u32 row_address) {
    emu::g_block->pointers[threadIdx.x] = emu::shared_pointer(row_address);
    emu::warp_barrier();
    unsigned lane = emu::lane_id(), g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 4; ++i) {
        // Matrix i's row `row`, column `col`: its rows are addressed by lanes 8i .. 8i + 7.
        auto at = [&](unsigned row, unsigned col) {
            const bf16_bits* p =
                (const bf16_bits*)emu::g_block->pointers[emu::mailbox(8 * i + row)];
            return p[col];
        };
        uint16_t lo = TRANS ? at(2 * t, g) : at(g, 2 * t);
        uint16_t hi = TRANS ? at(2 * t + 1, g) : at(g, 2 * t + 1);
        r[i] = ((u32)hi << 16) | lo;
    }
    emu::warp_barrier();
}

// A copy lands at once or at the wait that covers it, at random: landing early catches a buffer
// refilled while other warps still read it, landing late a tile read before it was waited for.
inline void copy_async_16(u32 shared_dst, const bf16_bits* global_src, bool valid) {
    void* dst = const_cast<void*>(emu::shared_pointer(shared_dst));
    static const bf16_bits zeros[8] = {};
    if (!valid) global_src = zeros;
    if (emu::chance())
        std::memcpy(dst, global_src, 16);
    else
        emu::g_block->async_copies[threadIdx.x].open.push_back({dst, global_src});
}

inline void async_commit() {
    auto& q = emu::g_block->async_copies[threadIdx.x];
    q.committed.push_back(std::move(q.open));
    q.open.clear();
}

template <int N>
inline void async_wait() {
    auto& q = emu::g_block->async_copies[threadIdx.x];
    while (q.committed.size() > (size_t)N) {
        for (const auto& c : q.committed.front()) std::memcpy(c.dst, c.src, 16);
        q.committed.erase(q.committed.begin());
    }
}

inline float exp2_approx(float x) { return std::exp2(x); }

// Blocks run one at a time, so one static buffer serves every launch (up to 224 KiB, sm_90's most).
inline unsigned char* dynamic_shared_memory() {
    alignas(16) static unsigned char bytes[224 << 10];
    return bytes;
}

// Blocks run one after another in index order: tickets follow the block index.
inline int block_ticket(int* counter) {
    static int ticket;
    if (threadIdx.x == 0) ticket = (*counter)++;
    __syncthreads();
    return ticket;
}

// Blocks run one after another in ticket order, so a block's turn has always come: a block that
// would wait is a kernel waiting on a later block, which could deadlock a GPU.
inline void wait_turn(const int* turn, int mine) {
    if (threadIdx.x == 0 && *turn != mine) {
        std::fprintf(stderr, "emu: block %u waits for turn %d but the counter is %d\n", blockIdx.x,
                     mine, *turn);
        std::exit(4);
    }
    __syncthreads();
}

inline void pass_turn(int* turn) {
    __syncthreads();
    if (threadIdx.x == 0) *turn += 1;
}

// Fibers switch only at barriers, so a plain addition is atomic here.
inline void atomic_add_pair(float* p, float a, float b) {
    p[0] += a;
    p[1] += b;
}
