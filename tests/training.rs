//! End-to-end training behaviour: learning, determinism, bitwise resume, gradient accumulation,
//! non-finite losses, checkpoint pruning.

mod common;

use common::{bits, quiet, tiny_config};
use titan::train::{train, RunOptions};

#[test]
fn loss_falls_on_the_synthetic_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 40);
    cfg.checkpoint.enable = false;
    cfg.optimizer.lr = 3e-3;
    let s = train(&cfg, &quiet()).unwrap();
    let first = s.losses[0].1;
    let last = s.losses.last().unwrap().1;
    assert!(last < 0.6 * first, "loss {first} -> {last}");
}

#[test]
fn qwen3_loss_falls_and_resumes_bit_for_bit() {
    let qwen3 = |dir: &std::path::Path, steps: u64| {
        let mut cfg = tiny_config(dir, steps);
        cfg.model.name = "qwen3".into();
        cfg.model.flavor = "debugmodel".into();
        cfg.optimizer.lr = 3e-3;
        cfg
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = qwen3(dir.path(), 40);
    cfg.checkpoint.enable = false;
    let s = train(&cfg, &quiet()).unwrap();
    let (first, last) = (s.losses[0].1, s.losses.last().unwrap().1);
    assert!(last < 0.6 * first, "qwen3: loss {first} -> {last}");
    // 10 steps straight, or 5 + resume + 5: the same bits.
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = train(&qwen3(a.path(), 10), &quiet()).unwrap().losses;
    let stop_at_5 = RunOptions {
        quiet: true,
        stop_after: Some(5),
    };
    train(&qwen3(b.path(), 10), &stop_at_5).unwrap();
    let resumed = train(&qwen3(b.path(), 10), &quiet()).unwrap().losses;
    assert_eq!(bits(&straight[5..]), bits(&resumed));
}

#[test]
fn same_seed_gives_bitwise_identical_losses() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut ca = tiny_config(a.path(), 6);
    ca.checkpoint.enable = false;
    let mut cb = tiny_config(b.path(), 6);
    cb.checkpoint.enable = false;
    assert_eq!(
        bits(&train(&ca, &quiet()).unwrap().losses),
        bits(&train(&cb, &quiet()).unwrap().losses)
    );
    cb.training.seed = 7;
    assert_ne!(
        bits(&train(&ca, &quiet()).unwrap().losses),
        bits(&train(&cb, &quiet()).unwrap().losses)
    );
}

#[test]
fn interrupted_and_resumed_run_matches_straight_run_bit_for_bit() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Accumulation (2 micro-batches) so the loader position inside a step matters too.
    let mut straight = tiny_config(a.path(), 20);
    straight.training.global_batch_size = 4;
    let full = train(&straight, &quiet()).unwrap();
    assert_eq!(full.losses.len(), 20);

    let mut resumed = tiny_config(b.path(), 20);
    resumed.training.global_batch_size = 4;
    let first = train(
        &resumed,
        &RunOptions {
            quiet: true,
            stop_after: Some(10),
        },
    )
    .unwrap();
    assert_eq!(first.losses.len(), 10);
    let second = train(&resumed, &quiet()).unwrap();
    assert_eq!(second.resumed_from, Some(10));
    let mut joined = first.losses.clone();
    joined.extend(second.losses);
    assert_eq!(bits(&joined), bits(&full.losses));
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut big = tiny_config(a.path(), 5);
    big.checkpoint.enable = false;
    big.training.local_batch_size = 4;
    let mut acc = tiny_config(b.path(), 5);
    acc.checkpoint.enable = false;
    acc.training.local_batch_size = 1;
    acc.training.global_batch_size = 4;
    let (lb, la) = (
        train(&big, &quiet()).unwrap().losses,
        train(&acc, &quiet()).unwrap().losses,
    );
    for ((s, x), (_, y)) in lb.iter().zip(&la) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {s}: {x} vs {y}");
    }
}

#[test]
fn non_finite_loss_stops_and_keeps_the_last_good_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 40);
    cfg.optimizer.lr = 1e6;
    cfg.training.max_norm = 0.0;
    cfg.lr_scheduler.warmup_steps = 0;
    cfg.checkpoint.interval = 1;
    let err = train(&cfg, &quiet()).unwrap_err().to_string();
    assert!(err.contains("non-finite"), "{err}");
    let steps = titan::checkpoint::list_steps(&cfg.checkpoint_folder()).unwrap();
    if let Some(&last) = steps.last() {
        assert!(err.contains(&format!("step-{last}")), "{err}");
        titan::checkpoint::read_state(&titan::checkpoint::step_dir(&cfg.checkpoint_folder(), last))
            .unwrap();
    }
}

#[test]
fn keep_latest_k_prunes_old_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 7);
    cfg.checkpoint.interval = 2;
    cfg.checkpoint.keep_latest_k = 2;
    train(&cfg, &quiet()).unwrap();
    assert_eq!(
        titan::checkpoint::list_steps(&cfg.checkpoint_folder()).unwrap(),
        vec![6, 7]
    );
}

#[test]
fn metrics_jsonl_has_every_documented_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 3);
    cfg.checkpoint.enable = false;
    cfg.metrics.enable_tensorboard = true;
    train(&cfg, &quiet()).unwrap();
    let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for key in [
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "tflops",
        "mfu",
        "step_time_s",
        "data_time_pct",
        "peak_memory_bytes",
    ] {
        assert!(lines[0].get(key).is_some(), "missing {key}");
    }
    let tb: Vec<_> = std::fs::read_dir(dir.path().join("tb")).unwrap().collect();
    assert_eq!(tb.len(), 1);
    let bytes = std::fs::read(tb[0].as_ref().unwrap().path()).unwrap();
    // version record + 3 scalar records, each framed as len(8) crc(4) data crc(4)
    let mut pos = 0;
    let mut records = 0;
    while pos < bytes.len() {
        let len = u64::from_le_bytes(bytes[pos..pos + 8].try_into().unwrap()) as usize;
        pos += 12 + len + 4;
        records += 1;
    }
    assert_eq!((pos, records), (bytes.len(), 4));
}
