//! `[optimizer]` and `[lr_scheduler]`: the optimizer's hyperparameters (AdamW's, Adam's, Muon's
//! and the AdamW beside it), parameter groups, and the learning-rate schedule (warm-up, then
//! decay); with their checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

/// The optimizers `[optimizer] name` accepts: `AdamW` (decoupled weight decay), `Adam`
/// (`torch.optim.Adam`: the decay added to the gradient as an L2 term) and `Muon`
/// (`torch.optim.Muon` on the blocks' weight matrices, AdamW on the rest).
pub const OPTIMIZERS: [&str; 3] = ["AdamW", "Adam", "Muon"];

/// `[optimizer] adjust_lr_fn`: how Muon scales its learning rate by a matrix's shape `[A, B]`
/// (`torch.optim.Muon`'s): `original` `√max(1, A/B)`, `match_rms_adamw` `0.2·√max(A, B)`,
/// `spectral_unclamped` `√(A/B)`.
pub const ADJUST_LR_FNS: [&str; 3] = ["original", "match_rms_adamw", "spectral_unclamped"];

/// `[optimizer] ns_dtype`: the precision of Muon's Newton–Schulz iteration, `bfloat16` (as
/// `torch.optim.Muon` runs it: every product rounded to bf16) or `float32`.
pub const NS_DTYPES: [&str; 2] = ["bfloat16", "float32"];

/// Whether Muon (not the AdamW beside it) updates parameter `name` of shape `shape`: every weight
/// matrix but the embedding and the output head (Moonlight's and TorchTitan's split; a routed
/// expert is a matrix of its own, so experts are orthogonalised one by one).
pub fn muon_updates(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && name != "tok_embeddings.weight" && name != "output.weight"
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub name: String,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Muon's momentum (0.95), Nesterov's form of it (true), the Newton–Schulz iteration's
    /// coefficients, steps, epsilon (the norm's floor) and precision, and its learning-rate
    /// adjustment (`torch.optim.Muon`'s keys and defaults; `eps` stays AdamW's).
    pub momentum: f64,
    pub nesterov: bool,
    pub ns_coefficients: [f64; 3],
    pub ns_steps: usize,
    pub ns_eps: f64,
    pub ns_dtype: String,
    pub adjust_lr_fn: String,
    /// With Muon, the learning rate of the parameters AdamW updates (embedding, output head,
    /// norms); absent: `lr`. The schedule scales it as it scales `lr`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adamw_lr: Option<f64>,
    /// The dtype the optimizer's state is stored in: `float32`, or `bfloat16` (half the memory;
    /// the update still computes in fp32).
    pub state_dtype: String,
    /// `[[optimizer.param_groups]]`: a parameter takes the settings of the first group one of
    /// whose patterns its name matches, the section's own when none does.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<ParamGroupConfig>,
}

/// One `[[optimizer.param_groups]]`: name patterns (`*` matches any run of characters, dots
/// included: `*norm*`, `tok_embeddings.*`) and the settings that replace the section's for the
/// parameters they match. The learning-rate schedule scales a group's `lr` as it scales the
/// section's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamGroupConfig {
    #[serde(rename = "match")]
    pub patterns: Vec<String>,
    pub lr: Option<f64>,
    pub weight_decay: Option<f64>,
    pub betas: Option<[f64; 2]>,
}

/// Whether `name` matches `pattern`, in which `*` stands for any run of characters.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: the whole name
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

impl OptimizerConfig {
    /// The index in `param_groups` of the group parameter `name` belongs to (None: the
    /// section's own settings).
    pub fn group_of(&self, name: &str) -> Option<usize> {
        self.param_groups
            .iter()
            .position(|g| g.patterns.iter().any(|p| name_matches(p, name)))
    }
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
            momentum: 0.95,
            nesterov: true,
            ns_coefficients: [3.4445, -4.775, 2.0315],
            ns_steps: 5,
            ns_eps: 1e-7,
            ns_dtype: "bfloat16".into(),
            adjust_lr_fn: "original".into(),
            adamw_lr: None,
            state_dtype: "float32".into(),
            param_groups: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::name_matches;

    #[test]
    fn patterns_match_whole_names_with_stars_for_any_run() {
        assert!(name_matches("tok_embeddings.*", "tok_embeddings.weight"));
        assert!(name_matches("*norm*", "layers.0.attention_norm.weight"));
        assert!(name_matches("*norm.weight", "norm.weight"));
        assert!(name_matches(
            "layers.*.wq.*",
            "layers.12.attention.wq.weight"
        ));
        assert!(name_matches("output.weight", "output.weight"));
        assert!(!name_matches("output", "output.weight"));
        assert!(!name_matches(
            "*.wq.weight",
            "layers.0.attention.wqa.weight"
        ));
        assert!(!name_matches("a*a", "a"));
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
        if !OPTIMIZERS.contains(&self.optimizer.name.as_str()) {
            bail!(
                "[optimizer] name = `{}` is not supported (accepted: {})",
                self.optimizer.name,
                OPTIMIZERS.join(", ")
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
        if !["float32", "bfloat16"].contains(&self.optimizer.state_dtype.as_str()) {
            bail!(
                "[optimizer] state_dtype = `{}` is not supported (accepted: float32, bfloat16)",
                self.optimizer.state_dtype
            );
        }
        if self.optimizer.name == "Muon" {
            self.validate_muon()?;
        }
        self.validate_param_groups()
    }

    /// Muon's keys in range, and a weight matrix in the model for it to update.
    fn validate_muon(&self) -> Result<()> {
        let o = &self.optimizer;
        if !(0.0..1.0).contains(&o.momentum) {
            bail!("[optimizer] momentum must be in [0, 1), got {}", o.momentum);
        }
        if !(1..100).contains(&o.ns_steps) {
            bail!(
                "[optimizer] ns_steps must be between 1 and 99 (Muon's Newton–Schulz iterations), got {}",
                o.ns_steps
            );
        }
        if !(o.ns_eps > 0.0 && o.ns_eps.is_finite()) {
            bail!(
                "[optimizer] ns_eps must be a positive number, got {}",
                o.ns_eps
            );
        }
        if o.ns_coefficients.iter().any(|c| !c.is_finite()) {
            bail!(
                "[optimizer] ns_coefficients must be finite, got {:?}",
                o.ns_coefficients
            );
        }
        for (key, value, accepted) in [
            ("adjust_lr_fn", &o.adjust_lr_fn, &ADJUST_LR_FNS[..]),
            ("ns_dtype", &o.ns_dtype, &NS_DTYPES[..]),
        ] {
            if !accepted.contains(&value.as_str()) {
                bail!(
                    "[optimizer] {key} = `{value}` is not supported (accepted: {})",
                    accepted.join(", ")
                );
            }
        }
        if let Some(lr) = o.adamw_lr.filter(|lr| !(*lr > 0.0 && lr.is_finite())) {
            bail!("[optimizer] adamw_lr must be a positive number, got {lr}");
        }
        let specs = crate::model::params::param_specs(&self.model_args()?);
        if !specs.iter().any(|(name, shape)| muon_updates(name, shape)) {
            bail!("[optimizer] name = `Muon`: this model has no weight matrix for Muon to update (it updates the blocks' 2-D weights; the embedding and output head take AdamW)");
        }
        Ok(())
    }

    /// Each group's settings in range and each pattern matching a parameter of the model.
    fn validate_param_groups(&self) -> Result<()> {
        let groups = &self.optimizer.param_groups;
        if groups.is_empty() {
            return Ok(());
        }
        let specs = crate::model::params::param_specs(&self.model_args()?);
        for (n, g) in groups.iter().enumerate() {
            let at = format!("[[optimizer.param_groups]] #{}", n + 1);
            if g.patterns.is_empty() {
                bail!("{at}: `match` names no pattern");
            }
            if let Some(lr) = g.lr.filter(|lr| !(*lr > 0.0 && lr.is_finite())) {
                bail!("{at}: lr must be a positive number, got {lr}");
            }
            if let Some(wd) = g.weight_decay.filter(|wd| !(*wd >= 0.0 && wd.is_finite())) {
                bail!("{at}: weight_decay must be a number >= 0, got {wd}");
            }
            if let Some(b) = g.betas.iter().flatten().find(|b| !(0.0..1.0).contains(*b)) {
                bail!("{at}: betas must be in [0, 1), got {b}");
            }
            for p in &g.patterns {
                if !specs.iter().any(|(name, _)| name_matches(p, name)) {
                    bail!("{at}: match pattern `{p}` matches no parameter of this model (names such as `layers.0.attention.wq.weight`, `tok_embeddings.weight`; `*` matches any characters)");
                }
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
