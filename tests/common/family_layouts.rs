//! The checks each model family's test file runs on its shrunk debug model (`args`, after
//! `TINY_ARGS`): a layout against one process (per-step loss and gradient norm within 1e-5),
//! every pipeline schedule, bf16 layouts against one process in bf16 (within 1e-3: an f32 sum in
//! another order moves a value across a bf16 rounding boundary, as `tests/bf16.rs` says), and a
//! model of the family made by transformers trained by titan and by PyTorch's AdamW.

use super::pytorch_training::{train_both, Comparison};
use super::{assert_layout_matches_one_process, metric, token_shard, train, write_random_tokens};

/// `--nproc n` on a free port.
pub fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// `args` with `extra` in one process against `args`, `extra` and `parallel` over `n` ranks.
pub fn check(args: &[&str], what: &str, n: &'static str, extra: &[&str], parallel: &[&str]) {
    let single = [args, extra].concat();
    assert_layout_matches_one_process(what, &single, &nproc(n), parallel, "rank 0 of");
}

/// PP 2 under each of `schedules` (4 blocks: 2 a rank, 1 a stage where a rank runs two).
pub fn pipeline_schedules(args: &[&str], family: &str, schedules: &[&str]) {
    for schedule in schedules {
        check(
            args,
            &format!("{family} PP 2 ({schedule})"),
            "2",
            &["--model.n_layers", "4"],
            &[
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            ],
        );
    }
}

/// bf16 mixed precision: TP 2 and FSDP 2 × EP 2 against one process in bf16, loss and gradient
/// norm within 1e-3.
pub fn bf16_layouts_match(args: &[&str], family: &str) {
    let bf16 = ["--training.mixed_precision_param", "bfloat16"];
    // (what, for both runs, for the parallel one)
    let cases: [(&str, &[&str], &[&str]); 2] = [
        ("TP 2", &[], &["--parallelism.tensor_parallel_degree", "2"]),
        (
            "FSDP 2 × EP 2",
            &["--training.global_batch_size", "4"],
            &["--parallelism.expert_parallel_degree", "2"],
        ),
    ];
    for (what, both, parallel) in cases {
        let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let single = [args, &bf16[..], both].concat();
        let o = train(one.path(), &[], &single);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = train(many.path(), &nproc("2"), &[&single[..], parallel].concat());
        assert!(
            o.status.success(),
            "{family} {what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for key in ["loss", "grad_norm"] {
            let (a, b) = (metric(one.path(), key), metric(many.path(), key));
            assert_eq!(a.len(), b.len(), "{family} {what}: steps");
            for ((step, x), (_, y)) in a.iter().zip(&b) {
                let rel = (x - y).abs() / x.abs();
                assert!(
                    rel <= 1e-3,
                    "{family} {what} {key}, step {step}: {x} vs {y}"
                );
            }
        }
    }
}

/// The model the Python `make` writes (an HF folder), trained 20 steps by titan (imported, with
/// `titan_extra`) and by PyTorch's AdamW on the same random tokens: every step's loss and
/// gradient norm within 1e-5.
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
pub fn trains_as_pytorch(py: &str, make: &str, titan_extra: &[&str], family: &str) {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("tokens.bin");
    write_random_tokens(&shard, 4000, 5);
    let data = token_shard(&shard);
    let curves = train_both(
        py,
        &Comparison {
            dir: dir.path(),
            make: Some(make),
            steps: "20",
            titan_data: &data,
            tokens: &shard,
            targets: None,
            document_start: None,
            titan_extra,
            python_extra: &[],
        },
    );
    let worst = curves.worst_loss_difference();
    let ((_, titan_norm), (_, torch_norm)) = (&curves.titan, &curves.pytorch);
    let worst_norm = titan_norm
        .iter()
        .zip(torch_norm)
        .map(|((_, a), (_, b))| (a - b).abs() / b.abs())
        .fold(0.0, f64::max);
    eprintln!(
        "{family} vs PyTorch, 20 steps: loss within {worst:.2e}, grad norm within {worst_norm:.2e}"
    );
    assert!(
        worst <= 1e-5,
        "{:?} vs {:?}",
        curves.titan.0,
        curves.pytorch.0
    );
    assert!(worst_norm <= 1e-5, "{titan_norm:?} vs {torch_norm:?}");
}
