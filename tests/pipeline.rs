//! Pipeline parallelism through the launcher, real processes on the CPU transport: per-step loss
//! and gradient-norm parity with one process under every schedule (and a custom CSV one), PP 4,
//! PP × TP, PP × FSDP, PP × DDP and PP × FSDP × TP, resharding resume in both directions, and
//! the refusals.

mod common;

use common::{assert_layout_matches_one_process, assert_parity, losses, train};

/// Four sequences a step: four microbatches of one.
const BATCH4: &[&str] = &["--training.local_batch_size", "4"];

fn pp(degree: &'static str, schedule: &'static str) -> Vec<&'static str> {
    pp_fsdp(degree, schedule, "1")
}

/// The pipeline with each stage sharded over `shard` FSDP ranks.
fn pp_fsdp(degree: &'static str, schedule: &'static str, shard: &'static str) -> Vec<&'static str> {
    vec![
        "--parallelism.pipeline_parallel_degree",
        degree,
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.data_parallel_shard_degree",
        shard,
    ]
}

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// Trains in one process and with `launcher` + `parallel`, 10 steps, and checks the curves agree.
fn check_parity(what: &str, extra: &[&str], launcher: &[&str], parallel: &[&str]) {
    let single = [&["--training.steps", "10"][..], BATCH4, extra].concat();
    assert_layout_matches_one_process(what, &single, launcher, parallel, "pipeline: ");
}

/// Trains `steps` steps (of 4 sequences, a checkpoint every 3) into `dir` with `launcher`, the
/// overrides `extra` and `parallel`, which must succeed.
fn train_saving(
    dir: &std::path::Path,
    steps: &str,
    launcher: &[&str],
    extra: &[&str],
    parallel: &[&str],
) {
    let args = [
        &["--training.steps", steps, "--checkpoint.interval", "3"][..],
        BATCH4,
        extra,
        parallel,
    ]
    .concat();
    let o = train(dir, launcher, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn pp_2_matches_one_process_under_every_schedule() {
    check_parity("PP 2 1F1B", &[], &nproc("2"), &pp("2", "1F1B"));
    check_parity("PP 2 GPipe", &[], &nproc("2"), &pp("2", "GPipe"));
    // Two stages per rank: embedding | block 0 | block 1 | head, looped over the two ranks.
    check_parity(
        "PP 2 Interleaved1F1B",
        &[],
        &nproc("2"),
        &pp("2", "Interleaved1F1B"),
    );
    check_parity("PP 2 LoopedBFS", &[], &nproc("2"), &pp("2", "LoopedBFS"));
    // Zero-bubble: backwards split into input and weight gradients, the latter deferred.
    for zb in ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"] {
        check_parity(&format!("PP 2 {zb}"), &[], &nproc("2"), &pp("2", zb));
    }
    // Tied embeddings (1B's): the first and last stages both hold the embedding, their
    // gradients summed, the norm counting it once.
    let tied = ["--model.flavor", "1B"];
    check_parity("PP 2 tied", &tied, &nproc("2"), &pp("2", "1F1B"));
    // Two micro-batches a step, each cut into four pipeline microbatches.
    let accum = ["--training.global_batch_size", "8"];
    check_parity("PP 2 accumulating", &accum, &nproc("2"), &pp("2", "1F1B"));
}

#[test]
fn pp_4_a_csv_schedule_and_pp_with_tp_match_one_process() {
    check_parity("PP 4 1F1B", &[], &nproc("4"), &pp("4", "1F1B"));
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 runs its two microbatches' backwards late (GPipe-like), rank 0 is 1F1B.
    let csv = dir.path().join("custom.csv");
    std::fs::write(
        &csv,
        "0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\n1F0,1F1,1B0,1B1,1F2,1F3,1B2,1B3\n",
    )
    .unwrap();
    let mut custom = pp("2", "1F1B");
    let path = csv.to_str().unwrap().to_string();
    let path: &'static str = Box::leak(path.into_boxed_str());
    custom.extend(["--parallelism.pipeline_parallel_schedule_csv", path]);
    check_parity("PP 2 CSV", &[], &nproc("2"), &custom);
    let mut with_tp = pp("2", "1F1B");
    with_tp.extend(["--parallelism.tensor_parallel_degree", "2"]);
    check_parity("PP 2 × TP 2", &[], &nproc("4"), &with_tp);
    // Deferred weight gradients read copies of their operands: async TP's chunked GEMMs and
    // activations recomputed by per-op checkpointing leave them right.
    let mut zbv_tp = pp("2", "ZBVZeroBubble");
    zbv_tp.extend([
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_async_tensor_parallel",
        "true",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]);
    check_parity(
        "PP 2 ZBV × async TP 2, per-op AC",
        &[],
        &nproc("4"),
        &zbv_tp,
    );
}

/// PyTorch's own DualPipeV schedule for PP 2 and 4 microbatches, as its CSV dump writes it
/// (`tests/fixtures/dualpipev_pp2_mb4.csv`, from `scripts/pytorch_dualpipev_csv.py`): V-placed
/// stages, split backwards, `(0F3;3B1)OVERLAP_F_B` cells and REDUCE_GRAD / WAIT_REDUCE_GRAD
/// actions. titan runs each overlap's forward and backward in order: the one-process curve.
#[test]
fn pytorchs_dualpipev_csv_with_overlap_cells_matches_one_process() {
    let csv = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/dualpipev_pp2_mb4.csv"
    );
    let text = std::fs::read_to_string(csv).unwrap();
    assert!(text.contains(")OVERLAP_F_B") && text.contains("WAIT_REDUCE_GRAD"));
    let mut dualpipe = pp("2", "1F1B");
    dualpipe.extend(["--parallelism.pipeline_parallel_schedule_csv", csv]);
    check_parity("PP 2 PyTorch DualPipeV CSV", &[], &nproc("2"), &dualpipe);
}

#[test]
fn a_pipeline_checkpoint_resumes_in_one_process_and_the_reverse() {
    let run = |dir: &std::path::Path, steps: &str, launcher: &[&str], parallel: &[&str]| {
        train_saving(dir, steps, launcher, &[], parallel)
    };
    let pipe = pp("2", "1F1B");
    // Reference: one process, saved at step 3, resumed to 6.
    let one = tempfile::tempdir().unwrap();
    run(one.path(), "3", &[], &[]);
    run(one.path(), "6", &[], &[]);
    // PP 2 saves, one process resumes.
    let a = tempfile::tempdir().unwrap();
    run(a.path(), "3", &nproc("2"), &pipe);
    assert!(a.path().join("checkpoint/step-3").is_dir());
    run(a.path(), "6", &[], &[]);
    // One process saves, PP 2 resumes.
    let b = tempfile::tempdir().unwrap();
    run(b.path(), "3", &[], &[]);
    run(b.path(), "6", &nproc("2"), &pipe);
    // PP 2 saves (each stage its own tensors) and resumes from its own files.
    let c = tempfile::tempdir().unwrap();
    run(c.path(), "3", &nproc("2"), &pipe);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(c.path().join("checkpoint/step-3/state.json")).unwrap(),
    )
    .unwrap();
    let index = &state["sharding"];
    assert_eq!(index["pp_parts"], 2, "{index}");
    assert_eq!(index["tensors"]["output.weight"]["pp_part"], 1, "{index}");
    assert!(index["tensors"]["tok_embeddings.weight"]["pp_part"].is_null());
    run(c.path(), "6", &nproc("2"), &pipe);
    // Saved under 1F1B (2 stages), resumed under Interleaved1F1B (4 stages): the ranks hold
    // other tensors than they wrote, so they merge the checkpoint instead of their own files.
    let d = tempfile::tempdir().unwrap();
    run(d.path(), "3", &nproc("2"), &pipe);
    run(d.path(), "6", &nproc("2"), &pp("2", "Interleaved1F1B"));
    let reference = losses(one.path());
    assert_parity(
        &reference,
        &losses(d.path()),
        "PP 2 1F1B → PP 2 Interleaved1F1B",
    );
    assert_eq!(reference.len(), 6);
    assert_parity(&reference, &losses(a.path()), "PP 2 → one process");
    assert_parity(&reference, &losses(b.path()), "one process → PP 2");
    assert_parity(&reference, &losses(c.path()), "PP 2 → PP 2");
}

#[test]
fn what_the_pipeline_cannot_run_is_refused_at_start() {
    let refused = |launcher: &[&str], parallel: &[&str], expect: &str| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--training.steps", "2"];
        args.extend_from_slice(parallel);
        let o = train(dir.path(), launcher, &args);
        assert!(!o.status.success(), "{parallel:?} ran");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(expect), "{parallel:?}: {e}");
    };
    // Two sequences are two microbatches: fewer than four stages need.
    refused(
        &nproc("4"),
        &pp("4", "1F1B"),
        "needs at least 4 microbatches",
    );
    refused(&[], &pp("2", "Looped"), "is not known");
    let mut odd = pp("2", "1F1B");
    odd.extend(["--parallelism.pipeline_parallel_microbatch_size", "3"]);
    refused(&[], &odd, "must divide");
    let mut points = pp("2", "1F1B");
    points.extend(["--parallelism.pipeline_parallel_split_points", "layers.7"]);
    refused(&nproc("2"), &points, "names no block");
}

/// The pipeline composed with data parallelism: each stage's parameters sharded (FSDP) or
/// replicated (DDP) over the data-parallel ranks, and all three dimensions at once.
#[test]
fn pp_composes_with_fsdp_ddp_and_tp() {
    // Two data-parallel ranks of four sequences: one process runs the global batch of eight.
    let global = ["--training.global_batch_size", "8"];
    check_parity(
        "PP 2 × FSDP 2",
        &global,
        &nproc("4"),
        &pp_fsdp("2", "1F1B", "2"),
    );
    let mut ddp = pp("2", "Interleaved1F1B");
    ddp.extend(["--parallelism.data_parallel_replicate_degree", "2"]);
    check_parity("PP 2 × DDP 2", &global, &nproc("4"), &ddp);
    let mut three_d = pp_fsdp("2", "ZBVZeroBubble", "2");
    three_d.extend(["--parallelism.tensor_parallel_degree", "2"]);
    check_parity("PP 2 × FSDP 2 × TP 2", &global, &nproc("8"), &three_d);
}

#[test]
fn pp_fsdp_and_3d_checkpoints_resume_under_other_layouts() {
    let global = ["--training.global_batch_size", "8"];
    let run = |dir: &std::path::Path, steps: &str, launcher: &[&str], parallel: &[&str]| {
        train_saving(dir, steps, launcher, &global, parallel)
    };
    let pipe = pp_fsdp("2", "1F1B", "2");
    let fsdp = ["--parallelism.data_parallel_shard_degree", "2"];
    let one = tempfile::tempdir().unwrap();
    run(one.path(), "3", &[], &[]);
    run(one.path(), "6", &[], &[]);
    let a = tempfile::tempdir().unwrap();
    run(a.path(), "3", &nproc("4"), &pipe);
    run(a.path(), "6", &nproc("2"), &fsdp);
    let b = tempfile::tempdir().unwrap();
    run(b.path(), "3", &nproc("2"), &fsdp);
    run(b.path(), "6", &nproc("4"), &pipe);
    // 3-D: the TP group of the first stages writes tensor-parallel parts.
    let c = tempfile::tempdir().unwrap();
    let mut three_d = pp_fsdp("2", "1F1B", "2");
    three_d.extend(["--parallelism.tensor_parallel_degree", "2"]);
    run(c.path(), "3", &nproc("8"), &three_d);
    run(c.path(), "6", &[], &[]);
    let reference = losses(one.path());
    assert_parity(&reference, &losses(a.path()), "PP 2 × FSDP 2 → FSDP 2");
    assert_parity(&reference, &losses(b.path()), "FSDP 2 → PP 2 × FSDP 2");
    assert_parity(
        &reference,
        &losses(c.path()),
        "PP 2 × FSDP 2 × TP 2 → one process",
    );
}

/// A tied embedding is written by both stages holding it, so each reads its own files back, and
/// the checkpoint merges under another layout.
#[test]
fn tied_embeddings_resume_under_pp_and_in_one_process() {
    let tied = ["--model.flavor", "1B"];
    let run = |dir: &std::path::Path, steps: &str, launcher: &[&str], parallel: &[&str]| {
        train_saving(dir, steps, launcher, &tied, parallel)
    };
    let pipe = pp("2", "1F1B");
    let one = tempfile::tempdir().unwrap();
    run(one.path(), "3", &[], &[]);
    run(one.path(), "6", &[], &[]);
    let a = tempfile::tempdir().unwrap();
    run(a.path(), "3", &nproc("2"), &pipe);
    run(a.path(), "6", &nproc("2"), &pipe);
    let b = tempfile::tempdir().unwrap();
    run(b.path(), "3", &nproc("2"), &pipe);
    run(b.path(), "6", &[], &[]);
    let reference = losses(one.path());
    assert_parity(&reference, &losses(a.path()), "tied, PP 2 → PP 2");
    assert_parity(&reference, &losses(b.path()), "tied, PP 2 → one process");
}
