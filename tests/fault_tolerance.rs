//! Replica-group fault tolerance (`[fault_tolerance]`, `titan lighthouse`), real processes: two
//! replica groups of two FSDP ranks each, separate jobs meeting through a lighthouse on loopback.
//! A group that loses a rank restarts and takes its state from the live group (no checkpoint),
//! while the live group never restarts; a group that stops answering is left out after the
//! timeout and, answering again, rejoins the same way. Both groups end with bit-identical weights
//! and optimizer state (their final checkpoints' files are equal byte for byte).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::{titan_bin, TINY_ARGS};

/// A lighthouse process, killed when dropped.
struct LighthouseProcess {
    child: Child,
    addr: String,
}

impl Drop for LighthouseProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lighthouse(secret: &Path, min_replicas: &str, join_timeout_ms: &str) -> LighthouseProcess {
    let log = secret.with_file_name("lighthouse.log");
    let child = Command::new(titan_bin())
        .args(["lighthouse", "--port", "0", "--min-replicas", min_replicas])
        .args(["--join-timeout-ms", join_timeout_ms])
        .arg("--job-secret-file")
        .arg(secret)
        .stdout(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(l) = text.lines().next().filter(|_| text.contains('\n')) {
            break l.to_string();
        }
        assert!(
            started.elapsed().as_secs() < 30,
            "the lighthouse did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let addr = line
        .split_whitespace()
        .nth(3)
        .unwrap_or_else(|| panic!("no address in `{line}`"))
        .to_string();
    LighthouseProcess { child, addr }
}

/// A 0600 file holding a fresh job secret, shared by the lighthouse and both groups.
fn secret_file(dir: &Path) -> PathBuf {
    let path = dir.join("secret");
    let hex: String = (0..32)
        .map(|i| format!("{:02x}", (i * 37 + 11) % 256))
        .collect();
    std::fs::write(&path, hex).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// Replica group `replica` of 2 (`titan train --nproc 2`, FSDP) for `steps`, with `env` and the
/// overrides `extra`.
fn replica(
    dir: &Path,
    lh: &LighthouseProcess,
    (replica, steps): (usize, &str),
    env: &[(&str, &str)],
    extra: &[&str],
) -> Child {
    let id = replica.to_string();
    let dump = dir.join(format!("replica{replica}"));
    let mut cmd = Command::new(titan_bin());
    cmd.args([
        "train",
        "--nproc",
        "2",
        "--master-port",
        "0",
        "--max-restarts",
        "1",
    ])
    .arg("--job-secret-file")
    .arg(dir.join("secret"))
    .args(TINY_ARGS)
    .args(["--job.dump_folder", dump.to_str().unwrap()])
    .args(["--training.steps", steps])
    .args([
        "--fault_tolerance.enable",
        "true",
        "--fault_tolerance.group_size",
        "2",
    ])
    .args(["--fault_tolerance.replica_id", &id])
    .args(["--fault_tolerance.lighthouse", &lh.addr])
    .args(["--fault_tolerance.process_group_timeout_ms", "1500"])
    .args(match extra.is_empty() {
        true => &["--checkpoint.interval", "100000"][..],
        false => extra,
    })
    .env("RAYON_NUM_THREADS", "1")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Waits for both groups; their outputs.
fn finish(a: Child, b: Child) -> [String; 2] {
    [a, b].map(|c| {
        let o = c.wait_with_output().unwrap();
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "a replica group failed:\n{text}");
        text
    })
}

/// The two groups' final checkpoints hold the same bytes, tensor file by tensor file.
fn assert_same_final_state(dir: &Path, step: &str) {
    assert_same_files(dir, step, "");
}

/// The two groups' checkpoints of `step` hold the same bytes in every tensor file whose name
/// starts with `prefix`; four files (two ranks' weights and optimizer state) without a prefix.
fn assert_same_files(dir: &Path, step: &str, prefix: &str) {
    let folder = |r: usize| dir.join(format!("replica{r}/checkpoint/step-{step}"));
    let mut files = 0;
    let listing = std::fs::read_dir(folder(0)).unwrap_or_else(|e| {
        let parent = folder(0).parent().unwrap().to_path_buf();
        let present: Vec<_> = std::fs::read_dir(&parent)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        panic!(
            "{}: {e}; {} holds {present:?}",
            folder(0).display(),
            parent.display()
        )
    });
    for entry in listing {
        let name = entry.unwrap().file_name();
        let text = name.to_string_lossy();
        if !text.ends_with(".safetensors") || !text.starts_with(prefix) {
            continue;
        }
        let (a, b) = (folder(0).join(&name), folder(1).join(&name));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{} differs between the replica groups",
            name.to_string_lossy()
        );
        files += 1;
    }
    let want = if prefix.is_empty() { 4 } else { 2 };
    assert_eq!(files, want, "{prefix}: the two ranks' files");
}

#[test]
fn a_killed_replica_group_restarts_and_catches_up_from_the_live_one() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path());
    let lh = lighthouse(&secret, "2", "2000");
    let a = replica(dir.path(), &lh, (0, "12"), &[], &[]);
    let b = replica(
        dir.path(),
        &lh,
        (1, "12"),
        &[("TITAN_CRASH_AT", "1:5")],
        &[],
    );
    let [out_a, out_b] = finish(a, b);
    assert!(
        !out_a.contains("restarting"),
        "the live group restarted:\n{out_a}"
    );
    assert!(out_a.contains("this step is dropped"), "{out_a}");
    assert!(out_b.contains("restarting all 2 ranks"), "{out_b}");
    assert!(
        out_b.contains("recovered step 4 from replica group 0"),
        "{out_b}"
    );
    assert_same_final_state(dir.path(), "12");
}

#[test]
fn a_replica_group_that_stops_answering_is_left_out_and_rejoins() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path());
    let lh = lighthouse(&secret, "1", "1000");
    // Enough steps that group 0 is still training when group 1 answers again (it stalls 4 s).
    let a = replica(dir.path(), &lh, (0, "600"), &[], &[]);
    let b = replica(
        dir.path(),
        &lh,
        (1, "600"),
        &[("TITAN_STALL_AT", "0:5")],
        &[],
    );
    let [out_a, out_b] = finish(a, b);
    assert!(!out_a.contains("restarting"), "{out_a}");
    assert!(out_a.contains("this step is dropped"), "{out_a}");
    assert!(!out_b.contains("restarting"), "{out_b}");
    assert!(
        out_b.contains("from replica group 0"),
        "the stalled group rejoined by recovering:\n{out_b}"
    );
    // The live group logs the membership both ways, the metrics carry it and `titan plot`
    // marks it.
    for change in ["live replica groups 2 → 1", "live replica groups 1 → 2"] {
        assert!(out_a.contains(change), "{change}:\n{out_a}");
    }
    let dump = dir.path().join("replica0");
    let o = Command::new(titan_bin())
        .args(["plot", dump.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let svg = std::fs::read_to_string(dump.join("metrics.svg")).unwrap();
    assert!(svg.contains("2 → 1 replica groups"), "{svg}");
    assert_same_final_state(dir.path(), "600");
}

/// A dump of `TITAN_SEMI_SYNC_DUMP` as f64.
fn dumped(dir: &Path, sync: usize, replica: usize, rank: usize, what: &str) -> Vec<f64> {
    let path = dir.join(format!("sync{sync}-replica{replica}-rank{rank}-{what}.f32"));
    std::fs::read(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect()
}

/// DiLoCo over two replica groups, syncing every 5 steps: right after each sync the groups hold
/// the same weights (their checkpoints' weight files are equal byte for byte; AdamW's moments stay
/// each group's own), and each sync's θ_g is the reference outer update written here: Nesterov
/// SGD (lr 0.7, momentum 0.9) on the mean over the groups of θ_g − θ_r.
#[test]
fn diloco_replicas_agree_after_each_sync_and_take_the_outer_nesterov_step() {
    let dir = tempfile::tempdir().unwrap();
    let secret = secret_file(dir.path());
    let dump = dir.path().join("dump");
    std::fs::create_dir(&dump).unwrap();
    let lh = lighthouse(&secret, "2", "2000");
    let diloco = [
        "--fault_tolerance.semi_sync_method",
        "diloco",
        "--fault_tolerance.sync_steps",
        "5",
        "--checkpoint.interval",
        "5",
    ];
    let env = [("TITAN_SEMI_SYNC_DUMP", dump.to_str().unwrap())];
    let a = replica(dir.path(), &lh, (0, "10"), &env, &diloco);
    let b = replica(dir.path(), &lh, (1, "10"), &env, &diloco);
    finish(a, b);
    for step in ["5", "10"] {
        assert_same_files(dir.path(), step, "model-");
    }
    let (lr, mu) = (0.7, 0.9);
    for rank in 0..2 {
        let mut momentum: Vec<f64> = Vec::new();
        // Sync 0 is the meeting at the start; 1 and 2 follow steps 5 and 10.
        for sync in 0..3 {
            let before = dumped(&dump, sync, 0, rank, "global_before");
            assert_eq!(before, dumped(&dump, sync, 1, rank, "global_before"));
            let locals = [0, 1].map(|r| dumped(&dump, sync, r, rank, "local"));
            let delta: Vec<f64> = (0..before.len())
                .map(|i| (2.0 * before[i] - locals[0][i] - locals[1][i]) / 2.0)
                .collect();
            momentum = match momentum.is_empty() {
                true => delta.clone(),
                false => momentum
                    .iter()
                    .zip(&delta)
                    .map(|(m, d)| mu * m + d)
                    .collect(),
            };
            let after = dumped(&dump, sync, 0, rank, "global_after");
            assert_eq!(after, dumped(&dump, sync, 1, rank, "global_after"));
            for i in 0..after.len() {
                let want = before[i] - lr * (delta[i] + mu * momentum[i]);
                assert!(
                    (after[i] - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "sync {sync} rank {rank} value {i}: {} vs the reference {want}",
                    after[i]
                );
            }
            if sync > 0 {
                assert!(
                    delta.iter().any(|d| d.abs() > 1e-6),
                    "the replicas trained between syncs"
                );
            }
        }
    }
}
