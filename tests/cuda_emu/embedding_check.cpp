// Runs the embedding backward (kernels/embedding.cu) on the CPU emulator: the tokens grouped by id
// as the host groups them (src/backend/cuda/ops/mod.rs, TokenGroups), many repeated ids, a width
// that is not a multiple of the 256-column blocks. The table must match, bit for bit, the plain
// loop over tokens in order that the CPU backend runs. The forward must give a zero row for an id
// of another rank's vocabulary shard (IGNORE_INDEX). Exits 1 on any difference.

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

    // Forward with every third id another tensor-parallel rank's (0xFFFFFFFF): a zero row there,
    // the table's row elsewhere.
    std::vector<u32> shard_ids = ids;
    for (int t = 0; t < tokens; t += 3) shard_ids[t] = 0xFFFFFFFFu;
    std::vector<float> out((size_t)tokens * dim, 7.0f), want_out((size_t)tokens * dim, 0.0f);
    for (int t = 0; t < tokens; ++t)
        if (shard_ids[t] != 0xFFFFFFFFu)
            for (int d = 0; d < dim; ++d) want_out[(size_t)t * dim + d] = table[(size_t)shard_ids[t] * dim + d];
    emu::launch(EmuDim3{(unsigned)tokens, 1, 1}, 256,
                [&] { embedding_forward(out.data(), table.data(), shard_ids.data(), dim); });
    size_t differ_fwd = 0;
    for (size_t i = 0; i < out.size(); ++i) differ_fwd += __float_as_uint(out[i]) != __float_as_uint(want_out[i]);
    std::printf("%-26s %zu of %zu values differ %s\n", "embedding_forward (shard)", differ_fwd, out.size(),
                differ_fwd == 0 ? "ok" : "FAILED");
    ok = ok && differ_fwd == 0;
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
