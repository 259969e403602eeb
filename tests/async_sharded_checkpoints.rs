//! Asynchronous saves of sharded checkpoints (`[checkpoint] async_mode = "async"` with FSDP, TP,
//! PP, HSDP), real processes: each writer stages its files on the training thread and writes them
//! on its own; writer 0 completes the checkpoint once every writer has reported through the store.
//! The checkpoints are byte for byte the synchronous saves' (weights, moments and `state.json`
//! with its index and file checks), and a run resumed from one continues on the same curve.

mod common;

use common::{losses, train, train_env};

/// The layouts, each with the launcher's ranks.
const LAYOUTS: [(&str, &str, &[&str]); 4] = [
    (
        "FSDP 2",
        "2",
        &["--parallelism.data_parallel_shard_degree", "2"],
    ),
    (
        "FSDP 2 x TP 2",
        "4",
        &[
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    ),
    (
        "PP 2 x FSDP 2",
        "4",
        &[
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.global_batch_size",
            "8",
        ],
    ),
    (
        "HSDP 2x2",
        "4",
        &[
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ],
    ),
];

/// Six steps, a checkpoint every two, all kept.
const SAVES: &[&str] = &[
    "--training.steps",
    "6",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.log_freq",
    "1",
];

const ASYNC: &[&str] = &["--checkpoint.async_mode", "async"];

fn run(what: &str, dump: &std::path::Path, nproc: &str, args: &[&str]) {
    let launcher = ["--nproc", nproc, "--master-port", "0"];
    let o = train(dump, &launcher, &[SAVES, args].concat());
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn async_sharded_saves_equal_synchronous_ones_and_resume_on_the_same_curve() {
    for (what, nproc, layout) in LAYOUTS {
        let (sync, asynchronous) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        run(what, sync.path(), nproc, layout);
        run(what, asynchronous.path(), nproc, &[layout, ASYNC].concat());
        for step in [2, 4, 6] {
            let dir = |d: &tempfile::TempDir| d.path().join(format!("checkpoint/step-{step}"));
            let mut files: Vec<_> = std::fs::read_dir(dir(&sync))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            files.sort();
            let mut async_files: Vec<_> = std::fs::read_dir(dir(&asynchronous))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            async_files.sort();
            assert_eq!(files, async_files, "{what} step {step}");
            assert!(files.len() >= 5, "{what} step {step}: {files:?}");
            for f in files {
                let a = std::fs::read(dir(&sync).join(&f)).unwrap();
                let b = std::fs::read(dir(&asynchronous).join(&f)).unwrap();
                assert!(a == b, "{what} step {step}: {f:?} differs");
            }
        }
        // Resumed from the asynchronously written step 4: steps 5 and 6 repeat bit for bit.
        let straight = losses(asynchronous.path());
        std::fs::remove_dir_all(asynchronous.path().join("checkpoint/step-6")).unwrap();
        std::fs::remove_file(asynchronous.path().join("metrics.jsonl")).unwrap();
        run(what, asynchronous.path(), nproc, &[layout, ASYNC].concat());
        let resumed = losses(asynchronous.path());
        let tail: Vec<(u64, f64)> = straight.into_iter().filter(|(s, _)| *s > 4).collect();
        assert_eq!(common::bits(&tail), common::bits(&resumed), "{what}");
    }
}

/// A writer whose files cannot be written (a fault drill standing in for a full disk) reports
/// why; the save fails at writer 0, which removes the temporary folder, and the run stops with an
/// error naming the writer and the last complete checkpoint: synchronously at the save, and
/// asynchronously at the next save at the latest.
#[test]
fn a_writer_that_cannot_write_fails_the_save_and_names_the_last_checkpoint() {
    for mode in [&[][..], ASYNC] {
        let dir = tempfile::tempdir().unwrap();
        let launcher = ["--nproc", "2", "--master-port", "0"];
        let args = [SAVES, LAYOUTS[0].2, mode].concat();
        let drill = [("TITAN_CHECKPOINT_WRITE_FAILS", "1:4")];
        let o = train_env(dir.path(), &launcher, &args, &drill);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{mode:?}: the run went on");
        assert!(
            e.contains("checkpoint writer 1 could not write its step-4 files")
                && e.contains("the last complete checkpoint is step-2"),
            "{mode:?}: {e}"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path().join("checkpoint"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(left, ["step-2"], "{mode:?}");
    }
}

/// With `[checkpoint] on_save_failure = "warn"` the same failure is a warning on every rank: the
/// run trains on to the end on the same curve as a run whose saves all land, the failed save
/// leaves no folder, and the next interval's save lands (synchronous and asynchronous saves).
#[test]
fn with_on_save_failure_warn_a_failed_save_is_skipped_and_training_goes_on() {
    let launcher = ["--nproc", "2", "--master-port", "0"];
    let warn = ["--checkpoint.on_save_failure", "warn"];
    let straight = tempfile::tempdir().unwrap();
    let o = train(straight.path(), &launcher, &[SAVES, LAYOUTS[0].2].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for mode in [&[][..], ASYNC] {
        let dir = tempfile::tempdir().unwrap();
        let args = [SAVES, LAYOUTS[0].2, mode, &warn].concat();
        let drill = [("TITAN_CHECKPOINT_WRITE_FAILS", "1:4")];
        let o = train_env(dir.path(), &launcher, &args, &drill);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{mode:?}: {e}");
        assert!(
            e.contains("warning:")
                && e.contains("checkpoint writer 1 could not write its step-4 files")
                && e.contains("training goes on"),
            "{mode:?}: {e}"
        );
        let mut left: Vec<_> = std::fs::read_dir(dir.path().join("checkpoint"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["step-2", "step-6"], "{mode:?}");
        assert_eq!(
            common::bits(&losses(straight.path())),
            common::bits(&losses(dir.path())),
            "{mode:?}"
        );
    }
}
