//! Profiler traces: a 2-rank FSDP run with profiling writes one Chrome trace per rank per
//! profiled step, each valid JSON whose spans (kernels, blocks, collectives, the step) nest
//! correctly on every thread's track.

mod common;

use common::train;

#[test]
fn fsdp_ranks_write_nested_chrome_traces_of_the_profiled_steps() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &["--nproc", "2", "--master-port", "0"],
        &[
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "1",
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_freq",
            "2",
            "--profiling.profiler_warmup",
            "0",
            "--profiling.profiler_active",
            "1",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let traces = dir.path().join("profile_traces");
    let mut iterations: Vec<String> = std::fs::read_dir(&traces)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    iterations.sort();
    assert_eq!(iterations, ["iteration_2", "iteration_4"]);
    for it in &iterations {
        for rank in 0..2 {
            let path = traces.join(it).join(format!("rank{rank}_trace.json"));
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let spans: Vec<&serde_json::Value> = v["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["ph"] == "X")
                .collect();
            let has = |cat: &str| spans.iter().any(|e| e["cat"] == cat);
            for cat in ["step", "model", "kernel", "collective", "optimizer", "data"] {
                assert!(has(cat), "{}: no `{cat}` span", path.display());
            }
            // One profiled step: its step span names it.
            let step = it.trim_start_matches("iteration_");
            assert!(spans.iter().any(|e| e["name"] == format!("step {step}")));
            assert!(spans.iter().all(|e| e["pid"] == rank));
            let gather = spans
                .iter()
                .find(|e| e["name"] == "all_gather")
                .expect("FSDP gathers");
            assert!(gather["args"]["bytes"].as_u64().unwrap() > 0);
            // On each track, spans are disjoint or nested.
            let mut tracks: std::collections::BTreeMap<u64, Vec<(f64, f64)>> = Default::default();
            for e in &spans {
                let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
                tracks
                    .entry(e["tid"].as_u64().unwrap())
                    .or_default()
                    .push((ts, ts + dur));
            }
            for (tid, mut s) in tracks {
                s.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
                let mut open: Vec<f64> = Vec::new();
                for (start, end) in s {
                    while open.last().is_some_and(|&top| top <= start + 1e-3) {
                        open.pop();
                    }
                    if let Some(&top) = open.last() {
                        assert!(
                            end <= top + 1e-3,
                            "{}: track {tid}: span [{start}, {end}] overlaps its parent ending {top}",
                            path.display()
                        );
                    }
                    open.push(end);
                }
            }
        }
    }
}

#[test]
fn bad_profiling_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &[],
        &[
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_freq",
            "2",
            "--profiling.profiler_warmup",
            "3",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("[profiling] profile_freq = 2"),
        "{err}"
    );
}

/// The memory timeline of an FSDP rank: the categories held for the whole run, and the blocks it
/// gathers, the full gradients and the collective buffers rising and falling back within a step.
#[test]
fn fsdp_ranks_write_a_memory_timeline_of_the_profiled_steps() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        dir.path(),
        &["--nproc", "2", "--master-port", "0"],
        &[
            "--training.steps",
            "2",
            "--profiling.enable_memory_snapshot",
            "true",
            "--profiling.profile_freq",
            "2",
            "--profiling.profiler_warmup",
            "0",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let at = dir.path().join("memory_snapshot/iteration_2");
    for rank in 0..2 {
        let svg = std::fs::read_to_string(at.join(format!("rank{rank}_memory.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let t: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(at.join(format!("rank{rank}_memory.json"))).unwrap(),
        )
        .unwrap();
        let names: Vec<&str> = t["categories"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        let samples = t["samples"].as_array().unwrap();
        let held = |s: &serde_json::Value, name: &str| {
            let i = names.iter().position(|n| *n == name).unwrap();
            s["bytes"][i].as_u64().unwrap()
        };
        let peak = |name: &str| samples.iter().map(|s| held(s, name)).max().unwrap();
        let last = samples.last().unwrap();
        for steady in ["weights", "optimizer_state", "activations"] {
            assert!(held(last, steady) > 0, "{steady}: {t}");
        }
        for moving in ["gathered_blocks", "comm_buffers"] {
            assert!(peak(moving) > 0, "{moving} never held: {t}");
            assert_eq!(held(last, moving), 0, "{moving} left held after the step");
        }
        assert!(peak("gradients") > held(last, "gradients"));
        assert!(samples
            .iter()
            .all(|s| s["measured_bytes"].as_u64().unwrap() > 0));
    }
}

/// A refused run leaves the estimate it was refused on, by category.
#[test]
fn a_refused_run_writes_its_memory_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let o = common::train_command(
        dir.path(),
        &[],
        &[
            "--model.flavor",
            "405B",
            "--profiling.enable_memory_snapshot",
            "true",
        ],
    )
    .output()
    .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs about"));
    let t: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("memory_snapshot/refused/rank0_memory.json"))
            .unwrap(),
    )
    .unwrap();
    let bytes: u64 = t["samples"][0]["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .sum();
    // 405B parameters alone are 1.6 TB in f32.
    assert!(bytes > 1_000_000_000_000, "{t}");
}
