// Runs the tensor-core attention kernels (kernels/attention_tc.cu) on the CPU emulator and checks
// forward (output, log-sum-exp) and backward (dQ, dK, dV) against a float64 reference of causal
// grouped-query attention on the same bf16-rounded inputs (also the fused backward with 64 and 128
// keys per block, and at head_dim 64 the two-block forward). Shapes with documents (each query's
// position in its document) check the block-causal mask of the forward, dQ and dK/dV passes; the
// fused backward takes none (the host runs the split passes for them). The shapes are the GPU op check's
// (src/backend/crosscheck.rs), lengths that are not multiples of the 64-row tiles included; the
// tolerance is its bf16 one, on the same measure: max |kernel − reference| / max |reference|.
// Prints one line per output and exits 1 when any is outside the tolerance or not finite.

#include <random>
#include <string>

#include "emu.h"
#include "attention_reference.h"
// clang-format off
#include "common.cuh"
#include "tensor_core_emu.h"
#include "attention_tc.cu"
// clang-format on

namespace {

constexpr double kTolerance = 1e-2;

struct Bf16Tensor {
    std::vector<bf16_bits> bits;
    std::vector<double> values;
};

// Uniform in [-1, 1], element i times factor(i / row_len) when given.
Bf16Tensor random_tensor(std::mt19937_64& rng, size_t n, size_t row_len = 1,
                         float (*factor)(size_t row) = nullptr) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    Bf16Tensor t;
    for (size_t i = 0; i < n; ++i) {
        float x = dist(rng);
        if (factor) x *= factor(i / row_len);
        bf16_bits b = emu::bf16_round(x);
        t.bits.push_back(b);
        t.values.push_back(emu::bf16_value(b));
    }
    return t;
}

bool report(const Shape& s, const char* output, const std::vector<float>& got,
            const std::vector<double>& want) {
    double err = rel_err(got, want);
    bool ok = err <= kTolerance;  // NaN fails
    std::printf("%-10s %-9s rel err %.3e %s\n", s.name, output, err, ok ? "ok" : "FAILED");
    return ok;
}

// The bf16 copy of an output, for the GEMM after attention: bit for bit its rounding.
bool report_copy(const Shape& s, const char* output, const std::vector<bf16_bits>& copy,
                 const std::vector<float>& values) {
    size_t wrong = 0;
    for (size_t i = 0; i < values.size(); ++i) wrong += copy[i] != emu::bf16_round(values[i]);
    std::printf("%-10s %-9s %zu of %zu differ %s\n", s.name, output, wrong, values.size(),
                wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

bool check(const Shape& s, std::mt19937_64& rng) {
    int D = s.head_dim;
    size_t q_len = (size_t)s.batch * s.seq * s.heads * D;
    size_t kv_len = (size_t)s.batch * s.seq * s.kv_heads * D;
    size_t rows = (size_t)s.batch * s.heads * s.seq;
    // With growing_scores, key j is scaled by 1 + j/8 (rows are positions when batch is 1) and
    // queries by 16: each key tile's largest score lies far (more than the forward's rescaling
    // slack of 2^8) above the previous tile's, so the online softmax rescales on later tiles too,
    // not only on the first, and one that stopped rescaling would overflow fp32.
    size_t kv_row = (size_t)s.kv_heads * D;
    auto key_growth = [](size_t position) { return 1.0f + (float)position / 8.0f; };
    auto query_scale = [](size_t) { return 16.0f; };
    Bf16Tensor q = s.growing_scores ? random_tensor(rng, q_len, 1, query_scale)
                                    : random_tensor(rng, q_len),
               k = s.growing_scores ? random_tensor(rng, kv_len, kv_row, key_growth)
                                    : random_tensor(rng, kv_len),
               v = random_tensor(rng, kv_len), dout = random_tensor(rng, q_len);
    Reference ref = reference(s, q.values, k.values, v.values, dout.values);
    float scale = 1.0f / std::sqrt((float)D);
    unsigned tiles = (unsigned)((s.seq + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS);
    EmuDim3 per_query{tiles, (unsigned)s.heads, (unsigned)s.batch};
    EmuDim3 per_key{tiles, (unsigned)s.kv_heads, (unsigned)s.batch};

    const unsigned* docs = s.doc_pos.empty() ? nullptr : s.doc_pos.data();
    std::vector<float> out(q_len, NAN), lse(rows, NAN);
    std::vector<bf16_bits> out16(q_len, 0xffff);
    emu::launch(per_query, 128, [&] {
        if (D == 64)
            attention_forward_tc64(out.data(), out16.data(), lse.data(), q.bits.data(),
                                   k.bits.data(), v.bits.data(), s.seq, s.heads, s.kv_heads, scale,
                                   docs);
        else
            attention_forward_tc128(out.data(), out16.data(), lse.data(), q.bits.data(),
                                    k.bits.data(), v.bits.data(), s.seq, s.heads, s.kv_heads, scale,
                                    docs);
    });
    bool ok = report(s, "out", out, ref.out);
    ok &= report(s, "lse", lse, ref.lse);
    ok &= report_copy(s, "out bf16", out16, out);
    if (D == 64) {
        // The forward with two 16-row blocks per warp (128 queries per block).
        std::vector<float> out2(q_len, NAN), lse2(rows, NAN);
        std::vector<bf16_bits> out2_16(q_len, 0xffff);
        unsigned tiles2 = (unsigned)((s.seq + 2 * TITAN_TC_ROWS - 1) / (2 * TITAN_TC_ROWS));
        emu::launch(EmuDim3{tiles2, (unsigned)s.heads, (unsigned)s.batch}, 128, [&] {
            attention_forward_tc64x2(out2.data(), out2_16.data(), lse2.data(), q.bits.data(),
                                     k.bits.data(), v.bits.data(), s.seq, s.heads, s.kv_heads,
                                     scale, docs);
        });
        ok &= report(s, "out x2", out2, ref.out);
        ok &= report(s, "lse x2", lse2, ref.lse);
        ok &= report_copy(s, "out16 x2", out2_16, out2);
    }

    // delta = rowsum(dout * out) from the kernel's own output, as the backend's delta kernel does.
    std::vector<float> delta(rows);
    for (int b = 0; b < s.batch; ++b)
        for (int i = 0; i < s.seq; ++i)
            for (int h = 0; h < s.heads; ++h) {
                size_t base = ((size_t)(b * s.seq + i) * s.heads + h) * D;
                float sum = 0.0f;
                for (int d = 0; d < D; ++d) sum += (float)dout.values[base + d] * out[base + d];
                delta[((size_t)b * s.heads + h) * s.seq + i] = sum;
            }
    std::vector<float> dq(q_len, NAN), dk(kv_len, NAN), dv(kv_len, NAN);
    emu::launch(per_query, 128, [&] {
        auto kernel = D == 64 ? attention_backward_dq_tc64 : attention_backward_dq_tc128;
        kernel(dq.data(), dout.bits.data(), q.bits.data(), k.bits.data(), v.bits.data(),
               lse.data(), delta.data(), s.seq, s.heads, s.kv_heads, scale, docs);
    });
    std::vector<decltype(&attention_backward_dkdv_tc64)> dkdv_passes;
    if (D == 64)
        dkdv_passes = {attention_backward_dkdv_tc64};
    else
        dkdv_passes = {attention_backward_dk_tc128, attention_backward_dv_tc128};
    for (auto pass : dkdv_passes)
        emu::launch(per_key, 128, [&] {
            pass(dk.data(), dv.data(), dout.bits.data(), q.bits.data(), k.bits.data(),
                 v.bits.data(), lse.data(), delta.data(), s.seq, s.heads, s.kv_heads, scale,
                 docs);
        });
    ok &= report(s, "dq", dq, ref.dq);
    ok &= report(s, "dk", dk, ref.dk);
    ok &= report(s, "dv", dv, ref.dv);
    if (docs == nullptr) {
        // The fused backward with 64 and 128 keys per block, its dQ additions taking turns (the
        // default) or not; it adds into a zeroed dq.
        for (auto [warps, ordered] : {std::pair{4, true}, {8, true}, {8, false}}) {
            std::vector<float> fdq(q_len, 0.0f), fdk(kv_len, NAN), fdv(kv_len, NAN);
            size_t query_tiles = (size_t)(s.seq + TITAN_TC_ROWS - 1) / TITAN_TC_ROWS;
            std::vector<int> turns((size_t)s.batch * s.heads * query_tiles + 1, 0);
            unsigned keys = 16u * (unsigned)warps;
            EmuDim3 grid{(unsigned)((s.seq + keys - 1) / keys), (unsigned)s.kv_heads,
                         (unsigned)s.batch};
            emu::launch(grid, 32u * (unsigned)warps, [&] {
                auto kernel = D == 64 ? (warps == 4 ? attention_backward_fused_tc64
                                                    : attention_backward_fused_tc64w8)
                                      : (warps == 4 ? attention_backward_fused_tc128
                                                    : attention_backward_fused_tc128w8);
                kernel(fdq.data(), fdk.data(), fdv.data(), dout.bits.data(), q.bits.data(),
                       k.bits.data(), v.bits.data(), lse.data(), delta.data(),
                       ordered ? turns.data() : nullptr, s.seq, s.heads, s.kv_heads, scale);
            });
            if (ordered) {
                // Every query tile's counter ends at the number of key blocks that visited it.
                size_t wrong = 0;
                for (int b = 0; b < s.batch; ++b)
                    for (int h = 0; h < s.heads; ++h)
                        for (size_t i = 0; i < query_tiles; ++i) {
                            int visitors = (int)(i * TITAN_TC_ROWS / keys) + 1;
                            visitors = std::min(visitors, (int)grid.x);
                            wrong += turns[((size_t)b * s.heads + h) * query_tiles + i] != visitors;
                        }
                // And one ticket per block.
                wrong += turns.back() != (int)(grid.x * grid.y * grid.z);
                std::printf("%-10s %-9s %zu of %zu counters wrong %s\n", s.name,
                            warps == 4 ? "turns" : "turns8", wrong, turns.size(),
                            wrong == 0 ? "ok" : "FAILED");
                ok &= wrong == 0;
            }
            std::string tag = !ordered ? " racing8" : warps == 4 ? " fused" : " fused8";
            ok &= report(s, ("dq" + tag).c_str(), fdq, ref.dq);
            ok &= report(s, ("dk" + tag).c_str(), fdk, ref.dk);
            ok &= report(s, ("dv" + tag).c_str(), fdv, ref.dv);
        }
    }
    return ok;
}

}  // namespace

// Each query's position in its document for documents of the given lengths, repeated to fill
// every sequence of `s` (a sequence's first token starts a document too, as titan's samples do).
Shape with_documents(Shape s, std::vector<int> lengths) {
    for (int b = 0; b < s.batch; ++b) {
        int at = 0, doc = b;  // each sequence starts at another length
        while (at < s.seq) {
            int len = lengths[(size_t)doc++ % lengths.size()];
            for (int p = 0; p < len && at < s.seq; ++p, ++at) s.doc_pos.push_back((unsigned)p);
        }
    }
    return s;
}

int main(int argc, char** argv) {
    std::vector<Shape> shapes = {
        {"hd64", 1, 77, 4, 2, 64},
        {"hd128", 1, 40, 8, 2, 128},
        {"hd64 long", 2, 200, 4, 2, 64},
        {"hd128 long", 1, 150, 4, 1, 128},
        {"hd64 even", 1, 128, 2, 2, 64},
        {"hd64 grow", 1, 200, 2, 1, 64, true},
        {"hd128 grow", 1, 150, 2, 1, 128, true},
        // Documents shorter than a tile, longer than two, one ending on a tile boundary.
        with_documents({"hd64 docs", 2, 300, 4, 2, 64}, {5, 140, 64, 1, 31, 90}),
        with_documents({"hd128 docs", 1, 200, 4, 1, 128}, {70, 3, 128, 17}),
        with_documents({"hd64 grow docs", 1, 256, 2, 1, 64, true}, {100, 156}),
    };
    unsigned long long seed = argc > 1 ? std::stoull(argv[1]) : 20261130;
    std::mt19937_64 rng(seed);
    emu::seed_schedule(seed);
    bool ok = true;
    for (const Shape& s : shapes) ok &= check(s, rng);
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
