//! Checkpoint integrity (corrupt, truncated, incomplete, mismatched) and Hugging Face round trips.

mod common;

use common::{quiet, tiny_config};
use titan::backend::cpu::CpuBackend;
use titan::checkpoint;
use titan::model::{Decoder, KvCache};
use titan::train::train;

fn trained(dir: &std::path::Path, steps: u64) -> titan::config::Config {
    let cfg = tiny_config(dir, steps);
    train(&cfg, &quiet()).unwrap();
    cfg
}

#[test]
fn corrupt_checkpoint_is_refused_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let model = checkpoint::step_dir(&cfg.checkpoint_folder(), 5).join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0x40;
    std::fs::write(&model, &bytes).unwrap();
    let mut again = cfg.clone();
    again.training.steps = 8;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt") && e.contains("load_step"),
        "{e}"
    );
}

#[test]
fn truncated_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let opt = checkpoint::step_dir(&cfg.checkpoint_folder(), 5).join("optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() / 3]).unwrap();
    let mut again = cfg.clone();
    again.training.steps = 8;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(
        e.contains("optimizer.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn half_written_checkpoint_is_ignored_and_load_step_selects() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 10);
    let folder = cfg.checkpoint_folder();
    // A crash mid-save leaves a temporary folder and no state.json: never taken for a checkpoint.
    std::fs::create_dir_all(folder.join(".tmp-step-15-999")).unwrap();
    std::fs::create_dir_all(folder.join("step-15")).unwrap();
    assert_eq!(checkpoint::list_steps(&folder).unwrap(), vec![5, 10]);
    let mut again = cfg.clone();
    again.training.steps = 12;
    again.checkpoint.load_step = 5;
    let s = train(&again, &quiet()).unwrap();
    assert_eq!(s.resumed_from, Some(5));
    assert_eq!(s.losses.first().unwrap().0, 6);
    again.checkpoint.load_step = 7;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(e.contains("load_step = 7"), "{e}");
}

#[test]
fn resuming_with_a_different_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let mut other = cfg.clone();
    other.training.steps = 8;
    other.model.n_layers = Some(3);
    let e = format!("{:#}", train(&other, &quiet()).unwrap_err());
    assert!(e.contains("different model"), "{e}");
}

fn last_logits(dir: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    let be = CpuBackend::new();
    let (args, params) = checkpoint::load_weights(&be, dir).unwrap();
    let model = Decoder::new(&be, args.clone(), 64).unwrap();
    let mut cache = KvCache::new(&be, &args, 64);
    model
        .forward_cached(&be, &params, &mut cache, tokens)
        .unwrap()
}

#[test]
fn hf_export_then_import_gives_the_same_logits() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let hf = dir.path().join("hf");
    checkpoint::hf::export(&cfg.checkpoint_folder(), &hf, titan::tensor::DType::F32).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    let names: Vec<String> = checkpoint::st::read_file(&hf.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(
        names.contains(&"model.layers.1.self_attn.q_proj.weight".to_string())
            && names.contains(&"lm_head.weight".to_string())
    );
    let back = dir.path().join("imported");
    checkpoint::hf::import(&hf, &back).unwrap();
    let tokens = [256u32, 72, 101, 108, 108, 111, 32, 119];
    assert_eq!(
        last_logits(&cfg.checkpoint_folder(), &tokens),
        last_logits(&back, &tokens)
    );
}

#[test]
fn hf_export_in_bfloat16_stays_close() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let hf = dir.path().join("hf16");
    checkpoint::hf::export(&cfg.checkpoint_folder(), &hf, titan::tensor::DType::BF16).unwrap();
    let back = dir.path().join("imported16");
    checkpoint::hf::import(&hf, &back).unwrap();
    let tokens = [256u32, 72, 101, 108];
    let (a, b) = (
        last_logits(&cfg.checkpoint_folder(), &tokens),
        last_logits(&back, &tokens),
    );
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 0.1, "worst logit difference {worst}");
}

#[test]
fn hf_import_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let hf = dir.path().join("hf");
    checkpoint::hf::export(&cfg.checkpoint_folder(), &hf, titan::tensor::DType::F32).unwrap();
    let tensors: Vec<_> = checkpoint::st::read_file(&hf.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    std::fs::write(
        hf.join("model.safetensors"),
        checkpoint::st::to_bytes(&tensors, None).unwrap(),
    )
    .unwrap();
    let e = format!(
        "{:#}",
        checkpoint::hf::import(&hf, &dir.path().join("x")).unwrap_err()
    );
    assert!(
        e.contains("model.norm.weight") && e.contains("missing"),
        "{e}"
    );
    std::fs::write(hf.join("config.json"), "{\"model_type\": \"gpt2\"}").unwrap();
    let e = format!(
        "{:#}",
        checkpoint::hf::import(&hf, &dir.path().join("x")).unwrap_err()
    );
    assert!(e.contains("gpt2") && e.contains("config.json"), "{e}");
}

#[test]
fn async_saves_write_the_same_checkpoints_and_resume_bitwise() {
    // tiny_config saves every 5 steps and keeps them all.
    let sync_dir = tempfile::tempdir().unwrap();
    let sync_cfg = trained(sync_dir.path(), 15);
    let async_dir = tempfile::tempdir().unwrap();
    let mut async_cfg = tiny_config(async_dir.path(), 15);
    async_cfg.checkpoint.async_mode = "async".into();
    let straight = train(&async_cfg, &quiet()).unwrap();
    for step in [5, 10, 15] {
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let a =
                std::fs::read(checkpoint::step_dir(&sync_cfg.checkpoint_folder(), step).join(file));
            let b = std::fs::read(
                checkpoint::step_dir(&async_cfg.checkpoint_folder(), step).join(file),
            );
            assert_eq!(a.unwrap(), b.unwrap(), "step {step} {file}");
        }
    }
    // Resume from the asynchronously written step 10: steps 11-15 repeat bit for bit.
    std::fs::remove_dir_all(checkpoint::step_dir(&async_cfg.checkpoint_folder(), 15)).unwrap();
    let resumed = train(&async_cfg, &quiet()).unwrap();
    assert_eq!(resumed.resumed_from, Some(10));
    let tail: Vec<(u64, f64)> = straight
        .losses
        .iter()
        .copied()
        .filter(|(s, _)| *s > 10)
        .collect();
    assert_eq!(common::bits(&tail), common::bits(&resumed.losses));
}

#[test]
fn an_unknown_async_mode_is_refused() {
    let args: Vec<String> = ["--checkpoint.async_mode", "async_with_pinned_mem"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let e = format!(
        "{:#}",
        titan::config::Config::load(None, &args).unwrap_err()
    );
    assert!(
        e.contains("async_mode") && e.contains("use \"async\""),
        "{e}"
    );
    let args = ["--checkpoint.on_save_failure", "retry"].map(String::from);
    let e = format!(
        "{:#}",
        titan::config::Config::load(None, &args).unwrap_err()
    );
    assert!(
        e.contains("on_save_failure") && e.contains("stop, warn"),
        "{e}"
    );
}

/// `[checkpoint] initial_load_path`: a run with no checkpoint of its own starts from another
/// model, a titan checkpoint or a Hugging Face folder, under any layout, with fresh AdamW state.
#[test]
fn a_run_starts_from_a_titan_checkpoint_or_a_hugging_face_folder() {
    use common::{assert_parity, losses, train};
    let bits = |d: &std::path::Path| common::bits(&losses(d));
    let source = tempfile::tempdir().unwrap();
    let o = train(
        source.path(),
        &[],
        &["--training.steps", "3", "--checkpoint.interval", "3"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let step3 = source.path().join("checkpoint/step-3");
    let hf = source.path().join("hf");
    let o = std::process::Command::new(common::titan_bin())
        .args(["convert", "hf-export"])
        .args([&step3, &hf])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let start = |launcher: &[&str], extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--training.steps", "2", "--checkpoint.enable", "true"];
        args.extend_from_slice(extra);
        let o = train(dir.path(), launcher, &args);
        assert!(
            o.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        dir
    };
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (step3, hf) = (path(&step3), path(&hf));
    let fresh = start(&[], &[]);
    let from_titan = start(&[], &["--checkpoint.initial_load_path", &step3]);
    let hf_args = [
        "--checkpoint.initial_load_path",
        &hf,
        "--checkpoint.initial_load_in_hf",
        "true",
    ];
    let from_hf = start(&[], &hf_args);
    // The same weights either way (the export round-trips exactly), not a fresh model's.
    assert_eq!(bits(from_titan.path()), bits(from_hf.path()));
    assert_ne!(bits(fresh.path()), bits(from_hf.path()));
    let mut fsdp_args = hf_args.to_vec();
    fsdp_args.extend(["--training.local_batch_size", "1"]);
    let nproc2 = ["--nproc", "2", "--master-port", "0"];
    let fsdp = start(&nproc2, &fsdp_args);
    assert_parity(
        &losses(from_hf.path()),
        &losses(fsdp.path()),
        "HF start under FSDP 2",
    );
    // Once the run has a checkpoint of its own, it resumes from it instead.
    let o = train(
        from_hf.path(),
        &[],
        &[
            "--training.steps",
            "3",
            "--checkpoint.initial_load_path",
            &hf,
            "--checkpoint.initial_load_in_hf",
            "true",
        ],
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("resumed from"));
    // Another model is refused, naming the path.
    let dir = tempfile::tempdir().unwrap();
    let mut wrong = hf_args.to_vec();
    wrong.extend(["--model.n_layers", "3"]);
    let o = train(dir.path(), &[], &wrong);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains(&hf) && err.contains("not the one this job configures"),
        "{err}"
    );
}
