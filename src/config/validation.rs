//! `[validation]`: the held-out loss every `freq` steps, its dataset and shape (the training's
//! where -1); with its checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::{Config, DATASETS};

/// `[validation]` (TorchTitan's keys): the loss on held-out data every `freq` steps, under the
/// training's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValidationConfig {
    /// TorchTitan's name since 2025-08; its older `enabled` is read as this, with a warning
    /// (`load::rename_deprecated_keys`).
    pub enable: bool,
    /// A dataset kind of `[training] dataset`; `synthetic` is another stream than training's.
    pub dataset: String,
    pub dataset_path: String,
    /// -1: the training's.
    pub local_batch_size: i64,
    pub seq_len: i64,
    pub freq: u64,
    /// Batches per validation (each validation reads the same ones, from the dataset's start).
    pub steps: i64,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            enable: false,
            dataset: "synthetic".into(),
            dataset_path: String::new(),
            local_batch_size: -1,
            seq_len: -1,
            freq: 10,
            steps: 10,
        }
    }
}

impl Config {
    /// `[validation]`'s local batch size and sequence length (the training's where -1).
    pub fn validation_shape(&self) -> (usize, usize) {
        let or = |v: i64, training: usize| if v < 0 { training } else { v as usize };
        (
            or(
                self.validation.local_batch_size,
                self.training.local_batch_size,
            ),
            or(self.validation.seq_len, self.training.seq_len),
        )
    }

    pub(super) fn validate_validation(&self) -> Result<()> {
        let v = &self.validation;
        if !v.enable {
            return Ok(());
        }
        if !DATASETS.contains(&v.dataset.as_str()) {
            bail!(
                "[validation] dataset = `{}` is not known (accepted: {})",
                v.dataset,
                DATASETS.join(", ")
            );
        }
        if v.dataset != "synthetic" && v.dataset_path.is_empty() {
            bail!(
                "[validation] dataset = `{}` needs a dataset_path",
                v.dataset
            );
        }
        for (key, value) in [
            ("local_batch_size", v.local_batch_size),
            ("seq_len", v.seq_len),
        ] {
            if value == 0 || value < -1 {
                bail!("[validation] {key} = {value} must be positive (or -1: the training's)");
            }
        }
        if v.freq == 0 {
            bail!("[validation] freq must be positive");
        }
        if v.steps <= 0 {
            bail!("[validation] steps = {}: give a positive number of batches (titan does not run a validation set to its end: -1 is not supported)", v.steps);
        }
        Ok(())
    }
}
