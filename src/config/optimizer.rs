//! `[optimizer]` and `[lr_scheduler]`: AdamW's hyperparameters and the learning-rate schedule
//! (warm-up, then decay); with their checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub name: String,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: "AdamW".into(),
            lr: 8e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayType {
    Linear,
    Sqrt,
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedulerConfig {
    pub warmup_steps: u64,
    /// Share of the steps spent decaying at the end; absent means every step after warm-up decays.
    pub decay_ratio: Option<f64>,
    pub decay_type: DecayType,
    pub min_lr_factor: f64,
}

impl Default for LrSchedulerConfig {
    fn default() -> Self {
        LrSchedulerConfig {
            warmup_steps: 20,
            decay_ratio: None,
            decay_type: DecayType::Linear,
            min_lr_factor: 0.0,
        }
    }
}

impl Config {
    pub(super) fn validate_optimizer(&self) -> Result<()> {
        if self.optimizer.name != "AdamW" {
            bail!(
                "[optimizer] name = `{}` is not supported (accepted: AdamW)",
                self.optimizer.name
            );
        }
        if !(self.optimizer.lr > 0.0 && self.optimizer.lr.is_finite()) {
            bail!(
                "[optimizer] lr must be a positive number, got {}",
                self.optimizer.lr
            );
        }
        for (k, v) in [
            ("beta1", self.optimizer.beta1),
            ("beta2", self.optimizer.beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                bail!("[optimizer] {k} must be in [0, 1), got {v}");
            }
        }
        Ok(())
    }

    pub(super) fn validate_lr_scheduler(&self) -> Result<()> {
        if let Some(r) = self.lr_scheduler.decay_ratio {
            if !(0.0..=1.0).contains(&r) {
                bail!("[lr_scheduler] decay_ratio must be in [0, 1], got {r}");
            }
        }
        if !(0.0..=1.0).contains(&self.lr_scheduler.min_lr_factor) {
            bail!(
                "[lr_scheduler] min_lr_factor must be in [0, 1], got {}",
                self.lr_scheduler.min_lr_factor
            );
        }
        Ok(())
    }
}
