// Runs the fp32 CUDA kernels that have no tensor cores on the CPU emulator against float64
// references: causal attention (kernels/attention.cu: forward, delta, dQ, dK/dV, at head dims that
// are and are not multiples of the 32 lanes; with documents and a sliding window; ring blocks with
// and without documents; attention sinks), RMSNorm forward and backward (kernels/norm.cu, with
// the two-pass weight gradient), RoPE both ways (kernels/rope.cu) and SwiGLU both ways
// (kernels/elementwise.cu). Launch shapes are the backend's (src/backend/cuda/ops). The tolerance is
// the GPU op check's fp32 one. Prints one line per output; exits 1 when any fails.

#include <random>
#include <string>

#include "emu.h"
#include "attention_reference.h"
// clang-format off
#include "common.cuh"
#include "tensor_core_emu.h"
#include "elementwise.cu"
#include "cast.cu"
#include "norm.cu"
#include "rope.cu"
#include "attention.cu"
// clang-format on

namespace {

constexpr double kTolerance = 1e-5;

std::mt19937_64 rng(20261130);

std::vector<float> random_floats(size_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

bool report(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    double err = rel_err(got, want);
    bool ok = err <= kTolerance;
    std::printf("%-28s rel err %.3e %s\n", what, err, ok ? "ok" : "FAILED");
    return ok;
}

// A kernel's bf16 copy of its output: every value the nearest-even bf16 of the f32 output, bit
// for bit, from element `from` on.
bool report_copy(const char* what, const std::vector<bf16_bits>& copy, const std::vector<float>& values,
                 size_t from = 0) {
    size_t wrong = 0;
    for (size_t i = from; i < values.size(); ++i) wrong += copy[i] != emu::bf16_round(values[i]);
    std::printf("%-28s %zu of %zu differ %s\n", what, wrong, values.size() - from,
                wrong == 0 ? "ok" : "FAILED");
    return wrong == 0;
}

bool attention(const Shape& s) {
    int D = s.head_dim;
    size_t q_len = (size_t)s.batch * s.seq * s.heads * D, kv_len = (size_t)s.batch * s.seq * s.kv_heads * D;
    size_t rows = (size_t)s.batch * s.heads * s.seq;
    auto q = random_floats(q_len), k = random_floats(kv_len), v = random_floats(kv_len),
         dout = random_floats(q_len);
    Reference ref = reference(s, widen(q), widen(k), widen(v), widen(dout));
    float scale = 1.0f / std::sqrt((float)D);
    unsigned per_warp = (unsigned)((s.seq + TITAN_ATTN_WARPS - 1) / TITAN_ATTN_WARPS);
    EmuDim3 per_query{per_warp, (unsigned)s.heads, (unsigned)s.batch};
    EmuDim3 per_key{per_warp, (unsigned)s.kv_heads, (unsigned)s.batch};
    unsigned threads = TITAN_ATTN_WARPS * 32;
    std::vector<float> out(q_len, NAN), lse(rows, NAN), delta(rows, NAN);
    const unsigned* doc_pos = s.doc_pos.empty() ? nullptr : s.doc_pos.data();
    emu::launch(per_query, threads, [&] {
        attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s.seq, s.seq, s.seq,
                          s.heads, s.kv_heads, D, 0, scale, doc_pos, s.window);
    });
    emu::launch(per_query, threads, [&] {
        attention_backward_delta(delta.data(), dout.data(), out.data(), s.seq, s.heads, D);
    });
    std::vector<float> dq(q_len, NAN), dk(kv_len, NAN), dv(kv_len, NAN);
    emu::launch(per_query, threads, [&] {
        attention_backward_dq(dq.data(), dout.data(), q.data(), k.data(), v.data(), lse.data(),
                              delta.data(), s.seq, s.seq, 0, s.heads, s.kv_heads, D, scale,
                              doc_pos, s.window);
    });
    emu::launch(per_key, threads, [&] {
        attention_backward_dkdv(dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(),
                                lse.data(), delta.data(), s.seq, s.seq, 0, s.heads, s.kv_heads, D,
                                scale, doc_pos, s.window);
    });
    std::string name = std::string("attention ") + s.name;
    bool ok = report((name + " out").c_str(), out, ref.out);
    ok &= report((name + " lse").c_str(), lse, ref.lse);
    ok &= report((name + " dq").c_str(), dq, ref.dq);
    ok &= report((name + " dk").c_str(), dk, ref.dk);
    ok &= report((name + " dv").c_str(), dv, ref.dv);
    return ok;
}

// Context parallelism's ring attention over two blocks of keys: the queries at positions
// P..P+c against keys 0..P (every key visible, q_offset P) and keys P..P+c (the diagonal,
// q_offset 0), each block's forward merged by attention_merge and each block's backward run with
// the merged out and lse, must equal whole causal attention over P + c positions whose output
// gradient is zero outside the chunk. With `doc_pos` (the whole sequence's document positions),
// block-causal: then the queries of a document starting after P see none of the first block
// (output 0, lse -inf), which the merge must fold in as nothing.
bool ring_attention_blocks(const char* name, std::vector<unsigned> doc_pos) {
    const int P = 20, c = 13, S = P + c, H = 4, KVH = 2, D = 16;
    Shape whole{"ring", 1, S, H, KVH, D};
    whole.doc_pos = doc_pos;
    std::vector<unsigned> chunk_pos(doc_pos.begin() + (doc_pos.empty() ? 0 : P), doc_pos.end());
    const unsigned* pos = chunk_pos.empty() ? nullptr : chunk_pos.data();
    auto q = random_floats((size_t)S * H * D), k = random_floats((size_t)S * KVH * D),
         v = random_floats((size_t)S * KVH * D), dout = random_floats((size_t)S * H * D);
    std::fill(dout.begin(), dout.begin() + (size_t)P * H * D, 0.0f);
    Reference ref = reference(whole, widen(q), widen(k), widen(v), widen(dout));
    auto rows = [](const std::vector<float>& x, int from, int to, int width) {
        return std::vector<float>(x.begin() + (size_t)from * width, x.begin() + (size_t)to * width);
    };
    auto q_c = rows(q, P, S, H * D), do_c = rows(dout, P, S, H * D);
    float scale = 1.0f / std::sqrt((float)D);
    unsigned threads = TITAN_ATTN_WARPS * 32;
    auto grid = [](int n, int heads) {
        return EmuDim3{(unsigned)((n + TITAN_ATTN_WARPS - 1) / TITAN_ATTN_WARPS), (unsigned)heads, 1};
    };
    struct Block {
        int from, to, q_offset;
        std::vector<float> out, lse;
    };
    Block blocks[2] = {{0, P, P, {}, {}}, {P, S, 0, {}, {}}};
    for (Block& blk : blocks) {
        int n = blk.to - blk.from;
        auto kb = rows(k, blk.from, blk.to, KVH * D), vb = rows(v, blk.from, blk.to, KVH * D);
        blk.out.assign((size_t)c * H * D, NAN);
        blk.lse.assign((size_t)H * c, NAN);
        emu::launch(grid(c, H), threads, [&] {
            attention_forward(blk.out.data(), blk.lse.data(), q_c.data(), kb.data(), vb.data(), c,
                              n, n, H, KVH, D, blk.q_offset, scale, pos, 0);
        });
    }
    std::vector<float> out = blocks[0].out, lse = blocks[0].lse;
    emu::launch(EmuDim3{1, 1, 1}, 128, [&] {
        attention_merge(out.data(), lse.data(), blocks[1].out.data(), blocks[1].lse.data(), 1, c, H,
                        D);
    });
    std::vector<float> delta((size_t)H * c, NAN), dq((size_t)c * H * D, 0.0f), dk, dv;
    emu::launch(grid(c, H), threads, [&] {
        attention_backward_delta(delta.data(), do_c.data(), out.data(), c, H, D);
    });
    for (Block& blk : blocks) {
        int n = blk.to - blk.from;
        auto kb = rows(k, blk.from, blk.to, KVH * D), vb = rows(v, blk.from, blk.to, KVH * D);
        std::vector<float> dq_b((size_t)c * H * D, NAN), dk_b(kb.size(), NAN), dv_b(vb.size(), NAN);
        emu::launch(grid(c, H), threads, [&] {
            attention_backward_dq(dq_b.data(), do_c.data(), q_c.data(), kb.data(), vb.data(),
                                  lse.data(), delta.data(), c, n, blk.q_offset, H, KVH, D, scale,
                                  pos, 0);
        });
        emu::launch(grid(n, KVH), threads, [&] {
            attention_backward_dkdv(dk_b.data(), dv_b.data(), do_c.data(), q_c.data(), kb.data(),
                                    vb.data(), lse.data(), delta.data(), c, n, blk.q_offset, H, KVH,
                                    D, scale, pos, 0);
        });
        for (size_t i = 0; i < dq.size(); ++i) dq[i] += dq_b[i];
        dk.insert(dk.end(), dk_b.begin(), dk_b.end());
        dv.insert(dv.end(), dv_b.begin(), dv_b.end());
    }
    auto chunk = [&](const std::vector<double>& x, int width) {
        return std::vector<double>(x.begin() + (size_t)P * width, x.end());
    };
    std::vector<double> want_lse;
    for (int h = 0; h < H; ++h)
        want_lse.insert(want_lse.end(), ref.lse.begin() + (size_t)h * S + P,
                        ref.lse.begin() + (size_t)(h + 1) * S);
    std::string label = std::string("ring blocks") + name;
    bool ok = report((label + " merged out").c_str(), out, chunk(ref.out, H * D));
    ok &= report((label + " merged lse").c_str(), lse, want_lse);
    ok &= report((label + " dq").c_str(), dq, chunk(ref.dq, H * D));
    ok &= report((label + " dk").c_str(), dk, ref.dk);
    ok &= report((label + " dv").c_str(), dv, ref.dv);
    return ok;
}

// dim a multiple of 4 takes the kernels' 16-byte path, any other dim the scalar one.
bool rmsnorm(int dim) {
    const int rows = 37;
    const float eps = 1e-5f;
    auto x = random_floats((size_t)rows * dim), w = random_floats(dim), dout = random_floats((size_t)rows * dim);
    auto dx0 = random_floats((size_t)rows * dim), dw0 = random_floats(dim);
    std::vector<double> want_out(x.size()), want_dx(dx0.begin(), dx0.end()), want_dw(dw0.begin(), dw0.end());
    for (int r = 0; r < rows; ++r) {
        double ss = 0.0, dot = 0.0;
        for (int d = 0; d < dim; ++d) ss += (double)x[r * dim + d] * x[r * dim + d];
        double rs = 1.0 / std::sqrt(ss / dim + eps);
        for (int d = 0; d < dim; ++d) {
            want_out[r * dim + d] = x[r * dim + d] * rs * w[d];
            dot += (double)dout[r * dim + d] * w[d] * x[r * dim + d];
            want_dw[d] += (double)dout[r * dim + d] * x[r * dim + d] * rs;
        }
        for (int d = 0; d < dim; ++d)
            want_dx[r * dim + d] += rs * (dout[r * dim + d] * w[d] - x[r * dim + d] * rs * rs * dot / dim);
    }
    std::vector<float> out(x.size(), NAN), rstd(rows, NAN), dx = dx0, dw = dw0;
    std::vector<bf16_bits> out16(x.size(), 0xffff), dx16(x.size(), 0xffff);
    EmuDim3 per_row{(rows + TITAN_NORM_WARPS - 1) / TITAN_NORM_WARPS, 1, 1};
    emu::launch(per_row, 32 * TITAN_NORM_WARPS, [&] {
        rmsnorm_forward(out.data(), out16.data(), rstd.data(), x.data(), w.data(), rows, dim, eps);
    });
    emu::launch(per_row, 32 * TITAN_NORM_WARPS, [&] {
        rmsnorm_backward_dx(dx.data(), dx16.data(), dout.data(), x.data(), w.data(), rstd.data(),
                            rows, dim);
    });
    // The weight gradient's two passes, with chunks of 16 rows (the backend uses more).
    const int per_chunk = 16, chunks = (rows + per_chunk - 1) / per_chunk;
    std::vector<float> partial((size_t)chunks * dim, NAN);
    unsigned column_blocks = (unsigned)((dim + 127) / 128);
    emu::launch(EmuDim3{column_blocks, (unsigned)chunks, 1}, 128, [&] {
        rmsnorm_dweight_partial(partial.data(), dout.data(), x.data(), rstd.data(), rows, dim, per_chunk);
    });
    emu::launch(EmuDim3{column_blocks, 1, 1}, 128,
                [&] { rmsnorm_dweight_reduce(dw.data(), partial.data(), chunks, dim); });
    std::string tag = " dim " + std::to_string(dim);
    bool ok = report(("rmsnorm_forward" + tag).c_str(), out, want_out);
    ok &= report_copy(("rmsnorm_forward bf16" + tag).c_str(), out16, out);
    // A bf16-only output (no f32 storage): the same bf16 values.
    std::vector<bf16_bits> only16(x.size(), 0xffff);
    std::vector<float> rstd2(rows, NAN);
    emu::launch(per_row, 32 * TITAN_NORM_WARPS, [&] {
        rmsnorm_forward(nullptr, only16.data(), rstd2.data(), x.data(), w.data(), rows, dim, eps);
    });
    ok &= report_copy(("rmsnorm_forward bf16 only" + tag).c_str(), only16, out);
    ok &= report(("rmsnorm_backward dx" + tag).c_str(), dx, want_dx);
    ok &= report_copy(("rmsnorm_backward bf16" + tag).c_str(), dx16, dx);
    ok &= report(("rmsnorm_backward dweight" + tag).c_str(), dw, want_dw);
    return ok;
}

bool rope() {
    const int batch = 2, seq = 19, heads = 3, hd = 16, offset = 5, half = hd / 2;
    std::vector<float> cos_t((size_t)(seq + offset) * half), sin_t(cos_t.size());
    for (int p = 0; p < seq + offset; ++p)
        for (int i = 0; i < half; ++i) {
            double theta = p * std::pow(500000.0, -2.0 * i / hd);
            cos_t[p * half + i] = (float)std::cos(theta);
            sin_t[p * half + i] = (float)std::sin(theta);
        }
    auto x = random_floats((size_t)batch * seq * heads * hd);
    std::vector<double> want(x.size());
    long long pairs = (long long)x.size() / 2;
    for (long long p = 0; p < pairs; ++p) {
        int i = (int)(p % half);
        long long pos = offset + (p / half / heads) % seq;
        double c = cos_t[pos * half + i], s = sin_t[pos * half + i];
        want[2 * p] = x[2 * p] * c - x[2 * p + 1] * s;
        want[2 * p + 1] = x[2 * p] * s + x[2 * p + 1] * c;
    }
    std::vector<float> y = x;
    std::vector<bf16_bits> y16(x.size(), 0xffff);
    EmuDim3 grid{(unsigned)((pairs + 255) / 256), 1, 1};
    emu::launch(grid, 256, [&] {
        rope_rotate(y.data(), y16.data(), cos_t.data(), sin_t.data(), pairs, seq, heads, hd,
                    offset, 1.0f);
    });
    bool ok = report("rope forward", y, want);
    ok &= report_copy("rope forward bf16", y16, y);
    // The backward (direction -1) undoes the forward.
    emu::launch(grid, 256, [&] {
        rope_rotate(y.data(), nullptr, cos_t.data(), sin_t.data(), pairs, seq, heads, hd, offset,
                    -1.0f);
    });
    ok &= report("rope backward of forward", y, widen(x));
    return ok;
}

// SwiGLU's output and gradients in float64.
void swiglu_reference(const std::vector<float>& gate, const std::vector<float>& up,
                      const std::vector<float>& dout, std::vector<double>& out,
                      std::vector<double>& dgate, std::vector<double>& dup) {
    out.resize(gate.size());
    dgate.resize(gate.size());
    dup.resize(gate.size());
    for (size_t i = 0; i < gate.size(); ++i) {
        double g = gate[i], sg = 1.0 / (1.0 + std::exp(-g));
        out[i] = g * sg * up[i];
        dup[i] = dout[i] * g * sg;
        dgate[i] = dout[i] * up[i] * sg * (1.0 + g * (1.0 - sg));
    }
}

// gpt-oss's clamped SwiGLU against float64, with values past both clamps' bounds and on them.
bool clamped_swiglu() {
    const long long n = 3000;
    const float alpha = 1.702f, limit = 7.0f;
    auto gate = random_floats(n, 10.0f), up = random_floats(n, 10.0f), dact = random_floats(n);
    gate[0] = limit, up[1] = -limit, up[2] = limit;
    std::vector<double> want_act(n), want_dgate(n), want_dup(n);
    for (long long i = 0; i < n; ++i) {
        double g = std::min((double)gate[i], (double)limit);
        double u = std::max(std::min((double)up[i], (double)limit), -(double)limit);
        double s = 1.0 / (1.0 + std::exp(-alpha * g));
        want_act[i] = (u + 1.0) * g * s;
        want_dgate[i] = gate[i] <= limit ? dact[i] * (u + 1.0) * (s + g * alpha * s * (1.0 - s)) : 0.0;
        want_dup[i] = (up[i] >= -limit && up[i] <= limit) ? dact[i] * g * s : 0.0;
    }
    std::vector<float> act(n, NAN), dgate(n, NAN), dup(n, NAN);
    EmuDim3 grid{3, 1, 1};  // the grid-stride loop wraps
    emu::launch(grid, 256, [&] { clamped_swiglu_forward(act.data(), gate.data(), up.data(), alpha, limit, n); });
    emu::launch(grid, 256, [&] {
        clamped_swiglu_backward(dgate.data(), dup.data(), dact.data(), gate.data(), up.data(), alpha, limit, n);
    });
    bool ok = report("clamped_swiglu_forward", act, want_act);
    ok &= report("clamped_swiglu_backward dgate", dgate, want_dgate);
    ok &= report("clamped_swiglu_backward dup", dup, want_dup);
    return ok;
}

bool swiglu() {
    const long long n = 5000;
    auto gate = random_floats(n, 4.0f), up = random_floats(n), dout = random_floats(n);
    std::vector<double> want_out, want_dgate, want_dup;
    swiglu_reference(gate, up, dout, want_out, want_dgate, want_dup);
    std::vector<float> out(n, NAN), dgate(n, NAN), dup(n, NAN);
    std::vector<bf16_bits> out16(n, 0xffff), dgate16(n, 0xffff), dup16(n, 0xffff);
    EmuDim3 grid{3, 1, 1};  // fewer blocks than elements / 256: the grid-stride loop wraps
    emu::launch(grid, 256, [&] { swiglu_forward(out.data(), out16.data(), gate.data(), up.data(), nullptr, nullptr, n); });
    emu::launch(grid, 256, [&] {
        swiglu_backward(dgate.data(), dup.data(), dgate16.data(), dup16.data(), dout.data(),
                        gate.data(), up.data(), nullptr, nullptr, nullptr, n);
    });
    bool ok = report("swiglu_forward", out, want_out);
    ok &= report("swiglu_backward dgate", dgate, want_dgate);
    ok &= report("swiglu_backward dup", dup, want_dup);
    ok &= report_copy("swiglu_forward bf16", out16, out);
    // A bf16-only output: no f32 storage (null), the same bf16 values.
    std::vector<bf16_bits> only16(n, 0xffff);
    emu::launch(grid, 256, [&] { swiglu_forward(nullptr, only16.data(), gate.data(), up.data(), nullptr, nullptr, n); });
    ok &= report_copy("swiglu_forward bf16 only", only16, out);
    ok &= report_copy("swiglu_backward bf16 dgate", dgate16, dgate);
    ok &= report_copy("swiglu_backward bf16 dup", dup16, dup);
    // bf16-only gradients (null f32 destinations): the same bf16 values, aligned and from an odd
    // offset (the one-by-one loop).
    for (int at : {0, 1}) {
        std::vector<bf16_bits> dgate_only(n, 0xffff), dup_only(n, 0xffff);
        emu::launch(grid, 256, [&] {
            swiglu_backward(nullptr, nullptr, dgate_only.data() + at, dup_only.data() + at,
                            dout.data() + at, gate.data() + at, up.data() + at, nullptr, nullptr, nullptr, n - at);
        });
        ok &= report_copy(at ? "swiglu_backward bf16-only dgate unaligned" : "swiglu_backward bf16-only dgate",
                          dgate_only, dgate, at);
        ok &= report_copy(at ? "swiglu_backward bf16-only dup unaligned" : "swiglu_backward bf16-only dup",
                          dup_only, dup, at);
    }
    // Views one element in: not 16-byte aligned, so the one-by-one loop runs (the forward
    // without a bf16 copy, the backward with).
    std::fill(out.begin(), out.end(), NAN);
    std::fill(dgate.begin(), dgate.end(), NAN);
    std::fill(dgate16.begin(), dgate16.end(), 0xffff);
    emu::launch(grid, 256, [&] {
        swiglu_forward(out.data() + 1, nullptr, gate.data() + 1, up.data() + 1, nullptr, nullptr, n - 1);
    });
    emu::launch(grid, 256, [&] {
        swiglu_backward(dgate.data() + 1, dup.data() + 1, dgate16.data() + 1, nullptr,
                        dout.data() + 1, gate.data() + 1, up.data() + 1, nullptr, nullptr, nullptr, n - 1);
    });
    auto tail = [](const std::vector<float>& v) { return std::vector<float>(v.begin() + 1, v.end()); };
    auto tail64 = [](const std::vector<double>& v) { return std::vector<double>(v.begin() + 1, v.end()); };
    ok &= report("swiglu_forward unaligned", tail(out), tail64(want_out));
    ok &= report("swiglu_backward unaligned", tail(dgate), tail64(want_dgate));
    ok &= report_copy("swiglu bf16 dgate unaligned", dgate16, dgate, 1);
    // Inputs kept in bf16 alone (null f32 pointers): the same results as from f32 inputs holding
    // the bf16 values, aligned and from an odd offset.
    std::vector<bf16_bits> gate_h(n), up_h(n), dout_h(n);
    std::vector<float> gate_r(n), up_r(n), dout_r(n);
    for (long long i = 0; i < n; ++i) {
        gate_h[i] = emu::bf16_round(gate[i]);
        up_h[i] = emu::bf16_round(up[i]);
        dout_h[i] = emu::bf16_round(dout[i]);
        gate_r[i] = emu::bf16_value(gate_h[i]);
        up_r[i] = emu::bf16_value(up_h[i]);
        dout_r[i] = emu::bf16_value(dout_h[i]);
    }
    std::vector<double> want_out_r, want_dgate_r, want_dup_r;
    swiglu_reference(gate_r, up_r, dout_r, want_out_r, want_dgate_r, want_dup_r);
    for (int at : {0, 1}) {
        std::vector<float> o(n, NAN), dg(n, NAN), du(n, NAN);
        emu::launch(grid, 256, [&] {
            swiglu_forward(o.data() + at, nullptr, nullptr, nullptr, gate_h.data() + at,
                           up_h.data() + at, n - at);
        });
        emu::launch(grid, 256, [&] {
            swiglu_backward(dg.data() + at, du.data() + at, nullptr, nullptr, nullptr, nullptr, nullptr,
                            dout_h.data() + at, gate_h.data() + at, up_h.data() + at, n - at);
        });
        auto from = [at](const auto& v) { return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + at, v.end()); };
        ok &= report(at ? "swiglu_forward bf16 in, unaligned" : "swiglu_forward bf16 in", from(o), from(want_out_r));
        ok &= report(at ? "swiglu_backward bf16 in dgate, unal." : "swiglu_backward bf16 in dgate", from(dg),
                     from(want_dgate_r));
        ok &= report(at ? "swiglu_backward bf16 in dup, unal." : "swiglu_backward bf16 in dup", from(du),
                     from(want_dup_r));
    }
    return ok;
}

// f32 → bf16 pairs, aligned (four at a time) and one element in (two at a time), with an odd
// count: every value must be the nearest-even bf16 and the padding half zero.
bool to_bf16() {
    const long long n = 1003;
    auto x = random_floats(n + 1, 3.0f);
    x[7] = NAN;
    bool ok = true;
    for (int offset : {0, 1}) {
        std::vector<u32> pairs((n + 1) / 2, 0xdeadbeefu);
        emu::launch(EmuDim3{2, 1, 1}, 256, [&] { f32_to_bf16(pairs.data(), x.data() + offset, n); });
        size_t bad = 0;
        for (long long i = 0; i < n; ++i) {
            unsigned bits = (pairs[i / 2] >> (16 * (i % 2))) & 0xffffu;
            bad += bits != emu::bf16_round(x[offset + i]);
        }
        bad += (pairs[n / 2] >> 16) != 0;  // the odd count's padding
        std::printf("%-28s %zu wrong %s\n", offset ? "f32_to_bf16 unaligned" : "f32_to_bf16",
                    bad, bad ? "FAILED" : "ok");
        ok &= bad == 0;
        if (offset == 0) {
            // And back: every value the f32 of its bf16 (NaN stays NaN).
            std::vector<float> back(n, 0.0f);
            emu::launch(EmuDim3{2, 1, 1}, 256, [&] { bf16_pairs_to_f32(back.data(), pairs.data(), n); });
            size_t wrong = 0;
            for (long long i = 0; i < n; ++i) {
                float want = emu::bf16_value(emu::bf16_round(x[i]));
                wrong += std::isnan(want) ? !std::isnan(back[i]) : back[i] != want;
            }
            std::printf("%-28s %zu wrong %s\n", "bf16_pairs_to_f32", wrong, wrong ? "FAILED" : "ok");
            ok &= wrong == 0;
        }
    }
    return ok;
}

// Attention sinks (gpt-oss) against float64: the fold into a finished attention (out, lse; a row
// that saw no key, lse -inf, too) and the sinks' gradient summed over each head's rows.
bool attention_sinks_check() {
    const int B = 2, Q = 37, H = 3, D = 20;
    const size_t rows = (size_t)B * Q * H;
    auto out = random_floats(rows * D), dout = random_floats(rows * D), lse = random_floats(rows, 3.0f),
         sinks = random_floats(H, 2.0f);
    lse[5] = -INFINITY;
    std::vector<double> want_out(rows * D), want_lse(rows), want_dsinks(H, 0.0);
    for (int b = 0; b < B; ++b)
        for (int i = 0; i < Q; ++i)
            for (int h = 0; h < H; ++h) {
                size_t row = ((size_t)b * Q + i) * H + h, at = ((size_t)b * H + h) * Q + i;
                double l = lse[at], sink = sinks[h];
                double merged = std::isinf(l) ? sink : std::max(l, sink) + std::log1p(std::exp(-std::fabs(l - sink)));
                double keep = std::exp(l - merged), dot = 0.0;
                for (int d = 0; d < D; ++d) {
                    want_out[row * D + d] = out[row * D + d] * keep;
                    dot += (double)dout[row * D + d] * want_out[row * D + d];
                }
                want_lse[at] = merged;
                want_dsinks[h] -= std::exp(sink - merged) * dot;
            }
    std::vector<float> got_out = out, got_lse = lse;
    emu::launch(EmuDim3{(unsigned)((rows + 127) / 128), 1, 1}, 128,
                [&] { attention_sinks(got_out.data(), got_lse.data(), sinks.data(), B, Q, H, D); });
    std::vector<float> dsinks(H, 0.0f);
    // The kernel reads the forward's results, as the backward does.
    emu::launch(EmuDim3{(unsigned)H, 1, 1}, 256, [&] {
        attention_sinks_grad(dsinks.data(), dout.data(), got_out.data(), got_lse.data(), sinks.data(), B, Q,
                             H, D);
    });
    bool ok = report("attention_sinks out", got_out, want_out);
    ok &= report("attention_sinks lse", got_lse, want_lse);
    ok &= report("attention_sinks_grad", dsinks, want_dsinks);
    return ok;
}

}  // namespace

// FSDP's strided copy: rows of a source with one pitch into a destination with another, on a
// grid with fewer blocks than rows and columns (both grid-strided loops wrap); everything outside
// the rows must stay untouched.
bool copy_rows() {
    const long long rows = 5, cols = 700, src_stride = 1003, dst_stride = 701;
    auto src = random_floats((size_t)(rows * src_stride));
    std::vector<float> dst((size_t)(rows * dst_stride + 9), -7.0f);
    std::vector<double> want(dst.begin(), dst.end());
    for (long long r = 0; r < rows; ++r)
        for (long long c = 0; c < cols; ++c) want[4 + r * dst_stride + c] = src[2 + r * src_stride + c];
    EmuDim3 grid{2, 3, 1};
    emu::launch(grid, 128, [&] {
        copy_rows_f32(dst.data() + 4, dst_stride, src.data() + 2, src_stride, rows, cols);
    });
    return report("copy_rows", dst, want);
}

// MLA's strided add: the same runs added into a destination that already holds values.
bool add_rows() {
    const long long rows = 5, cols = 700, src_stride = 1003, dst_stride = 701;
    auto src = random_floats((size_t)(rows * src_stride));
    auto dst = random_floats((size_t)(rows * dst_stride + 9));
    std::vector<double> want(dst.begin(), dst.end());
    for (long long r = 0; r < rows; ++r)
        for (long long c = 0; c < cols; ++c)
            want[4 + r * dst_stride + c] = (double)(dst[4 + r * dst_stride + c] + src[2 + r * src_stride + c]);
    EmuDim3 grid{2, 3, 1};
    emu::launch(grid, 128, [&] {
        add_rows_f32(dst.data() + 4, dst_stride, src.data() + 2, src_stride, rows, cols);
    });
    return report("add_rows", dst, want);
}

// A mixture of experts' row ops: each row scaled by its weight, and each row's dot product with
// another buffer's (one warp per row; a width that is not a multiple of the 32 lanes).
bool moe_row_ops() {
    const long long rows = 13, width = 45;
    auto x = random_floats((size_t)(rows * width)), y = random_floats((size_t)(rows * width)),
         scales = random_floats((size_t)rows);
    std::vector<double> want_scaled(x.size()), want_dots(rows, 0.0);
    for (long long r = 0; r < rows; ++r)
        for (long long c = 0; c < width; ++c) {
            want_scaled[r * width + c] = (double)x[r * width + c] * scales[r];
            want_dots[r] += (double)x[r * width + c] * y[r * width + c];
        }
    std::vector<float> dots(rows, NAN);
    emu::launch(EmuDim3{(unsigned)((rows + 3) / 4), 1, 1}, 128,
                [&] { row_dots_f32(dots.data(), x.data(), y.data(), rows, width); });
    std::vector<float> scaled = x;
    emu::launch(EmuDim3{3, 1, 1}, 128,
                [&] { scale_rows_f32(scaled.data(), scales.data(), width, rows * width); });
    bool ok = report("moe row_dots", dots, want_dots);
    ok &= report("moe scale_rows", scaled, want_scaled);
    return ok;
}

int main() {
    emu::seed_schedule(20261130);
    bool ok = true;
    // Each query's position in its document, for sequences cut into documents of `lengths`.
    auto positions = [](std::vector<std::vector<unsigned>> lengths) {
        std::vector<unsigned> p;
        for (auto& row : lengths)
            for (unsigned n : row)
                for (unsigned i = 0; i < n; ++i) p.push_back(i);
        return p;
    };
    Shape documents{"hd16 documents", 2, 45, 4, 2, 16};
    documents.doc_pos = positions({{7, 1, 20, 17}, {45}});
    Shape window{"hd40 window+docs", 1, 38, 4, 2, 40};
    window.doc_pos = positions({{30, 8}});
    window.window = 9;
    for (const Shape& s : {Shape{"hd16", 2, 45, 4, 4, 16}, Shape{"hd40 GQA", 1, 38, 4, 2, 40},
                           Shape{"hd64 GQA", 1, 33, 4, 1, 64}, documents, window})
        ok &= attention(s);
    ok &= ring_attention_blocks("", {});
    // Documents 0..12, 12..27, 27..33: the last chunk's queries of the third see no key before 20.
    ok &= ring_attention_blocks(" documents", positions({{12, 15, 6}}));
    ok &= attention_sinks_check();
    ok &= rmsnorm(96);
    ok &= rmsnorm(38);
    ok &= rope();
    ok &= swiglu();
    ok &= clamped_swiglu();
    ok &= to_bf16();
    ok &= copy_rows();
    ok &= add_rows();
    ok &= moe_row_ops();
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
