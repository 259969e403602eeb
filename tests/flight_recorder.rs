//! The flight recorder: a 2-rank FSDP run where one rank skips a collective, or dies, leaves the
//! dumps of the ranks that could write one, and `titan debug flight-recorder` names what went wrong;
//! on the device road its device collectives are in the dumps too.

mod common;

use common::{titan_bin, train_env};

const FSDP2: &[&str] = &["--nproc", "2", "--master-port", "0"];

fn analyze(dir: &std::path::Path) -> String {
    let o = std::process::Command::new(titan_bin())
        .args(["debug", "flight-recorder", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const EXTRA: &[&str] = &[
    "--training.steps",
    "4",
    "--comm.train_timeout_seconds",
    "20",
];

#[test]
fn a_skipped_collective_is_named_by_both_dumps() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 skips its 11th collective on the group (after the 2 of the start, where every rank
    // takes rank 0's resume step: the 9th of the step-1 gradient sync, a reduce-scatter); its
    // next one pairs with it.
    let o = train_env(
        dir.path(),
        FSDP2,
        EXTRA,
        &[("TITAN_SKIP_COLLECTIVE", "1:10")],
    );
    assert!(!o.status.success());
    let traces = dir.path().join("comm_traces");
    for r in 0..2 {
        assert!(
            traces.join(format!("rank_{r}.json")).exists(),
            "rank {r} wrote no dump: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let text = analyze(&traces);
    assert!(
        text.contains("disagree on collective #10") && text.contains("rank 1 called"),
        "{text}"
    );
}

#[test]
fn device_collectives_are_recorded_in_a_buffer_of_their_own() {
    // The device road on CPU ranks: FSDP's gathers and reduce-scatters go through the device
    // communicator attached to the shard group, recorded under `<group>/device` (numbered in
    // their own order). Rank 1 skips a collective (of the host transport underneath, which
    // records its own): both ranks dump both buffers.
    let dir = tempfile::tempdir().unwrap();
    let o = train_env(
        dir.path(),
        FSDP2,
        EXTRA,
        &[
            ("TITAN_SKIP_COLLECTIVE", "1:10"),
            ("TITAN_DEVICE_COLLECTIVES", "host"),
        ],
    );
    assert!(!o.status.success());
    let traces = dir.path().join("comm_traces");
    for r in 0..2 {
        let dump = std::fs::read_to_string(traces.join(format!("rank_{r}.json"))).unwrap();
        let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
        let groups = dump["groups"].as_array().unwrap();
        let device = groups
            .iter()
            .find(|g| g["name"].as_str().unwrap().ends_with("/device"))
            .unwrap_or_else(|| panic!("rank {r}: no device group in {dump}"));
        let entries = device["entries"].as_array().unwrap();
        let has = |op: &str, state: &str| {
            entries
                .iter()
                .any(|e| e["op"] == op && (state.is_empty() || e["state"] == state))
        };
        // The reduce-scatters started last may still be in flight when the host transport's
        // failure writes the dump.
        assert!(
            has("device all_gather", "completed") && has("device reduce_scatter", ""),
            "rank {r}: {device}"
        );
        // Numbered from 0 on their own, in order.
        let seqs: Vec<u64> = entries.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    }
    let text = analyze(&traces);
    assert!(text.contains("disagree on collective #10"), "{text}");
}

#[test]
fn a_killed_rank_is_named_from_the_survivors_dump() {
    let dir = tempfile::tempdir().unwrap();
    let o = train_env(dir.path(), FSDP2, EXTRA, &[("TITAN_CRASH_AT", "1:3")]);
    assert!(!o.status.success());
    let traces = dir.path().join("comm_traces");
    assert!(
        traces.join("rank_0.json").exists(),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!traces.join("rank_1.json").exists());
    let text = analyze(&traces);
    assert!(
        text.contains("ranks [1] of 2 wrote no dump") && text.contains("rank 1 died first"),
        "{text}"
    );
}

#[test]
fn off_writes_nothing_and_mixed_runs_are_refused() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut extra = EXTRA.to_vec();
    extra.extend_from_slice(&["--comm.trace_buf_size", "0"]);
    let o = train_env(a.path(), FSDP2, &extra, &[("TITAN_CRASH_AT", "1:2")]);
    assert!(!o.status.success());
    assert!(!a.path().join("comm_traces").exists());
    // Two separate failed runs: their dumps must not be compared.
    for dir in [&a, &b] {
        let o = train_env(dir.path(), FSDP2, EXTRA, &[("TITAN_CRASH_AT", "1:2")]);
        assert!(!o.status.success());
    }
    let mixed = tempfile::tempdir().unwrap();
    std::fs::copy(
        a.path().join("comm_traces/rank_0.json"),
        mixed.path().join("rank_0.json"),
    )
    .unwrap();
    let mut other: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(b.path().join("comm_traces/rank_0.json")).unwrap(),
    )
    .unwrap();
    other["rank"] = 1.into();
    std::fs::write(mixed.path().join("rank_1.json"), other.to_string()).unwrap();
    assert!(analyze(mixed.path()).contains("different runs"));
}
