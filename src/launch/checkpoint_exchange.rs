//! The file exchange of a sharded checkpoint save (`checkpoint::sharded::FileExchange`) through the
//! rendezvous store, on a connection of its own: a save finishing on a background thread waits
//! there for the other writers (up to the save's long timeout) without holding the connection the
//! training thread uses.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::checkpoint::sharded::FileExchange;
use crate::checkpoint::FileCheck;
use crate::comm::store::StoreClient;

pub struct StoreFileExchange {
    pub(super) store: StoreClient,
    /// `checkpoint-files/g{generation}/{writers group}`: this run's and group's keys.
    pub(super) prefix: String,
    /// How long writer 0 waits for the others' files.
    pub(super) wait: Duration,
}

impl StoreFileExchange {
    fn key(&self, step: u64, rank: usize) -> String {
        format!("{}/step-{step}/{rank}", self.prefix)
    }
}

impl FileExchange for StoreFileExchange {
    fn publish(
        &self,
        step: u64,
        rank: usize,
        files: std::result::Result<[FileCheck; 2], String>,
    ) -> Result<()> {
        let value = serde_json::to_vec(&files)?;
        self.store.set(&self.key(step, rank), &value)
    }

    fn collect(&self, step: u64, writers: usize) -> Result<Vec<[FileCheck; 2]>> {
        let deadline = Instant::now() + self.wait;
        (0..writers)
            .map(|r| {
                let left = deadline.saturating_duration_since(Instant::now());
                let value = self
                    .store
                    .get_within(&self.key(step, r), left)
                    .map_err(|_| {
                        anyhow!(
                        "checkpoint writer {r} did not report its step-{step} files within {:.0?}",
                        self.wait
                    )
                    })?;
                let told: std::result::Result<[FileCheck; 2], String> =
                    serde_json::from_slice(&value).map_err(|e| {
                        anyhow!("checkpoint writer {r}'s step-{step} report is not readable: {e}")
                    })?;
                told.map_err(|e| {
                    anyhow!("checkpoint writer {r} could not write its step-{step} files: {e}")
                })
            })
            .collect()
    }
}
