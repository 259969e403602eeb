// Runs the float8 cast kernels (kernels/float8.cu) on the CPU emulator against a reference written
// here in double arithmetic: amaxes along each axis (a NaN propagating), the quantise-dequantise
// of an operand with one scale, one per row and one per column, in e4m3 and e5m2 (ties, values
// below the formats' normals, saturation, signed zeros), and FSDP's float8 codes both ways. Every
// value must match bit for bit (NaN for NaN): the CPU computes exactly these numbers
// (src/backend/float8), so the GPU's emulated float8 GEMMs read the CPU's operands. Launch shapes
// are the backend's (src/backend/cuda/ops/float8.rs). Exits 1 on any difference.

#include <random>

#include "emu.h"
// clang-format off
#include "common.cuh"
#include "float8.cu"
// clang-format on

namespace {

constexpr unsigned kNormWarps = 4;  // TITAN_NORM_WARPS: rows per block of the row kernels.

struct Format {
    const char* name;
    int code, mantissa, min_exponent;
    double max;
};
const Format kE4M3{"e4m3", 0, 3, -6, 448.0}, kE5M2{"e5m2", 1, 2, -14, 57344.0};

// x rounded to the format, ties to even, saturating; NaN kept (the reference of Fp8Format::round).
float round_ref(const Format& f, float x) {
    if (std::isnan(x) || x == 0.0f) return x;
    double a = std::fabs((double)x);
    int e;
    std::frexp(a, &e);
    int exponent = std::max(e - 1, f.min_exponent);
    double quantum = std::ldexp(1.0, exponent - f.mantissa);
    double r = std::min(std::nearbyint(a / quantum) * quantum, f.max);
    return std::copysign((float)r, x);
}

float quantize_ref(const Format& f, float v, float s) {
    float scaled = v * s;
    if (std::isnan(scaled)) return scaled;
    return round_ref(f, std::fmin(std::fmax(scaled, (float)-f.max), (float)f.max));
}

bool same(float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || __float_as_uint(a) == __float_as_uint(b);
}

bool report(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    size_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += !same(got[i], want[i]);
    bool ok = differ == 0 && got.size() == want.size();
    std::printf("%-34s %zu of %zu values differ %s\n", what, differ, want.size(), ok ? "ok" : "FAILED");
    return ok;
}

EmuDim3 blocks(size_t n, unsigned threads) { return EmuDim3{(unsigned)std::min<size_t>((n + threads - 1) / threads, 8192), 1, 1}; }

// Values of many magnitudes (each format's subnormals and saturation), exact ties of e4m3 and
// e5m2, signed zeros.
std::vector<float> probe_values(std::mt19937_64& rng, size_t n) {
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-24, 18);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) {
        switch (i % 7) {
            case 0: v[i] = std::ldexp(1.0f + 0.0625f * (float)(i % 16), exponent(rng)); break;  // ties
            case 1: v[i] = -std::ldexp(1.125f, exponent(rng)); break;
            case 2: v[i] = (i % 2) ? 0.0f : -0.0f; break;
            default: v[i] = std::ldexp(unit(rng), exponent(rng)); break;
        }
    }
    return v;
}

// An operand kept in bf16 alone (x16 given, x null): the amaxes along each axis and the cast (with
// codes) must be those of its values widened to f32 and read as f32, bit for bit.
bool check_bf16_operands(const std::vector<float>& x) {
    const size_t rows = 37, cols = 90, n = rows * cols;
    std::vector<bf16_bits> x16(n);
    std::vector<float> widened(n);
    for (size_t i = 0; i < n; ++i) {
        x16[i] = (bf16_bits)(__float_as_uint(round_bf16(x[i])) >> 16);
        widened[i] = f32_of_bf16(x16[i]);
    }
    bool ok = true;
    std::vector<u32> p16(256, 0), p32(256, 0);
    emu::launch(EmuDim3{256, 1, 1}, 256, [&] { float8_amax_partial(p16.data(), nullptr, x16.data(), (i64)n); });
    emu::launch(EmuDim3{256, 1, 1}, 256, [&] { float8_amax_partial(p32.data(), widened.data(), nullptr, (i64)n); });
    std::vector<float> a16(256), a32(256);
    for (size_t i = 0; i < 256; ++i) a16[i] = __uint_as_float(p16[i]), a32[i] = __uint_as_float(p32[i]);
    ok &= report("bf16 operand: amax tensor", a16, a32);
    std::vector<float> r16(rows), r32(rows), c16(cols), c32(cols);
    EmuDim3 row_blocks{(unsigned)((rows + kNormWarps - 1) / kNormWarps), 1, 1};
    emu::launch(row_blocks, 32 * kNormWarps, [&] { float8_amax_rows(r16.data(), nullptr, x16.data(), (i64)rows, (i64)cols); });
    emu::launch(row_blocks, 32 * kNormWarps, [&] { float8_amax_rows(r32.data(), widened.data(), nullptr, (i64)rows, (i64)cols); });
    ok &= report("bf16 operand: amax rows", r16, r32);
    emu::launch(blocks(cols, 256), 256, [&] { float8_amax_columns(c16.data(), nullptr, x16.data(), (i64)rows, (i64)cols); });
    emu::launch(blocks(cols, 256), 256, [&] { float8_amax_columns(c32.data(), widened.data(), nullptr, (i64)rows, (i64)cols); });
    ok &= report("bf16 operand: amax columns", c16, c32);
    std::vector<float> scales(rows), q16(n), q32(n);
    for (size_t r = 0; r < rows; ++r) scales[r] = std::exp2((float)(r % 9) - 2.0f);
    std::vector<u8> k16(n), k32(n);
    emu::launch(blocks(n, 256), 256, [&] {
        float8_fake_quantize(q16.data(), nullptr, x16.data(), scales.data(), (i64)cols, 1, 0, k16.data(), 1, (i64)n);
    });
    emu::launch(blocks(n, 256), 256, [&] {
        float8_fake_quantize(q32.data(), widened.data(), nullptr, scales.data(), (i64)cols, 1, 0, k32.data(), 1, (i64)n);
    });
    ok &= report("bf16 operand: fake quantize", q16, q32);
    std::vector<float> d16(n), d32(n);
    for (size_t i = 0; i < n; ++i) d16[i] = fp8_value(0, k16[i]), d32[i] = fp8_value(0, k32[i]);
    ok &= report("bf16 operand: codes", d16, d32);
    return ok;
}

// MXFP8's E8M0 byte of a block whose largest magnitude is `amax`, in double arithmetic from the
// definitions (mx.rs): FLOOR, the amax's f32 exponent (-127 below the normals) less 8; RCEIL,
// ceil(log2(amax / 448)) of the f32 quotient, exactly.
int mx_byte_ref(float amax, bool rceil) {
    if (std::isnan(amax)) return 255;
    if (!rceil) {
        int e = amax < std::ldexp(1.0f, -126) ? -127 : (std::isinf(amax) ? 128 : std::ilogb(amax));
        return std::min(std::max(e - 8, -127), 128) + 127;
    }
    float descale = amax / 448.0f;
    int e;
    if (descale == 0.0f) {
        e = -127;
    } else if (std::isinf(descale)) {
        e = 127;
    } else {
        int exponent;
        double m = std::frexp((double)descale, &exponent);  // descale = m 2^exponent, m in [0.5, 1)
        e = m == 0.5 ? exponent - 1 : exponent;
    }
    return std::min(std::max(e, -127), 127) + 127;
}

// A block's values cast and dequantised from the reference byte.
void mx_block_ref(float* out, const float* x, const size_t* at, size_t count, bool rceil) {
    float amax = 0.0f;
    for (size_t j = 0; j < count; ++j) {
        float a = std::fabs(x[at[j]]);
        amax = (std::isnan(a) || std::isnan(amax)) ? NAN : std::max(amax, a);
    }
    int byte = mx_byte_ref(amax, rceil);
    float multiplier = byte == 255 ? NAN : (byte == 0 ? (rceil ? 1.0f : std::ldexp(1.0f, 126)) : std::ldexp(1.0f, 127 - byte));
    float dequantize = byte == 255 ? NAN : std::ldexp(1.0f, byte - 127);
    for (size_t j = 0; j < count; ++j) out[at[j]] = quantize_ref(kE4M3, x[at[j]], multiplier) * dequantize;
}

// MXFP8 casts (mx_fake_quantize) against the reference, bit for bit: blocks along rows and down
// columns (37 rows: the last group of rows is 5 short of a block), FLOOR and RCEIL scales, blocks
// whose RCEIL descale lies just above a power of two (where log2f would round down), a NaN block,
// an infinite one, an all-zero one; and from a bf16 copy as from its widened values.
bool check_mx(std::mt19937_64& rng) {
    const size_t rows = 37, cols = 96, n = rows * cols;
    std::vector<float> x = probe_values(rng, n);
    // Two blocks whose RCEIL descale is 1 ulp above 16 and 32: the exact exponent is 5 (6), where
    // ceilf(log2f()) gives 4 (5); their other values become e4m3's smallest subnormal under the
    // latter scale and a tie that rounds to zero under the former, so the two differ.
    for (size_t j = 0; j < 32; ++j) {
        x[32 + j] = j == 3 ? std::nextafter(448.0f * 16.0f, INFINITY) : 0.03125f;
        x[64 + j] = j == 9 ? -std::nextafter(448.0f * 32.0f, INFINITY) : 0.0625f;
        x[2 * cols + j] = 0.0f;
    }
    x[5 * cols + 40] = NAN;
    x[9 * cols + 70] = INFINITY;
    bool ok = true;
    for (int down = 0; down < 2; ++down) {
        for (int rceil = 0; rceil < 2; ++rceil) {
            std::vector<float> want(n, 0.0f), got(n, 7.0f);
            std::vector<size_t> at;
            if (!down) {
                for (size_t b = 0; b < n / 32; ++b) {
                    at.clear();
                    for (size_t j = 0; j < 32; ++j) at.push_back(b * 32 + j);
                    mx_block_ref(want.data(), x.data(), at.data(), at.size(), rceil);
                }
            } else {
                for (size_t g = 0; g * 32 < rows; ++g)
                    for (size_t c = 0; c < cols; ++c) {
                        at.clear();
                        for (size_t r = 32 * g; r < std::min(rows, 32 * g + 32); ++r) at.push_back(r * cols + c);
                        mx_block_ref(want.data(), x.data(), at.data(), at.size(), rceil);
                    }
            }
            EmuDim3 grid = down ? blocks(((rows + 31) / 32) * cols, 256)
                                : EmuDim3{(unsigned)((n / 32 + kNormWarps - 1) / kNormWarps), 1, 1};
            unsigned threads = down ? 256 : 32 * kNormWarps;
            emu::launch(grid, threads, [&] {
                mx_fake_quantize(got.data(), x.data(), nullptr, (i64)rows, (i64)cols, down, rceil);
            });
            char what[64];
            std::snprintf(what, sizeof what, "mx %s %s", down ? "down columns" : "along rows", rceil ? "RCEIL" : "FLOOR");
            ok &= report(what, got, want);
        }
    }
    // From a bf16 copy: the same as from the widened values.
    std::vector<bf16_bits> x16(n);
    std::vector<float> widened(n), from16(n), from32(n);
    for (size_t i = 0; i < n; ++i) {
        x16[i] = (bf16_bits)(__float_as_uint(round_bf16(x[i])) >> 16);
        widened[i] = f32_of_bf16(x16[i]);
    }
    EmuDim3 grid{(unsigned)((n / 32 + kNormWarps - 1) / kNormWarps), 1, 1};
    emu::launch(grid, 32 * kNormWarps, [&] { mx_fake_quantize(from16.data(), nullptr, x16.data(), (i64)rows, (i64)cols, 0, 1); });
    emu::launch(grid, 32 * kNormWarps, [&] { mx_fake_quantize(from32.data(), widened.data(), nullptr, (i64)rows, (i64)cols, 0, 1); });
    ok &= report("mx from a bf16 copy", from16, from32);
    return ok;
}

// The float8 GEMM's data path without cuBLASLt: a linear's three GEMMs (Y = X·Wᵀ, dX = G·W,
// dW = Gᵀ·X, the last accumulating) with each operand cast by float8_fake_quantize into codes laid
// out with the summed dimension contiguous, the codes multiplied here as cuBLASLt's float8 GEMM
// does (exact products summed in double, rounded to f32), and float8_scale_product scaling them
// back: the result must be the GEMM of the dequantised values (the emulated path, summed here in
// double too) to 1e-6 of its largest value, for one scale per tensor and one per row or column.
bool check_float8_gemms(std::mt19937_64& rng) {
    const size_t m = 48, n = 32, k = 64;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    struct Operand {
        size_t rows, cols;
        bool sums_rows;  // the GEMM sums down the columns (codes transposed)
    };
    struct Gemm {
        const char* name;
        Operand a, b;
        size_t om, on, depth;  // output [om, on], summed dimension
        bool accumulate;
    };
    const Gemm gemms[] = {
        {"Y = X.W^T", {m, k, false}, {n, k, false}, m, n, k, false},
        {"dX = G.W", {m, n, false}, {n, k, true}, m, k, n, false},
        {"dW = G^T.X (accumulating)", {m, n, true}, {m, k, true}, n, k, m, true},
    };
    bool ok = true;
    for (int rowwise = 0; rowwise < 2; ++rowwise) {
        for (const Gemm& g : gemms) {
            // Each operand: values, scales (per tensor, or per index of the unsummed dimension),
            // its cast through the kernel, and a "value(i, d)" reader of the GEMM's element.
            std::vector<float> values[2], casts[2], inverse[2];
            std::vector<u8> codes[2];
            const Operand* ops[2] = {&g.a, &g.b};
            for (int o = 0; o < 2; ++o) {
                const Operand& op = *ops[o];
                size_t len = op.rows * op.cols;
                values[o].resize(len);
                for (float& v : values[o]) v = normal(rng) * 3.0f;
                int axis = rowwise ? (op.sums_rows ? 2 : 1) : 0;
                size_t count = axis == 0 ? 1 : (axis == 1 ? op.rows : op.cols);
                std::vector<float> scales(count);
                for (size_t i = 0; i < count; ++i) scales[i] = std::exp2((float)(i % 5) + 4.0f) * (rowwise ? 1.0f : 1.37f);
                inverse[o].resize(count);
                for (size_t i = 0; i < count; ++i) inverse[o][i] = 1.0f / scales[i];
                casts[o].assign(len, 0.0f);
                codes[o].assign(len, 0);
                emu::launch(blocks(len, 256), 256, [&] {
                    float8_fake_quantize(casts[o].data(), values[o].data(), nullptr, scales.data(), (i64)op.cols,
                                         axis, 0, codes[o].data(), op.sums_rows ? 1 : 0, (i64)len);
                });
            }
            // Element (i, d) of operand o as the GEMM reads it: i the unsummed index, d the summed.
            auto cast_at = [&](int o, size_t i, size_t d) {
                const Operand& op = *ops[o];
                return op.sums_rows ? casts[o][d * op.cols + i] : casts[o][i * op.cols + d];
            };
            auto code_at = [&](int o, size_t i, size_t d) {  // codes are [unsummed, summed] either way
                return fp8_value(0, codes[o][i * g.depth + d]);
            };
            std::vector<float> product(g.om * g.on), out(g.om * g.on), want(g.om * g.on);
            std::vector<float> start(g.om * g.on);
            for (float& v : start) v = g.accumulate ? normal(rng) : 0.0f;
            for (size_t i = 0; i < g.om; ++i)
                for (size_t j = 0; j < g.on; ++j) {
                    double codes_sum = 0.0, values_sum = 0.0;
                    for (size_t d = 0; d < g.depth; ++d) {
                        codes_sum += (double)code_at(0, i, d) * code_at(1, j, d);
                        values_sum += (double)cast_at(0, i, d) * cast_at(1, j, d);
                    }
                    product[i * g.on + j] = (float)codes_sum;
                    want[i * g.on + j] = (float)(start[i * g.on + j] + values_sum);
                }
            out = start;
            emu::launch(blocks(out.size(), 256), 256, [&] {
                float8_scale_product(out.data(), product.data(), g.accumulate ? out.data() : nullptr,
                                     inverse[0].data(), inverse[0].size() > 1, inverse[1].data(),
                                     inverse[1].size() > 1, (i64)g.on, (i64)out.size());
            });
            double largest = 0.0, worst = 0.0;
            for (size_t i = 0; i < out.size(); ++i) {
                largest = std::max(largest, (double)std::fabs(want[i]));
                worst = std::max(worst, (double)std::fabs(out[i] - want[i]));
            }
            bool fine = worst <= 1e-6 * largest;
            std::printf("float8 GEMM %-9s %-26s max |diff| %.2e of %.2e %s\n", rowwise ? "rowwise" : "tensorwise",
                        g.name, worst, largest, fine ? "ok" : "FAILED");
            ok &= fine;
        }
    }
    return ok;
}

}  // namespace

int main() {
    std::mt19937_64 rng(20261203);
    emu::seed_schedule(20261203);
    const size_t rows = 37, cols = 90, n = rows * cols;
    std::vector<float> x = probe_values(rng, n);
    bool ok = true;

    // Amaxes: the tensor's (two-pass, 256 blocks), each row's, each column's; then with a NaN.
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1) x[5 * cols + 7] = NAN;
        float tensor = 0.0f;
        std::vector<float> row_want(rows, 0.0f), col_want(cols, 0.0f);
        for (size_t r = 0; r < rows; ++r)
            for (size_t c = 0; c < cols; ++c) {
                float a = std::fabs(x[r * cols + c]);
                auto grow = [&](float& m) { m = (std::isnan(a) || std::isnan(m)) ? NAN : std::max(m, a); };
                grow(tensor);
                grow(row_want[r]);
                grow(col_want[c]);
            }
        std::vector<u32> partials(256, 0);
        emu::launch(EmuDim3{256, 1, 1}, 256, [&] { float8_amax_partial(partials.data(), x.data(), nullptr, (i64)n); });
        u32 m = 0;
        for (u32 p : partials) m = std::max(m, p);
        std::vector<float> rows_got(rows), cols_got(cols);
        emu::launch(EmuDim3{(unsigned)((rows + kNormWarps - 1) / kNormWarps), 1, 1}, 32 * kNormWarps,
                    [&] { float8_amax_rows(rows_got.data(), x.data(), nullptr, (i64)rows, (i64)cols); });
        emu::launch(blocks(cols, 256), 256,
                    [&] { float8_amax_columns(cols_got.data(), x.data(), nullptr, (i64)rows, (i64)cols); });
        const char* names[2][3] = {{"amax tensor", "amax rows", "amax columns"},
                                   {"amax tensor (a NaN)", "amax rows (a NaN)", "amax columns (a NaN)"}};
        ok &= report(names[pass][0], {__uint_as_float(m)}, {tensor});
        ok &= report(names[pass][1], rows_got, row_want);
        ok &= report(names[pass][2], cols_got, col_want);
    }

    // Quantise-dequantise along each axis, in each format; scales of every kind (powers of two
    // and not, one making values saturate).
    std::uniform_real_distribution<float> log_scale(-6.0f, 20.0f);
    for (const Format* f : {&kE4M3, &kE5M2}) {
        for (int axis = 0; axis < 3; ++axis) {
            size_t count = axis == 0 ? 1 : (axis == 1 ? rows : cols);
            std::vector<float> scales(count);
            for (size_t k = 0; k < count; ++k)
                scales[k] = k % 3 == 0 ? std::exp2(std::floor(log_scale(rng))) : std::exp2(log_scale(rng));
            std::vector<float> want(n), got(n, 7.0f);
            for (size_t i = 0; i < n; ++i) {
                float s = scales[axis == 0 ? 0 : (axis == 1 ? i / cols : i % cols)];
                want[i] = quantize_ref(*f, x[i], s) * (1.0f / s);
            }
            // Without codes (the emulated GEMMs), then with them in both layouts (float8 GEMMs):
            // the values must not change, and each code must be its value's.
            emu::launch(blocks(n, 256), 256, [&] {
                float8_fake_quantize(got.data(), x.data(), nullptr, scales.data(), (i64)cols, axis, f->code,
                                     nullptr, 0, (i64)n);
            });
            char what[64];
            std::snprintf(what, sizeof what, "fake quantize %s %s", f->name,
                          axis == 0 ? "tensor" : (axis == 1 ? "rows" : "columns"));
            ok &= report(what, got, want);
            for (int transposed = 0; transposed < 2; ++transposed) {
                std::vector<u8> codes(n, 0xab);
                std::vector<float> with_codes(n, 7.0f), decoded(n), want_decoded(n);
                emu::launch(blocks(n, 256), 256, [&] {
                    float8_fake_quantize(with_codes.data(), x.data(), nullptr, scales.data(), (i64)cols, axis,
                                         f->code, codes.data(), transposed, (i64)n);
                });
                for (size_t i = 0; i < n; ++i) {
                    size_t r = i / cols, c = i % cols;
                    float s = scales[axis == 0 ? 0 : (axis == 1 ? r : c)];
                    want_decoded[i] = quantize_ref(*f, x[i], s);
                    decoded[i] = fp8_value(f->code, codes[transposed ? c * rows + r : i]);
                }
                std::snprintf(what, sizeof what, "  with codes%s: values", transposed ? " (transposed)" : "");
                ok &= report(what, with_codes, want);
                std::snprintf(what, sizeof what, "  with codes%s: codes", transposed ? " (transposed)" : "");
                ok &= report(what, decoded, want_decoded);
            }
        }
        // FSDP's codes: n values (not a multiple of four), one scale, there and back.
        const size_t odd = n - 3, words = (odd + 3) / 4;
        float scale = 3.7f;
        std::vector<u32> codes(words, 0xdeadbeefu);
        emu::launch(blocks(words, 256), 256,
                    [&] { float8_encode_words(codes.data(), x.data(), scale, f->code, (i64)odd); });
        std::vector<float> back(words * 4, 7.0f), want(words * 4, 0.0f);
        emu::launch(blocks(words * 4, 256), 256,
                    [&] { float8_decode_words(back.data(), codes.data(), f->code, (i64)(words * 4)); });
        for (size_t i = 0; i < odd; ++i) want[i] = quantize_ref(*f, x[i], scale);
        char what[64];
        std::snprintf(what, sizeof what, "codes %s there and back", f->name);
        ok &= report(what, back, want);
    }
    ok &= check_bf16_operands(x);
    ok &= check_mx(rng);
    ok &= check_float8_gemms(rng);
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
