//! CUDA kernels run on the CPU: `tests/cuda_emu/` compiles their CUDA C source with the host C++
//! compiler against an emulator of the CUDA dialect and of the PTX tensor-core instructions, and
//! checks them against references: the tensor-core attention (forward and backward) against float64,
//! the multi-tensor optimizer kernels against the single-tensor ones, the grouped embedding backward
//! against the in-order sum, the loss kernel (with its bf16 gradient), the vocabulary-parallel
//! loss kernels over three shards against whole rows, and the fp32 attention,
//! RMSNorm, RoPE and SwiGLU kernels against float64. This is how a change to those
//! kernels is tested on machines without a GPU; `scripts/gpu_check.sh` tests them on one.
//! Outside CI a machine with no C++ compiler skips it; in CI (`CI` set) that fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn cxx() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from));
    for c in candidates {
        if Command::new(&c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Some(c);
        }
    }
    common::reference_missing(
        "no C++ compiler found (c++, g++ or clang++); the emulated CUDA kernel check did not run",
    );
    None
}

fn build(cxx: &str, source: &str, out: &Path) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(cxx)
        .args(["-std=c++17", "-O2", "-Wall", "-Wno-unknown-pragmas", "-I"])
        .arg(root.join("src/backend/cuda/kernels"))
        .arg("-I")
        .arg(root.join("tests/cuda_emu"))
        .arg(root.join("tests/cuda_emu").join(source))
        .arg("-o")
        .arg(out)
        .output()
        .expect("run the C++ compiler");
    assert!(
        o.status.success(),
        "{source} did not compile:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Builds and runs one check program of tests/cuda_emu; it must succeed with `ok_lines` outputs
/// reported ok (a check that silently skipped a kernel would print fewer).
fn run_check(source: &str, ok_lines: usize) {
    let Some(cxx) = cxx() else { return };
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("check");
    build(&cxx, source, &exe);
    let o = Command::new(&exe).output().expect("run the emulated check");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains("all outputs within tolerance"),
        "{source}:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(stdout.matches(" ok\n").count(), ok_lines, "{stdout}");
}

#[test]
fn tensor_core_attention_matches_a_float64_reference_on_the_emulator() {
    // Seven shapes (two with scores growing along the sequence), five outputs each, the output's
    // bf16 copy, and the fused backward's three with 64 and with 128 keys per block taking turns
    // (and the turn counters), and with 128 racing; at the four head_dim 64 ones also the
    // two-block forward's two and its bf16 copy.
    run_check("attention_tc_check.cpp", 155);
}

#[test]
fn multi_tensor_kernels_match_the_single_tensor_ones_on_the_emulator() {
    // AdamW's three outputs, the bf16 copy (f32 and bf16 bits), the fill, the sum of squares.
    run_check("multi_tensor_check.cpp", 7);
}

#[test]
fn embedding_backward_matches_the_in_order_sum_bit_for_bit_on_the_emulator() {
    // The backward, and the forward with ids of another tensor-parallel rank's vocabulary.
    run_check("embedding_check.cpp", 2);
}

#[test]
fn loss_kernel_writes_its_bf16_gradient_as_the_rounded_f32_one_on_the_emulator() {
    run_check("loss_check.cpp", 4);
}

#[test]
fn moe_routing_dispatch_order_and_combine_kernels_match_their_references_on_the_emulator() {
    // Four routers (experts, weights, scores, logits' gradient each), the dispatch order's four
    // outputs, the combine, the load count.
    run_check("routing_check.cpp", 22);
}

#[test]
fn moe_auxiliary_loss_kernels_match_the_cpu_arithmetic_bit_for_bit_on_the_emulator() {
    // Two routers (softmax on whole sequences, sigmoid on rows starting mid-sequence): the
    // figures, the balance and the scores' gradient of each.
    run_check("moe_aux_check.cpp", 6);
}

#[test]
fn grouped_expert_gemm_kernels_match_float64_on_the_emulator() {
    // The forward and the accumulated input gradient (each with the rows of no expert), five
    // experts' weight gradients (one passed as null).
    run_check("grouped_gemm_check.cpp", 9);
}

#[test]
fn vocabulary_parallel_loss_kernels_match_whole_rows_on_the_emulator() {
    run_check("vocab_shard_check.cpp", 4);
}

#[test]
fn fp32_attention_norm_rope_and_swiglu_kernels_match_float64_on_the_emulator() {
    // Attention at three shapes and two masked ones (documents; a window with documents; five
    // outputs each), ring blocks causal and with documents (five each), RMSNorm (3, the bf16 copies of out and dx,
    // and a bf16-only out, on the 16-byte and the scalar path), RoPE (2 and a bf16 copy), SwiGLU (3 and their bf16
    // copies, a bf16-only output, bf16-only gradients aligned and not, 2 and a copy through
    // unaligned views, and all 3 from bf16-only inputs aligned and not), FSDP's strided copy and
    // MLA's strided add, the bf16 conversion (aligned and not) and back.
    run_check("kernels_check.cpp", 83);
}

#[test]
fn float8_cast_kernels_match_a_reference_bit_for_bit_on_the_emulator() {
    // Amaxes along three axes, with and without a NaN; the quantise-dequantise along three axes
    // in e4m3 and e5m2, without codes and with them in both layouts; an operand kept in bf16
    // alone (3 amaxes, the cast and its codes) as its widened values; the codes there and back in
    // both; MXFP8 casts along rows and down columns, FLOOR and RCEIL, and from a bf16 copy; the
    // float8 GEMM path (codes multiplied, products scaled back) of a linear's three GEMMs
    // under tensorwise and rowwise scales against the dequantised GEMM.
    run_check("float8_check.cpp", 54);
}
