//! Learning-rate schedule: linear warm-up, then warmup-stable-decay (WSD) with linear, sqrt or
//! cosine decay down to `min_lr_factor · lr` over the last steps.

use crate::config::{DecayType, LrSchedulerConfig};

#[derive(Debug, Clone)]
pub struct LrSchedule {
    base_lr: f64,
    warmup: u64,
    total: u64,
    decay: u64,
    decay_type: DecayType,
    min_factor: f64,
}

impl LrSchedule {
    pub fn new(base_lr: f64, cfg: &LrSchedulerConfig, total_steps: u64) -> Self {
        let warmup = cfg.warmup_steps.min(total_steps);
        let decay = match cfg.decay_ratio {
            Some(r) => (total_steps as f64 * r).round() as u64,
            None => total_steps - warmup,
        }
        .min(total_steps - warmup);
        LrSchedule {
            base_lr,
            warmup,
            total: total_steps,
            decay,
            decay_type: cfg.decay_type,
            min_factor: cfg.min_lr_factor,
        }
    }

    /// Multiplier of the base lr at optimizer step `step` (1-based). Warm-up starts at
    /// `1/(warmup+1)` (never zero, as in TorchTitan) and reaches 1 after it; the decay window is the
    /// last `decay` steps, symmetric to the warm-up: its last step is one `1/(decay+1)` short of
    /// `min_lr_factor`, so every step still updates the weights.
    pub fn factor(&self, step: u64) -> f64 {
        if step <= self.warmup {
            return step as f64 / (self.warmup + 1) as f64;
        }
        let decay_start = self.total - self.decay;
        if self.decay == 0 || step <= decay_start {
            return 1.0;
        }
        let progress = ((step - decay_start) as f64 / (self.decay + 1) as f64).min(1.0);
        let f = match self.decay_type {
            DecayType::Linear => 1.0 - progress,
            DecayType::Sqrt => 1.0 - progress.sqrt(),
            DecayType::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        self.min_factor + (1.0 - self.min_factor) * f
    }

    pub fn lr(&self, step: u64) -> f64 {
        self.base_lr * self.factor(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(warmup: u64, ratio: Option<f64>, t: DecayType, min: f64) -> LrSchedulerConfig {
        LrSchedulerConfig {
            warmup_steps: warmup,
            decay_ratio: ratio,
            decay_type: t,
            min_lr_factor: min,
        }
    }

    #[test]
    fn warmup_then_linear_decay_to_zero() {
        let s = LrSchedule::new(1.0, &cfg(4, None, DecayType::Linear, 0.0), 10);
        let f: Vec<f64> = (1..=10).map(|i| s.factor(i)).collect();
        assert!((f[0] - 0.2).abs() < 1e-12 && (f[3] - 0.8).abs() < 1e-12);
        assert!(f[4] <= 1.0 && f.windows(2).skip(4).all(|w| w[1] < w[0]));
        assert!((f[9] - 1.0 / 7.0).abs() < 1e-12, "{f:?}");
    }

    #[test]
    fn wsd_keeps_lr_stable_before_the_decay_window() {
        let s = LrSchedule::new(2.0, &cfg(2, Some(0.2), DecayType::Cosine, 0.1), 20);
        assert_eq!(s.lr(10), 2.0);
        assert_eq!(s.lr(16), 2.0);
        assert!(s.lr(18) < 2.0 && s.lr(18) > 0.2);
        assert!(s.lr(20) > 0.2 && s.lr(20) < 0.4, "{}", s.lr(20));
    }

    #[test]
    fn sqrt_decay_is_below_linear_midway() {
        let lin = LrSchedule::new(1.0, &cfg(0, None, DecayType::Linear, 0.0), 100);
        let sq = LrSchedule::new(1.0, &cfg(0, None, DecayType::Sqrt, 0.0), 100);
        assert!(sq.factor(50) < lin.factor(50));
    }
}
