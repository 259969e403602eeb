//! Semi-synchronous training over replica groups (`[fault_tolerance] semi_sync_method`): each
//! replica trains alone with its own AdamW, and every `sync_steps` steps the replicas meet.
//!
//! - `local_sgd`: the weights become their mean over the live replicas.
//! - `diloco` (Douillard et al., 2023): the replicas' pseudo-gradient `Δ = mean_r(θ_g − θ_r)`
//!   (θ_g the weights all replicas had after the last sync) drives an outer Nesterov SGD,
//!   PyTorch's `SGD(lr, momentum, nesterov=True)`: `m ← μ·m + Δ` (`m = Δ` at the first sync),
//!   `θ_g ← θ_g − lr·(Δ + μ·m)`; every replica then continues from θ_g. The inner optimizer's
//!   moments stay each replica's own.
//!
//! Only replicas at the quorum's step contribute (a replica behind it adds zeros and is not
//! counted, then takes the result from an up-to-date one, `replicas`). A sync whose average fails
//! (a replica lost) is skipped: every replica keeps its local weights and tries again at the next
//! sync. The outer state (θ_g and the momentum) lives on the host, in f32, one vector per tensor.

use anyhow::{bail, Result};

use crate::backend::Backend;
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::config::FaultToleranceConfig;
use crate::model::ParamSet;

/// Which semi-synchronous method.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SemiSyncMethod {
    LocalSgd,
    DiLoCo { outer_lr: f32, outer_momentum: f32 },
}

/// The replicas' shared state between syncs.
pub struct SemiSync {
    pub method: SemiSyncMethod,
    pub sync_steps: u64,
    /// θ_g per weight tensor (empty until the first sync takes this rank's weights).
    pub global: Vec<Vec<f32>>,
    /// DiLoCo's outer momentum per tensor (empty before the first sync).
    pub momentum: Vec<Vec<f32>>,
    /// Syncs done by this process (the initial meeting is number 0).
    syncs: u64,
    /// `TITAN_SEMI_SYNC_DUMP=DIR` (a test's drill): each sync writes θ_g before, this rank's
    /// weights before and θ_g after as little-endian f32 files `sync{N}-{label}-{what}.f32`.
    dump: Option<(std::path::PathBuf, String)>,
}

impl SemiSync {
    /// From `[fault_tolerance]`; None without `semi_sync_method`.
    pub fn from_config(ft: &FaultToleranceConfig) -> Result<Option<Self>> {
        let method = match ft.semi_sync_method.as_deref() {
            None => return Ok(None),
            Some("local_sgd") => SemiSyncMethod::LocalSgd,
            Some("diloco") => SemiSyncMethod::DiLoCo {
                outer_lr: ft.outer_lr,
                outer_momentum: ft.outer_momentum,
            },
            Some(other) => bail!("[fault_tolerance] semi_sync_method = \"{other}\" is not known (accepted: \"diloco\", \"local_sgd\")"),
        };
        Ok(Some(SemiSync {
            method,
            sync_steps: ft.sync_steps,
            global: Vec::new(),
            momentum: Vec::new(),
            syncs: 0,
            dump: None,
        }))
    }

    /// Dumps every sync under `TITAN_SEMI_SYNC_DUMP`, the files labelled `label`.
    pub fn dumping_as(mut self, label: String) -> Self {
        self.dump = std::env::var_os("TITAN_SEMI_SYNC_DUMP").map(|d| (d.into(), label));
        self
    }

    fn write_dump(&self, what: &str, tensors: &[Vec<f32>]) -> Result<()> {
        let Some((dir, label)) = &self.dump else {
            return Ok(());
        };
        let bytes: Vec<u8> = tensors
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let path = dir.join(format!("sync{}-{label}-{what}.f32", self.syncs));
        std::fs::write(&path, bytes).map_err(|e| {
            anyhow::anyhow!("TITAN_SEMI_SYNC_DUMP: cannot write {}: {e}", path.display())
        })
    }

    /// Whether step `step` ends with a sync.
    pub fn syncs_after(&self, step: u64) -> bool {
        step.is_multiple_of(self.sync_steps)
    }

    /// Takes `weights` as θ_g when there is none yet (the run's first sync point).
    fn ensure_global<B: Backend>(&mut self, be: &B, weights: &ParamSet<B>) {
        if self.global.is_empty() {
            self.global = weights.bufs.iter().map(|b| be.download(b)).collect();
        }
    }

    /// One sync over `group` (None: this replica alone), contributing this rank's weights when
    /// `contributes`; the weights are then the synced ones. False when the average failed.
    pub fn sync<B: Backend>(
        &mut self,
        be: &B,
        weights: &mut ParamSet<B>,
        group: Option<&dyn ProcessGroup>,
        contributes: bool,
    ) -> Result<bool> {
        self.ensure_global(be, weights);
        if self.dump.is_some() {
            let local: Vec<Vec<f32>> = weights.bufs.iter().map(|b| be.download(b)).collect();
            self.write_dump("global_before", &self.global)?;
            self.write_dump("local", &local)?;
        }
        // Σ over contributors of θ_g − θ_r, and their count, in one all-reduce.
        let mut packed: Vec<f32> = Vec::new();
        for (g, b) in self.global.iter().zip(&weights.bufs) {
            match contributes {
                true => packed.extend(g.iter().zip(be.download(b)).map(|(g, l)| g - l)),
                false => packed.extend(std::iter::repeat_n(0.0, g.len())),
            }
        }
        packed.push(if contributes { 1.0 } else { 0.0 });
        if let Some(group) = group {
            if let Err(e) = group.all_reduce(&mut packed, ReduceOp::Sum) {
                errln!("[fault_tolerance] the {:?} sync failed ({e:#}); every replica keeps its weights until the next", self.method);
                return Ok(false);
            }
        }
        let count = packed.pop().unwrap_or(0.0).max(1.0);
        packed.iter_mut().for_each(|d| *d /= count);
        self.outer_step(&packed);
        for (b, g) in weights.bufs.iter_mut().zip(&self.global) {
            *b = be.upload(g);
        }
        self.write_dump("global_after", &self.global)?;
        self.syncs += 1;
        Ok(true)
    }

    /// θ_g from the averaged pseudo-gradient `delta` (all tensors, concatenated).
    fn outer_step(&mut self, delta: &[f32]) {
        let first = self.momentum.is_empty();
        if first {
            self.momentum = self.global.iter().map(|g| vec![0.0; g.len()]).collect();
        }
        let mut at = 0;
        for (g, m) in self.global.iter_mut().zip(self.momentum.iter_mut()) {
            let d = &delta[at..at + g.len()];
            at += g.len();
            match self.method {
                SemiSyncMethod::LocalSgd => {
                    g.iter_mut().zip(d).for_each(|(g, d)| *g -= d);
                }
                SemiSyncMethod::DiLoCo {
                    outer_lr,
                    outer_momentum,
                } => {
                    for ((g, m), &d) in g.iter_mut().zip(m.iter_mut()).zip(d) {
                        *m = if first { d } else { outer_momentum * *m + d };
                        *g -= outer_lr * (d + outer_momentum * *m);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diloco_is_nesterov_sgd_on_the_pseudo_gradient_and_local_sgd_the_mean() {
        let mut s = SemiSync {
            method: SemiSyncMethod::DiLoCo {
                outer_lr: 0.5,
                outer_momentum: 0.9,
            },
            sync_steps: 5,
            global: vec![vec![1.0, 2.0]],
            momentum: Vec::new(),
            syncs: 0,
            dump: None,
        };
        s.outer_step(&[0.2, -0.4]);
        // m = Δ; θ = θ − 0.5·(Δ + 0.9·Δ).
        assert_eq!(
            s.global[0],
            vec![1.0 - 0.5 * 1.9 * 0.2, 2.0 + 0.5 * 1.9 * 0.4]
        );
        let before = s.global[0].clone();
        s.outer_step(&[0.1, 0.0]);
        let m = [0.9 * 0.2 + 0.1, 0.9 * -0.4];
        let want = [
            before[0] - 0.5 * (0.1 + 0.9 * m[0]),
            before[1] - 0.5 * (0.9 * m[1]),
        ];
        assert!(s.global[0]
            .iter()
            .zip(want)
            .all(|(a, b)| (a - b).abs() < 1e-6));
        let mut local = SemiSync {
            method: SemiSyncMethod::LocalSgd,
            global: vec![vec![1.0]],
            momentum: Vec::new(),
            ..s
        };
        local.outer_step(&[0.25]);
        assert_eq!(local.global[0], vec![0.75]);
    }
}
