// Runs the vocabulary-parallel loss kernels (kernels/loss.cu: vocab_shard_row_max, _row_sums,
// _loss_rows) on the CPU emulator over three uneven shards of a vocabulary, the row statistics
// combined between the steps as the tensor-parallel group combines them (max, then sum): every
// row's loss and every shard's logit gradient must match a float64 reference over whole rows,
// an ignored target's row must be NaN with a zero gradient, and without the gradient the logits
// must be left as they were. Exits 1 otherwise.

#include <random>

#include "emu.h"
// clang-format off
#include "common.cuh"
#include "cast.cu"
#include "loss.cu"
#include "loss_reference.h"
// clang-format on

int main() {
    std::mt19937_64 rng(20261207);
    emu::seed_schedule(20261207);
    const int rows = 7, vocab = 1000;
    const int shards[3][2] = {{0, 400}, {400, 350}, {750, 250}};  // offset, width
    const float grad_scale = 0.5f;
    std::uniform_real_distribution<float> dist(-6.0f, 6.0f);
    std::vector<float> logits((size_t)rows * vocab);
    for (auto& x : logits) x = dist(rng);
    // Targets in each shard, at shard edges, and one ignored.
    std::vector<u32> targets = {0, 399, 400, TITAN_IGNORE_INDEX, 749, 750, 999};

    const LossReference want = reference_cross_entropy(logits, rows, vocab, targets, grad_scale);
    const std::vector<double>&want_loss = want.loss, &want_grad = want.grad;

    // Each shard's logits as its rank holds them: [rows, width].
    std::vector<std::vector<float>> shard_logits(3);
    for (int s = 0; s < 3; ++s)
        for (int r = 0; r < rows; ++r)
            for (int j = 0; j < shards[s][1]; ++j)
                shard_logits[s].push_back(logits[(size_t)r * vocab + shards[s][0] + j]);
    const auto original = shard_logits;
    // Step 1, then the max over the shards.
    std::vector<float> max(rows, -INFINITY);
    for (int s = 0; s < 3; ++s) {
        std::vector<float> m(rows);
        emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
            vocab_shard_row_max(shard_logits[s].data(), m.data(), shards[s][1]);
        });
        for (int r = 0; r < rows; ++r) max[r] = std::max(max[r], m[r]);
    }
    // Step 2, then the sum over the shards.
    std::vector<float> sums(2 * rows, 0.0f);
    for (int s = 0; s < 3; ++s) {
        std::vector<float> part(2 * rows, -1.0f);
        emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
            vocab_shard_row_sums(shard_logits[s].data(), max.data(), targets.data(), shards[s][1],
                                 shards[s][0], part.data());
        });
        for (int i = 0; i < 2 * rows; ++i) sums[i] += part[i];
    }
    // Step 3 on every shard: the losses (the same on every rank) and the gradient.
    double loss_err = 0.0, grad_err = 0.0, grad_max = 0.0;
    size_t wrong_marks = 0, touched = 0;
    for (int s = 0; s < 3; ++s) {
        std::vector<float> loss(rows, 0.0f), loss_no_grad(rows, 0.0f);
        std::vector<float> kept = shard_logits[s];
        emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
            vocab_shard_loss_rows(kept.data(), max.data(), sums.data(), targets.data(),
                                  shards[s][1], shards[s][0], grad_scale, 0, loss_no_grad.data());
        });
        for (size_t i = 0; i < kept.size(); ++i) touched += kept[i] != original[s][i];
        emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
            vocab_shard_loss_rows(shard_logits[s].data(), max.data(), sums.data(), targets.data(),
                                  shards[s][1], shards[s][0], grad_scale, 1, loss.data());
        });
        for (int r = 0; r < rows; ++r) {
            bool same = loss[r] == loss_no_grad[r] || (std::isnan(loss[r]) && std::isnan(loss_no_grad[r]));
            wrong_marks += !same;
            if (targets[r] == TITAN_IGNORE_INDEX) {
                wrong_marks += !std::isnan(loss[r]);
                continue;
            }
            loss_err = std::max(loss_err, std::fabs(loss[r] - want_loss[r]) / std::fabs(want_loss[r]));
            for (int j = 0; j < shards[s][1]; ++j) {
                double want = want_grad[(size_t)r * vocab + shards[s][0] + j];
                grad_err = std::max(grad_err, std::fabs(shard_logits[s][(size_t)r * shards[s][1] + j] - want));
                grad_max = std::max(grad_max, std::fabs(want));
            }
        }
        int ignored = 3;
        for (int j = 0; j < shards[s][1]; ++j)
            wrong_marks += shard_logits[s][(size_t)ignored * shards[s][1] + j] != 0.0f;
    }
    grad_err /= grad_max;
    bool loss_ok = loss_err < 1e-5, grad_ok = grad_err < 1e-5;
    bool marks_ok = wrong_marks == 0, untouched_ok = touched == 0;
    std::printf("%-30s rel err %.3e %s\n", "vocab shard loss", loss_err, loss_ok ? "ok" : "FAILED");
    std::printf("%-30s rel err %.3e %s\n", "vocab shard grad", grad_err, grad_ok ? "ok" : "FAILED");
    std::printf("%-30s %zu wrong %s\n", "vocab shard ignored rows", wrong_marks, marks_ok ? "ok" : "FAILED");
    std::printf("%-30s %zu changed %s\n", "vocab shard logits w/o grad", touched, untouched_ok ? "ok" : "FAILED");
    bool ok = loss_ok && grad_ok && marks_ok && untouched_ok;
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
