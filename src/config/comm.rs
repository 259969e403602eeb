//! `[comm]`: collective timeouts and the flight recorder's buffer and dump folder; with its
//! checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommConfig {
    /// Rendezvous and group set-up.
    pub init_timeout_seconds: u64,
    /// Every collective during training.
    pub train_timeout_seconds: u64,
    /// Flight recorder: the latest operations each process group keeps for a dump when a
    /// collective fails (0 turns it off).
    pub trace_buf_size: usize,
    /// Where the dumps go, under the dump folder (`rank_{r}.json`).
    pub save_traces_folder: String,
    /// Run a multi-node job without a job secret: its store and ranks then accept any
    /// connection (docs/security.md). Off: such a job is refused until it has a secret.
    pub insecure_no_auth: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            init_timeout_seconds: 300,
            train_timeout_seconds: 100,
            trace_buf_size: 20000,
            save_traces_folder: "comm_traces".into(),
            insecure_no_auth: false,
        }
    }
}

impl Config {
    pub(super) fn validate_comm(&self) -> Result<()> {
        if self.comm.init_timeout_seconds == 0 || self.comm.train_timeout_seconds == 0 {
            bail!("[comm] init_timeout_seconds and train_timeout_seconds must be positive");
        }
        Ok(())
    }
}
