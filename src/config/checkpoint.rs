//! `[checkpoint]`: when and where checkpoints are saved, which one a run resumes from, and the
//! model a fresh run may start from (a titan checkpoint or a Hugging Face folder); with its checks.

use std::path::PathBuf;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub enable: bool,
    pub interval: u64,
    /// Checkpoints to keep (oldest removed first); 0 keeps all.
    pub keep_latest_k: usize,
    /// Relative to `job.dump_folder` unless absolute.
    pub folder: String,
    /// Step to resume from; -1 picks the latest complete checkpoint.
    pub load_step: i64,
    /// `disabled` (saves block the step) or `async` (a writer thread writes while training goes on;
    /// whole checkpoints only, sharded saves stay synchronous). TorchTitan's key.
    pub async_mode: String,
    /// A titan checkpoint (a `step-N` folder) or, with `initial_load_in_hf`, a Hugging Face Llama
    /// folder to start from when the run's own checkpoint folder holds none (continued
    /// pretraining); empty: a fresh model.
    pub initial_load_path: String,
    pub initial_load_in_hf: bool,
    /// Only the weights (fresh AdamW state, step 0); false also takes a titan checkpoint's
    /// moments.
    pub initial_load_model_only: bool,
    /// What a save that fails (a full disk, a writer that cannot write) does: `stop` the run with
    /// an error naming the last complete checkpoint, or `warn` and train on, the next interval's
    /// save trying again (every rank learns the outcome from rank 0 first, so all go on together).
    pub on_save_failure: String,
    /// Parts of a checkpoint a resumed run does not load (TorchTitan's key): `optimizer` starts
    /// the optimizer state afresh (zero moments), as changing the optimizer or its parameter
    /// groups between runs needs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exclude_from_loading: Vec<String>,
}

impl CheckpointConfig {
    /// Whether a resumed run starts the optimizer state afresh (`exclude_from_loading`).
    pub fn excludes_optimizer(&self) -> bool {
        self.exclude_from_loading.iter().any(|p| p == "optimizer")
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            enable: true,
            interval: 100,
            keep_latest_k: 3,
            folder: "checkpoint".into(),
            load_step: -1,
            async_mode: "disabled".into(),
            initial_load_path: String::new(),
            initial_load_in_hf: false,
            initial_load_model_only: true,
            on_save_failure: "stop".into(),
            exclude_from_loading: Vec::new(),
        }
    }
}

impl Config {
    pub fn checkpoint_folder(&self) -> PathBuf {
        self.dump_folder().join(&self.checkpoint.folder)
    }

    /// `[checkpoint] on_save_failure = "warn"`: a failed save is a warning, not the run's end.
    pub fn save_failure_warns(&self) -> bool {
        self.checkpoint.on_save_failure == "warn"
    }

    pub(super) fn validate_checkpoint(&self) -> Result<()> {
        let c = &self.checkpoint;
        if let Some(part) = c.exclude_from_loading.iter().find(|p| *p != "optimizer") {
            bail!("[checkpoint] exclude_from_loading: `{part}` is not supported (accepted: optimizer)");
        }
        if c.initial_load_path.is_empty() && c.initial_load_in_hf {
            bail!("[checkpoint] initial_load_in_hf = true needs initial_load_path (the Hugging Face folder)");
        }
        if c.initial_load_in_hf && !c.initial_load_model_only {
            bail!("[checkpoint] initial_load_model_only = false with initial_load_in_hf: a Hugging Face folder holds no optimizer state");
        }
        if c.interval == 0 {
            bail!("[checkpoint] interval must be positive");
        }
        if !matches!(c.on_save_failure.as_str(), "stop" | "warn") {
            bail!(
                "[checkpoint] on_save_failure = `{}` is not known (accepted: stop, warn)",
                c.on_save_failure
            );
        }
        match c.async_mode.as_str() {
            "disabled" | "async" => {}
            "async_with_pinned_mem" => bail!(
                "[checkpoint] async_mode = \"async_with_pinned_mem\" is not built (pinned host memory \
                 only speeds up GPU-to-host copies); use \"async\""
            ),
            other => bail!(
                "[checkpoint] async_mode = `{other}` is not known (accepted: disabled, async)"
            ),
        }
        Ok(())
    }
}
