//! `[fault_tolerance]`: replica-group fault tolerance (TorchTitan's names, torchft's behaviour):
//! this job is replica group `replica_id` of `group_size`, which agree on a quorum each step
//! through the lighthouse (`titan lighthouse`) and average their gradients over the live ones;
//! with its checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultToleranceConfig {
    pub enable: bool,
    /// This job's replica group, `0 .. group_size`.
    pub replica_id: usize,
    /// Replica groups in all (each reads its own share of the data).
    pub group_size: usize,
    /// The fewest live replica groups a step proceeds with (it waits for more otherwise).
    pub min_replica_size: usize,
    /// The lighthouse's `host:port` (`titan lighthouse --port P`); empty: `TORCHFT_LIGHTHOUSE`.
    pub lighthouse: String,
    /// Every cross-replica collective: a replica silent this long is dead.
    pub process_group_timeout_ms: u64,
    /// How long a step waits for the lighthouse's quorum (enough live replica groups) before the
    /// job fails (torchft's `quorum_timeout`).
    pub quorum_timeout_seconds: u64,
    /// Semi-synchronous training: `diloco` or `local_sgd` (absent: gradients averaged every step).
    pub semi_sync_method: Option<String>,
    /// Steps between the semi-synchronous syncs.
    pub sync_steps: u64,
    /// DiLoCo's outer Nesterov SGD: learning rate and momentum (the paper's 0.7 and 0.9).
    pub outer_lr: f32,
    pub outer_momentum: f32,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        FaultToleranceConfig {
            enable: false,
            replica_id: 0,
            group_size: 1,
            min_replica_size: 1,
            lighthouse: String::new(),
            process_group_timeout_ms: 10_000,
            quorum_timeout_seconds: 60,
            semi_sync_method: None,
            sync_steps: 5,
            outer_lr: 0.7,
            outer_momentum: 0.9,
        }
    }
}

impl FaultToleranceConfig {
    /// The lighthouse's address: the key, else torchft's `TORCHFT_LIGHTHOUSE` (as `host:port` or
    /// `http://host:port`).
    pub fn lighthouse_addr(&self) -> Result<String> {
        let addr = match self.lighthouse.is_empty() {
            false => self.lighthouse.clone(),
            true => std::env::var("TORCHFT_LIGHTHOUSE").unwrap_or_default(),
        };
        let addr = addr.trim_start_matches("http://").to_string();
        if addr.is_empty() {
            bail!("[fault_tolerance] enable = true needs lighthouse = \"host:port\" (or TORCHFT_LIGHTHOUSE): start one with `titan lighthouse --port P --min-replicas N`");
        }
        Ok(addr)
    }
}

impl Config {
    pub(super) fn validate_fault_tolerance(&self) -> Result<()> {
        let ft = &self.fault_tolerance;
        if !ft.enable {
            return Ok(());
        }
        if ft.group_size == 0 || ft.replica_id >= ft.group_size {
            bail!(
                "[fault_tolerance] replica_id = {} must be below group_size = {}",
                ft.replica_id,
                ft.group_size
            );
        }
        if ft.min_replica_size == 0 || ft.min_replica_size > ft.group_size {
            bail!(
                "[fault_tolerance] min_replica_size = {} must be between 1 and group_size = {}",
                ft.min_replica_size,
                ft.group_size
            );
        }
        if ft.process_group_timeout_ms == 0 || ft.quorum_timeout_seconds == 0 {
            bail!("[fault_tolerance] process_group_timeout_ms and quorum_timeout_seconds must be positive");
        }
        if let Some(m) = &ft.semi_sync_method {
            if m != "diloco" && m != "local_sgd" {
                bail!("[fault_tolerance] semi_sync_method = \"{m}\" is not known (accepted: \"diloco\", \"local_sgd\"; absent: gradients averaged every step)");
            }
            if ft.sync_steps == 0 {
                bail!("[fault_tolerance] sync_steps must be at least 1");
            }
            let (lr, mu) = (ft.outer_lr, ft.outer_momentum);
            if !(lr.is_finite() && lr > 0.0 && mu.is_finite() && (0.0..1.0).contains(&mu)) {
                bail!("[fault_tolerance] outer_lr = {lr} must be positive and outer_momentum = {mu} in [0, 1)");
            }
        }
        Ok(())
    }
}
