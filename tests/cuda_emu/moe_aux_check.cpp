// Runs the auxiliary balance loss's kernels (kernels/moe_aux.cu) on the CPU emulator with the
// backend's launch shapes (src/backend/cuda/ops/moe_aux.rs) against the f32 arithmetic of
// backend/moe_aux.rs, written again here, bit for bit: the per-sequence figures (softmax and
// sigmoid scores; a rank's rows starting mid-sequence, a sequence without local rows), the
// balance, the scores' gradient. Prints one line per output; exits 1 when any fails.

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "emu.h"
#include "attention_reference.h"
// clang-format off
#include "common.cuh"
#include "moe_aux.cu"
// clang-format on

namespace {

constexpr unsigned kThreads = 128;  // TOKEN_THREADS

std::mt19937_64 rng(20261208);

struct Case {
    const char* name;
    int E, K;
    bool sigmoid;
    long seq, first, tokens;
    int sequences;
};

unsigned blocks(long n) { return (unsigned)std::max(1L, (n + kThreads - 1) / kThreads); }

// backend/moe_aux.rs's `figures`, `balance`, `score_grads`, in the same f32 operations.
std::vector<float> want_figures(const Case& c, const std::vector<u32>& experts, const std::vector<float>& scores) {
    int n = c.sequences, E = c.E;
    std::vector<float> f(2 * (size_t)n * E + n, 0.0f);
    for (long t = 0; t < c.tokens; ++t) {
        long b = (c.first + t) / c.seq;
        for (int j = 0; j < c.K; ++j) f[b * E + experts[t * c.K + j]] += 1.0f;
        float total = 0.0f;
        for (int x = 0; x < E; ++x) total += scores[t * E + x];
        for (int x = 0; x < E; ++x)
            f[(size_t)n * E + b * E + x] += c.sigmoid ? scores[t * E + x] / total : scores[t * E + x];
        f[2 * (size_t)n * E + b] += 1.0f;
    }
    return f;
}

std::vector<float> want_balance(const Case& c, const std::vector<float>& fig) {
    int n = c.sequences, E = c.E;
    std::vector<float> out((size_t)n * E + n, 0.0f);
    for (int b = 0; b < n; ++b) {
        float t = std::max(fig[2 * (size_t)n * E + b], 1.0f);
        for (int x = 0; x < E; ++x) {
            out[(size_t)b * E + x] = (float)E / ((float)c.K * t) * fig[(size_t)b * E + x];
            out[(size_t)n * E + b] += out[(size_t)b * E + x] * fig[(size_t)n * E + (size_t)b * E + x] / t;
        }
    }
    return out;
}

std::vector<float> want_grads(const Case& c, const std::vector<float>& bal, const std::vector<float>& fig,
                              float scale) {
    int n = c.sequences, E = c.E;
    std::vector<float> g((size_t)c.tokens * E);
    for (long t = 0; t < c.tokens; ++t) {
        long b = (c.first + t) / c.seq;
        float per_token = scale / std::max(fig[2 * (size_t)n * E + b], 1.0f);
        for (int x = 0; x < E; ++x) g[t * E + x] = per_token * bal[b * E + x];
    }
    return g;
}

bool exact(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
    size_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) wrong += emu_bit_cast<u32>(got[i]) != emu_bit_cast<u32>(want[i]);
    std::printf("%-36s %zu of %zu differ %s\n", what.c_str(), wrong, want.size(), wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

bool aux_case(const Case& c) {
    int n = c.sequences, E = c.E;
    std::vector<float> scores = uniform_floats(rng, (size_t)c.tokens * E, 0.01f, 1.0f);
    std::vector<u32> experts((size_t)c.tokens * c.K);
    std::vector<u32> all(E);
    std::iota(all.begin(), all.end(), 0u);
    for (long t = 0; t < c.tokens; ++t) {
        std::shuffle(all.begin(), all.end(), rng);
        std::copy(all.begin(), all.begin() + c.K, experts.begin() + t * c.K);
    }
    std::vector<float> figures(2 * (size_t)n * E + n, 0.0f);
    emu::launch(EmuDim3{blocks((long)n * E), 1, 1}, kThreads, [&] {
        moe_aux_figures(figures.data(), experts.data(), scores.data(), c.tokens, c.first, c.seq, n, E, c.K,
                        c.sigmoid);
    });
    std::vector<float> fig_want = want_figures(c, experts, scores);
    bool ok = exact(std::string(c.name) + " figures", figures, fig_want);
    // The balance and gradient from the reference figures, so each kernel is checked alone.
    std::vector<float> balance((size_t)n * E + n, -1.0f);
    emu::launch(EmuDim3{blocks(n), 1, 1}, kThreads,
                [&] { moe_aux_balance(balance.data(), fig_want.data(), n, E, c.K); });
    std::vector<float> bal_want = want_balance(c, fig_want);
    ok &= exact(std::string(c.name) + " balance", balance, bal_want);
    const float scale = 0.37f;
    std::vector<float> grads((size_t)c.tokens * E, -1.0f);
    emu::launch(EmuDim3{blocks(c.tokens * E), 1, 1}, kThreads, [&] {
        moe_aux_score_grads(grads.data(), bal_want.data(), fig_want.data(), c.tokens, c.first, c.seq, n, E,
                            scale);
    });
    ok &= exact(std::string(c.name) + " score grads", grads, want_grads(c, bal_want, fig_want, scale));
    return ok;
}

}  // namespace

int main() {
    emu::seed_schedule(20261208);
    bool ok = true;
    // Qwen3-MoE-like: softmax scores, four whole sequences on one rank.
    ok &= aux_case(Case{"softmax", 8, 2, false, 5, 0, 20, 4});
    // DeepSeek-V3-like sigmoid scores on a sequence-parallel rank whose rows start mid-sequence
    // (row 10 of sequences of 7): sequence 0 has no rows here, sequence 1 only its last four.
    ok &= aux_case(Case{"sigmoid from row 10", 24, 3, true, 7, 10, 11, 3});
    std::printf(ok ? "all outputs within tolerance\n" : "SOME OUTPUTS FAILED\n");
    return ok ? 0 : 1;
}
