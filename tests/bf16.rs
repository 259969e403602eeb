//! bf16 mixed precision (`[training] mixed_precision_param = "bfloat16"`): the blocks compute
//! with bf16-rounded weights and the residual stream between blocks is stored in bf16. Trained
//! against PyTorch running the same transformers model as FSDP2's `MixedPrecisionPolicy(
//! param_dtype=bfloat16, reduce_dtype=float32)` does (a bf16 compute copy, fp32 masters, AdamW),
//! and every layout against one process in bf16.

mod common;

use common::pytorch_training::{train_both, Comparison};
use common::{hf_python, losses, metric, train};

const BF16: &[&str] = &["--training.mixed_precision_param", "bfloat16"];

/// Relative difference of `a` from `b`.
fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// 30 steps from a tiny transformers Llama: step 1's loss within 2e-3 and gradient norm within 1%
/// of PyTorch's, and every step's loss within 1%.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn bf16_training_follows_pytorchs_bf16_mixed_precision() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("tokens.bin");
    common::write_random_tokens(&shard, 4000, 11);
    let data = [
        &common::token_shard(&shard)[..],
        &["--training.document_start_id", "1"],
    ]
    .concat();
    let curves = train_both(
        &py,
        &Comparison {
            dir: dir.path(),
            steps: "30",
            titan_data: &data,
            tokens: &shard,
            targets: None,
            make: None,
            document_start: Some("1"),
            titan_extra: BF16,
            python_extra: &["--param-dtype", "bfloat16"],
        },
    );
    let ((titan_loss, titan_norm), (torch_loss, torch_norm)) = (&curves.titan, &curves.pytorch);
    let loss_1 = rel(titan_loss[0].1, torch_loss[0].1);
    let norm_1 = rel(titan_norm[0].1, torch_norm[0].1);
    let worst = curves.worst_loss_difference();
    eprintln!(
        "bf16 vs PyTorch bf16: step-1 loss {loss_1:.2e}, step-1 grad norm {norm_1:.2e}, \
         30 steps' loss within {worst:.2e}"
    );
    assert!(loss_1 <= 2e-3, "{titan_loss:?} vs {torch_loss:?}");
    assert!(norm_1 <= 1e-2, "{titan_norm:?} vs {torch_norm:?}");
    assert!(worst <= 1e-2, "{titan_loss:?} vs {torch_loss:?}");
}

/// Per-step values within `tol` (relative) of one process's; the largest difference.
fn assert_close(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64, what: &str) -> f64 {
    assert_eq!(a.len(), b.len(), "{what}: steps");
    assert!(!a.is_empty(), "{what}: no steps");
    let mut worst = 0.0f64;
    for ((s, x), (_, y)) in a.iter().zip(b) {
        let r = rel(*y, *x);
        assert!(r <= tol, "{what}, step {s}: one process {x}, parallel {y}");
        worst = worst.max(r);
    }
    worst
}

/// Every layout in bf16 against one process in bf16, loss and gradient norm within 1e-3 over 10
/// steps: the stream is rounded per value, so layouts differ only where an f32 sum's order moves
/// a value across a bf16 rounding boundary. Pipelines send the stored bf16 pairs; zero-bubble
/// schedules read the stored inputs for their deferred weight gradients.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn bf16_layouts_match_one_process_in_bf16() {
    let steps = ["--training.steps", "10", "--training.local_batch_size", "4"];
    let pp = |schedule: &'static str| {
        vec![
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ]
    };
    let moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"];
    let layers = ["--model.n_layers", "4"];
    // Data-parallel ranks take half the sequences each.
    let half = ["--training.local_batch_size", "2"];
    let ac_full = ["--activation_checkpoint.mode", "full"];
    let ac_op = [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ];
    let float8 = [
        "--model.converters",
        "quantize.linear.float8",
        "--quantize.linear.float8.recipe_name",
        "rowwise",
    ];
    let cases: Vec<(&str, &str, Vec<&str>, Vec<&str>)> = vec![
        ("FSDP 2, full AC", "2", ac_full.to_vec(), half.to_vec()),
        (
            "TP 2 (SP)",
            "2",
            vec![],
            vec![
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
        ),
        (
            "CP 2",
            "2",
            vec![],
            vec![
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
        ),
        ("PP 2, 1F1B", "2", vec![], pp("1F1B")),
        (
            "PP 2, Interleaved 1F1B, full AC",
            "2",
            [&layers[..], &ac_full[..]].concat(),
            pp("Interleaved1F1B"),
        ),
        (
            "PP 2, ZBV zero bubble",
            "2",
            layers.to_vec(),
            pp("ZBVZeroBubble"),
        ),
        ("PP 2, DualPipeV", "2", layers.to_vec(), pp("DualPipeV")),
        (
            "PP 2, Interleaved 1F1B, DeepSeek-V3 (MLA, MoE)",
            "2",
            [common::TINY_DEEPSEEK, &ac_op[..]].concat(),
            pp("Interleaved1F1B"),
        ),
        (
            // The stage's gathered block weights held as bf16 pairs for the pass.
            "PP 2 × FSDP 2, ZBV zero bubble, per-op AC",
            "4",
            [&layers[..], &ac_op[..]].concat(),
            [
                &pp("ZBVZeroBubble")[..6],
                &["--parallelism.data_parallel_shard_degree", "2"],
                &half[..],
            ]
            .concat(),
        ),
        (
            "HSDP 2 × 2, per-op AC",
            "4",
            ac_op.to_vec(),
            vec![
                "--training.local_batch_size",
                "1",
                "--parallelism.data_parallel_replicate_degree",
                "2",
            ],
        ),
        (
            "async TP 2, float8 rowwise",
            "2",
            float8.to_vec(),
            vec![
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--parallelism.enable_async_tensor_parallel",
                "true",
            ],
        ),
        (
            "EP 2 (Qwen3-MoE)",
            "2",
            moe.to_vec(),
            [&half[..], &["--parallelism.expert_parallel_degree", "2"]].concat(),
        ),
    ];
    for (what, n, model, parallel) in cases {
        let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let single = [&model[..], &steps[..], BF16].concat();
        let o = train(one.path(), &[], &single);
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let launcher = ["--nproc", n, "--master-port", "0"];
        let o = train(
            many.path(),
            &launcher,
            &[&single[..], &parallel[..]].concat(),
        );
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let loss = assert_close(&losses(one.path()), &losses(many.path()), 1e-3, what);
        let norms = |d: &std::path::Path| metric(d, "grad_norm");
        let norm = assert_close(&norms(one.path()), &norms(many.path()), 1e-3, what);
        eprintln!("{what} in bf16 vs one process: loss within {loss:.1e}, grad norm {norm:.1e}");
    }
}

/// A checkpoint written by one process in bf16 at step 6 resumes under PP 2 (whose stages send
/// the stored bf16 stream) and under FSDP 2, each on the uninterrupted bf16 curve (within 1e-3):
/// the stream is rebuilt from the weights, nothing of it is saved.
#[test]
fn a_bf16_checkpoint_resumes_under_other_layouts_on_the_same_curve() {
    let base = [
        &["--training.steps", "10", "--training.local_batch_size", "4"][..],
        BF16,
    ]
    .concat();
    let straight = tempfile::tempdir().unwrap();
    let o = train(
        straight.path(),
        &[],
        &[&base[..], &["--checkpoint.interval", "6"]].concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tail: Vec<(u64, f64)> = losses(straight.path()).into_iter().skip(6).collect();
    assert_eq!(tail.len(), 4);
    let pp2 = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ];
    let fsdp2 = ["--training.local_batch_size", "2"];
    for (what, layout) in [("PP 2", &pp2[..]), ("FSDP 2", &fsdp2[..])] {
        let dir = tempfile::tempdir().unwrap();
        let dst = dir.path().join("checkpoint");
        std::fs::create_dir_all(&dst).unwrap();
        let status = std::process::Command::new("cp")
            .arg("-r")
            .arg(straight.path().join("checkpoint/step-6"))
            .arg(&dst)
            .status()
            .unwrap();
        assert!(status.success());
        let launcher = ["--nproc", "2", "--master-port", "0"];
        let o = train(dir.path(), &launcher, &[&base[..], layout].concat());
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("resumed from"), "{what}: {out}");
        assert_close(&tail, &losses(dir.path()), 1e-3, what);
    }
}
