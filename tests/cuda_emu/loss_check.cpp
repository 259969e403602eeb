// Runs the loss kernel (kernels/loss.cu) on the CPU emulator over rows with an ignored target:
// the losses and the f32 logit gradients must match a float64 reference, and the bf16 gradients it
// writes for the bf16 GEMMs (instead of the f32 ones) must be exactly the f32 gradients rounded to
// bf16. With the logits themselves in bf16 (a GEMM wrote them so), the losses and gradients must be
// bit for bit those computed from the same values in f32. Exits 1 otherwise.

#include <random>

#include "emu.h"
// clang-format off
#include "common.cuh"
#include "cast.cu"
#include "loss.cu"
#include "loss_reference.h"
// clang-format on

int main() {
    std::mt19937_64 rng(20261130);
    emu::seed_schedule(20261130);
    const int rows = 6, vocab = 1000;
    const float grad_scale = 0.25f;
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    std::vector<float> logits((size_t)rows * vocab);
    for (auto& x : logits) x = dist(rng);
    std::vector<u32> targets = {3, 999, TITAN_IGNORE_INDEX, 0, 517, 42};

    const LossReference want = reference_cross_entropy(logits, rows, vocab, targets, grad_scale);
    const std::vector<double>&want_loss = want.loss, &want_grad = want.grad;

    std::vector<float> row_loss(rows, 0.0f);
    const std::vector<float> original = logits;
    std::vector<float> logits_for_bf16 = logits;
    emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
        cross_entropy_rows(logits.data(), row_loss.data(), targets.data(), vocab, grad_scale, 1,
                           nullptr, nullptr);
    });
    // With the gradient in bf16 only, the f32 block stays as it was.
    std::vector<float> row_loss16(rows, 0.0f);
    std::vector<bf16_bits> grad16(logits.size(), 0x7fff);
    emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
        cross_entropy_rows(logits_for_bf16.data(), row_loss16.data(), targets.data(), vocab,
                           grad_scale, 1, grad16.data(), grad16.data());
    });
    // Logits kept in bf16 alone (null f32 logits): the same bits as the f32 path on those values.
    std::vector<bf16_bits> logits16(logits.size()), grad16_ref(logits.size(), 0x7fff);
    std::vector<float> rounded(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) {
        logits16[i] = bf16_of(original[i]);
        rounded[i] = f32_of_bf16(logits16[i]);
    }
    std::vector<float> row_loss_ref(rows, 0.0f), row_loss_b(rows, 0.0f);
    emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
        cross_entropy_rows(rounded.data(), row_loss_ref.data(), targets.data(), vocab, grad_scale, 1,
                           grad16_ref.data(), grad16_ref.data());
    });
    emu::launch(EmuDim3{rows, 1, 1}, 256, [&] {
        cross_entropy_rows(nullptr, row_loss_b.data(), targets.data(), vocab, grad_scale, 1,
                           logits16.data(), logits16.data());
    });
    size_t bf16_logit_bits = 0;
    for (int r = 0; r < rows; ++r)
        bf16_logit_bits += !(row_loss_b[r] == row_loss_ref[r] || (std::isnan(row_loss_b[r]) && std::isnan(row_loss_ref[r])));
    for (size_t i = 0; i < logits.size(); ++i) bf16_logit_bits += logits16[i] != grad16_ref[i];
    bool ok = true;
    double loss_err = 0.0, grad_err = 0.0, grad_max = 0.0;
    for (int r = 0; r < rows; ++r) {
        if (targets[r] == TITAN_IGNORE_INDEX) {
            ok &= std::isnan(row_loss[r]);
            continue;
        }
        loss_err = std::max(loss_err, std::fabs(row_loss[r] - want_loss[r]) / std::fabs(want_loss[r]));
    }
    size_t bits_differ = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
        grad_err = std::max(grad_err, std::fabs(logits[i] - want_grad[i]));
        grad_max = std::max(grad_max, std::fabs(want_grad[i]));
        bits_differ += ((unsigned)grad16[i] << 16) != __float_as_uint(round_bf16(logits[i]));
    }
    // The bf16 run leaves the logits untouched and computes the same losses.
    for (int r = 0; r < rows; ++r)
        bits_differ += !(row_loss16[r] == row_loss[r] || (std::isnan(row_loss16[r]) && std::isnan(row_loss[r])));
    for (size_t i = 0; i < logits.size(); ++i) bits_differ += logits_for_bf16[i] != original[i];
    grad_err /= grad_max;
    bool loss_ok = ok && loss_err < 1e-5, grad_ok = grad_err < 1e-5, bits_ok = bits_differ == 0;
    std::printf("%-26s rel err %.3e %s\n", "cross_entropy loss", loss_err, loss_ok ? "ok" : "FAILED");
    std::printf("%-26s rel err %.3e %s\n", "cross_entropy grad", grad_err, grad_ok ? "ok" : "FAILED");
    std::printf("%-26s %zu differ %s\n", "cross_entropy bf16 grad", bits_differ, bits_ok ? "ok" : "FAILED");
    bool bf16_logits_ok = bf16_logit_bits == 0;
    std::printf("%-26s %zu differ %s\n", "cross_entropy bf16 logits", bf16_logit_bits,
                bf16_logits_ok ? "ok" : "FAILED");
    ok = loss_ok && grad_ok && bits_ok && bf16_logits_ok;
    std::printf("%s\n", ok ? "all outputs within tolerance" : "FAILED");
    return ok ? 0 : 1;
}
