//! Which checkpoint a run resumes from, chosen once for the whole job:
//! - rank 0 (`choose`) removes what interrupted saves left (`atomic::remove_stale`), then takes
//!   `[checkpoint] load_step` or else the latest complete checkpoint that verifies (`state.json`'s
//!   SHA-256, model arguments and shard index, every file's size and CRC32, read in pieces). When
//!   the latest cannot be read it falls back to the previous complete one with a warning, so a
//!   restart loop (`--max-restarts`) cannot stall on a bad checkpoint; when none can be read it is
//!   an error, never a silent fresh start;
//! - every rank then learns rank 0's choice and checks that it has that step (`agree`): a rank
//!   that lacks it (a checkpoint folder not shared by every rank) fails the job on every rank with
//!   an error naming it, instead of ranks resuming from different steps.

use std::path::Path;

use anyhow::{anyhow, bail, Result};

use super::{atomic, list_steps, read_state, read_state_file, step_dir};
use crate::comm::group::ProcessGroup;

/// Rank 0's choice of the step to resume from in `folder` (`load_step`: the one asked for, which
/// must verify); None when there is no complete checkpoint.
pub fn choose(folder: &Path, load_step: Option<u64>) -> Result<Option<u64>> {
    atomic::remove_stale(folder)?;
    let steps = list_steps(folder)?;
    if let Some(s) = load_step {
        if !steps.contains(&s) {
            bail!(
                "[checkpoint] load_step = {s}: no complete checkpoint step-{s} in {} (found: {steps:?})",
                folder.display()
            );
        }
        read_state(&step_dir(folder, s))?;
        return Ok(Some(s));
    }
    let mut failed: Vec<(u64, anyhow::Error)> = Vec::new();
    for &s in steps.iter().rev() {
        match read_state(&step_dir(folder, s)) {
            Ok(_) => {
                for (bad, e) in &failed {
                    eprintln!(
                        "warning: checkpoint step-{bad} cannot be read ({e:#}); resuming from step-{s}, the latest complete checkpoint before it"
                    );
                }
                return Ok(Some(s));
            }
            Err(e) => failed.push((s, e)),
        }
    }
    match failed.into_iter().next() {
        None => Ok(None),
        Some((s, e)) if steps.len() == 1 => Err(e.context(format!("checkpoint step-{s}"))),
        Some((s, e)) => Err(e.context(format!(
            "checkpoint step-{s} cannot be read, nor any earlier one"
        ))),
    }
}

/// Every rank of `group` (the whole job) takes rank 0's `chosen` step (what other ranks pass is
/// ignored) and checks that it has it: its `state.json` verifies in `folder`. Collective.
pub fn agree(
    group: &dyn ProcessGroup,
    folder: &Path,
    chosen: Result<Option<u64>>,
) -> Result<Option<u64>> {
    let rank = group.rank();
    // Status (0: no checkpoint, 1: a step, 2: rank 0 failed), then the step in 16-bit pieces
    // (exact in an f32).
    let mut msg = [0f32; 5];
    if rank == 0 {
        match &chosen {
            Ok(None) => {}
            Ok(Some(s)) => {
                msg[0] = 1.0;
                for (i, m) in msg[1..].iter_mut().enumerate() {
                    *m = ((s >> (16 * i)) & 0xffff) as f32;
                }
            }
            Err(_) => msg[0] = 2.0,
        }
    }
    group.broadcast(&mut msg, 0)?;
    let step = match msg[0] as u32 {
        0 => None,
        1 => Some((0..4).fold(0u64, |s, i| s | ((msg[1 + i] as u64) << (16 * i)))),
        _ if rank == 0 => return chosen,
        _ => bail!(
            "rank {rank}: rank 0 could not choose a checkpoint to resume from (its error says why)"
        ),
    };
    let mine = match step {
        Some(s) if rank != 0 => read_state_file(&step_dir(folder, s)).map(|_| ()),
        _ => Ok(()),
    };
    let mut all = vec![0f32; group.size()];
    group.all_gather(&[if mine.is_ok() { 1.0 } else { 0.0 }], &mut all)?;
    let missing: Vec<usize> = (0..all.len()).filter(|&r| all[r] == 0.0).collect();
    match (step, missing.is_empty()) {
        (Some(s), false) => Err(anyhow!(
            "rank {rank}: rank 0 chose to resume from step-{s} in {}, which rank(s) {missing:?} cannot read (is the checkpoint folder on storage every rank shares?){}",
            folder.display(),
            mine.err().map(|e| format!(": {e:#}")).unwrap_or_default()
        )),
        _ => Ok(step),
    }
}
