// Runs the embedding backward (kernels/embedding.cu) on the CPU emulator: the tokens grouped by id
// as the host groups them (src/backend/cuda/ops/mod.rs, TokenGroups), many repeated ids, a width
// that is not a multiple of the 256-column blocks. The table must match, bit for bit, the plain
// loop over tokens in order that the CPU backend runs. Exits 1 on any difference.

#include <algorithm>
#include <numeric>
#include <random>

#include "emu.h"
// clang-format off
#include "common.cuh"
#include "embedding.cu"
// clang-format on

int main() {
    std::mt19937_64 rng(20261130);
    emu::seed_schedule(20261130);
    const int vocab = 11, tokens = 300, dim = 300;
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<u32> ids(tokens);
    for (auto& id : ids) id = (u32)(rng() % vocab);
    std::vector<float> dout((size_t)tokens * dim), table((size_t)vocab * dim);
    for (auto& x : dout) x = dist(rng);
    for (auto& x : table) x = dist(rng);

    std::vector<float> want = table;
    for (int t = 0; t < tokens; ++t)
        for (int d = 0; d < dim; ++d) want[(size_t)ids[t] * dim + d] += dout[(size_t)t * dim + d];

    std::vector<u32> order(tokens), rows, starts;
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](u32 a, u32 b) { return ids[a] < ids[b]; });
    for (int i = 0; i < tokens; ++i)
        if (rows.empty() || rows.back() != ids[order[i]]) {
            rows.push_back(ids[order[i]]);
            starts.push_back((u32)i);
        }
    starts.push_back((u32)tokens);

    std::vector<float> got = table;
    EmuDim3 grid{(unsigned)rows.size(), (unsigned)((dim + 255) / 256), 1};
    emu::launch(grid, 256, [&] {
        embedding_backward(got.data(), dout.data(), rows.data(), starts.data(), order.data(), dim);
    });
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += __float_as_uint(got[i]) != __float_as_uint(want[i]);
    bool ok = differ == 0;
    std::printf("%-26s %zu of %zu values differ %s\n", "embedding_backward", differ, got.size(),
                ok ? "ok" : "FAILED");
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
