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
                    errln!(
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::{Arc, Barrier, Mutex};

    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::checkpoint::{save, TrainState, FORMAT_VERSION};
    use crate::comm::group::ReduceOp;
    use crate::model::{params::param_specs, ParamSet};

    /// Ranks as threads of one process: just the collectives `agree` uses.
    struct Threads {
        rank: usize,
        size: usize,
        shared: Arc<(Mutex<Vec<Vec<f32>>>, Barrier)>,
    }

    impl ProcessGroup for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.size
        }
        fn name(&self) -> &str {
            "threads"
        }
        fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
            let (slots, barrier) = &*self.shared;
            if self.rank == root {
                slots.lock().unwrap()[0] = buf.to_vec();
            }
            barrier.wait();
            buf.copy_from_slice(&slots.lock().unwrap()[0]);
            barrier.wait();
            Ok(())
        }
        fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
            let (slots, barrier) = &*self.shared;
            slots.lock().unwrap()[self.rank] = input.to_vec();
            barrier.wait();
            output.copy_from_slice(&slots.lock().unwrap().concat());
            barrier.wait();
            Ok(())
        }
        fn all_reduce(&self, _: &mut [f32], _: ReduceOp) -> Result<()> {
            bail!("not used")
        }
        fn reduce_scatter(&self, _: &[f32], _: &mut [f32], _: ReduceOp) -> Result<()> {
            bail!("not used")
        }
        fn send(&self, _: &[f32], _: usize) -> Result<()> {
            bail!("not used")
        }
        fn recv(&self, _: &mut [f32], _: usize) -> Result<()> {
            bail!("not used")
        }
        fn all_to_all(&self, _: &[f32], _: &[usize], _: &mut [f32], _: &[usize]) -> Result<()> {
            bail!("not used")
        }
        fn barrier(&self) -> Result<()> {
            self.shared.1.wait();
            Ok(())
        }
    }

    /// A checkpoint of a tiny model at `step` in `folder`.
    fn saved(folder: &Path, step: u64) {
        let mut args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) = (16, 1, 2, 2);
        (args.vocab_size, args.ffn_hidden) = (8, 8);
        let be = CpuBackend::new();
        let p = ParamSet::zeros(&be, &param_specs(&args));
        let state = TrainState {
            format_version: FORMAT_VERSION,
            step,
            model_args: args,
            seed: 0,
            data: Default::default(),
            tokenizer_path: String::new(),
            sharding: None,
            files: Default::default(),
            expert_bias: None,
            optimizer: None,
        };
        save(&be, folder, &p, &p, &p, state, 0).unwrap();
    }

    /// `agree` on two thread ranks, each seeing its own folder; rank 0 runs `choose`.
    fn agree_on(folders: [PathBuf; 2]) -> Vec<Result<Option<u64>>> {
        let shared = Arc::new((Mutex::new(vec![Vec::new(); 2]), Barrier::new(2)));
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (folder, shared) = (folders[rank].clone(), shared.clone());
                    s.spawn(move || {
                        let group = Threads {
                            rank,
                            size: 2,
                            shared,
                        };
                        let chosen = match rank {
                            0 => choose(&folder, None),
                            _ => Ok(None),
                        };
                        agree(&group, &folder, chosen)
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_takes_rank_0s_step_or_fails_naming_the_rank_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let (shared, empty) = (dir.path().join("shared"), dir.path().join("empty"));
        for r in agree_on([empty.clone(), empty.clone()]) {
            assert_eq!(r.unwrap(), None);
        }
        saved(&shared, 5);
        saved(&shared, 10);
        for r in agree_on([shared.clone(), shared.clone()]) {
            assert_eq!(r.unwrap(), Some(10));
        }
        // Rank 1 does not see rank 0's checkpoints: both stop, naming rank 1.
        let errors: Vec<String> = agree_on([shared.clone(), empty.clone()])
            .into_iter()
            .map(|r| format!("{:#}", r.unwrap_err()))
            .collect();
        for (rank, e) in errors.iter().enumerate() {
            assert!(
                e.starts_with(&format!("rank {rank}:"))
                    && e.contains("step-10")
                    && e.contains("rank(s) [1]"),
                "{e}"
            );
        }
        // Rank 0 cannot choose (its only checkpoint is corrupt): rank 1 stops too.
        std::fs::remove_dir_all(step_dir(&shared, 10)).unwrap();
        std::fs::write(step_dir(&shared, 5).join("model.safetensors"), b"x").unwrap();
        let r = agree_on([shared.clone(), shared.clone()]);
        let e0 = format!("{:#}", r[0].as_ref().unwrap_err());
        let e1 = format!("{:#}", r[1].as_ref().unwrap_err());
        assert!(
            e0.contains("model.safetensors") && e0.contains("truncated"),
            "{e0}"
        );
        assert!(e1.contains("rank 0 could not choose"), "{e1}");
    }
}
