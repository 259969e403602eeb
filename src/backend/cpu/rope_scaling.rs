//! RoPE's frequency scalings for contexts longer than pretraining's, as Hugging Face
//! `transformers` computes them (`modeling_rope_utils`): Llama 3.1's (`rope_type = "llama3"`:
//! low frequencies divided by `factor`, a smooth blend between) and YaRN's (`rope_type = "yarn"`:
//! NTK-by-parts interpolation between the dimensions that rotate more than `beta_fast` and less
//! than `beta_slow` times over the original context, plus an attention factor that multiplies
//! every cos and sin, so the attention logits by its square). DeepSeek-V3's `mscale` and
//! `mscale_all_dim` are kept: they set the attention factor, and MLA scales its softmax by
//! `mscale_all_dim`'s factor squared.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

/// A frequency scaling. Checkpoints store the variant's fields alone (untagged): a Llama 3
/// scaling has `low_freq_factor`, a YaRN one `beta_fast`, so each reads back as itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RopeScaling {
    Llama3(Llama3Scaling),
    Yarn(YarnScaling),
}

/// Llama 3.1 long-context frequency scaling (`rope_type = "llama3"` in HF configs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// YaRN (`rope_type = "yarn"`), with transformers' defaults resolved: `beta_fast` 32,
/// `beta_slow` 1, `truncate` true; `factor` given or `max_position_embeddings` over
/// `original_max_position_embeddings`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Whether the correction range's ends are rounded outwards to whole dimensions.
    pub truncate: bool,
    /// The cos/sin multiplier when given; else from `mscale`/`mscale_all_dim` or `factor`.
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
}

/// YaRN's magnitude correction `0.1 · m · ln(scale) + 1` (1 for a scale of at most 1).
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The multiplier of every cos and sin (1 for Llama 3's scaling).
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Llama3(_) => 1.0,
            RopeScaling::Yarn(y) => y.attention_factor(),
        }
    }

    /// The scaled inverse frequency of each of `plain` (`θ^(-2i/d)`, `i < d/2`).
    fn scale(&self, plain: &[f64], theta: f64) -> Vec<f64> {
        match self {
            RopeScaling::Llama3(s) => plain.iter().map(|&f| s.scale(f)).collect(),
            RopeScaling::Yarn(y) => y.scale(plain, theta),
        }
    }

    /// Each field finite and in range, with an error naming it.
    pub fn validate(&self) -> anyhow::Result<()> {
        let (what, values): (&str, Vec<(&str, f64)>) = match self {
            RopeScaling::Llama3(s) => (
                "llama3",
                vec![
                    ("factor", s.factor),
                    ("low_freq_factor", s.low_freq_factor),
                    ("high_freq_factor", s.high_freq_factor),
                ],
            ),
            RopeScaling::Yarn(y) => (
                "yarn",
                vec![
                    ("factor", y.factor),
                    ("beta_fast", y.beta_fast),
                    ("beta_slow", y.beta_slow),
                    ("attention_factor", y.attention_factor.unwrap_or(1.0)),
                    (
                        "original_max_position_embeddings",
                        y.original_max_position_embeddings as f64,
                    ),
                ],
            ),
        };
        for (field, v) in values {
            if !(v.is_finite() && v > 0.0) {
                anyhow::bail!(
                    "rope_scaling ({what}) {field} = {v} must be a finite positive number"
                );
            }
        }
        Ok(())
    }
}

impl Llama3Scaling {
    fn scale(&self, freq: f64) -> f64 {
        let old = self.original_max_position_embeddings as f64;
        let low_wavelen = old / self.low_freq_factor;
        let high_wavelen = old / self.high_freq_factor;
        let wavelen = 2.0 * PI / freq;
        if wavelen < high_wavelen {
            freq
        } else if wavelen > low_wavelen {
            freq / self.factor
        } else {
            let smooth = (old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * freq / self.factor + smooth * freq
        }
    }
}

impl YarnScaling {
    /// transformers' choice: the given factor; else `mscale`'s correction over `mscale_all_dim`'s
    /// when both are non-zero (DeepSeek-V3: 1 when they are equal); else `factor`'s.
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(self.factor, m) / yarn_mscale(self.factor, all)
            }
            _ => yarn_mscale(self.factor, 1.0),
        }
    }

    /// NTK-by-parts: dimensions below the correction range keep their frequency (they rotate
    /// many times over the original context), those above it are divided by `factor`, with a
    /// linear ramp between.
    fn scale(&self, plain: &[f64], theta: f64) -> Vec<f64> {
        let dim = 2 * plain.len();
        let original = self.original_max_position_embeddings as f64;
        // The dimension whose wavelength turns `rotations` times over the original context.
        let correction_dim = |rotations: f64| {
            dim as f64 * (original / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast),
            correction_dim(self.beta_slow),
        );
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
        if low == high {
            high += 0.001;
        }
        plain
            .iter()
            .enumerate()
            .map(|(i, &extrapolated)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                extrapolated / self.factor * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }
}

/// Inverse frequencies `θ^(-2i/d)` for `i < d/2`, scaled as `scaling` says.
pub fn inverse_frequencies(head_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> Vec<f64> {
    let plain: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    match scaling {
        None => plain,
        Some(s) => s.scale(&plain, theta),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64) -> YarnScaling {
        YarnScaling {
            factor,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
        }
    }

    #[test]
    fn yarn_keeps_fast_dimensions_and_divides_slow_ones() {
        let (dim, theta) = (64, 10000.0);
        let plain = inverse_frequencies(dim, theta, None);
        let scaled = inverse_frequencies(dim, theta, Some(RopeScaling::Yarn(yarn(40.0))));
        // The first dimensions turn far more than 32 times over 4096 positions: unchanged; the
        // last turn less than once: divided by the factor; the ramp in between is monotone.
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[31] - plain[31] / 40.0).abs() < 1e-15);
        let ratio: Vec<f64> = scaled.iter().zip(&plain).map(|(s, p)| s / p).collect();
        assert!(ratio.windows(2).all(|w| w[1] <= w[0] + 1e-12), "{ratio:?}");
    }

    #[test]
    fn the_attention_factor_follows_transformers_choice() {
        let mut y = yarn(40.0);
        assert!((y.attention_factor() - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-15);
        // DeepSeek-V3: mscale = mscale_all_dim, a factor of 1 (its softmax carries the correction).
        (y.mscale, y.mscale_all_dim) = (Some(1.0), Some(1.0));
        assert_eq!(y.attention_factor(), 1.0);
        y.mscale = Some(0.707);
        let want = (0.1 * 0.707 * 40f64.ln() + 1.0) / (0.1 * 40f64.ln() + 1.0);
        assert!((y.attention_factor() - want).abs() < 1e-15);
        y.attention_factor = Some(0.5);
        assert_eq!(y.attention_factor(), 0.5);
        assert_eq!(yarn(1.0).attention_factor(), 1.0);
    }

    #[test]
    fn each_variant_reads_back_as_itself() {
        let llama = RopeScaling::Llama3(Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        let y = RopeScaling::Yarn(yarn(4.0));
        for s in [llama, y] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(
                serde_json::from_str::<RopeScaling>(&json).unwrap(),
                s,
                "{json}"
            );
        }
        // A checkpoint written before YaRN existed stored the Llama 3 fields alone.
        let old = r#"{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#;
        assert_eq!(serde_json::from_str::<RopeScaling>(old).unwrap(), llama);
    }
}
