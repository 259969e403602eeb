//! Tensor parallelism through the launcher, real processes on the CPU transport: per-step loss and
//! gradient-norm parity with one process (TP 2 and 4, without loss parallel, in bf16, composed with
//! DDP, FSDP and HSDP), resharding resume between TP and other layouts, and the refusals.

mod common;

use common::{assert_layout_matches_one_process, assert_parity, losses, train};

fn tp(degree: &'static str) -> Vec<&'static str> {
    vec![
        "--parallelism.tensor_parallel_degree",
        degree,
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
}

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// Trains `extra` in one process and `parallel` with `launcher`, and checks both curves agree.
fn check_parity(what: &str, steps: &str, extra: &[&str], launcher: &[&str], parallel: &[&str]) {
    let single = [&["--training.steps", steps][..], extra].concat();
    assert_layout_matches_one_process(what, &single, launcher, parallel, "tensor parallel");
}

#[test]
fn tp_2_and_tp_4_match_one_process_with_and_without_loss_parallel_and_in_bf16() {
    check_parity("TP 2", "20", &[], &nproc("2"), &tp("2"));
    // TP 4 needs key/value heads that split four ways.
    let kv4 = ["--model.n_kv_heads", "4"];
    check_parity("TP 4", "20", &kv4, &nproc("4"), &tp("4"));
    let mut gathered = tp("2");
    gathered.extend(["--parallelism.disable_loss_parallel", "true"]);
    check_parity("TP 2 gathered logits", "20", &[], &nproc("2"), &gathered);
    let bf16 = ["--training.mixed_precision_param", "bfloat16"];
    check_parity("TP 2 bf16", "20", &bf16, &nproc("2"), &tp("2"));
    // Gradient accumulation: two micro-batches a step.
    let accum = ["--training.global_batch_size", "4"];
    check_parity("TP 2 accumulating", "8", &accum, &nproc("2"), &tp("2"));
}

fn async_tp(degree: &'static str) -> Vec<&'static str> {
    let mut args = tp(degree);
    args.extend(["--parallelism.enable_async_tensor_parallel", "true"]);
    args
}

#[test]
fn async_tp_matches_one_process() {
    check_parity("async TP 2", "20", &[], &nproc("2"), &async_tp("2"));
    // 2 × 30 tokens: 30 rows per rank, in chunks of 8, 8, 8 and 6.
    let uneven = ["--training.seq_len", "30"];
    check_parity(
        "async TP 2, uneven chunks",
        "10",
        &uneven,
        &nproc("2"),
        &async_tp("2"),
    );
    let kv4 = ["--model.n_kv_heads", "4"];
    check_parity("async TP 4", "10", &kv4, &nproc("4"), &async_tp("4"));
    // Beside FSDP's own queue of gathers and reduce-scatters.
    let mut fsdp = async_tp("2");
    fsdp.extend([
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ]);
    let batch4 = ["--training.local_batch_size", "4"];
    check_parity("FSDP 2 x async TP 2", "10", &batch4, &nproc("4"), &fsdp);
}

#[test]
fn two_d_layouts_match_one_process() {
    // The same global batch of 4 rows: one process takes them all, two data-parallel ranks 2 each.
    let batch4 = ["--training.local_batch_size", "4"];
    let dp2 = |replicate: &'static str, shard: &'static str| {
        vec![
            "--training.local_batch_size",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            replicate,
            "--parallelism.data_parallel_shard_degree",
            shard,
        ]
    };
    check_parity("FSDP 2 x TP 2", "20", &batch4, &nproc("4"), &dp2("1", "2"));
    check_parity("DDP 2 x TP 2", "10", &batch4, &nproc("4"), &dp2("2", "1"));
    // HSDP 2 x 2 x TP 2 on 8 ranks: a batch of 8 rows of 16 tokens, one row per rank pair.
    let short = [
        "--training.local_batch_size",
        "8",
        "--training.seq_len",
        "16",
    ];
    let mut hsdp = dp2("2", "2");
    hsdp[1] = "2";
    hsdp.extend(["--training.local_batch_size", "2"]);
    check_parity("HSDP 2 x 2 x TP 2", "10", &short, &nproc("8"), &hsdp);
}

/// Steps 11.. of a run resumed from `ckpt`'s step-10 checkpoint under `launcher`/`layout`.
fn resumed_losses(ckpt: &std::path::Path, launcher: &[&str], layout: &[&str]) -> Vec<(u64, f64)> {
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("checkpoint");
    std::fs::create_dir_all(&dst).unwrap();
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(ckpt.join("checkpoint/step-10"))
        .arg(&dst)
        .status()
        .unwrap();
    assert!(status.success());
    let mut args = vec!["--training.steps", "14", "--training.local_batch_size", "4"];
    args.extend_from_slice(layout);
    let o = train(dir.path(), launcher, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("resumed from"), "{out}");
    losses(dir.path())
}

#[test]
fn tp_checkpoints_resume_under_other_layouts_and_fsdp_resumes_as_2d() {
    let base = ["--training.steps", "14", "--training.local_batch_size", "4"];
    let straight = tempfile::tempdir().unwrap();
    let o = train(straight.path(), &[], &base);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tail: Vec<(u64, f64)> = losses(straight.path()).into_iter().skip(10).collect();
    assert_eq!(tail.len(), 4);

    // TP 2 writes step 10, then resumes in one process and under FSDP 2.
    let tp2 = tempfile::tempdir().unwrap();
    let mut args = base.to_vec();
    args.extend(["--checkpoint.interval", "10"]);
    args.extend(tp("2"));
    let o = train(tp2.path(), &nproc("2"), &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Each TP rank wrote its own parts, indexed with their splits.
    let step10 = tp2.path().join("checkpoint/step-10");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(step10.join("state.json")).unwrap()).unwrap();
    let index = &state["sharding"];
    assert_eq!(
        (index["shards"].as_u64(), index["tp_parts"].as_u64()),
        (Some(2), Some(2))
    );
    let split = |name: &str| {
        index["tensors"][name]["tp_split"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(split("layers.0.attention.wq.weight"), "rows");
    assert_eq!(split("layers.0.feed_forward.w2.weight"), "columns");
    assert_eq!(split("norm.weight"), "replicated");
    for r in 0..2 {
        assert!(step10.join(format!("model-rank{r}.safetensors")).exists());
        assert!(step10
            .join(format!("optimizer-rank{r}.safetensors"))
            .exists());
    }
    assert_parity(
        &tail,
        &resumed_losses(tp2.path(), &[], &[]),
        "TP 2 -> one process",
    );
    // The layout that wrote it reads each rank's own files.
    assert_parity(
        &tail,
        &resumed_losses(tp2.path(), &nproc("2"), &tp("2")),
        "TP 2 -> TP 2",
    );
    // The tools that read checkpoints read a TP one too.
    let hf = tp2.path().join("hf");
    let o = std::process::Command::new(common::titan_bin())
        .args(["convert", "hf-export"])
        .arg(tp2.path().join("checkpoint/step-10"))
        .arg(&hf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(hf.join("model.safetensors").exists() && hf.join("config.json").exists());
    let fsdp2 = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    assert_parity(
        &tail,
        &resumed_losses(tp2.path(), &nproc("2"), &fsdp2),
        "TP 2 -> FSDP 2",
    );

    // FSDP 4 writes sharded files at step 10; FSDP 2 x TP 2 resumes from them.
    let fsdp4 = tempfile::tempdir().unwrap();
    let mut args = base.to_vec();
    args.extend([
        "--checkpoint.interval",
        "10",
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--training.local_batch_size",
        "1",
    ]);
    let o = train(fsdp4.path(), &nproc("4"), &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let two_d = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    assert_parity(
        &tail,
        &resumed_losses(fsdp4.path(), &nproc("4"), &two_d),
        "FSDP 4 -> FSDP 2 x TP 2",
    );

    // FSDP 2 x TP 2 writes 4 files, each an FSDP shard of a TP part: one process and FSDP 4 (the
    // same number of files, but flat shards of whole tensors) resume from them.
    let two_d_ckpt = tempfile::tempdir().unwrap();
    let mut args = base.to_vec();
    args.extend(["--checkpoint.interval", "10"]);
    args.extend(two_d);
    let o = train(two_d_ckpt.path(), &nproc("4"), &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_parity(
        &tail,
        &resumed_losses(two_d_ckpt.path(), &[], &[]),
        "FSDP 2 x TP 2 -> one process",
    );
    assert_parity(
        &tail,
        &resumed_losses(two_d_ckpt.path(), &nproc("4"), &two_d),
        "FSDP 2 x TP 2 -> FSDP 2 x TP 2",
    );
    let fsdp4_layout = [
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--training.local_batch_size",
        "1",
    ];
    assert_parity(
        &tail,
        &resumed_losses(two_d_ckpt.path(), &nproc("4"), &fsdp4_layout),
        "FSDP 2 x TP 2 -> FSDP 4",
    );
}

#[test]
fn layouts_tp_cannot_split_are_refused_naming_the_numbers() {
    let refused = |launcher: &[&str], extra: &[&str], want: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--training.steps", "2"];
        args.extend_from_slice(extra);
        let o = train(dir.path(), launcher, &args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} ran");
        for w in want {
            assert!(err.contains(w), "{extra:?}: no `{w}` in\n{err}");
        }
    };
    // The tiny model has 2 key/value heads.
    refused(
        &nproc("4"),
        &tp("4"),
        &["tensor_parallel_degree = 4", "n_kv_heads 2"],
    );
    let mut odd_tokens = tp("2");
    odd_tokens.extend([
        "--training.local_batch_size",
        "1",
        "--training.seq_len",
        "15",
    ]);
    refused(
        &nproc("2"),
        &odd_tokens,
        &["15 tokens", "tensor_parallel_degree 2"],
    );
}

/// `titan bench train` runs any layout the launcher can start, with the figures every parallel
/// dimension reports through (the largest rank's memory beside its estimate, TP's exposed
/// communication), and the one-process bench the same keys.
#[test]
fn bench_train_reports_every_layout_through_the_same_keys() {
    let bench = |launch: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "bench",
            "train",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            "--threads",
            "1",
        ];
        args.extend_from_slice(launch);
        args.extend_from_slice(common::TINY_ARGS);
        let o = std::process::Command::new(common::titan_bin())
            .args(&args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "{launch:?}: not one JSON object ({e}): {}",
                String::from_utf8_lossy(&o.stdout)
            )
        })
    };
    let one = bench(&[]);
    let two_d = bench(&["--nproc", "4", "--parallelism.tensor_parallel_degree", "2"]);
    assert_eq!(two_d["layout"], "dp_shard 2 × tp 2", "{two_d}");
    assert_eq!(two_d["global_batch"].as_u64(), Some(4), "{two_d}");
    for v in [&one, &two_d] {
        let per_device = v["tokens_per_s"].as_f64().unwrap() / v["nproc"].as_f64().unwrap();
        assert!(
            (v["tokens_per_s_per_device"].as_f64().unwrap() - per_device).abs() < 1e-6 * per_device,
            "{v}"
        );
        for key in ["tokens_per_s", "peak_rss_mib", "memory_estimate_mib"] {
            assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
        }
        assert!(v["peak_device_mib"].is_null(), "{v}");
    }
    assert!(one["tp_exposed_comm_ms_per_step"].is_null(), "{one}");
    assert!(
        two_d["tp_exposed_comm_ms_per_step"].as_f64().unwrap() > 0.0,
        "{two_d}"
    );
    // Each rank of the 2-D layout holds half the weights of one TP rank's group, a quarter of
    // the model's split weights: its estimate is below one process's.
    assert!(
        two_d["memory_estimate_mib"].as_f64().unwrap()
            < one["memory_estimate_mib"].as_f64().unwrap(),
        "{one}\n{two_d}"
    );
}
