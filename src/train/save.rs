//! Who writes a step's checkpoint, for every layout, in the one layout-free format family:
//! - ranks that hold different parts of the state (FSDP shards, tensor-parallel parts, or both)
//!   write their own parts together, as a sharded checkpoint (`checkpoint::sharded`), over their
//!   writers group (`Distributed::writers`); HSDP and DDP replicas hold the same parts, and
//!   replica 0's ranks write them;
//! - otherwise (one process, or DDP alone) every rank holds the whole state and rank 0 writes it
//!   as one checkpoint, in the background with `[checkpoint] async_mode = "async"`.
//!
//! Then every rank waits until rank 0 has finished (`Distributed::checkpoint_saved`).

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::optimizer::AdamW;
use crate::backend::Backend;
use crate::checkpoint::{self, writer::AsyncWriter, TrainState};
use crate::config::Config;
use crate::launch::Distributed;
use crate::parallel::plan::{ParamState, RankLayout};

/// Saves `state` with this rank's weights and moments (every rank of the job calls this
/// together). Returns the folder written, on the rank that completed it.
pub fn save_checkpoint<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&Distributed>,
    layout: &RankLayout<B>,
    opt: &AdamW<B>,
    writer: &mut AsyncWriter,
    state: TrainState,
) -> Result<Option<PathBuf>> {
    let folder = cfg.checkpoint_folder();
    let keep = cfg.checkpoint.keep_latest_k;
    let step = state.step;
    let rank = dist.map_or(0, |d| d.rank);
    let writers = dist.and_then(|d| d.writers.as_ref().map(|w| (d, w)));
    // Pipeline: every stage's tensors go to pipeline rank 0, which writes them as the same layout
    // without a pipeline would; the other pipeline ranks write nothing.
    // Only data-parallel rank 0's pipeline writes (its pipeline group shares that coordinate).
    let dp_first = dist.is_none_or(|d| d.dp.rank() == 0);
    let gathered = match (&layout.pipeline, &layout.state) {
        (Some(_), ParamState::Whole { .. }) if !dp_first => None,
        (Some(pipe), ParamState::Whole { params, .. }) => {
            Some(pipe.gather_to_first(be, &[params, &opt.exp_avg, &opt.exp_avg_sq])?)
        }
        // With FSDP each stage's shards are first made whole over the shard group, and global
        // rank 0 writes one whole checkpoint.
        (Some(pipe), ParamState::Sharded { fsdp, .. }) => {
            let shapes: Vec<Vec<usize>> = layout
                .model
                .param_specs()
                .into_iter()
                .map(|(_, s)| s)
                .collect();
            // Every rank of the shard group takes part in making the shards whole.
            let whole = [
                fsdp.whole(be, &fsdp.shards, &shapes)?,
                fsdp.whole(be, &opt.exp_avg, &shapes)?,
                fsdp.whole(be, &opt.exp_avg_sq, &shapes)?,
            ];
            if dp_first {
                Some(pipe.gather_to_first(be, &[&whole[0], &whole[1], &whole[2]])?)
            } else {
                None
            }
        }
        _ => None,
    };
    let whole_state = gathered.flatten().map(|mut sets| {
        let exp_avg_sq = sets.pop().expect("three sets");
        let exp_avg = sets.pop().expect("three sets");
        let params = sets.pop().expect("three sets");
        let moments = AdamW {
            exp_avg,
            exp_avg_sq,
            cfg: opt.cfg.clone(),
        };
        (params, moments)
    });
    let writes_here = layout
        .pipeline
        .as_ref()
        .is_none_or(|p| p.group().rank() == 0);
    let opt = whole_state.as_ref().map_or(opt, |w| &w.1);
    let whole_params = whole_state.as_ref().map(|w| &w.0);
    // One whole checkpoint by rank 0, in the background with `async_mode = "async"`.
    let mut write_whole = |params: &crate::model::ParamSet<B>,
                           state: TrainState|
     -> Result<Option<PathBuf>> {
        if cfg.checkpoint.async_mode == "async" {
            // Returns the previous save, which this one waited for.
            let snapshot = checkpoint::Snapshot::take(be, params, &opt.exp_avg, &opt.exp_avg_sq)?;
            writer.start(snapshot, &folder, state, keep)
        } else {
            let dir = checkpoint::save(
                be,
                &folder,
                params,
                &opt.exp_avg,
                &opt.exp_avg_sq,
                state,
                keep,
            )?;
            Ok(Some(dir))
        }
    };
    let written = match (&layout.state, writers) {
        _ if !writes_here => None,
        // PP × FSDP: the stages' whole tensors, gathered above, written by rank 0; with TP each
        // is a tensor-parallel part, which the TP group of data-parallel rank 0 writes, as TP
        // alone would.
        (ParamState::Sharded { .. }, _) if layout.pipeline.is_some() => {
            match (
                whole_params,
                dist.and_then(|d| d.tp.as_ref().map(|tp| (d, tp))),
            ) {
                (Some(params), Some((d, tp))) if d.dp.rank() == 0 => save_parts(
                    be,
                    d,
                    tp.as_ref(),
                    layout,
                    params,
                    opt,
                    &folder,
                    state,
                    keep,
                    &|| tp.barrier(),
                )?,
                (Some(params), None) if rank == 0 => write_whole(params, state)?,
                _ => None,
            }
        }
        (param_state, Some((d, writers))) => {
            // FSDP (maybe with TP): replica 0's shards. TP alone: data-parallel rank 0's parts.
            let (parts, writes) = match param_state {
                ParamState::Sharded { fsdp, .. } => (
                    &fsdp.shards,
                    d.replicate.as_ref().is_none_or(|r| r.rank() == 0),
                ),
                ParamState::Whole { params, .. } => {
                    (whole_params.unwrap_or(params), d.dp.rank() == 0)
                }
            };
            if writes {
                save_parts(
                    be,
                    d,
                    writers.as_ref(),
                    layout,
                    parts,
                    opt,
                    &folder,
                    state,
                    keep,
                    &|| d.checkpoint_written(step),
                )?
            } else {
                None
            }
        }
        (ParamState::Whole { params, .. }, None) if rank == 0 => {
            write_whole(whole_params.unwrap_or(params), state)?
        }
        _ => None,
    };
    if let Some(d) = dist {
        d.checkpoint_saved(step)?;
    }
    Ok(written)
}

/// This rank's parts (`weights`: FSDP shards, or tensor-parallel parts whole) as its files of a
/// sharded checkpoint written by `writers`; `all_written` returns once every writer has written
/// its files.
#[allow(clippy::too_many_arguments)]
fn save_parts<B: Backend>(
    be: &B,
    d: &Distributed,
    writers: &dyn crate::comm::group::ProcessGroup,
    layout: &RankLayout<B>,
    weights: &crate::model::ParamSet<B>,
    opt: &AdamW<B>,
    folder: &Path,
    state: TrainState,
    keep: usize,
    all_written: &dyn Fn() -> Result<()>,
) -> Result<Option<PathBuf>> {
    let shapes: Vec<Vec<usize>> = crate::model::params::param_specs(&layout.model.args)
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    checkpoint::sharded::save(
        be,
        writers,
        layout.model.local.tp,
        &d.mesh,
        folder,
        weights,
        &opt.exp_avg,
        &opt.exp_avg_sq,
        &shapes,
        state,
        keep,
        all_written,
    )
}
