// A CPU emulator for titan's CUDA C kernels: the CUDA dialect they use, compiled by the host C++
// compiler, with every thread of a block run as a fiber on one OS thread.
//
// Why by hand: no maintained tool runs CUDA C with inline PTX on a CPU, and titan's development
// machines have no GPU. The kernels' own source is compiled unchanged; only the tensor-core
// instructions (kernels/tensor_core.cuh) are swapped for tensor_core_emu.h, which implements
// PTX's documented fragment layouts. Kernels that pass on an H200 also pass here, so a layout this
// file got wrong would show up on them; a new kernel that passes here has had its indexing, masking,
// pipelining and barriers exercised before it meets a GPU.
//
// Threads of a block run as fibers, switched only at barriers: `__syncthreads`, and the
// warp-collective operations (shuffles, `mma`, `ldmatrix`), which every lane of a warp enters
// together. Each round of the scheduler resumes a random half of the threads (seeded, so a run
// repeats), which lets warps run far ahead of each other as they may on a GPU. Blocks run one after
// another, so `__shared__` is plain `static` storage. A barrier that can never complete (a
// divergent `__syncthreads`) aborts with a message rather than hanging.

#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct EmuDim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

using std::max;
using std::min;

// CUDA's bit casts between float and 32-bit integers.
template <typename To, typename From>
inline To emu_bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To to;
    std::memcpy(&to, &from, sizeof to);
    return to;
}

inline unsigned __float_as_uint(float f) { return emu_bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned v) { return emu_bit_cast<float>(v); }
inline float __int_as_float(int v) { return emu_bit_cast<float>(v); }
inline int __float_as_int(float f) { return emu_bit_cast<int>(f); }

// CUDA's round-to-nearest arithmetic intrinsics (never contracted into an FMA): the host's IEEE
// f32 operations, which an ISO C++ build does not contract either.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// Leading zero bits of a 32-bit word (32 for zero), as CUDA's __clz.
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }

namespace emu {

constexpr size_t kStackBytes = 256 << 10;

// A suspended fiber (or the scheduler): on x86-64 its stack pointer, switched by a few lines of
// assembly that save the callee-saved registers (glibc's swapcontext also saves the signal mask,
// a system call per switch, which made it most of the emulator's time); elsewhere a ucontext.
#if defined(__x86_64__)
struct Context {
    void* sp = nullptr;
};

extern "C" void emu_switch_context(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl emu_switch_context
    .type emu_switch_context, @function
emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_context, .-emu_switch_context
)");

inline void switch_context(Context& from, Context& to) { emu_switch_context(&from.sp, to.sp); }

// A context that starts `entry` (which must never return) on `stack`: the stack holds entry's
// address for `ret` and zeros for the six registers, aligned as if entry had just been called.
inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
    uintptr_t top = (uintptr_t)(stack.data() + stack.size()) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)entry;
    for (int i = 0; i < 6; ++i) *--sp = nullptr;
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack.data();
    c.uc.uc_stack.ss_size = stack.size();
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

// A queued 16-byte `cp.async` copy.
struct PendingCopy {
    void* dst;
    const void* src;
};

// Per thread: copies issued since the last commit, and committed groups oldest first.
struct AsyncQueues {
    std::vector<PendingCopy> open;
    std::vector<std::vector<PendingCopy>> committed;
};

struct Fiber {
    Context context;
    std::vector<char> stack;
    bool done = false;
};

// The block being run: its fibers, and the state of its barriers.
struct Block {
    std::vector<Fiber> fibers;
    Context scheduler;
    unsigned current = 0;
    unsigned live = 0;
    std::function<void()> body;
    unsigned block_arrived = 0, block_generation = 0;
    unsigned warp_arrived[32] = {}, warp_generation[32] = {};
    // Arrivals, releases and exits: a scheduler round without any is a deadlock.
    unsigned long long progress = 0;
    // One mailbox per lane for the warp collectives (up to 8 words, or one pointer).
    uint32_t words[1024][8];
    const void* pointers[1024];
    AsyncQueues async_copies[1024];
};

inline Block* g_block = nullptr;

// Drives the scheduling (which threads run each round) and when queued copies land. Threads are
// resumed at random, so warps drift apart by many steps: a missing barrier lets one warp overwrite
// what another still reads, and the results change.
inline std::mt19937_64 g_schedule(1);

inline bool chance() { return (g_schedule() >> 63) != 0; }

inline void seed_schedule(unsigned long long seed) { g_schedule.seed(seed); }

inline void yield_to_scheduler() {
    switch_context(g_block->fibers[g_block->current].context, g_block->scheduler);
}

inline void fiber_entry() {
    g_block->body();
    g_block->fibers[g_block->current].done = true;
    g_block->live -= 1;
    g_block->progress += 1;
    // Exited threads no longer count at `__syncthreads`: release the others if they were the last.
    if (g_block->block_arrived > 0 && g_block->block_arrived == g_block->live) {
        g_block->block_arrived = 0;
        g_block->block_generation += 1;
    }
    // Back to the scheduler for good: it never resumes a finished fiber, so this never returns.
    switch_context(g_block->fibers[g_block->current].context, g_block->scheduler);
    std::abort();
}

// Waits until `target` threads have arrived at this barrier (generation-counted, reusable).
inline void barrier(unsigned& arrived, unsigned& generation, unsigned target) {
    unsigned gen = generation;
    g_block->progress += 1;
    if (++arrived == target) {
        arrived = 0;
        generation += 1;
        return;
    }
    while (generation == gen) yield_to_scheduler();
}

inline void warp_barrier() {
    unsigned w = threadIdx.x >> 5;
    barrier(g_block->warp_arrived[w], g_block->warp_generation[w], 32);
}

inline unsigned lane_id() { return threadIdx.x & 31; }

// Index of lane `lane` of the calling thread's warp in the mailboxes.
inline unsigned mailbox(unsigned lane) { return (threadIdx.x & ~31u) + lane; }

// Runs the kernel body (a call of one `extern "C"` kernel) over the grid, block by block.
inline void launch(EmuDim3 grid, unsigned threads, const std::function<void()>& body) {
    if (threads % 32 != 0 || threads > 1024) {
        std::fprintf(stderr, "emu: blocks of %u threads are not supported\n", threads);
        std::exit(2);
    }
    Block block;
    block.fibers.resize(threads);
    block.body = body;
    for (auto& f : block.fibers) f.stack.resize(kStackBytes);
    g_block = &block;
    gridDim = grid;
    blockDim = EmuDim3{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = EmuDim3{x, y, z};
                block.live = threads;
                for (auto& q : block.async_copies) q = AsyncQueues{};
                block.block_arrived = 0;
                std::fill(std::begin(block.warp_arrived), std::end(block.warp_arrived), 0u);
                for (unsigned t = 0; t < threads; ++t) {
                    Fiber& f = block.fibers[t];
                    f.done = false;
                    make_context(f.context, f.stack, fiber_entry);
                }
                unsigned idle_rounds = 0;
                while (block.live > 0) {
                    unsigned long long before = block.progress;
                    for (unsigned t = 0; t < threads; ++t) {
                        if (block.fibers[t].done || !chance()) continue;
                        block.current = t;
                        threadIdx = EmuDim3{t, 0, 0};
                        switch_context(block.scheduler, block.fibers[t].context);
                    }
                    idle_rounds = block.progress == before ? idle_rounds + 1 : 0;
                    if (block.live > 0 && idle_rounds > 200) {
                        std::fprintf(stderr,
                                     "emu: block (%u,%u,%u) deadlocked: %u threads wait at a "
                                     "barrier that the others never reach\n",
                                     x, y, z, block.live);
                        std::exit(3);
                    }
                }
            }
    g_block = nullptr;
}

template <typename T>
T shuffle(T value, unsigned source_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    std::memcpy(g_block->words[threadIdx.x], &value, sizeof(T));
    warp_barrier();
    T out;
    std::memcpy(&out, g_block->words[mailbox(source_lane & 31)], sizeof(T));
    warp_barrier();
    return out;
}

}  // namespace emu

inline void __syncthreads() {
    emu::barrier(emu::g_block->block_arrived, emu::g_block->block_generation, emu::g_block->live);
}

inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_barrier(); }

// One OS thread: every write is visible at once.
inline void __threadfence() {}

// Whether any lane of the warp passes `predicate` (every lane takes part, as titan's kernels call it).
inline int __any_sync(unsigned, int predicate) {
    emu::g_block->words[threadIdx.x][0] = predicate != 0;
    emu::warp_barrier();
    int any = 0;
    for (unsigned lane = 0; lane < 32; ++lane) any |= (int)emu::g_block->words[emu::mailbox(lane)][0];
    emu::warp_barrier();
    return any;
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
    return emu::shuffle(value, emu::lane_id() ^ (unsigned)lane_mask);
}

template <typename T>
T __shfl_sync(unsigned, T value, int source_lane) {
    return emu::shuffle(value, (unsigned)source_lane);
}
