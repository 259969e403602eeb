//! `titan plan` (issue 31) end to end: a calibration of this CPU, a plan whose JSON overrides
//! select a layout `titan train` runs, the planner's memory figure equal to the one the trainer
//! checks the same layout against, and the answers to input that cannot be planned.

mod common;

use std::process::Command;

use common::titan_bin;
use serde_json::Value;

fn titan(args: &[&str], calibration: &std::path::Path) -> std::process::Output {
    Command::new(titan_bin())
        .args(args)
        .env("TITAN_PLAN_CALIBRATION", calibration)
        .output()
        .expect("run titan")
}

fn ok(out: &std::process::Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|s| s.as_str().expect("a string").to_string())
        .collect()
}

#[test]
fn a_cpu_plan_calibrates_ranks_layouts_and_its_overrides_train() {
    let dir = tempfile::tempdir().unwrap();
    let calibration = dir.path().join("plan_cpu.json");
    ok(
        &titan(&["plan", "--calibrate"], &calibration),
        "titan plan --calibrate",
    );
    let stored: Value =
        serde_json::from_str(&std::fs::read_to_string(&calibration).unwrap()).unwrap();
    let compute = &stored["device"]["compute"];
    assert!(compute["flops_per_s"].as_f64().unwrap() > 1e8, "{stored}");
    let small = [
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "64",
    ];
    let mut args = vec!["plan", "--nproc", "2", "--json", "--top", "1000"];
    args.extend(small);
    let plan: Value = serde_json::from_str(&ok(&titan(&args, &calibration), "titan plan")).unwrap();
    let list = plan.as_array().unwrap();
    assert!(list.len() >= 8, "{plan}");
    let fitting: Vec<&Value> = list.iter().filter(|c| c["fits"] == true).collect();
    for pair in fitting.windows(2) {
        let (a, b) = (
            pair[0]["tokens_per_s"].as_f64().unwrap(),
            pair[1]["tokens_per_s"].as_f64().unwrap(),
        );
        assert!(a >= b, "best first: {a} then {b}");
    }
    for c in &fitting {
        assert!(
            c["memory_gib"].as_f64().unwrap() > 0.0 && c["why"].is_null(),
            "{c}"
        );
    }
    // The best layout and the best pipelined one: the trainer's memory estimate of the layout is
    // the planner's, and `titan train` runs its overrides.
    let pipelined = fitting
        .iter()
        .find(|c| c["layout"].as_str().unwrap().starts_with("pp 2"))
        .expect("a pipelined layout fits");
    for c in [fitting[0], *pipelined] {
        let overrides = strings(&c["overrides"]);
        let mut bench: Vec<String> = [
            "bench", "train", "--json", "--nproc", "2", "--steps", "1", "--warmup", "1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        bench.extend(small.iter().map(|s| s.to_string()));
        bench.extend(overrides.iter().cloned());
        let bench_args: Vec<&str> = bench.iter().map(String::as_str).collect();
        let out = ok(&titan(&bench_args, &calibration), "titan bench train");
        let row: Value =
            serde_json::from_str(out.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
        let trainer_mib = row["memory_estimate_mib"].as_f64().unwrap();
        let planner_mib = c["memory_gib"].as_f64().unwrap() * 1024.0;
        assert!(
            (trainer_mib - planner_mib).abs() <= 1e-6 * trainer_mib,
            "{}: planner {planner_mib} MiB, trainer {trainer_mib} MiB",
            c["layout"]
        );
        let dump = dir
            .path()
            .join(format!("run{}", c["layout"].as_str().unwrap().len()));
        let dump_arg = dump.display().to_string();
        let mut train: Vec<&str> = vec![
            "train",
            "--nproc",
            "2",
            "--quiet",
            "--training.steps",
            "2",
            "--checkpoint.enable",
            "false",
            "--job.dump_folder",
            &dump_arg,
        ];
        train.extend(small);
        train.extend(overrides.iter().map(String::as_str));
        ok(
            &titan(&train, &calibration),
            "titan train with the plan's overrides",
        );
        assert!(dump.join("metrics.jsonl").exists());
    }
    // Text output: the table and the best layout's TOML, which titan reads back.
    let mut text_args = vec!["plan", "--nproc", "2"];
    text_args.extend(small);
    let text = ok(&titan(&text_args, &calibration), "titan plan (table)");
    assert!(
        text.contains("tokens/s") && text.contains("[parallelism]"),
        "{text}"
    );
    let toml: String = text
        .lines()
        .skip_while(|l| !l.starts_with("[parallelism]"))
        .take_while(|l| !l.starts_with("(or"))
        .map(|l| format!("{l}\n"))
        .collect();
    let file = dir.path().join("best.toml");
    std::fs::write(&file, toml).unwrap();
    let cfg = titan::config::Config::load(Some(&file), &[]).unwrap();
    assert_eq!(
        cfg.parallelism.data_parallel_shard_degree
            * cfg.parallelism.tensor_parallel_degree as i64
            * cfg.parallelism.pipeline_parallel_degree as i64
            * cfg.parallelism.context_parallel_degree as i64
            * cfg.parallelism.data_parallel_replicate_degree as i64,
        2
    );
}

#[test]
fn gpu_plans_name_unknown_gpus_and_the_device_count_a_model_needs() {
    let dir = tempfile::tempdir().unwrap();
    let calibration = dir.path().join("unused.json");
    let out = titan(&["plan", "--ngpu", "8", "--gpu", "v100"], &calibration);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("h100, h200, b200"),
        "{err}"
    );
    let out = titan(
        &[
            "plan",
            "--ngpu",
            "1",
            "--gpu",
            "h100",
            "--model.flavor",
            "8B",
            "--training.seq_len",
            "2048",
            "--training.local_batch_size",
            "1",
        ],
        &calibration,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "8B trains on one H100?");
    assert!(
        err.contains("no layout fits") && err.contains("--ngpu"),
        "{err}"
    );
    let out = ok(
        &titan(
            &[
                "plan",
                "--ngpu",
                "8",
                "--gpu",
                "h100",
                "--model.flavor",
                "8B",
                "--training.seq_len",
                "2048",
                "--training.global_batch_size",
                "16",
                "--json",
            ],
            &calibration,
        ),
        "8B on 8 H100s",
    );
    let plan: Value = serde_json::from_str(&out).unwrap();
    let best = &plan[0];
    assert_eq!(best["fits"], true, "{best}");
    let per_gpu = best["tokens_per_s"].as_f64().unwrap() / 8.0;
    assert!((1000.0..20000.0).contains(&per_gpu), "{best}");
    assert!(!calibration.exists(), "a GPU plan needs no CPU calibration");
}
