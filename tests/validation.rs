//! Validation: the held-out loss every `freq` steps, the same under one process, FSDP 2, PP 2 and
//! PP 2 × FSDP 2, and a training curve untouched by it; bad settings refused naming the key or
//! the file.

mod common;

use common::{metric, train};

fn run(launcher: &[&str], extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["--training.steps", "6", "--checkpoint.enable", "false"];
    args.extend_from_slice(extra);
    let o = train(dir.path(), launcher, &args);
    assert!(
        o.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

const VALIDATE: [&str; 6] = [
    "--validation.enable",
    "true",
    "--validation.freq",
    "3",
    "--validation.steps",
    "2",
];

#[test]
fn validation_matches_across_layouts_and_leaves_training_alone() {
    let plain = run(&[], &[]);
    let one = run(&[], &VALIDATE);
    let bits = |d: &tempfile::TempDir, key: &str| -> Vec<(u64, u64)> {
        metric(d.path(), key)
            .into_iter()
            .map(|(s, x)| (s, x.to_bits()))
            .collect()
    };
    // The training curve is bit-identical with validation on and off.
    assert_eq!(bits(&plain, "loss"), bits(&one, "loss"));
    assert_eq!(bits(&plain, "grad_norm"), bits(&one, "grad_norm"));
    let v1 = metric(one.path(), "validation_loss");
    assert_eq!(v1.iter().map(|&(s, _)| s).collect::<Vec<_>>(), [3, 6]);
    let ppl = metric(one.path(), "validation_perplexity");
    for ((_, l), (_, p)) in v1.iter().zip(&ppl) {
        assert!((l.exp() - p).abs() <= 1e-9 * p, "{l} {p}");
    }
    // The model learns between the two validations, on data it does not train on.
    assert!(v1[1].1 < v1[0].1, "{v1:?}");
    // FSDP 2 (each rank half of every batch) measures the same loss.
    let with_batch = |training: &'static str, validation: &'static str| {
        let mut args = VALIDATE.to_vec();
        args.extend([
            "--training.local_batch_size",
            training,
            "--validation.local_batch_size",
            validation,
        ]);
        args
    };
    let fsdp = run(
        &["--nproc", "2", "--master-port", "0"],
        &with_batch("1", "1"),
    );
    let one_b2 = run(&[], &with_batch("2", "2"));
    assert_eq!(metric(fsdp.path(), "validation_loss").len(), 2);
    common::assert_parity(
        &metric(one_b2.path(), "validation_loss"),
        &metric(fsdp.path(), "validation_loss"),
        "validation loss, FSDP 2 against one process",
    );
    // The pipeline (only the last stage computes the loss), alone and with FSDP.
    let pp = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ];
    let pipelined = run(
        &["--nproc", "2", "--master-port", "0"],
        &[&with_batch("2", "2")[..], &pp].concat(),
    );
    common::assert_parity(
        &metric(one_b2.path(), "validation_loss"),
        &metric(pipelined.path(), "validation_loss"),
        "validation loss, PP 2 against one process",
    );
    let mut pp_fsdp = pp;
    pp_fsdp[3] = "2";
    let one_b4 = run(&[], &with_batch("4", "4"));
    let pipelined = run(
        &["--nproc", "4", "--master-port", "0"],
        &[&with_batch("2", "2")[..], &pp_fsdp].concat(),
    );
    common::assert_parity(
        &metric(one_b4.path(), "validation_loss"),
        &metric(pipelined.path(), "validation_loss"),
        "validation loss, PP 2 × FSDP 2 against one process",
    );
    // A validation shape of its own (its own workspace).
    let other = run(
        &[],
        &[
            "--validation.enable",
            "true",
            "--validation.freq",
            "6",
            "--validation.steps",
            "1",
            "--validation.seq_len",
            "16",
            "--validation.local_batch_size",
            "3",
        ],
    );
    assert_eq!(metric(other.path(), "validation_loss").len(), 1);
    assert_eq!(bits(&plain, "loss"), bits(&other, "loss"));
}

#[test]
fn bad_validation_settings_are_refused() {
    for (args, want) in [
        (
            vec![
                "--validation.enable",
                "true",
                "--validation.dataset",
                "jsonl",
                "--validation.dataset_path",
                "/no/such/file.jsonl",
            ],
            "/no/such/file.jsonl",
        ),
        (
            vec!["--validation.enable", "true", "--validation.steps", "-1"],
            "[validation] steps = -1",
        ),
        (
            vec![
                "--validation.enable",
                "true",
                "--validation.dataset",
                "jsonl",
            ],
            "needs a dataset_path",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let o = train(dir.path(), &[], &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
}
