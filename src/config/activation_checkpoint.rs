//! `[activation_checkpoint]`: what each block keeps from its forward for its backward; the
//! setting is checked by parsing it into `model::activation_checkpoint::AcMode`.

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::Config;

/// `[activation_checkpoint]` (TorchTitan's keys): what each block keeps from its forward for its
/// backward (`model::activation_checkpoint`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointConfig {
    /// `none`, `full` (a block keeps only its input) or `selective`.
    pub mode: String,
    /// With `selective`: `op` (keep the GEMMs' and attention's outputs, recompute the rest) or N
    /// (every N-th block fully checkpointed), as a string or an integer.
    #[serde(deserialize_with = "string_or_integer")]
    pub selective_ac_option: String,
}

impl Default for ActivationCheckpointConfig {
    fn default() -> Self {
        ActivationCheckpointConfig {
            mode: "none".into(),
            selective_ac_option: "2".into(),
        }
    }
}

impl ActivationCheckpointConfig {
    pub fn mode(&self) -> Result<crate::model::activation_checkpoint::AcMode> {
        crate::model::activation_checkpoint::AcMode::parse(&self.mode, &self.selective_ac_option)
    }
}

/// TorchTitan writes `selective_ac_option = "2"`; `2` reads the same.
fn string_or_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        S(String),
        I(i64),
    }
    Ok(match Either::deserialize(d)? {
        Either::S(s) => s,
        Either::I(i) => i.to_string(),
    })
}

impl Config {
    pub(super) fn validate_activation_checkpoint(&self) -> Result<()> {
        self.activation_checkpoint.mode()?;
        Ok(())
    }
}
