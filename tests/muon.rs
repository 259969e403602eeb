//! Distributed Muon: every layout trains as one process does (loss and gradient norm within 1e-5
//! over 10 steps), each weight matrix is orthogonalised exactly once per step over all the ranks
//! (the `muon_matrices` metric counts the Newton–Schulz runs of every rank), and under FSDP 4 the
//! work is spread: no rank runs more than 30% of the Newton–Schulz FLOPs.

mod common;

use common::{assert_parity, losses, metric, train};

/// Muon with its Newton–Schulz in float32 (so layouts compare to 1e-5), 10 steps, 4 sequences a
/// step.
const MUON: &[&str] = &[
    "--optimizer.name",
    "Muon",
    "--optimizer.lr",
    "2e-2",
    "--optimizer.adamw_lr",
    "2e-3",
    "--optimizer.ns_dtype",
    "float32",
    "--training.steps",
    "10",
    "--training.global_batch_size",
    "4",
];

/// The tiny Llama's matrices: 2 blocks × (wq, wk, wv, wo, w1, w2, w3).
const LLAMA_MATRICES: f64 = 14.0;

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// Runs `extra` in one process and with `n` processes and `parallel`; both curves agree and both
/// runs orthogonalise `matrices` matrices every step. Returns the parallel run's busiest rank's
/// share of the Newton–Schulz FLOPs, per step.
fn check(
    what: &str,
    extra: &[&str],
    n: &'static str,
    parallel: &[&str],
    matrices: f64,
) -> Vec<f64> {
    let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let single = [MUON, extra].concat();
    let o = train(one.path(), &[], &single);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = train(many.path(), &nproc(n), &[&single[..], parallel].concat());
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_parity(&losses(one.path()), &losses(many.path()), what);
    assert_parity(
        &metric(one.path(), "grad_norm"),
        &metric(many.path(), "grad_norm"),
        &format!("{what} (grad norm)"),
    );
    for dump in [one.path(), many.path()] {
        let counted = metric(dump, "muon_matrices");
        assert_eq!(counted.len(), 10, "{what}: {counted:?}");
        assert!(
            counted.iter().all(|&(_, c)| c == matrices),
            "{what}: matrices orthogonalised per step {counted:?}, the model has {matrices}"
        );
    }
    metric(many.path(), "muon_max_rank_ns_share")
        .into_iter()
        .map(|(_, s)| s)
        .collect()
}

#[test]
fn muon_data_parallel_layouts_match_one_process() {
    let shard = |n| ["--parallelism.data_parallel_shard_degree", n];
    let one_sequence = ["--training.local_batch_size", "1"];
    check("FSDP 2", &[], "2", &shard("2"), LLAMA_MATRICES);
    let ddp = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ];
    check("DDP 2", &[], "2", &ddp, LLAMA_MATRICES);
    let hsdp = [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ];
    check(
        "HSDP 2 × 2",
        &[],
        "4",
        &[&hsdp[..], &one_sequence].concat(),
        LLAMA_MATRICES,
    );
    // The work is spread over the four shard ranks, not repeated: each runs at most 30% of it.
    let fsdp_4 = [&shard("4")[..], &one_sequence].concat();
    let shares = check("FSDP 4", &[], "4", &fsdp_4, LLAMA_MATRICES);
    assert!(
        shares.iter().all(|&s| s <= 0.30),
        "FSDP 4: the busiest rank's share of the Newton–Schulz FLOPs per step {shares:?}"
    );
}

#[test]
fn muon_tensor_and_pipeline_layouts_match_one_process() {
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    check("TP 2", &[], "2", &tp, LLAMA_MATRICES);
    let fsdp_tp = [&tp[..], &["--parallelism.data_parallel_shard_degree", "2"]].concat();
    check("FSDP 2 × TP 2", &[], "4", &fsdp_tp, LLAMA_MATRICES);
    let (what, pp, _) = common::FSDP_TP_PP[2];
    check(what, &[], "2", pp, LLAMA_MATRICES);
}

#[test]
fn muon_expert_parallel_matches_one_process() {
    let moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"];
    let matrices = moe_matrices();
    let ep = ["--parallelism.expert_parallel_degree", "2"];
    check("EP 2", &moe, "2", &ep, matrices);
}

/// The tiny Qwen3-MoE's matrices, from its parameter names: every 2-D weight but the embedding
/// and the output head.
fn moe_matrices() -> f64 {
    let overrides: Vec<String> = common::TINY_ARGS
        .iter()
        .chain(&["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"])
        .map(|s| s.to_string())
        .collect();
    let cfg = titan::config::Config::load(None, &overrides).unwrap();
    let specs = titan::model::params::param_specs(&cfg.model_args().unwrap());
    specs
        .iter()
        .filter(|(name, shape)| titan::config::muon_updates(name, shape))
        .count() as f64
}

/// Settings for the resume tests: checkpoints every 2 steps, a constant learning rate (the
/// schedule does not depend on the run's length).
fn resumable(steps: &'static str) -> Vec<&'static str> {
    [
        &MUON[..6],
        &[
            "--training.steps",
            steps,
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--training.local_batch_size",
            "2",
            "--training.global_batch_size",
            "4",
            "--lr_scheduler.warmup_steps",
            "0",
            "--lr_scheduler.decay_ratio",
            "0",
        ][..],
    ]
    .concat()
}

/// A Muon run stopped at step 2 and resumed trains steps 3 and 4 bit for bit as the run that never
/// stopped, in one process and under FSDP 2 (each rank's momentum shards), with fp32 and with
/// bf16 state (checkpoints hold the bf16 values widened); a checkpoint written
/// under FSDP 2 resumes in one process (the momentum merged by name).
#[test]
fn a_muon_run_resumes_bit_for_bit_and_under_another_layout() {
    let fsdp: &[&str] = &["--nproc", "2", "--master-port", "0"];
    let bf16_state: &[&str] = &["--optimizer.state_dtype", "bfloat16"];
    for (launcher, extra) in [
        (&[][..], &[][..]),
        (fsdp, &[]),
        (&[], bf16_state),
        (fsdp, bf16_state),
    ] {
        let (straight, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for (dir, n) in [(&straight, "4"), (&resumed, "2"), (&resumed, "4")] {
            let o = train(dir.path(), launcher, &[&resumable(n)[..], extra].concat());
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let tail = |d: &std::path::Path| common::bits(&losses(d)[2..]);
        assert_eq!(losses(resumed.path()).len(), 4);
        assert_eq!(
            tail(straight.path()),
            tail(resumed.path()),
            "{launcher:?} {extra:?}"
        );
    }
    let (sharded, whole) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(sharded.path(), fsdp, &resumable("4"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = train(whole.path(), &[], &resumable("4"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Steps 3 and 4 again, in one process, from the FSDP checkpoint of step 2.
    std::fs::remove_dir_all(sharded.path().join("checkpoint/step-4")).unwrap();
    let again = tempfile::tempdir().unwrap();
    let from = sharded.path().join("checkpoint");
    let o = train(
        again.path(),
        &[],
        &[
            &resumable("4")[..],
            &["--checkpoint.folder", from.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_parity(
        &losses(whole.path())[2..],
        &losses(again.path()),
        "FSDP 2 → one process",
    );
}

/// Resuming an AdamW checkpoint with Muon is refused naming both (the state would mean something
/// else) unless the optimizer state is excluded from loading; bad Muon keys are refused by name.
#[test]
fn changing_the_optimizer_and_bad_muon_keys_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let adamw: Vec<&str> = resumable("2").into_iter().skip(6).collect();
    let o = train(dir.path(), &[], &adamw);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = train(dir.path(), &[], &resumable("4"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("holds the state of AdamW without parameter groups")
            && err.contains("exclude_from_loading"),
        "{err}"
    );
    let o = train(
        dir.path(),
        &[],
        &[
            &resumable("4")[..],
            &["--checkpoint.exclude_from_loading", "[\"optimizer\"]"],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(losses(dir.path()).len(), 4);
    for (extra, says) in [
        (
            &["--optimizer.ns_steps", "0"][..],
            "[optimizer] ns_steps must be between 1 and 99",
        ),
        (
            &["--optimizer.adjust_lr_fn", "rms"][..],
            "[optimizer] adjust_lr_fn = `rms` is not supported",
        ),
        (
            &["--optimizer.momentum", "1.5"][..],
            "[optimizer] momentum must be in [0, 1)",
        ),
        (
            &["--checkpoint.exclude_from_loading", "[\"model\"]"][..],
            "exclude_from_loading: `model` is not supported",
        ),
    ] {
        let o = train(
            &dir.path().join("bad"),
            &[],
            &[
                &["--training.steps", "1", "--optimizer.name", "Muon"][..],
                extra,
            ]
            .concat(),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(says),
            "{extra:?}: {err}"
        );
    }
}
