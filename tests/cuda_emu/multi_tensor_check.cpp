// Runs the multi-tensor kernels (kernels/multi_tensor.cu) on the CPU emulator over a list with an
// empty tensor and lengths on both sides of the 8192-element chunks, on a grid smaller than the
// list so blocks stride: AdamW and the bf16 copy must match the single-tensor element functions
// bit for bit, and the sum of squares a float64 sum to 1e-12. Exits 1 on any mismatch.

#include <random>

#include "emu.h"
// clang-format off
#include "common.cuh"
#include "cast.cu"
#include "adamw.cu"
#include "multi_tensor.cu"
// clang-format on

namespace {

struct List {
    std::vector<std::vector<float>> tensors;
    std::vector<float*> pointers;
};

List random_list(std::mt19937_64& rng, const std::vector<int>& lens, float scale, bool positive) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    List l;
    for (int n : lens) {
        std::vector<float> t(n);
        for (float& v : t) v = positive ? std::fabs(dist(rng)) : dist(rng);
        l.tensors.push_back(std::move(t));
    }
    for (auto& t : l.tensors) l.pointers.push_back(t.data());
    return l;
}

bool same_bits(const char* what, const List& got, const List& want) {
    for (size_t t = 0; t < got.tensors.size(); ++t)
        for (size_t j = 0; j < got.tensors[t].size(); ++j)
            if (__float_as_uint(got.tensors[t][j]) != __float_as_uint(want.tensors[t][j])) {
                std::printf("%-26s tensor %zu element %zu: %.9g, want %.9g FAILED\n", what, t, j,
                            got.tensors[t][j], want.tensors[t][j]);
                return false;
            }
    std::printf("%-26s bitwise equal ok\n", what);
    return true;
}

}  // namespace

int main() {
    std::mt19937_64 rng(20261130);
    emu::seed_schedule(20261130);
    const std::vector<int> lens = {3000, 0, 8192, 1, 8193, 20000, 5};
    std::vector<i64> offsets = {0};
    for (int n : lens) offsets.push_back(offsets.back() + n);
    int n = (int)lens.size();
    EmuDim3 grid{3, 1, 1};

    List p = random_list(rng, lens, 1.0f, false), g = random_list(rng, lens, 0.1f, false),
         m = random_list(rng, lens, 0.01f, false), v = random_list(rng, lens, 1e-3f, true);
    List p_ref = p, m_ref = m, v_ref = v;
    float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, step_size = 1.7e-3f, bias2_sqrt = 0.37f,
          decay = 0.9999f, l2 = 0.0f, grad_scale = 0.5f;
    for (int t = 0; t < n; ++t)
        for (i64 j = 0; j < lens[t]; ++j)
            adamw_update(p_ref.tensors[t].data(), g.tensors[t].data(), m_ref.tensors[t].data(),
                         v_ref.tensors[t].data(), j, b1, b2, eps, step_size, bias2_sqrt, decay,
                         l2, grad_scale);
    emu::launch(grid, 256, [&] {
        adamw_step_all(p.pointers.data(), (const float* const*)g.pointers.data(),
                       m.pointers.data(), v.pointers.data(), offsets.data(), n, b1, b2, eps,
                       step_size, bias2_sqrt, decay, l2, grad_scale);
    });
    bool ok = same_bits("adamw_step_all param", p, p_ref);
    ok &= same_bits("adamw_step_all exp_avg", m, m_ref);
    ok &= same_bits("adamw_step_all exp_avg_sq", v, v_ref);

    List copy = random_list(rng, lens, 1.0f, false), copy_ref = p;
    for (auto& t : copy_ref.tensors)
        for (float& x : t) x = round_bf16(x);
    std::vector<std::vector<unsigned short>> bits;
    std::vector<unsigned short*> bit_pointers;
    for (int len : lens) bits.emplace_back(len, 0xffff);
    for (auto& b : bits) bit_pointers.push_back(b.data());
    emu::launch(grid, 256, [&] {
        copy_rounded_to_bf16_all(copy.pointers.data(), bit_pointers.data(),
                                 (const float* const*)p.pointers.data(), offsets.data(), n);
    });
    ok &= same_bits("copy_rounded_to_bf16_all", copy, copy_ref);
    bool bits_ok = true;
    for (size_t t = 0; t < bits.size(); ++t)
        for (size_t j = 0; j < bits[t].size(); ++j)
            bits_ok &= (unsigned)bits[t][j] << 16 == __float_as_uint(copy_ref.tensors[t][j]);
    std::printf("%-26s %s\n", "copy_rounded_to_bf16_all bf16 bits", bits_ok ? "equal ok" : "FAILED");
    ok &= bits_ok;

    List zeroed = random_list(rng, lens, 1.0f, false);
    emu::launch(grid, 256, [&] { fill_all(zeroed.pointers.data(), offsets.data(), n, 0.5f); });
    bool fill_ok = true;
    for (auto& t : zeroed.tensors)
        for (float x : t) fill_ok &= x == 0.5f;
    std::printf("%-26s %s\n", "fill_all", fill_ok ? "every value set ok" : "FAILED");
    ok &= fill_ok;

    double want = 0.0;
    for (auto& t : g.tensors)
        for (float x : t) want += (double)x * x;
    std::vector<double> partials(grid.x, NAN);
    emu::launch(grid, 256, [&] {
        sum_squares_all_partial(partials.data(), (const float* const*)g.pointers.data(),
                                offsets.data(), n);
    });
    double got = 0.0;
    for (double x : partials) got += x;
    double err = std::fabs(got - want) / want;
    bool sum_ok = err <= 1e-12;
    std::printf("%-26s rel err %.3e %s\n", "sum_squares_all", err, sum_ok ? "ok" : "FAILED");
    ok &= sum_ok;
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
