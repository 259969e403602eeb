//! `[metrics]`: how often steps are logged, TensorBoard output and the peak TFLOP/s behind MFU;
//! with its checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    pub log_freq: u64,
    pub enable_tensorboard: bool,
    /// Relative to `job.dump_folder`.
    pub save_tb_folder: String,
    /// Peak TFLOP/s used for MFU; 0 uses the documented default of the device (see README).
    pub peak_tflops: f64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            log_freq: 10,
            enable_tensorboard: false,
            save_tb_folder: "tb".into(),
            peak_tflops: 0.0,
        }
    }
}

impl Config {
    pub(super) fn validate_metrics(&self) -> Result<()> {
        if self.metrics.log_freq == 0 {
            bail!("[metrics] log_freq must be positive");
        }
        Ok(())
    }
}
