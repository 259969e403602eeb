//! Asynchronous checkpoint saves (`[checkpoint] async_mode = "async"`, TorchTitan's key): the
//! training thread only serialises the state into memory (`Snapshot`), and a writer thread writes,
//! checksums, fsyncs and renames it while the next steps run. One save is in flight at a time: the
//! next one (and the end of training) first waits for it, so saves land in step order and an error
//! is reported at the latest one save later. A crash mid-write leaves only a temporary folder, which
//! loading ignores, as for synchronous saves.
//!
//! Sharded (FSDP/HSDP) saves stay synchronous: their ranks agree through collectives, which must not
//! run beside the training step's own.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};

use super::{Snapshot, TrainState};

#[derive(Default)]
pub struct AsyncWriter {
    pending: Option<(u64, JoinHandle<Result<PathBuf>>)>,
}

impl AsyncWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for the save in flight, if any; returns where it landed.
    pub fn wait(&mut self) -> Result<Option<PathBuf>> {
        match self.pending.take() {
            None => Ok(None),
            Some((step, handle)) => handle
                .join()
                .map_err(|_| anyhow!("the checkpoint writer for step {step} panicked"))?
                .map(Some),
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
        let previous = self.wait()?;
        let step = state.step;
        let folder = folder.to_path_buf();
        let handle = std::thread::Builder::new()
            .name(format!("titan-checkpoint-{step}"))
            .spawn(move || snapshot.write(&folder, state, keep_latest_k))
            .map_err(|e| anyhow!("cannot start the checkpoint writer: {e}"))?;
        self.pending = Some((step, handle));
        Ok(previous)
    }
}
