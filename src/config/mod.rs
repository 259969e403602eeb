//! Job configuration: TOML files with TorchTitan's section and key names, `--section.key value`
//! overrides on the command line, and validation whose errors name the file, the key and what is
//! accepted. The built-in defaults are `configs/debug_model.toml` (embedded at build time), so
//! `titan train` with no arguments trains the debug model on the synthetic corpus.
//!
//! This file holds the whole job (`Config`) and its validation, one check per section in order.
//! Each section's struct, its defaults, its checks and the values derived from it live in the
//! section's own file; `load` reads the file and the overrides.

mod activation_checkpoint;
mod checkpoint;
mod comm;
mod fault_tolerance;
mod job;
mod load;
mod lora;
mod metrics;
mod model;
mod optimizer;
mod parallelism;
mod profiling;
mod quantize;
mod training;
mod validation;

use anyhow::Result;
use serde::{Deserialize, Serialize};

pub use activation_checkpoint::ActivationCheckpointConfig;
pub use checkpoint::CheckpointConfig;
pub use comm::CommConfig;
pub use fault_tolerance::FaultToleranceConfig;
pub use job::JobConfig;
pub use load::{parse_overrides, DEFAULT_CONFIG_TOML};
pub use lora::{LoraConfig, LORA};
pub use metrics::MetricsConfig;
pub use model::ModelConfig;
pub use optimizer::{
    muon_updates, name_matches, DecayType, LrSchedulerConfig, OptimizerConfig, ParamGroupConfig,
};
pub use parallelism::ParallelismConfig;
pub use profiling::ProfilingConfig;
pub use quantize::{QuantizeConfig, CONVERTERS, FLOAT8_GROUPED_MM, FLOAT8_LINEAR, MX_LINEAR};
pub use training::{TrainingConfig, DATASETS, DEVICES, PRECISIONS};
pub use validation::ValidationConfig;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    pub job: JobConfig,
    pub model: ModelConfig,
    pub optimizer: OptimizerConfig,
    pub lr_scheduler: LrSchedulerConfig,
    pub training: TrainingConfig,
    pub parallelism: ParallelismConfig,
    pub checkpoint: CheckpointConfig,
    pub activation_checkpoint: ActivationCheckpointConfig,
    pub validation: ValidationConfig,
    pub profiling: ProfilingConfig,
    pub metrics: MetricsConfig,
    pub comm: CommConfig,
    pub quantize: QuantizeConfig,
    pub lora: LoraConfig,
    pub fault_tolerance: FaultToleranceConfig,
}

impl Config {
    /// Every section's checks; the first failure is the error, naming its section and key.
    pub fn validate(&self) -> Result<()> {
        self.validate_model()?;
        self.validate_quantize()?;
        if self.lora_enabled() || self.lora != LoraConfig::default() {
            self.model_args()?; // with `[lora]`'s checks against the model
        }
        self.validate_optimizer()?;
        self.validate_lr_scheduler()?;
        self.validate_training()?;
        self.validate_parallelism()?;
        self.validate_activation_checkpoint()?;
        self.validate_profiling()?;
        self.validate_checkpoint()?;
        self.validate_validation()?;
        self.validate_comm()?;
        self.validate_fault_tolerance()?;
        self.validate_metrics()
    }
}

/// A list of strings: `converters = ["a", "b"]` in a file, or one string of comma-separated items
/// on the command line (`--model.converters a,b`, TorchTitan's form; `""` or `,` is the empty list).
fn list_or_comma_separated<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Either::deserialize(d)? {
        Either::Many(v) => v,
        Either::One(s) => s
            .split(',')
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
            .collect(),
    })
}
