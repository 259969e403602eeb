//! Elastic jobs (`titan train --nnodes MIN:MAX`), two "nodes" as two launchers on this machine:
//! a job that loses a node goes on at half size from its latest checkpoint, and one that gains a
//! node regroups with it; the global batch is kept by gradient accumulation, so the loss curve is
//! the uninterrupted run's (within fp32 rounding), apart from the steps repeated since the
//! checkpoint.

mod common;

use common::{free_port, losses, train, train_command, TINY_ARGS};

/// FSDP over whatever ranks there are (`-1`), four sequences a step, 12 steps, a checkpoint
/// every 4.
const JOB: &[&str] = &[
    "--training.steps",
    "12",
    "--checkpoint.interval",
    "4",
    "--training.global_batch_size",
    "4",
    "--metrics.log_freq",
    "1",
];

/// Node `rank` of an elastic 1:2 job on `port` (one rank a node), training `job` into `dump`.
fn node(
    dump: &std::path::Path,
    port: &str,
    (rank, restarts): (&str, &str),
    job: &[&str],
    env: &[(&str, &str)],
) -> std::process::Child {
    node_of(dump, port, ("1", rank, restarts), job, env)
}

/// Node `rank` of an elastic 1:2 job of `nproc` ranks a node.
fn node_of(
    dump: &std::path::Path,
    port: &str,
    (nproc, rank, restarts): (&str, &str, &str),
    job: &[&str],
    env: &[(&str, &str)],
) -> std::process::Child {
    node_with(dump, port, (nproc, rank, restarts), &[], job, env)
}

/// `node_of` with more launcher flags.
fn node_with(
    dump: &std::path::Path,
    port: &str,
    (nproc, rank, restarts): (&str, &str, &str),
    flags: &[&str],
    job: &[&str],
    env: &[(&str, &str)],
) -> std::process::Child {
    let launcher = [
        "--nproc",
        nproc,
        "--nnodes",
        "1:2",
        "--rdzv-timeout",
        "3",
        "--node-rank",
        rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--max-restarts",
        restarts,
    ];
    let launcher = [&launcher[..], flags].concat();
    let mut cmd = train_command(dump, &launcher, &[TINY_ARGS, job].concat());
    cmd.env("RAYON_NUM_THREADS", "1")
        .env("TITAN_JOB_SECRET", "ef".repeat(32))
        .env("TITAN_HOST", "127.0.0.1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Both nodes' outputs once they exit: (status, stdout, stderr) each.
fn outputs(
    node0: std::process::Child,
    node1: std::process::Child,
) -> [(std::process::ExitStatus, String, String); 2] {
    [node0, node1].map(|n| {
        let o = n.wait_with_output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (o.status, text(&o.stdout), text(&o.stderr))
    })
}

/// The last logged step of both runs is `steps`, their losses there within 1e-5.
fn final_losses_agree(straight: &std::path::Path, elastic: &std::path::Path, steps: u64) {
    let (a, b) = (losses(straight), losses(elastic));
    let last = |l: &[(u64, f64)]| *l.last().unwrap();
    let ((sa, la), (sb, lb)) = (last(&a), last(&b));
    assert_eq!((sa, sb), (steps, steps));
    assert!((la - lb).abs() <= 1e-5 * la.abs(), "{la} vs {lb}");
}

#[test]
fn a_job_that_loses_a_node_goes_on_at_half_size_on_the_same_curve() {
    let (straight, elastic) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(
        straight.path(),
        &["--nproc", "2", "--master-port", "0"],
        JOB,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let port = free_port();
    // Node 1's rank dies at step 7 and its launcher has no restart: the node is gone. Node 0's
    // rank fails with it; its launcher waits 3 s for a second node, then goes on alone.
    let crash = [("TITAN_CRASH_AT", "1:7")];
    let node1 = node(elastic.path(), &port, ("1", "0"), JOB, &crash);
    let node0 = node(elastic.path(), &port, ("0", "1"), JOB, &[]);
    let [(s0, out0, e0), (s1, _, e1)] = outputs(node0, node1);
    assert!(s0.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    assert!(!s1.success(), "node 1 should have died:\n{e1}");
    assert!(e0.contains("the job goes from 2 to 1 ranks"), "{e0}");
    // The worker says what the change cost: the steps since the step-4 checkpoint run again.
    assert!(
        out0.contains(
            "membership change: 2 → 1 ranks, layout one process; resuming at step 4, steps 5..="
        ),
        "{out0}"
    );
    // Steps 5-12 ran again on one rank with two micro-batches a step.
    final_losses_agree(straight.path(), elastic.path(), 12);
    // The metrics carry the ranks of each step, and `titan plot` marks the change.
    let ranks: Vec<f64> = common::metric(elastic.path(), "world_size")
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    assert_eq!((ranks.first(), ranks.last()), (Some(&2.0), Some(&1.0)));
    let svg = elastic.path().join("metrics.svg");
    let o = std::process::Command::new(common::titan_bin())
        .args(["plot", elastic.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let drawn = std::fs::read_to_string(svg).unwrap();
    assert!(drawn.contains("2 → 1 ranks"), "{drawn}");
}

#[test]
fn a_job_that_gains_a_node_regroups_with_it_on_the_same_curve() {
    // Long enough that the second node arrives while the first still trains.
    let job = [
        "--training.steps",
        "1000",
        "--checkpoint.interval",
        "100",
        "--training.global_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
    ];
    let (straight, elastic) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(straight.path(), &[], &job);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let port = free_port();
    let node0 = node(elastic.path(), &port, ("0", "1"), &job, &[]);
    // Node 0 waits 3 s for a second node, then trains alone; node 1 arrives once it has steps.
    let metrics = elastic.path().join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "node 0 did not start training"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let node1 = node(elastic.path(), &port, ("1", "1"), &job, &[]);
    let [(s0, out0, e0), (s1, _, e1)] = outputs(node0, node1);
    assert!(s0.success() && s1.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    assert!(
        e0.contains("a node waits to join the 1-rank job: regrouping")
            && e0.contains("the job goes from 1 to 2 ranks"),
        "{e0}"
    );
    assert!(
        out0.contains("membership change: 1 → 2 ranks, layout dp_shard 2; resuming at step"),
        "{out0}"
    );
    final_losses_agree(straight.path(), elastic.path(), 1000);
}

/// Issue 30's scenario: a 4-rank job (two nodes of two ranks) loses a node at step 11, goes on at
/// 2 ranks from its step-10 checkpoint, and grows back to 4 when a node arrives again after step
/// 20; the global batch is kept throughout, so it ends on the uninterrupted 4-rank run's loss.
#[test]
fn a_job_shrinks_from_4_to_2_ranks_and_grows_back_on_the_same_curve() {
    let job = [
        "--training.steps",
        "400",
        "--checkpoint.interval",
        "10",
        "--checkpoint.keep_latest_k",
        "3",
        "--training.global_batch_size",
        "8",
        "--metrics.log_freq",
        "1",
    ];
    let (straight, elastic) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(
        straight.path(),
        &["--nproc", "4", "--master-port", "0"],
        &job,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let port = free_port();
    let two_ranks = |rank: &'static str, restarts: &'static str, env: &[(&str, &str)]| {
        node_of(elastic.path(), &port, ("2", rank, restarts), &job, env)
    };
    let node0 = two_ranks("0", "3", &[]);
    // Global rank 2 (node 1's first) dies at step 11, and its launcher has no restart left.
    let lost = two_ranks("1", "0", &[("TITAN_CRASH_AT", "2:11")]);
    let lost = lost.wait_with_output().unwrap();
    assert!(!lost.status.success(), "node 1 should have died");
    // Node 1 comes back once the job trains at 2 ranks past step 20.
    let metrics = elastic.path().join("metrics.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let shrunk_past_20 = || {
        std::fs::read_to_string(&metrics).is_ok_and(|m| {
            m.lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .any(|v| v["world_size"].as_u64() == Some(2) && v["step"].as_u64() >= Some(20))
        })
    };
    while !shrunk_past_20() {
        assert!(
            std::time::Instant::now() < deadline,
            "the job did not go on at 2 ranks"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let back = two_ranks("1", "1", &[]);
    let [(s0, _, e0), (s1, _, e1)] = outputs(node0, back);
    assert!(s0.success() && s1.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    for change in [
        "the job goes from 4 to 2 ranks",
        "the job goes from 2 to 4 ranks",
    ] {
        assert!(e0.contains(change), "{change}:\n{e0}");
    }
    let ranks: Vec<f64> = common::metric(elastic.path(), "world_size")
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    assert!(ranks.contains(&2.0), "{ranks:?}");
    assert_eq!((ranks.first(), ranks.last()), (Some(&4.0), Some(&4.0)));
    final_losses_agree(straight.path(), elastic.path(), 400);
}

#[test]
fn a_replanned_job_lays_each_world_size_out_as_titan_plan_ranks_it() {
    let elastic = tempfile::tempdir().unwrap();
    let calibration = common::plan_calibration();
    let calibration = calibration.to_str().unwrap();
    let port = free_port();

    // Node 1's rank dies at step 7 and its launcher has no restart; node 0 goes on alone, laid
    // out anew for one rank. Node 1 reads generation 0's layout from node 0 through the store.
    let env = |crash: bool| {
        let mut e = vec![("TITAN_PLAN_CALIBRATION", calibration)];
        if crash {
            e.push(("TITAN_CRASH_AT", "1:7"));
        }
        e
    };
    let replan = ["--replan"];
    let node1 = node_with(
        elastic.path(),
        &port,
        ("1", "1", "0"),
        &replan,
        JOB,
        &env(true),
    );
    let node0 = node_with(
        elastic.path(),
        &port,
        ("1", "0", "1"),
        &replan,
        JOB,
        &env(false),
    );
    let [(s0, _, e0), (s1, _, e1)] = outputs(node0, node1);
    assert!(s0.success(), "node 0:\n{e0}\nnode 1:\n{e1}");
    assert!(!s1.success(), "node 1 should have died:\n{e1}");
    for (who, text) in [("node 0", &e0), ("node 1", &e1)] {
        assert!(
            text.contains("generation 0: 2 ranks laid out by titan plan: --parallelism."),
            "{who}:\n{text}"
        );
    }
    assert!(e0.contains("1 ranks laid out by titan plan"), "{e0}");
    let ranks: Vec<f64> = common::metric(elastic.path(), "world_size")
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    assert_eq!((ranks.first(), ranks.last()), (Some(&2.0), Some(&1.0)));
    assert_eq!(losses(elastic.path()).last().unwrap().0, 12);
}
