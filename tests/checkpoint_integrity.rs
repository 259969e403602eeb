//! Checkpoints that cannot lie or crash (issue 27, item 6): `state.json` under a SHA-256, crafted
//! model arguments, shard indexes and HF configs refused naming the file and field before any
//! allocation, saves that leave no temporary folder behind and name the last good step, stale
//! temporary folders removed at start-up, and an unreadable latest checkpoint skipped for the one
//! before it (in one process and under FSDP, where rank 0 chooses for every rank).

mod common;

use std::path::{Path, PathBuf};

use common::{quiet, tiny_config};
use serde_json::{json, Value};
use titan::backend::cpu::CpuBackend;
use titan::checkpoint::{self, integrity::sha256_hex};
use titan::train::train;

fn trained(dir: &Path, steps: u64) -> titan::config::Config {
    let cfg = tiny_config(dir, steps);
    train(&cfg, &quiet()).unwrap();
    cfg
}

/// Rewrites `dir`'s `state.json` through `edit`, with a matching `state.json.sha256` (a crafted
/// checkpoint, not a corrupted one).
fn rewrite_state(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("state.json");
    let mut state: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut state);
    let text = serde_json::to_string_pretty(&state).unwrap();
    std::fs::write(&path, &text).unwrap();
    let line = format!("{}  state.json\n", sha256_hex(text.as_bytes()));
    std::fs::write(dir.join("state.json.sha256"), line).unwrap();
}

fn load_error(dir: &Path) -> String {
    match checkpoint::load_weights(&CpuBackend::new(), dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// A copy of checkpoint `dir` in `to`.
fn copy_dir(dir: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to.to_path_buf()
}

fn temporary_folders(folder: &Path) -> Vec<String> {
    std::fs::read_dir(folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn a_corrupted_state_json_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let step5 = checkpoint::step_dir(&cfg.checkpoint_folder(), 5);
    let sha = std::fs::read_to_string(step5.join("state.json.sha256")).unwrap();
    assert!(sha.ends_with("  state.json\n"), "{sha}");
    // A changed number still parses: only the checksum tells.
    let state = std::fs::read_to_string(step5.join("state.json")).unwrap();
    std::fs::write(
        step5.join("state.json"),
        state.replace("\"step\": 5", "\"step\": 6"),
    )
    .unwrap();
    for e in [
        format!("{:#}", checkpoint::read_state(&step5).unwrap_err()),
        load_error(&step5),
    ] {
        assert!(
            e.contains(&step5.join("state.json").display().to_string()) && e.contains("SHA-256"),
            "{e}"
        );
    }
    let mut again = cfg.clone();
    again.training.steps = 8;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(e.contains("SHA-256") && e.contains("load_step"), "{e}");
    // A checkpoint of an earlier titan (no checksum file) still loads, with a warning.
    std::fs::write(step5.join("state.json"), state).unwrap();
    std::fs::remove_file(step5.join("state.json.sha256")).unwrap();
    checkpoint::read_state(&step5).unwrap();
    assert_eq!(train(&again, &quiet()).unwrap().resumed_from, Some(5));
}

#[test]
fn crafted_model_arguments_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let step5 = checkpoint::step_dir(&cfg.checkpoint_folder(), 5);
    let cases: [(&str, Value, &str); 7] = [
        ("n_heads", json!(0), "n_heads = 0"),
        ("dim", json!(66), "not divisible by n_heads"),
        ("n_kv_heads", json!(3), "n_kv_heads = 3"),
        (
            "vocab_size",
            json!(1u64 << 40),
            "vocab_size = 1099511627776",
        ),
        ("n_layers", json!(1u64 << 62), "n_layers"),
        ("ffn_hidden", json!(0), "ffn_hidden = 0"),
        // In range, but far more weights than the files hold: refused before allocating them.
        ("vocab_size", json!(1 << 22), "weight files hold only"),
    ];
    for (i, (field, value, want)) in cases.into_iter().enumerate() {
        let crafted = copy_dir(&step5, &dir.path().join(format!("crafted-{i}")));
        rewrite_state(&crafted, |s| s["model_args"][field] = value.clone());
        let e = load_error(&crafted);
        assert!(
            e.contains("state.json") && e.contains(want),
            "{field} = {value}: {e}"
        );
    }
    // On the resume path too.
    rewrite_state(&step5, |s| s["model_args"]["n_heads"] = json!(0));
    let mut again = cfg.clone();
    again.training.steps = 8;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(e.contains("state.json") && e.contains("n_heads = 0"), "{e}");
}

/// Turns the single-file checkpoint `dir` into a sharded one of one writer (the index and
/// `model-rank0`/`optimizer-rank0` files of flat shards), as an FSDP save of one rank writes it.
fn as_sharded(dir: &Path) {
    let mut files = serde_json::Map::new();
    let mut tensors = serde_json::Map::new();
    for (kind, whole) in [
        ("model", "model.safetensors"),
        ("optimizer", "optimizer.safetensors"),
    ] {
        let flat: Vec<(String, titan::tensor::Tensor)> =
            checkpoint::st::read_file(&dir.join(whole))
                .unwrap()
                .into_iter()
                .map(|(n, t)| {
                    if kind == "model" {
                        tensors
                            .insert(n.clone(), json!({"shape": t.shape, "shard_len": t.numel()}));
                    }
                    let v = t.to_f32_vec();
                    (n, titan::tensor::Tensor::from_f32(vec![v.len()], v))
                })
                .collect();
        let bytes = checkpoint::st::to_bytes(&flat, None).unwrap();
        let name = format!("{kind}-rank0.safetensors");
        std::fs::write(dir.join(&name), &bytes).unwrap();
        std::fs::remove_file(dir.join(whole)).unwrap();
        files.insert(
            name,
            json!({"bytes": bytes.len(), "crc32": crc32fast::hash(&bytes)}),
        );
    }
    rewrite_state(dir, |s| {
        s["files"] = Value::Object(files);
        s["sharding"] = json!({"shards": 1, "tp_parts": 1, "tensors": tensors});
    });
}

#[test]
fn a_crafted_shard_index_is_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let step5 = checkpoint::step_dir(&cfg.checkpoint_folder(), 5);
    let sharded = copy_dir(&step5, &dir.path().join("sharded"));
    as_sharded(&sharded);
    let be = CpuBackend::new();
    let (_, whole) = checkpoint::load_weights(&be, &step5).unwrap();
    let (_, merged) = checkpoint::load_weights(&be, &sharded).unwrap();
    assert_eq!(whole.bufs, merged.bufs);
    let cases: [(&str, Value, &str); 9] = [
        ("/sharding/shards", json!(0), "shards = 0"),
        (
            "/sharding/shards",
            json!(1u64 << 40),
            "shards = 1099511627776",
        ),
        ("/sharding/tp_parts", json!(0), "tp_parts = 0"),
        (
            "/sharding/tensors/norm.weight/shard_len",
            json!(1u64 << 62),
            "tensors.norm.weight.shard_len = 4611686018427387904",
        ),
        (
            "/sharding/tensors/norm.weight/shape",
            json!([1u64 << 40, 1u64 << 40]),
            "tensors.norm.weight.shape",
        ),
        (
            "/sharding/tensors/norm.weight/ep_parts",
            json!(0),
            "tensors.norm.weight: ep_part",
        ),
        (
            "/sharding/tensors/norm.weight/pp_part",
            json!(3),
            "tensors.norm.weight.pp_part = 3",
        ),
        (
            "/files/..%2Fstate.json",
            json!({"bytes": 1, "crc32": 0}),
            "files",
        ),
        (
            "/sharding/tensors/evil.weight",
            json!({"shape": [1], "shard_len": 1}),
            "tensors.evil.weight",
        ),
    ];
    for (i, (pointer, value, want)) in cases.into_iter().enumerate() {
        let crafted = copy_dir(&sharded, &dir.path().join(format!("crafted-{i}")));
        rewrite_state(&crafted, |s| {
            let (parent, key) = pointer.rsplit_once('/').unwrap();
            let key = key.replace("%2F", "/");
            s.pointer_mut(parent).unwrap()[key.as_str()] = value.clone();
        });
        let e = load_error(&crafted);
        assert!(
            e.contains("state.json") && e.contains(want),
            "{pointer}: {e}"
        );
    }
}

#[test]
fn a_crafted_safetensors_header_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let step5 = checkpoint::step_dir(&cfg.checkpoint_folder(), 5);
    // A header claiming a tensor of 2⁸⁰ values over 8 bytes of data (padded with spaces).
    let mut header = br#"{"norm.weight":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}}"#.to_vec();
    header.resize(1024, b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&[0u8; 8]);
    std::fs::write(step5.join("model.safetensors"), &bytes).unwrap();
    rewrite_state(&step5, |s| {
        s["files"]["model.safetensors"] =
            json!({"bytes": bytes.len(), "crc32": crc32fast::hash(&bytes)});
        // Small enough a model for the weights-present check to let the file be read.
        s["model_args"]["vocab_size"] = json!(2);
        s["model_args"]["n_layers"] = json!(1);
        s["model_args"]["dim"] = json!(2);
        s["model_args"]["n_heads"] = json!(1);
        s["model_args"]["n_kv_heads"] = json!(1);
        s["model_args"]["ffn_hidden"] = json!(1);
    });
    let e = load_error(&step5);
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_failed_save_leaves_no_temporary_folder_and_names_the_last_good_step() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let folder = cfg.checkpoint_folder();
    // Something that is not a checkpoint folder stands where step-10 must go.
    std::fs::write(folder.join("step-10"), b"not a folder").unwrap();
    let mut again = cfg.clone();
    again.training.steps = 10;
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(
        e.contains("checkpoint step-10 was not saved")
            && e.contains("the last complete checkpoint is step-5"),
        "{e}"
    );
    assert!(
        temporary_folders(&folder).is_empty(),
        "{:?}",
        temporary_folders(&folder)
    );
    // Asynchronous saves too (the error arrives with the next save or the end of training).
    again.checkpoint.async_mode = "async".into();
    let e = format!("{:#}", train(&again, &quiet()).unwrap_err());
    assert!(e.contains("the last complete checkpoint is step-5"), "{e}");
    assert!(
        temporary_folders(&folder).is_empty(),
        "{:?}",
        temporary_folders(&folder)
    );
}

/// A write that fails part way (the file size limit, as a full disk would): the `titan` process
/// stops with the last good step named and leaves no temporary folder. Root ignores a read-only
/// folder, not this limit.
#[test]
fn a_save_that_cannot_be_written_stops_the_run_naming_the_last_good_step() {
    let dir = tempfile::tempdir().unwrap();
    let o = common::train(dir.path(), &[], &["--training.steps", "5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let folder = dir.path().join("checkpoint");
    let model = std::fs::metadata(folder.join("step-5/model.safetensors"))
        .unwrap()
        .len();
    // In blocks of 512 or 1024 bytes (the shell's): either way below the model file.
    let blocks = (model / 2 / 1024).to_string();
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        "trap '' XFSZ; ulimit -f \"$0\"; shift; exec \"$@\"",
        &blocks,
    ]);
    let mut args = vec![common::titan_bin().to_string(), "train".into()];
    args.extend(["--job.dump_folder".into(), dir.path().display().to_string()]);
    args.extend(common::TINY_ARGS.iter().map(|s| s.to_string()));
    args.extend(["--training.steps".into(), "10".into()]);
    let o = cmd.arg("--").args(&args[..]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("checkpoint step-10 was not saved")
            && err.contains("the last complete checkpoint is step-5"),
        "{err}"
    );
    assert!(
        temporary_folders(&folder).is_empty(),
        "{:?}",
        temporary_folders(&folder)
    );
    assert_eq!(checkpoint::list_steps(&folder).unwrap(), vec![5]);
}

#[test]
fn start_up_removes_stale_temporary_folders_and_restores_an_interrupted_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let folder = cfg.checkpoint_folder();
    // A save killed mid-write, and one killed between moving the old step-5 aside and
    // renaming the new one in.
    std::fs::create_dir_all(folder.join(".tmp-step-10-4242")).unwrap();
    std::fs::write(folder.join(".tmp-step-10-4242/model.safetensors"), b"half").unwrap();
    std::fs::rename(folder.join("step-5"), folder.join(".old-step-5-4242")).unwrap();
    let mut again = cfg.clone();
    again.training.steps = 7;
    assert_eq!(train(&again, &quiet()).unwrap().resumed_from, Some(5));
    assert!(
        temporary_folders(&folder).is_empty(),
        "{:?}",
        temporary_folders(&folder)
    );
    // Saving a step again replaces it whole, leaving nothing aside.
    again.training.steps = 10;
    again.checkpoint.load_step = 5;
    train(&again, &quiet()).unwrap();
    train(&again, &quiet()).unwrap();
    assert!(
        temporary_folders(&folder).is_empty(),
        "{:?}",
        temporary_folders(&folder)
    );
    checkpoint::read_state(&checkpoint::step_dir(&folder, 10)).unwrap();
}

#[test]
fn an_unreadable_latest_checkpoint_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(dir.path(), 12);
    let straight = train(&cfg, &quiet()).unwrap();
    let folder = cfg.checkpoint_folder();
    // A truncated file, then a state.json that fails its checksum: step 5 each time, on the
    // uninterrupted curve.
    let step10 = checkpoint::step_dir(&folder, 10);
    let saved = std::fs::read(step10.join("optimizer.safetensors")).unwrap();
    std::fs::write(
        step10.join("optimizer.safetensors"),
        &saved[..saved.len() / 2],
    )
    .unwrap();
    let broken_state = |d: &Path| {
        let s = std::fs::read_to_string(d.join("state.json")).unwrap();
        std::fs::write(d.join("state.json"), s.replace("\"seed\"", "\"seed\" ")).unwrap();
    };
    for round in 0..2 {
        std::fs::remove_dir_all(checkpoint::step_dir(&folder, 12)).unwrap();
        let resumed = train(&cfg, &quiet()).unwrap();
        assert_eq!(resumed.resumed_from, Some(5), "round {round}");
        let want: Vec<(u64, f64)> = straight
            .losses
            .iter()
            .copied()
            .filter(|(s, _)| *s > 5)
            .collect();
        assert_eq!(
            common::bits(&resumed.losses),
            common::bits(&want),
            "round {round}"
        );
        // This run saved a good step-10 (and step-12): break it for the next round.
        broken_state(&step10);
    }
    std::fs::remove_dir_all(checkpoint::step_dir(&folder, 12)).unwrap();
    // With no earlier readable checkpoint it is an error, never a fresh start.
    broken_state(&checkpoint::step_dir(&folder, 5));
    let e = format!("{:#}", train(&cfg, &quiet()).unwrap_err());
    assert!(
        e.contains("nor any earlier one") && e.contains("SHA-256"),
        "{e}"
    );
}

/// Under FSDP rank 0 chooses the step for every rank: the job resumes together from the step
/// before an unreadable latest one (a file only rank 1 reads is truncated), on the same curve.
#[test]
fn an_fsdp_job_falls_back_together_from_an_unreadable_latest_checkpoint() {
    let fsdp = ["--nproc", "2", "--master-port", "0"];
    let batch = ["--training.local_batch_size", "1"];
    let dir = tempfile::tempdir().unwrap();
    let steps = [&batch[..], &["--training.steps", "12"]].concat();
    let o = common::train(dir.path(), &fsdp, &steps);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let straight = common::losses(dir.path());
    std::fs::remove_dir_all(dir.path().join("checkpoint/step-12")).unwrap();
    let f = dir
        .path()
        .join("checkpoint/step-10/optimizer-rank1.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 4]).unwrap();
    let o = common::train(dir.path(), &fsdp, &steps);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("checkpoint step-10 cannot be read") && err.contains("resuming from step-5"),
        "{err}"
    );
    // metrics.jsonl holds the first run's 12 steps, then the resumed run's from step 6.
    let all = common::losses(dir.path());
    assert_eq!(all.len(), 12 + 7);
    assert_eq!(common::bits(&all[12..]), common::bits(&straight[5..]));
}

#[test]
fn a_crafted_hugging_face_config_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = trained(dir.path(), 5);
    let hf = dir.path().join("hf");
    checkpoint::hf::export(&cfg.checkpoint_folder(), &hf, titan::tensor::DType::F32).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    for (key, value, want) in [
        ("num_attention_heads", json!(0), "`num_attention_heads` = 0"),
        (
            "vocab_size",
            json!(1u64 << 40),
            "`vocab_size` = 1099511627776",
        ),
        (
            "hidden_size",
            json!(66),
            "hidden_size = 66 is not divisible",
        ),
        ("num_hidden_layers", json!(-1), "`num_hidden_layers` = -1"),
        ("head_dim", json!(1u64 << 61), "`head_dim`"),
        // In range, but more weights than the safetensors files hold: refused before allocating.
        ("vocab_size", json!(1 << 22), "hold only"),
    ] {
        let mut c = config.clone();
        c[key] = value.clone();
        if key == "hidden_size" {
            // Llama's default head width, hidden_size / num_attention_heads.
            c["head_dim"] = Value::Null;
        }
        std::fs::write(hf.join("config.json"), c.to_string()).unwrap();
        let e = format!(
            "{:#}",
            checkpoint::hf::import(&hf, &dir.path().join("x")).unwrap_err()
        );
        assert!(
            e.contains("config.json") && e.contains(want),
            "{key} = {value}: {e}"
        );
    }
}
