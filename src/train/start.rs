//! Where a run starts from: the weights, gradients and AdamW moments, freshly initialised or read
//! from the latest (or the chosen) checkpoint, laid out for the run: whole on every rank, or with
//! FSDP as this rank's shards only (the full values are cut one tensor at a time on the host, so
//! no full tensor ever reaches the device).

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};

use super::optimizer::AdamW;
use crate::backend::Backend;
use crate::checkpoint::{self, HostCheckpoint, TrainState, WriterPlace};
use crate::comm::queue::CollectiveQueue;
use crate::config::Config;
use crate::launch::Distributed;
use crate::model::params::TpSharding;
use crate::model::{init_params, Llama, ParamDtype, ParamSet};
use crate::parallel::fsdp::{ExpertShards, Fsdp, ReshardPolicy, StartValues};

/// The state a run starts from.
pub struct StartState<B: Backend> {
    /// Full weights; with FSDP an unallocated working set (the shards live in `fsdp`).
    pub params: ParamSet<B>,
    /// Full gradients; with FSDP an unallocated working set.
    pub grads: ParamSet<B>,
    pub opt: AdamW<B>,
    pub fsdp: Option<Fsdp<B>>,
    /// Set when the run resumes from a checkpoint.
    pub resumed: Option<Resumed>,
}

/// Another model a run starts from (`[checkpoint] initial_load_path`).
enum Initial {
    /// A titan checkpoint, and whether to take its AdamW moments too.
    Titan {
        ckpt: Box<HostCheckpoint>,
        moments: bool,
    },
    /// A Hugging Face folder's weights, in titan's names and layout.
    Hf(Vec<Vec<f32>>),
}

impl Initial {
    fn open(cfg: &Config, args: &crate::model::ModelArgs) -> Result<Self> {
        let c = &cfg.checkpoint;
        let path = std::path::Path::new(&c.initial_load_path);
        let what =
            |e: anyhow::Error| anyhow!("[checkpoint] initial_load_path {}: {e:#}", path.display());
        if c.initial_load_in_hf {
            let (theirs, weights) = checkpoint::hf::read_hf(path).map_err(what)?;
            if !theirs.same_model(args) {
                bail!("[checkpoint] initial_load_path {}: the Hugging Face model ({theirs:?}) is not the one this job configures ({args:?}); set [model] to its shapes", path.display());
            }
            return Ok(Initial::Hf(weights.bufs));
        }
        let dir = checkpoint::resolve_checkpoint_dir(path).map_err(what)?;
        Ok(Initial::Titan {
            ckpt: Box::new(HostCheckpoint::read(&dir, args).map_err(what)?),
            moments: !c.initial_load_model_only,
        })
    }

    /// Whole values of tensor `i` (`name`, `shape`), or of one of its moments: None where the
    /// initial model does not give them (moments of a model-only start).
    fn values(
        &self,
        moment: Option<&str>,
        i: usize,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        match (self, moment) {
            (Initial::Titan { ckpt, .. }, None) => ckpt.values(None, name, shape).map(Some),
            (
                Initial::Titan {
                    ckpt,
                    moments: true,
                },
                m,
            ) => ckpt.values(m, name, shape).map(Some),
            (Initial::Hf(weights), None) => Ok(Some(weights[i].clone())),
            _ => Ok(None),
        }
    }
}

/// The checkpoint a run resumed from.
pub struct Resumed {
    pub state: TrainState,
    /// The step in the folder's name, and the folder.
    pub folder_step: u64,
    pub dir: PathBuf,
}

/// Builds the starting state of `model` for this rank, in the job `dist` (one process: None);
/// `fsdp` says whether it shards with FSDP (its collectives through `queue` when given, see
/// `Fsdp::new`).
#[allow(clippy::too_many_arguments)]
pub fn start_state<B: Backend>(
    be: &B,
    cfg: &Config,
    model: &Llama<B>,
    dist: Option<&Distributed>,
    fsdp: bool,
    queue: Option<Box<dyn CollectiveQueue<B>>>,
    experts: Option<ExpertShards<B>>,
    reshard: ReshardPolicy,
    param_dtype: ParamDtype,
    held: Option<&(dyn Fn(&str) -> bool + Sync)>,
    holder: Option<&(dyn Fn(&str) -> usize + Sync)>,
) -> Result<StartState<B>> {
    let args = &model.args;
    let seed = cfg.training.seed;
    // Checkpoints and initial values are of whole tensors (`global`); this rank holds its
    // tensor-parallel part of each (`specs`).
    let global = crate::model::params::param_specs(args);
    let specs = model.param_specs();
    let (tp, tp_rank) = (model.local.tp, model.local.tp_rank);
    let tp_part = |i: usize, values: Vec<f32>| -> Vec<f32> {
        if tp == 1 {
            return values;
        }
        let (name, shape) = &global[i];
        TpSharding::of(name).cut(&values, shape, tp, tp_rank)
    };
    let ckpt_folder = cfg.checkpoint_folder();
    let resume_dir = if cfg.checkpoint.enable {
        let steps = checkpoint::list_steps(&ckpt_folder)?;
        let pick = if cfg.checkpoint.load_step >= 0 {
            let s = cfg.checkpoint.load_step as u64;
            if !steps.contains(&s) {
                bail!("[checkpoint] load_step = {s}: no complete checkpoint step-{s} in {} (found: {steps:?})", ckpt_folder.display());
            }
            Some(s)
        } else {
            steps.last().copied()
        };
        pick.map(|s| (s, checkpoint::step_dir(&ckpt_folder, s)))
    } else {
        None
    };
    let cannot_resume = |e: anyhow::Error| {
        anyhow!("cannot resume: {e}\n(remove the bad checkpoint folder or choose another with --checkpoint.load_step N)")
    };
    // A rank of the layout that wrote a sharded checkpoint (FSDP, TP or both) holds its own files
    // only: its shards, or its tensor-parallel parts, as they were saved.
    let writer = dist
        .and_then(|d| d.writers.as_ref().map(|w| (d, w)))
        .map(|(d, w)| WriterPlace {
            rank: w.rank(),
            size: w.size(),
            tp,
            pp: d.mesh.degree("pp"),
            experts: checkpoint::sharded::ExpertParts::of_shapes(&model.local),
        });
    // A pipeline rank holds (and reads) only its stages' tensors, an expert-parallel rank only its
    // experts.
    let here = |i: usize| held.is_none_or(|h| h(&global[i].0)) && model.local.holds(&global[i].0);
    let ckpt = match (&resume_dir, writer) {
        (Some((_, dir)), Some(w)) => Some(HostCheckpoint::read_for_writer(dir, args, w)),
        (Some((_, dir)), None) => Some(HostCheckpoint::read(dir, args)),
        (None, _) => None,
    }
    .transpose()
    .map_err(cannot_resume)?;
    // A pipeline rank whose stages hold other tensors than when the checkpoint was written
    // merges it instead of reading its own files.
    let ckpt = match (ckpt, holder, &resume_dir) {
        (Some(c), Some(h), Some((_, dir))) if !c.same_stages(h) => {
            Some(HostCheckpoint::read(dir, args).map_err(cannot_resume)?)
        }
        (c, _, _) => c,
    };
    // No checkpoint of its own: the run may start from another model's weights.
    let initial = match &ckpt {
        None if !cfg.checkpoint.initial_load_path.is_empty() => Some(Initial::open(cfg, args)?),
        _ => None,
    };
    // Whole values of tensor `i` (or, with `moment`, of an AdamW moment) a run starts from without
    // a checkpoint of its own: the initial model's, else a fresh initialisation (moments zero).
    let fresh = |moment: Option<&str>, i: usize| -> Result<Vec<f32>> {
        let (name, shape) = &global[i];
        let numel = shape.iter().product();
        if let Some(from) = initial.as_ref().map(|x| x.values(moment, i, name, shape)) {
            if let Some(values) = from? {
                return Ok(values);
            }
        }
        Ok(match moment {
            None => crate::model::init::init_param(args, name, numel, seed),
            Some(_) => vec![0.0; numel],
        })
    };
    let (params, grads, opt, fsdp_state);
    if let Some(d) = dist.filter(|_| fsdp) {
        let shard = d.shard.clone().expect("FSDP mode has a shard group");
        // A pipeline rank shards only its stages' tensors; the others are empty here.
        let fsdp_specs: Vec<(String, Vec<usize>)> = specs
            .iter()
            .enumerate()
            .map(|(i, (n, s))| (n.clone(), if here(i) { s.clone() } else { vec![0] }))
            .collect();
        let start_values = |moment: Option<&str>, i: usize| -> Result<StartValues> {
            let (name, shape) = &global[i];
            if !here(i) {
                return Ok(StartValues::Full(Vec::new()));
            }
            match (&ckpt, moment) {
                (Some(ckpt), _) => {
                    let own = ckpt
                        .own_shard(moment, name, &specs[i].1)
                        .map_err(cannot_resume)?;
                    match own {
                        Some(shard) => Ok(StartValues::Shard(shard)),
                        None => ckpt
                            .values(moment, name, shape)
                            .map(|v| StartValues::Full(tp_part(i, v)))
                            .map_err(cannot_resume),
                    }
                }
                (None, _) => Ok(StartValues::Full(tp_part(i, fresh(moment, i)?))),
            }
        };
        let f = Fsdp::new(
            be,
            shard,
            d.replicate.clone(),
            queue,
            experts,
            model,
            &fsdp_specs,
            &|i| start_values(None, i),
            reshard,
            param_dtype,
        )?;
        opt = AdamW {
            exp_avg: f.shard_from(be, &|i| start_values(Some("exp_avg."), i))?,
            exp_avg_sq: f.shard_from(be, &|i| start_values(Some("exp_avg_sq."), i))?,
            cfg: cfg.optimizer.clone(),
        };
        params = ParamSet::unallocated(be, &specs);
        grads = ParamSet::unallocated(be, &specs);
        fsdp_state = Some(f);
    } else {
        let mut p = ParamSet::zeros(be, &specs);
        let mut o = AdamW::new(be, &specs, cfg.optimizer.clone());
        match &ckpt {
            Some(ckpt) => {
                for (set, moment) in [
                    (&mut p, None),
                    (&mut o.exp_avg, Some("exp_avg.")),
                    (&mut o.exp_avg_sq, Some("exp_avg_sq.")),
                ] {
                    for (i, (name, shape)) in global.iter().enumerate().filter(|(i, _)| here(*i)) {
                        let own = ckpt
                            .own_shard(moment, name, &specs[i].1)
                            .map_err(cannot_resume)?;
                        let values = match own {
                            Some(part) => part,
                            None => {
                                tp_part(i, ckpt.values(moment, name, shape).map_err(cannot_resume)?)
                            }
                        };
                        set.bufs[i] = be.upload(&values);
                    }
                }
            }
            None if tp == 1 && initial.is_none() => p = init_params(be, args, seed),
            None => {
                for (set, moment) in [
                    (&mut p, None),
                    (&mut o.exp_avg, Some("exp_avg.")),
                    (&mut o.exp_avg_sq, Some("exp_avg_sq.")),
                ] {
                    if moment.is_some() && initial.is_none() {
                        continue; // AdamW::new's zeros
                    }
                    for i in 0..global.len() {
                        set.bufs[i] = be.upload(&tp_part(i, fresh(moment, i)?));
                    }
                }
            }
        }
        params = p;
        grads = ParamSet::zeros(be, &specs);
        opt = o;
        fsdp_state = None;
    }
    let resumed = match (ckpt, resume_dir) {
        (Some(ckpt), Some((folder_step, dir))) => Some(Resumed {
            state: ckpt.state,
            folder_step,
            dir,
        }),
        _ => None,
    };
    Ok(StartState {
        params,
        grads,
        opt,
        fsdp: fsdp_state,
        resumed,
    })
}
