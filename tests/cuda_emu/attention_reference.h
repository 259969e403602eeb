// Causal grouped-query attention and its gradients in float64, the reference of the emulated
// attention checks. Layouts as the kernels': q, out, dout [b, s, h, d]; k, v [b, s, kvh, d];
// lse [b, h, s]. Also the checks' shared helpers: the relative error, its report line, random
// inputs.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

struct Shape {
    const char* name;
    int batch, seq, heads, kv_heads, head_dim;
    // Keys scaled up along the sequence (see attention_tc_check.cpp), so that later key tiles
    // hold much larger scores than earlier ones.
    bool growing_scores = false;
    // The mask (kernels/attention.cu): each query's position in its document [batch, seq] (empty:
    // one document per sequence) and a sliding window (0: none).
    std::vector<unsigned> doc_pos = {};
    int window = 0;
};

// The first key query i of sequence b sees (whole sequences: query i at key index i).
inline int first_key(const Shape& s, int b, int i) {
    int first = 0;
    if (!s.doc_pos.empty()) first = std::max(i - (int)s.doc_pos[(size_t)b * s.seq + i], 0);
    if (s.window > 0) first = std::max(first, i + 1 - s.window);
    return first;
}

struct Reference {
    std::vector<double> out, lse, dq, dk, dv;
};

inline Reference reference(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout) {
    int D = s.head_dim, group = s.heads / s.kv_heads;
    double scale = 1.0 / std::sqrt((double)D);
    Reference r;
    r.out.assign(q.size(), 0.0);
    r.dq.assign(q.size(), 0.0);
    r.dk.assign(k.size(), 0.0);
    r.dv.assign(v.size(), 0.0);
    r.lse.assign((size_t)s.batch * s.heads * s.seq, 0.0);
    auto qi = [&](int b, int i, int h) { return ((size_t)(b * s.seq + i) * s.heads + h) * D; };
    auto kj = [&](int b, int j, int kh) { return ((size_t)(b * s.seq + j) * s.kv_heads + kh) * D; };
    std::vector<double> p(s.seq), dp(s.seq);
    for (int b = 0; b < s.batch; ++b)
        for (int h = 0; h < s.heads; ++h) {
            int kh = h / group;
            for (int i = 0; i < s.seq; ++i) {
                int first = first_key(s, b, i);
                double mx = -INFINITY;
                for (int j = first; j <= i; ++j) {
                    double dot = 0.0;
                    for (int d = 0; d < D; ++d) dot += q[qi(b, i, h) + d] * k[kj(b, j, kh) + d];
                    p[j] = dot * scale;
                    mx = std::max(mx, p[j]);
                }
                double sum = 0.0;
                for (int j = first; j <= i; ++j) sum += std::exp(p[j] - mx);
                r.lse[((size_t)b * s.heads + h) * s.seq + i] = mx + std::log(sum);
                for (int j = first; j <= i; ++j) p[j] = std::exp(p[j] - mx) / sum;
                double delta = 0.0;
                for (int d = 0; d < D; ++d) {
                    double o = 0.0;
                    for (int j = first; j <= i; ++j) o += p[j] * v[kj(b, j, kh) + d];
                    r.out[qi(b, i, h) + d] = o;
                    delta += o * dout[qi(b, i, h) + d];
                }
                for (int j = first; j <= i; ++j) {
                    double dot = 0.0;
                    for (int d = 0; d < D; ++d) dot += dout[qi(b, i, h) + d] * v[kj(b, j, kh) + d];
                    double ds = p[j] * (dot - delta) * scale;
                    for (int d = 0; d < D; ++d) {
                        r.dq[qi(b, i, h) + d] += ds * k[kj(b, j, kh) + d];
                        r.dk[kj(b, j, kh) + d] += ds * q[qi(b, i, h) + d];
                        r.dv[kj(b, j, kh) + d] += p[j] * dout[qi(b, i, h) + d];
                    }
                }
            }
        }
    return r;
}


// max |got - want| / max |want|; NaN when `got` holds a non-finite value (as the GPU op check).
inline double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
    double scale = 1e-30, diff = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (!std::isfinite(got[i])) return NAN;
        scale = std::max(scale, std::fabs(want[i]));
        diff = std::max(diff, std::fabs((double)got[i] - want[i]));
    }
    return diff / scale;
}

// Prints `what`'s relative error against `want` on one line; true when within `tolerance`.
inline bool report_rel_err(const char* what, const std::vector<float>& got,
                           const std::vector<double>& want, double tolerance) {
    double err = rel_err(got, want);
    bool ok = err <= tolerance;
    std::printf("%-36s rel err %.3e %s\n", what, err, ok ? "ok" : "FAILED");
    return ok;
}

// `n` floats drawn uniformly from [lo, hi) by `rng`.
inline std::vector<float> uniform_floats(std::mt19937_64& rng, size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}
