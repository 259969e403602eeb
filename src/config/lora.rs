//! `[lora]` (TorchTitan's LoRA converter, `[model] converters = ["lora"]`): the adapters' rank,
//! scale and which linears they adapt, with their checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;
use crate::model::lora::{LoraArgs, ADAPTABLE};
use crate::model::ModelArgs;

/// The converter name that turns LoRA on.
pub const LORA: &str = "lora";

/// `[lora]`: TorchTitan's keys and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// The adapters' rank (`lora_a` is `[rank, in]`, `lora_b` `[out, rank]`).
    pub rank: usize,
    /// The adapters' output is scaled by `alpha / rank`.
    pub alpha: f64,
    /// The adapted linears' last name segments (`["wq", "wv"]`); empty: every block projection.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            target_modules: Vec::new(),
        }
    }
}

impl Config {
    /// Whether `[model] converters` turns LoRA on.
    pub fn lora_enabled(&self) -> bool {
        self.model.converters.iter().any(|c| c == LORA)
    }

    /// The adapters the model gets (None without the `lora` converter).
    pub(super) fn lora_args(&self) -> Option<LoraArgs> {
        self.lora_enabled().then(|| LoraArgs {
            rank: self.lora.rank,
            alpha: self.lora.alpha,
            target_modules: self.lora.target_modules.clone(),
        })
    }

    /// `[lora]` against the model: a positive rank, known target names, at least one linear.
    pub(super) fn validate_lora(&self, args: &ModelArgs) -> Result<()> {
        let l = &self.lora;
        if !self.lora_enabled() {
            if *l != LoraConfig::default() {
                bail!("[lora] is set but [model] converters does not name \"lora\" (add --model.converters lora)");
            }
            return Ok(());
        }
        if l.rank == 0 {
            bail!("[lora] rank = 0: the adapters need a rank of at least 1 (TorchTitan's default is 8)");
        }
        if !(l.alpha.is_finite() && l.alpha > 0.0) {
            bail!("[lora] alpha = {}: must be a positive number (the adapters' output is scaled by alpha / rank)", l.alpha);
        }
        for t in &l.target_modules {
            if t == "output" || t == "gate" {
                bail!("[lora] target_modules: `{t}` is not adapted yet (LoRA adapts the block projections: {}); the output projection and the router stay frozen", ADAPTABLE.join(", "));
            }
            if !ADAPTABLE.contains(&t.as_str()) {
                bail!(
                    "[lora] target_modules: `{t}` is not a linear's name (accepted: {})",
                    ADAPTABLE.join(", ")
                );
            }
        }
        let lora = self.lora_args().expect("LoRA is on");
        let specs = crate::model::params::param_specs(&ModelArgs {
            lora: None,
            attention_sinks: false,
            sliding_window: None,
            attention_bias: false,
            every_n_layers_nope: None,
            attention_chunk_size: None,
            l2_qk_norm: false,
            attention_temperature: None,
            ..args.clone()
        });
        for t in &l.target_modules {
            let one = LoraArgs {
                target_modules: vec![t.clone()],
                ..lora.clone()
            };
            if !specs.iter().any(|(name, _)| one.adapts(name)) {
                bail!(
                    "[lora] target_modules: `{t}` names no linear of this model ({} {})",
                    self.model.name,
                    self.model.flavor
                );
            }
        }
        if !specs.iter().any(|(name, _)| lora.adapts(name)) {
            bail!("[lora]: this model has no linear LoRA adapts");
        }
        Ok(())
    }
}
