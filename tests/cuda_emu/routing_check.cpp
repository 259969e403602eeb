// Runs a mixture of experts' routing kernels (kernels/routing.cu) on the CPU emulator with the
// backend's launch shapes (src/backend/cuda/ops/routing.rs): the router (softmax and sigmoid, with
// and without renormalisation, an expert bias, group-limited choice) and its backward (with and
// without the auxiliary loss's score gradient) against a float64 reference of the same
// definitions (backend/routing.rs); the dispatch order over several chunks against a stable sort,
// bit for bit; the combine against the in-order sum, bit for bit; the load count exactly. Prints one line per output;
// exits 1 when any fails.

#include <algorithm>
#include <numeric>
#include <string>
#include <random>

#include "emu.h"
#include "attention_reference.h"
// clang-format off
#include "common.cuh"
#include "routing.cu"
// clang-format on

namespace {

constexpr double kTolerance = 1e-5;
constexpr unsigned kTokenThreads = 128;  // TOKEN_THREADS
constexpr int kChunk = 1024;             // CHUNK

std::mt19937_64 rng(20261207);

std::vector<float> random_floats(size_t n, float lo, float hi) { return uniform_floats(rng, n, lo, hi); }

bool report(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    return report_rel_err(what, got, want, kTolerance);
}

bool report_exact(const char* what, const std::vector<u32>& got, const std::vector<u32>& want) {
    size_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    std::printf("%-36s %zu of %zu differ %s\n", what, wrong, want.size(), wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

struct Router {
    int E, K;
    bool sigmoid, norm;
    float scale;
    int groups, limited;  // groups 0: no group limit
    bool bias, aux;
};

struct Reference {
    std::vector<u32> experts;
    std::vector<double> weights, scores, dlogits;
};

// The float64 router of one token: scores, the choice (descending, lower index first), weights.
void route_token(const Router& r, const float* l, const float* bias, double* s, u32* chosen, double* w) {
    if (r.sigmoid) {
        for (int x = 0; x < r.E; ++x) s[x] = 1.0 / (1.0 + std::exp(-(double)l[x]));
    } else {
        double max = -INFINITY, sum = 0.0;
        for (int x = 0; x < r.E; ++x) max = std::max(max, (double)l[x]);
        for (int x = 0; x < r.E; ++x) sum += s[x] = std::exp(l[x] - max);
        for (int x = 0; x < r.E; ++x) s[x] /= sum;
    }
    std::vector<double> select(r.E);
    for (int x = 0; x < r.E; ++x) select[x] = s[x] + (bias ? bias[x] : 0.0);
    auto best_first = [&](const std::vector<double>& v) {
        std::vector<int> order(v.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
        return order;
    };
    if (r.groups > 0) {
        int per = r.E / r.groups;
        std::vector<double> group_score(r.groups);
        for (int g = 0; g < r.groups; ++g) {
            std::vector<double> v(select.begin() + g * per, select.begin() + (g + 1) * per);
            std::sort(v.begin(), v.end(), std::greater<double>());
            group_score[g] = r.sigmoid && per > 1 ? v[0] + v[1] : v[0];
        }
        std::vector<int> order = best_first(group_score);
        for (int i = r.limited; i < r.groups; ++i)
            for (int x = order[i] * per; x < (order[i] + 1) * per; ++x) select[x] = -INFINITY;
    }
    std::vector<int> order = best_first(select);
    double total = 0.0;
    for (int j = 0; j < r.K; ++j) total += s[chosen[j] = order[j]];
    for (int j = 0; j < r.K; ++j) w[j] = (r.norm ? s[chosen[j]] / total : s[chosen[j]]) * r.scale;
}

// The float64 logits' gradient of one token: the weights' Jacobian, the normalised scores' for
// the auxiliary loss, then the score function's.
void route_token_backward(const Router& r, const double* s, const u32* chosen, const float* dw,
                          const float* g, double* dl) {
    std::vector<double> ds(r.E, 0.0);
    double z = 0.0;
    for (int j = 0; j < r.K; ++j) z += s[chosen[j]];
    for (int j = 0; j < r.K; ++j)
        for (int i = 0; i < r.K; ++i) {
            // ∂w_j/∂s_{c_i}
            double d = r.norm ? ((i == j) / z - s[chosen[j]] / (z * z)) : (i == j);
            ds[chosen[i]] += r.scale * dw[j] * d;
        }
    if (g) {
        double total = 0.0, dot = 0.0;
        for (int x = 0; x < r.E; ++x) total += s[x];
        if (!r.sigmoid) total = 1.0;
        for (int x = 0; x < r.E; ++x) dot += g[x] * s[x];
        for (int x = 0; x < r.E; ++x) ds[x] += r.sigmoid ? g[x] / total - dot / (total * total) : g[x];
    }
    double dot = 0.0;
    for (int x = 0; x < r.E; ++x) dot += ds[x] * s[x];
    for (int x = 0; x < r.E; ++x) dl[x] = r.sigmoid ? ds[x] * s[x] * (1.0 - s[x]) : s[x] * (ds[x] - dot);
}

bool router_case(const char* name, const Router& r) {
    const int tokens = 50;
    std::vector<float> logits = random_floats((size_t)tokens * r.E, -3.0f, 3.0f);
    std::vector<float> bias = random_floats(r.E, -0.1f, 0.1f);
    std::vector<float> dw = random_floats((size_t)tokens * r.K, -1.0f, 1.0f);
    std::vector<float> g = random_floats((size_t)tokens * r.E, -0.5f, 0.5f);
    const float* bias_arg = r.bias ? bias.data() : nullptr;
    const float* aux_arg = r.aux ? g.data() : nullptr;

    Reference want{std::vector<u32>((size_t)tokens * r.K), std::vector<double>((size_t)tokens * r.K),
                   std::vector<double>((size_t)tokens * r.E), std::vector<double>((size_t)tokens * r.E)};
    for (int t = 0; t < tokens; ++t) {
        route_token(r, &logits[(size_t)t * r.E], bias_arg, &want.scores[(size_t)t * r.E],
                    &want.experts[(size_t)t * r.K], &want.weights[(size_t)t * r.K]);
        route_token_backward(r, &want.scores[(size_t)t * r.E], &want.experts[(size_t)t * r.K],
                             &dw[(size_t)t * r.K], aux_arg ? &g[(size_t)t * r.E] : nullptr,
                             &want.dlogits[(size_t)t * r.E]);
    }

    std::vector<u32> experts((size_t)tokens * r.K);
    std::vector<float> weights(experts.size()), scores(logits.size()), dlogits(logits.size());
    EmuDim3 grid{(tokens + kTokenThreads - 1) / kTokenThreads, 1, 1};
    emu::launch(grid, kTokenThreads, [&] {
        moe_route(experts.data(), weights.data(), scores.data(), logits.data(), bias_arg, tokens, r.E,
                  r.K, r.sigmoid, r.norm, r.scale, r.groups, r.limited);
    });
    emu::launch(grid, kTokenThreads, [&] {
        moe_route_backward(dlogits.data(), scores.data(), experts.data(), dw.data(), aux_arg, tokens,
                           r.E, r.K, r.sigmoid, r.norm, r.scale);
    });
    std::string label(name);
    bool ok = report_exact((label + " experts").c_str(), experts, want.experts);
    ok &= report((label + " weights").c_str(), weights, want.weights);
    ok &= report((label + " scores").c_str(), scores, want.scores);
    ok &= report((label + " dlogits").c_str(), dlogits, want.dlogits);
    return ok;
}

// The dispatch order of `tokens` tokens' `K` choices over `E` experts (several chunks, an expert
// count that is no multiple of 32, an expert nobody chose) against a stable sort by expert.
bool dispatch_order() {
    const int tokens = 700, K = 3, E = 37;
    const int n = tokens * K, chunks = (n + kChunk - 1) / kChunk;
    std::vector<u32> experts(n);
    std::uniform_int_distribution<int> pick(0, E - 2);  // expert E - 1 gets no row
    for (auto& e : experts) e = pick(rng);
    std::vector<u32> want_slots(n);
    std::iota(want_slots.begin(), want_slots.end(), 0u);
    std::stable_sort(want_slots.begin(), want_slots.end(),
                     [&](u32 a, u32 b) { return experts[a] < experts[b]; });
    std::vector<u32> want_rows(n), want_row_of_slot(n), want_offsets(E + 1, 0);
    for (int r = 0; r < n; ++r) {
        want_rows[r] = want_slots[r] / K;
        want_row_of_slot[want_slots[r]] = r;
    }
    for (u32 e : experts) ++want_offsets[e + 1];
    for (int e = 0; e < E; ++e) want_offsets[e + 1] += want_offsets[e];

    const unsigned threads = 64;  // E rounded up to whole warps
    std::vector<u32> counts((size_t)chunks * E), bases((size_t)chunks * E);
    std::vector<u32> rows(n, ~0u), slots(n, ~0u), row_of_slot(n, ~0u), offsets(E + 1, ~0u);
    emu::launch(EmuDim3{(unsigned)chunks, 1, 1}, threads,
                [&] { moe_chunk_counts(counts.data(), experts.data(), n, E); });
    emu::launch(EmuDim3{1, 1, 1}, threads,
                [&] { moe_offsets(offsets.data(), bases.data(), counts.data(), chunks, E); });
    emu::launch(EmuDim3{(unsigned)chunks, 1, 1}, threads, [&] {
        moe_place(rows.data(), slots.data(), row_of_slot.data(), experts.data(), bases.data(), n, E, K);
    });
    bool ok = report_exact("dispatch offsets", offsets, want_offsets);
    ok &= report_exact("dispatch rows", rows, want_rows);
    ok &= report_exact("dispatch slots", slots, want_slots);
    ok &= report_exact("dispatch row_of_slot", row_of_slot, want_row_of_slot);
    return ok;
}

// The combine: each token's rows added in increasing row order, as the CPU adds them, bit for bit.
bool combine() {
    const int tokens = 40, K = 4, width = 70;
    const int n = tokens * K;
    std::vector<u32> row_of_slot(n);
    std::iota(row_of_slot.begin(), row_of_slot.end(), 0u);
    std::shuffle(row_of_slot.begin(), row_of_slot.end(), rng);
    // Values of very different sizes, so that another order would round differently.
    std::vector<float> rows = random_floats((size_t)n * width, -1.0f, 1.0f);
    for (size_t i = 0; i < rows.size(); i += 3) rows[i] *= 1e7f;
    std::vector<float> out = random_floats((size_t)tokens * width, -1.0f, 1.0f), want = out;
    for (int t = 0; t < tokens; ++t) {
        std::vector<u32> order(&row_of_slot[(size_t)t * K], &row_of_slot[(size_t)t * K] + K);
        std::sort(order.begin(), order.end());
        for (u32 r : order)
            for (int c = 0; c < width; ++c) want[(size_t)t * width + c] += rows[(size_t)r * width + c];
    }
    emu::launch(EmuDim3{(unsigned)tokens, 1, 1}, 96,
                [&] { moe_combine(out.data(), rows.data(), row_of_slot.data(), K, width); });
    size_t wrong = 0;
    for (size_t i = 0; i < out.size(); ++i) wrong += emu_bit_cast<u32>(out[i]) != emu_bit_cast<u32>(want[i]);
    std::printf("%-36s %zu of %zu differ %s\n", "combine", wrong, out.size(), wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

// A step's load counted from two blocks' offsets into one row of counts each, exactly.
bool count_load() {
    const int E = 37, layers = 2;
    std::vector<float> counts((size_t)layers * E, 0.0f), want = counts;
    for (int l = 0; l < layers; ++l) {
        std::vector<u32> offsets(E + 1, 0);
        for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (u32)((e * 7 + l * 3) % 11);
        for (int e = 0; e < E; ++e) want[(size_t)l * E + e] += 2.0f * (float)(offsets[e + 1] - offsets[e]);
        for (int twice = 0; twice < 2; ++twice)
            emu::launch(EmuDim3{(unsigned)((E + kTokenThreads - 1) / kTokenThreads), 1, 1}, kTokenThreads,
                        [&] { moe_count_load(counts.data(), offsets.data(), (i64)l * E, E); });
    }
    size_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) wrong += counts[i] != want[i];
    std::printf("%-36s %zu of %zu differ %s\n", "count load", wrong, want.size(), wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

}  // namespace

int main() {
    emu::seed_schedule(20261207);
    bool ok = true;
    // Qwen3-MoE's softmax, renormalised; Mixtral-like without renormalising, with the aux loss.
    ok &= router_case("softmax norm", Router{24, 3, false, true, 1.0f, 0, 0, false, false});
    ok &= router_case("softmax aux", Router{24, 2, false, false, 1.3f, 0, 0, false, true});
    // DeepSeek-V3's sigmoid with the expert bias and group-limited choice, with the aux loss.
    ok &= router_case("sigmoid groups bias aux", Router{24, 3, true, true, 2.5f, 4, 2, true, true});
    ok &= router_case("sigmoid plain", Router{24, 4, true, false, 1.0f, 0, 0, false, false});
    ok &= dispatch_order();
    ok &= combine();
    ok &= count_load();
    std::printf(ok ? "all outputs within tolerance\n" : "SOME OUTPUTS FAILED\n");
    return ok ? 0 : 1;
}
