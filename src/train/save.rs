//! Who writes a step's checkpoint, for every layout, in the one layout-free format family:
//! - ranks that hold different parts of the state (FSDP shards, tensor-parallel parts, pipeline
//!   stages, or several) write their own parts together, as a sharded checkpoint
//!   (`checkpoint::sharded`), over their writers group (`Distributed::writers`): each pipeline
//!   stage writes its own tensors; HSDP and DDP replicas hold the same parts, and replica 0's
//!   ranks write them;
//! - otherwise (one process, or DDP alone) every rank holds the whole state and rank 0 writes it
//!   as one checkpoint.
//!
//! With `[checkpoint] async_mode = "async"` both finish in the background (`checkpoint::writer`):
//! the training thread only stages the state in memory, one save in flight per rank. Without it,
//! every rank waits until rank 0 has completed the checkpoint (`Distributed::checkpoint_saved`).
//!
//! A save that fails leaves no temporary folder (`checkpoint::atomic`) and its error names the
//! last complete checkpoint, the one a restart resumes from; the run stops with it, or with
//! `[checkpoint] on_save_failure = "warn"` warns and trains on (all ranks agree through rank 0
//! first; an asynchronous save's failure is met at the next save, `AsyncWriter::wait`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::optimizer::Optimizer;
use crate::backend::Backend;
use crate::checkpoint::{self, writer::AsyncWriter, TrainState};
use crate::config::Config;
use crate::launch::Distributed;
use crate::parallel::layout::{ParamState, RankLayout};

/// Saves `state` with this rank's weights and moments (every rank of the job calls this
/// together). Returns the folder written, on the rank that completed it.
pub fn save_checkpoint<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&Distributed>,
    layout: &RankLayout<B>,
    opt: &Optimizer<B>,
    writer: &mut AsyncWriter,
    state: TrainState,
) -> Result<Option<PathBuf>> {
    let step = state.step;
    let written = write_checkpoint(be, cfg, dist, (layout, opt), writer, state);
    let Some(d) = dist else {
        return written;
    };
    // Every rank learns rank 0's outcome, which covers every writer's (a writer that failed
    // reported it to rank 0's collect); a rank's own failure stands beside it. So every rank
    // fails a save together, and `[checkpoint] on_save_failure` stops or warns on all of them.
    let told = written.as_ref().map(|_| ()).map_err(|e| format!("{e:#}"));
    let agreed = d.checkpoint_saved(step, if d.rank == 0 { told } else { Ok(()) });
    written.and_then(|w| agreed.map(|()| w))
}

/// This rank's part of the save of `state`: what it writes (or stages for its writer thread).
fn write_checkpoint<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&Distributed>,
    (layout, opt): (&RankLayout<B>, &Optimizer<B>),
    writer: &mut AsyncWriter,
    state: TrainState,
) -> Result<Option<PathBuf>> {
    let folder = cfg.checkpoint_folder();
    let keep = cfg.checkpoint.keep_latest_k;
    let step = state.step;
    let rank = dist.map_or(0, |d| d.rank);
    let writers = dist.and_then(|d| d.groups.writers.as_ref().map(|w| (d, w)));
    let written = match (&layout.state, writers) {
        (param_state, Some((d, writers))) => {
            // FSDP (maybe with TP or PP): replica 0's shards. TP or PP without FSDP:
            // data-parallel rank 0's parts (a pipeline group shares that coordinate).
            let (parts, writes) = match param_state {
                ParamState::Sharded(s) => (
                    &s.fsdp.shards,
                    d.groups.replicate.as_ref().is_none_or(|r| r.rank() == 0),
                ),
                ParamState::Whole(w) => (&w.params, d.groups.dp.rank() == 0),
            };
            let asynchronous = cfg.checkpoint.async_mode == "async";
            // One save in flight: this rank's previous one is done before the next stages.
            let previous = match asynchronous {
                true => writer.wait()?,
                false => None,
            };
            if writes {
                let staged = SavedParts {
                    weights: parts,
                    opt,
                    folder: &folder,
                    keep,
                };
                let snapshot = stage_parts(be, d, writers.as_ref(), layout, staged, state)?;
                let exchange = d
                    .file_exchange()?
                    .expect("a rank with a writers group has a file exchange");
                let on_failure = folder.clone();
                let write = move || {
                    snapshot
                        .write(&exchange)
                        .with_context(|| checkpoint::atomic::save_failed(&on_failure, step))
                };
                match asynchronous {
                    true => {
                        writer.start_job(step, write)?;
                        previous
                    }
                    false => write()?,
                }
            } else {
                previous
            }
        }
        (ParamState::Whole(w), None) if rank == 0 => {
            let params = &w.params;
            if cfg.checkpoint.async_mode == "async" {
                // Returns the previous save, which this one waited for.
                let snapshot = opt.with_f32_state(be, |exp_avg, exp_avg_sq| {
                    checkpoint::Snapshot::take(be, params, exp_avg, exp_avg_sq)
                })?;
                writer.start(snapshot, &folder, state, keep)?
            } else {
                Some(opt.with_f32_state(be, |exp_avg, exp_avg_sq| {
                    checkpoint::save(be, &folder, params, exp_avg, exp_avg_sq, state, keep)
                })?)
            }
        }
        _ => None,
    };
    Ok(written)
}

/// What a writer saves: its weights (FSDP shards, or tensor-parallel parts whole; under a
/// pipeline only its stages' tensors) and AdamW moments, into `folder`, keeping the latest `keep`.
struct SavedParts<'a, B: Backend> {
    weights: &'a crate::model::ParamSet<B>,
    opt: &'a Optimizer<B>,
    folder: &'a Path,
    keep: usize,
}

/// This rank's part of a sharded checkpoint written by `writers`, staged in memory (a collective
/// of the writers).
fn stage_parts<B: Backend>(
    be: &B,
    d: &Distributed,
    writers: &dyn crate::comm::group::ProcessGroup,
    layout: &RankLayout<B>,
    parts: SavedParts<'_, B>,
    state: TrainState,
) -> Result<checkpoint::sharded::ShardedSnapshot> {
    let step = state.step;
    let shapes: Vec<Vec<usize>> = crate::model::params::param_specs(&layout.model.args)
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    let part_of = |name: &str| layout.pipeline.as_ref().map_or(0, |p| p.holder(name));
    let held_by = |name: &str, r: usize| {
        layout
            .pipeline
            .as_ref()
            .is_some_and(|p| p.holds_on(r, name))
    };
    let pipeline = layout
        .pipeline
        .as_ref()
        .map(|p| checkpoint::sharded::PipelineParts {
            parts: p.group().size(),
            part_of: &part_of,
            held_by: &held_by,
        });
    parts
        .opt
        .with_f32_state(be, |exp_avg, exp_avg_sq| {
            checkpoint::sharded::stage(
                be,
                writers,
                layout.model.local.tp,
                &d.mesh,
                parts.folder,
                parts.weights,
                exp_avg,
                exp_avg_sq,
                &shapes,
                pipeline.as_ref(),
                checkpoint::sharded::ExpertParts::of_shapes(&layout.model.local),
                state,
                parts.keep,
            )
        })
        .with_context(|| checkpoint::atomic::save_failed(parts.folder, step))
}
