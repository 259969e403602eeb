// Runs a mixture of experts' grouped GEMMs (kernels/grouped_gemm.cu) on the CPU emulator with the
// backend's launch shapes and address tables (src/backend/cuda/ops/grouped_gemm.rs) against a float64 reference: the
// forward (x . W^T), the input gradient added into its output (dy . W), and the weight gradients
// added into theirs, over experts of uneven row counts (one with none, one of a single row, one
// spanning three tiles) and sizes that are not multiples of the tiles; rows outside every expert,
// and a gradient passed as null, must be left untouched. Prints one line per output; exits 1 when
// any fails.

#include <random>
#include <vector>

#include "emu.h"
#include "attention_reference.h"
// clang-format off
#include "common.cuh"
#include "grouped_gemm.cu"
// clang-format on

namespace {

constexpr double kTolerance = 1e-5;
constexpr int kTile = 64;        // TITAN_GG_TILE
constexpr unsigned kThreads = 256;  // TITAN_GG_THREADS

std::mt19937_64 rng(20261208);

std::vector<float> random_floats(size_t n) { return uniform_floats(rng, n, -1.0f, 1.0f); }

bool report(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    return report_rel_err(what, got, want, kTolerance);
}

bool report_untouched(const char* what, const std::vector<float>& got, const std::vector<float>& was,
                      size_t from, size_t to) {
    size_t moved = 0;
    for (size_t i = from; i < to; ++i) moved += emu_bit_cast<u32>(got[i]) != emu_bit_cast<u32>(was[i]);
    std::printf("%-36s %zu of %zu moved %s\n", what, moved, to - from, moved == 0 ? "ok" : "FAILED");
    return moved == 0;
}

// Experts' rows: 70, none, 130 (three tiles), 1, 60; then 9 rows that belong to no expert.
const std::vector<u32> kOffsets = {0, 70, 70, 200, 201, 261};
constexpr int kRows = 270;
constexpr int kExperts = 5;

int expert_of(int row) {
    for (int e = 0; e < kExperts; ++e)
        if ((u32)row < kOffsets[e + 1]) return e;
    return -1;
}

GgAddresses addresses(std::vector<std::vector<float>>& bufs) {
    GgAddresses out{};
    for (size_t e = 0; e < bufs.size(); ++e) out.at[e] = (unsigned long long)(uintptr_t)bufs[e].data();
    return out;
}

// out (+)= a . op(W_e) per expert, as the backend launches it.
bool grouped(const char* what, int k, int n, bool trans_b, bool accumulate) {
    std::vector<std::vector<float>> weights;
    for (int e = 0; e < kExperts; ++e) weights.push_back(random_floats((size_t)k * n));
    auto table = addresses(weights);
    std::vector<float> a = random_floats((size_t)kRows * k), out = random_floats((size_t)kRows * n);
    const std::vector<float> was = out;
    std::vector<double> want(out.begin(), out.end());
    for (int r = 0; r < (int)kOffsets[kExperts]; ++r) {
        const std::vector<float>& w = weights[expert_of(r)];
        for (int c = 0; c < n; ++c) {
            double s = accumulate ? (double)was[(size_t)r * n + c] : 0.0;
            for (int j = 0; j < k; ++j)
                s += (double)a[(size_t)r * k + j] * (trans_b ? w[(size_t)c * k + j] : w[(size_t)j * n + c]);
            want[(size_t)r * n + c] = s;
        }
    }
    EmuDim3 grid{(unsigned)((n + kTile - 1) / kTile), (unsigned)((kRows + kTile - 1) / kTile + kExperts), 1};
    emu::launch(grid, kThreads, [&] {
        grouped_gemm(out.data(), a.data(), table, kOffsets.data(), kExperts, k, n, trans_b, accumulate);
    });
    size_t routed = (size_t)kOffsets[kExperts] * n;
    std::vector<float> got(out.begin(), out.begin() + routed);
    bool ok = report(what, got, std::vector<double>(want.begin(), want.begin() + routed));
    std::string rest = std::string(what) + ", rows of no expert";
    return ok & report_untouched(rest.c_str(), out, was, routed, out.size());
}

// grads[e] += dy_e^T . x_e, expert 3's gradient passed as null.
bool weight_grads(int n_out, int k_in) {
    std::vector<std::vector<float>> grads;
    for (int e = 0; e < kExperts; ++e) grads.push_back(random_floats((size_t)n_out * k_in));
    const auto was = grads;
    auto table = addresses(grads);
    table.at[3] = 0;
    std::vector<float> dy = random_floats((size_t)kRows * n_out), x = random_floats((size_t)kRows * k_in);
    EmuDim3 grid{(unsigned)((k_in + kTile - 1) / kTile), (unsigned)((n_out + kTile - 1) / kTile), kExperts};
    emu::launch(grid, kThreads, [&] {
        grouped_weight_grad(table, dy.data(), x.data(), kOffsets.data(), n_out, k_in);
    });
    bool ok = true;
    for (int e = 0; e < kExperts; ++e) {
        std::string what = "weight grad, expert " + std::to_string(e);
        if (e == 3) {
            ok &= report_untouched((what + " (null)").c_str(), grads[e], was[e], 0, grads[e].size());
            continue;
        }
        std::vector<double> want(was[e].begin(), was[e].end());
        for (u32 r = kOffsets[e]; r < kOffsets[e + 1]; ++r)
            for (int o = 0; o < n_out; ++o)
                for (int i = 0; i < k_in; ++i)
                    want[(size_t)o * k_in + i] += (double)dy[(size_t)r * n_out + o] * x[(size_t)r * k_in + i];
        ok &= report(what.c_str(), grads[e], want);
    }
    return ok;
}

}  // namespace

int main() {
    emu::seed_schedule(20261208);
    bool ok = true;
    // The forward x . W^T (dim 40 -> hidden 72) and the input gradient dy . W added in.
    ok &= grouped("forward x.W^T", 40, 72, true, false);
    ok &= grouped("input grad dy.W, accumulated", 72, 40, false, true);
    ok &= weight_grads(72, 40);
    std::printf(ok ? "all outputs within tolerance\n" : "SOME OUTPUTS FAILED\n");
    return ok ? 0 : 1;
}
