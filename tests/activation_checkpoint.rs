//! Activation checkpointing: every mode gives the same losses and gradient norms as keeping every
//! activation, bit for bit (the recompute runs the same kernels on the same inputs), in one
//! process, under DDP, FSDP and tensor parallelism (plain and async); bad settings are refused
//! naming the key, and a run too big without checkpointing is told which mode would fit.

mod common;

use common::{metric, train};

/// `(step, loss bits, grad norm bits)` of a 10-step run with `ac` under `launcher`/`layout`.
fn curve(launcher: &[&str], layout: &[&str], ac: &[&str]) -> Vec<(u64, u64, u64)> {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec![
        "--training.steps",
        "10",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "false",
    ];
    args.extend_from_slice(layout);
    args.extend_from_slice(ac);
    let o = train(dir.path(), launcher, &args);
    assert!(
        o.status.success(),
        "{ac:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (loss, norm) = (metric(dir.path(), "loss"), metric(dir.path(), "grad_norm"));
    assert_eq!(loss.len(), 10);
    loss.iter()
        .zip(&norm)
        .map(|(&(s, l), &(_, n))| (s, l.to_bits(), n.to_bits()))
        .collect()
}

const MODES: [&[&str]; 3] = [
    &["--activation_checkpoint.mode", "full"],
    &[
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    &[
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
];

fn check_every_mode(what: &str, launcher: &[&str], layout: &[&str]) {
    let none = curve(launcher, layout, &["--activation_checkpoint.mode", "none"]);
    for ac in MODES {
        assert_eq!(curve(launcher, layout, ac), none, "{what} with {ac:?}");
    }
}

#[test]
fn every_mode_is_bit_identical_in_one_process_and_under_fsdp_and_tp() {
    // Three blocks, so that `selective` every 2nd block checkpoints blocks 0 and 2 and keeps 1.
    let three = ["--model.n_layers", "3"];
    check_every_mode("one process", &[], &three);
    // Accumulating two micro-batches a step, in bf16.
    let mut accum_bf16 = three.to_vec();
    accum_bf16.extend([
        "--training.global_batch_size",
        "4",
        "--training.mixed_precision_param",
        "bfloat16",
    ]);
    check_every_mode("one process, 2 micro-batches, bf16", &[], &accum_bf16);
    let nproc2 = ["--nproc", "2", "--master-port", "0"];
    check_every_mode("FSDP 2", &nproc2, &three);
    let mut ddp2 = three.to_vec();
    ddp2.extend([
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]);
    check_every_mode("DDP 2", &nproc2, &ddp2);
    let mut tp2 = three.to_vec();
    tp2.extend([
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]);
    check_every_mode("TP 2", &nproc2, &tp2);
    // The recompute runs the forward's own chunked gathers and GEMMs.
    tp2.extend(["--parallelism.enable_async_tensor_parallel", "true"]);
    check_every_mode("async TP 2", &nproc2, &tp2);
}

#[test]
fn every_mode_is_bit_identical_for_qwen3_and_qwen3_moe() {
    // QK-norm's inputs and statistics, and a mixture of experts' routed activations, recomputed.
    let three = ["--model.n_layers", "3", "--model.name", "qwen3"];
    check_every_mode(
        "Qwen3",
        &[],
        &[&three[..], &["--model.flavor", "debugmodel"]].concat(),
    );
    let moe = [&three[..], &["--model.flavor", "debugmodel_moe"]].concat();
    check_every_mode("Qwen3-MoE", &[], &moe);
    let nproc2 = ["--nproc", "2", "--master-port", "0"];
    check_every_mode("Qwen3-MoE FSDP 2", &nproc2, &moe);
    // In bf16 the experts' activations are rounded where produced and kept as bf16 pairs.
    let bf16 = ["--training.mixed_precision_param", "bfloat16"];
    check_every_mode("Qwen3-MoE bf16", &[], &[&moe[..], &bf16[..]].concat());
}

#[test]
fn bad_settings_are_refused_naming_the_key() {
    for (args, want) in [
        (
            vec!["--activation_checkpoint.mode", "partial"],
            "mode = `partial` is not known (accepted: none, full, selective)",
        ),
        (
            vec![
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "0",
            ],
            "selective_ac_option = `0`",
        ),
        (
            vec!["--activation_checkpoint.every", "2"],
            "unknown field `every`",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let o = train(dir.path(), &[], &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
}

/// A run whose activations do not fit this machine without checkpointing, but do with per-op
/// checkpointing, is refused before allocating, naming the mode that would fit.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn a_run_that_does_not_fit_is_told_which_mode_would() {
    use titan::model::activation_checkpoint::AcMode;
    use titan::model::LocalShapes;
    use titan::train::memory::{available_memory, MemoryEstimate};
    let Some(avail) = available_memory() else {
        eprintln!("no MemAvailable on this machine: nothing to check");
        return;
    };
    let args = titan::model::families::llama3::flavor("debugmodel").unwrap();
    let whole = LocalShapes::whole(&args);
    let seq = 2048;
    let need = |batch: usize, mode: AcMode| {
        let plan = mode.plan(args.n_layers);
        let cpu = titan::backend::cpu::CpuBackend::new();
        MemoryEstimate::new(&args, &whole, batch, seq, &plan)
            .with_backend_scratch(&cpu, &whole, batch, seq, &plan)
            .total() as f64
    };
    // Without checkpointing 1.2–1.35 times what is available; per-op then needs about 0.7 of it.
    let batch = (1..4096)
        .find(|&b| need(b, AcMode::None) > 1.2 * avail as f64)
        .unwrap();
    assert!(need(batch, AcMode::None) < 1.35 * avail as f64);
    assert!(need(batch, AcMode::Op) < 0.8 * avail as f64);
    let dir = tempfile::tempdir().unwrap();
    let batch = batch.to_string();
    let o = common::train_command(
        dir.path(),
        &[],
        &[
            "--training.local_batch_size",
            &batch,
            "--training.seq_len",
            "2048",
            "--training.steps",
            "1",
        ],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "ran");
    assert!(
        err.contains("activation checkpointing: none")
            && err.contains(r#"[activation_checkpoint] mode = "selective", selective_ac_option = "op" would make it fit"#),
        "{err}"
    );
}
