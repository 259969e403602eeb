//! Context parallelism through the launcher, real processes on the CPU transport: per-step loss
//! and gradient-norm parity with one process for CP 2 and CP 4 under both rotate methods, with
//! activation checkpointing and gradient accumulation, composed with FSDP, HSDP, TP and PP, the
//! 4-D PP × FSDP × TP × CP layout, sliding windows, validation, resume across layouts, and the
//! refusals.

mod common;

use common::{
    assert_layout_matches_one_process, assert_parity, assert_validation_matches, losses, train,
};

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

fn cp(degree: &'static str, rotate: &'static str) -> Vec<&'static str> {
    vec![
        "--parallelism.context_parallel_degree",
        degree,
        "--parallelism.context_parallel_rotate_method",
        rotate,
    ]
}

/// Trains in one process and with `launcher` + `parallel`, 10 steps, and checks the curves agree.
fn check_parity(what: &str, extra: &[&str], launcher: &[&str], parallel: &[&str]) {
    let single = [&["--training.steps", "10"][..], extra].concat();
    assert_layout_matches_one_process(what, &single, launcher, parallel, "context parallel ");
}

#[test]
fn cp_2_and_4_match_one_process_under_both_rotate_methods() {
    check_parity("CP 2 allgather", &[], &nproc("2"), &cp("2", "allgather"));
    check_parity("CP 2 alltoall", &[], &nproc("2"), &cp("2", "alltoall"));
    check_parity("CP 4 allgather", &[], &nproc("4"), &cp("4", "allgather"));
    check_parity("CP 4 alltoall", &[], &nproc("4"), &cp("4", "alltoall"));
}

#[test]
fn cp_composes_with_activation_checkpointing_and_accumulation() {
    // Full AC recomputes each block's ring attention (its collectives again); per-op AC keeps
    // attention's output and recomputes the rest.
    let full = ["--activation_checkpoint.mode", "full"];
    check_parity("CP 2 full AC", &full, &nproc("2"), &cp("2", "alltoall"));
    let op = [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ];
    check_parity("CP 2 per-op AC", &op, &nproc("2"), &cp("2", "allgather"));
    let accum = ["--training.global_batch_size", "4"];
    check_parity(
        "CP 2 accumulating",
        &accum,
        &nproc("2"),
        &cp("2", "allgather"),
    );
}

#[test]
fn cp_composes_with_fsdp_tp_and_pp() {
    // Two data-parallel ranks of two sequences: one process runs the global batch of four.
    let global = ["--training.global_batch_size", "4"];
    let mut fsdp = cp("2", "allgather");
    fsdp.extend(["--parallelism.data_parallel_shard_degree", "2"]);
    check_parity("FSDP 2 × CP 2", &global, &nproc("4"), &fsdp);
    let mut hsdp = cp("2", "alltoall");
    hsdp.extend(["--parallelism.data_parallel_replicate_degree", "2"]);
    check_parity("HSDP 2 × CP 2", &global, &nproc("4"), &hsdp);
    let mut tp = cp("2", "allgather");
    tp.extend(["--parallelism.tensor_parallel_degree", "2"]);
    check_parity("TP 2 × CP 2", &[], &nproc("4"), &tp);
    let mut pp = cp("2", "alltoall");
    pp.extend([
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    ]);
    check_parity("PP 2 × CP 2", &[], &nproc("4"), &pp);
}

/// The 4-D layout of TorchTitan's 405B recipe in miniature: 16 processes (about a second on two
/// cores with the tiny model).
#[test]
fn pp_fsdp_tp_cp_4d_matches_one_process() {
    let global = ["--training.global_batch_size", "4"];
    let mut four_d = cp("2", "allgather");
    four_d.extend([
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]);
    check_parity(
        "PP 2 × FSDP 2 × TP 2 × CP 2",
        &global,
        &nproc("16"),
        &four_d,
    );
}

/// Sliding-window attention (Mistral's, on every block; a window of 6 keys over sequences of 32):
/// CP's ring skips the blocks of keys no query of a chunk sees and masks within the others, TP
/// splits the heads; each equals one process.
#[test]
fn sliding_windows_under_cp_and_tp_match_one_process() {
    let mistral = [
        "--model.name",
        "mistral",
        "--model.flavor",
        "debugmodel",
        "--model.sliding_window_size",
        "6",
    ];
    check_parity(
        "window 6, CP 2",
        &mistral,
        &nproc("2"),
        &cp("2", "allgather"),
    );
    let mut tp = cp("2", "alltoall");
    tp.extend(["--parallelism.tensor_parallel_degree", "2"]);
    check_parity("window 6, TP 2 × CP 2", &mistral, &nproc("4"), &tp);
}

/// Llama 4's attention on the debug model: every second block without RoPE and chunked attention
/// of 24 positions on the others, over packed documents (a chunk restarts at a document's start
/// too): CP's ring with the chunk mask over its load-balanced shards, and TP × CP, equal one
/// process.
#[test]
fn chunked_attention_and_nope_blocks_under_cp_and_tp_match_one_process() {
    let chunks = [
        "--model.attention_chunk_size",
        "24",
        "--model.every_n_layers_nope",
        "2",
    ];
    check_parity(
        "chunks 24, CP 2",
        &chunks,
        &nproc("2"),
        &cp("2", "allgather"),
    );
    let mut tp = cp("2", "alltoall");
    tp.extend(["--parallelism.tensor_parallel_degree", "2"]);
    check_parity("chunks 24, TP 2 × CP 2", &chunks, &nproc("4"), &tp);
}

#[test]
fn validation_under_cp_equals_one_process() {
    assert_validation_matches(&[], &nproc("2"), &cp("2", "alltoall"), "CP 2 validation");
}

#[test]
fn cp_checkpoints_resume_under_other_layouts_and_back() {
    let run = |dir: &std::path::Path, steps: &str, launcher: &[&str], parallel: &[&str]| {
        let args = [
            &["--training.steps", steps, "--checkpoint.interval", "3"][..],
            parallel,
        ]
        .concat();
        let o = train(dir, launcher, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let one = tempfile::tempdir().unwrap();
    run(one.path(), "6", &[], &[]);
    // Parameters sharded over the CP ranks → one process, and one process → CP 2 × TP 2.
    let a = tempfile::tempdir().unwrap();
    run(a.path(), "3", &nproc("2"), &cp("2", "allgather"));
    run(a.path(), "6", &[], &[]);
    let b = tempfile::tempdir().unwrap();
    run(b.path(), "3", &[], &[]);
    let mut tp = cp("2", "alltoall");
    tp.extend(["--parallelism.tensor_parallel_degree", "2"]);
    run(b.path(), "6", &nproc("4"), &tp);
    let reference = losses(one.path());
    assert_parity(&reference, &losses(a.path()), "CP 2 → one process");
    assert_parity(&reference, &losses(b.path()), "one process → TP 2 × CP 2");
}

#[test]
fn bad_cp_settings_are_refused_naming_the_key() {
    let refused = |launcher: &[&str], extra: &[&str], says: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let o = train(
            dir.path(),
            launcher,
            &[&["--training.steps", "1"][..], extra].concat(),
        );
        assert!(!o.status.success(), "{extra:?} should be refused");
        let err = String::from_utf8_lossy(&o.stderr);
        for s in says {
            assert!(err.contains(s), "{extra:?}: {err}");
        }
    };
    // 32 positions do not make 2 × 3 chunks.
    refused(
        &nproc("3"),
        &cp("3", "allgather"),
        &["seq_len = 32", "context_parallel_degree"],
    );
    refused(
        &nproc("2"),
        &cp("2", "ring"),
        &["context_parallel_rotate_method", "\"ring\"", "alltoall"],
    );
    // CP 4 cannot fill a world of 2.
    refused(&nproc("2"), &cp("4", "allgather"), &["cp 4", "world size"]);
}
