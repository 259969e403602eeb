//! Asynchronous checkpoint saves (`[checkpoint] async_mode = "async"`, TorchTitan's key): the
//! training thread only serialises the state into memory (`Snapshot`), and a writer thread writes,
//! checksums, fsyncs and renames it while the next steps run. One save is in flight at a time: the
//! next one (and the end of training) first waits for it, so saves land in step order and an error
//! is reported at the latest one save later. A crash mid-write leaves only a temporary folder, which
//! loading ignores, as for synchronous saves.
//!
//! Sharded saves (FSDP, TP, PP, every layout whose ranks write their own parts) do the same: each
//! writer stages its files in memory on the training thread (after the writers' barrier), then
//! its own writer thread writes them and reports their checks through the launcher's store, where
//! writer 0's thread waits for every report before it completes the checkpoint
//! (`sharded::ShardedSnapshot::write`); no collective runs beside the training step's.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};

use super::{Snapshot, TrainState};

/// A save running on its own thread: its step, and what it returns (the folder it completed, on
/// the rank that completes it).
type Job = (u64, JoinHandle<Result<Option<PathBuf>>>);

#[derive(Default)]
pub struct AsyncWriter {
    pending: Option<Job>,
    /// A failed save is a warning (`[checkpoint] on_save_failure = "warn"`), not an error.
    warn_on_failure: bool,
}

impl AsyncWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A writer whose failed saves are warnings when `warn_on_failure` (the run goes on; the next
    /// save tries again). The policy lives here, not only with the trainer, because a background
    /// save's failure meets the next save before it is staged: that save must still be staged on
    /// every rank (staging is a collective of the writers), whichever of them saw the failure.
    pub fn with_failure_warning(warn_on_failure: bool) -> Self {
        AsyncWriter {
            pending: None,
            warn_on_failure,
        }
    }

    /// Waits for the save in flight, if any; returns where it landed (on the rank that
    /// completed it). A save that failed is an error, or with `warn_on_failure` a warning and
    /// `None`.
    pub fn wait(&mut self) -> Result<Option<PathBuf>> {
        let landed = match self.pending.take() {
            None => Ok(None),
            Some((step, handle)) => handle
                .join()
                .map_err(|_| anyhow!("the checkpoint writer for step {step} panicked"))
                .and_then(|r| r),
        };
        match landed {
            Err(e) if self.warn_on_failure => {
                warn_save_failed(&e);
                Ok(None)
            }
            other => other,
        }
    }

    /// Starts writing `snapshot` in the background after the previous save has finished; returns
    /// where that previous one landed.
    pub fn start(
        &mut self,
        snapshot: Snapshot,
        folder: &Path,
        state: TrainState,
        keep_latest_k: usize,
    ) -> Result<Option<PathBuf>> {
        let step = state.step;
        let folder = folder.to_path_buf();
        self.start_job(step, move || {
            snapshot.write(&folder, state, keep_latest_k).map(Some)
        })
    }

    /// Runs `job`, the rest of the step-`step` save, on a thread of its own after the previous
    /// save has finished; returns where that previous one landed.
    pub fn start_job(
        &mut self,
        step: u64,
        job: impl FnOnce() -> Result<Option<PathBuf>> + Send + 'static,
    ) -> Result<Option<PathBuf>> {
        let previous = self.wait()?;
        let handle = std::thread::Builder::new()
            .name(format!("titan-checkpoint-{step}"))
            .spawn(job)
            .map_err(|e| anyhow!("cannot start the checkpoint writer: {e}"))?;
        self.pending = Some((step, handle));
        Ok(previous)
    }
}

/// The warning of a failed save under `[checkpoint] on_save_failure = "warn"`.
pub fn warn_save_failed(e: &anyhow::Error) {
    errln!("warning: {e:#}; training goes on ([checkpoint] on_save_failure = \"warn\"), the next save tries again");
}
