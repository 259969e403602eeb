// The float64 reference of a cross-entropy over whole rows of logits, shared by the loss kernels'
// emulated checks: each row's loss and its logits' gradient grad_scale * (softmax - onehot); an
// ignored target's row has loss 0 and gradient 0 (the checks expect NaN and zeros of the kernels).
#pragma once

#include <cmath>
#include <vector>

struct LossReference {
    std::vector<double> loss, grad;
};

inline LossReference reference_cross_entropy(const std::vector<float>& logits, int rows, int vocab,
                                             const std::vector<u32>& targets, double grad_scale) {
    LossReference want{std::vector<double>(rows, 0.0), std::vector<double>(logits.size(), 0.0)};
    for (int r = 0; r < rows; ++r) {
        if (targets[r] == 0xffffffffu) continue;
        const float* row = &logits[(size_t)r * vocab];
        double m = -INFINITY, z = 0.0;
        for (int j = 0; j < vocab; ++j) m = std::max(m, (double)row[j]);
        for (int j = 0; j < vocab; ++j) z += std::exp(row[j] - m);
        want.loss[r] = m + std::log(z) - row[targets[r]];
        for (int j = 0; j < vocab; ++j)
            want.grad[(size_t)r * vocab + j] =
                grad_scale * (std::exp(row[j] - m) / z - (j == (int)targets[r] ? 1.0 : 0.0));
    }
    return want;
}
