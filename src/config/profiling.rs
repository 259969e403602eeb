//! `[profiling]`: which steps are traced (Chrome traces, memory timelines) and where the files
//! go; with its checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

/// `[profiling]` (TorchTitan's keys): Chrome traces of profiled steps (`crate::trace`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfilingConfig {
    pub enable_profiling: bool,
    /// Under `job.dump_folder`: `{folder}/iteration_{step}/rank{r}_trace.json`.
    pub save_traces_folder: String,
    /// Every `profile_freq` steps, the last `profiler_active` are recorded, after
    /// `profiler_warmup` unrecorded ones (TorchTitan's wait, warm-up and active phases).
    pub profile_freq: u64,
    pub profiler_warmup: u64,
    pub profiler_active: u64,
    /// The memory timeline of the same profiled steps (`crate::memory_timeline`), under
    /// `job.dump_folder`: `{folder}/iteration_{step}/rank{r}_memory.{json,svg}`.
    pub enable_memory_snapshot: bool,
    pub save_memory_snapshot_folder: String,
}

impl Default for ProfilingConfig {
    fn default() -> Self {
        ProfilingConfig {
            enable_profiling: false,
            save_traces_folder: "profile_traces".into(),
            profile_freq: 10,
            profiler_warmup: 3,
            profiler_active: 1,
            enable_memory_snapshot: false,
            save_memory_snapshot_folder: "memory_snapshot".into(),
        }
    }
}

impl ProfilingConfig {
    /// Whether `step` (from 1) is recorded, and whether it is the last recorded step of its
    /// period (its trace is written after it).
    pub fn phase(&self, step: u64) -> (bool, bool) {
        if !self.enable_profiling && !self.enable_memory_snapshot {
            return (false, false);
        }
        let pos = (step - 1) % self.profile_freq;
        let active = pos >= self.profile_freq - self.profiler_active;
        (active, active && pos == self.profile_freq - 1)
    }
}

impl Config {
    pub(super) fn validate_profiling(&self) -> Result<()> {
        let pr = &self.profiling;
        if (pr.enable_profiling || pr.enable_memory_snapshot)
            && (pr.profile_freq == 0
                || pr.profiler_active == 0
                || pr.profiler_warmup + pr.profiler_active > pr.profile_freq)
        {
            bail!("[profiling] profile_freq = {} must be positive and at least profiler_warmup {} + profiler_active {} (active at least 1)", pr.profile_freq, pr.profiler_warmup, pr.profiler_active);
        }
        Ok(())
    }
}
