//! Where a run starts from: the weights, gradients and AdamW moments, freshly initialised or read
//! from the latest (or the chosen) checkpoint, laid out for the run: whole on every rank, or with
//! FSDP as this rank's shards only (the full values are cut one tensor at a time on the host, so
//! no full tensor ever reaches the device).

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};

use super::optimizer::{keeps_second_moment, Optimizer};
use crate::backend::Backend;
use crate::checkpoint::{self, HostCheckpoint, TrainState, WriterPlace};
use crate::config::Config;
use crate::launch::Distributed;
use crate::model::lora;
use crate::model::params::TpSharding;
use crate::model::{init_params, Decoder, ParamDtype, ParamSet, ReduceDtype};
use crate::parallel::fsdp::{ExpertShards, Fsdp, ReshardPolicy, StartValues};

/// The state a run starts from.
pub struct StartState<B: Backend> {
    /// Full weights; with FSDP an unallocated working set (the shards live in `fsdp`).
    pub params: ParamSet<B>,
    /// Full gradients; with FSDP an unallocated working set.
    pub grads: ParamSet<B>,
    pub opt: Optimizer<B>,
    pub fsdp: Option<Fsdp<B>>,
    /// Set when the run resumes from a checkpoint.
    pub resumed: Option<Resumed>,
    /// The expert bias of the model a fresh run starts from (`initial_load_path`: a Hugging Face
    /// DeepSeek-V3's routing bias), for the model to route with.
    pub initial_expert_bias: Option<Vec<Vec<f32>>>,
}

/// Another model a run starts from (`[checkpoint] initial_load_path`).
enum Initial {
    /// A titan checkpoint, and whether to take its AdamW moments too.
    Titan {
        ckpt: Box<HostCheckpoint>,
        moments: bool,
    },
    /// A Hugging Face folder's weights by titan's names, and its routing bias.
    Hf(
        std::collections::HashMap<String, Vec<f32>>,
        Option<Vec<Vec<f32>>>,
    ),
}

impl Initial {
    fn open(cfg: &Config, args: &crate::model::ModelArgs) -> Result<Self> {
        let c = &cfg.checkpoint;
        let path = std::path::Path::new(&c.initial_load_path);
        let what =
            |e: anyhow::Error| anyhow!("[checkpoint] initial_load_path {}: {e:#}", path.display());
        if c.initial_load_in_hf {
            let hf = checkpoint::hf::read_hf(path).map_err(what)?;
            let (theirs, weights) = (hf.args, hf.params);
            if !theirs.same_model(args) {
                bail!("[checkpoint] initial_load_path {}: the Hugging Face model ({theirs:?}) is not the one this job configures ({args:?}); set [model] to its shapes", path.display());
            }
            let by_name = weights.names.into_iter().zip(weights.bufs).collect();
            return Ok(Initial::Hf(by_name, hf.expert_bias));
        }
        let dir = checkpoint::resolve_checkpoint_dir(path).map_err(what)?;
        Ok(Initial::Titan {
            ckpt: Box::new(HostCheckpoint::read(&dir, args).map_err(what)?),
            moments: !c.initial_load_model_only,
        })
    }

    /// Whole values of tensor `name` (of `shape`), or of one of its moments: None where the
    /// initial model does not give them (moments of a model-only start; LoRA's adapters of a
    /// base model without them, which start fresh).
    fn values(
        &self,
        moment: Option<&str>,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        let has_adapters = match self {
            Initial::Titan { ckpt, .. } => ckpt.state.model_args.lora.is_some(),
            Initial::Hf(..) => false,
        };
        if lora::is_adapter(name) && !has_adapters {
            return Ok(None);
        }
        match (self, moment) {
            (Initial::Titan { ckpt, .. }, None) => ckpt.values(None, name, shape).map(Some),
            (
                Initial::Titan {
                    ckpt,
                    moments: true,
                },
                m,
            ) => ckpt.values(m, name, shape).map(Some),
            (Initial::Hf(weights, _), None) => match weights.get(name) {
                Some(w) => Ok(Some(w.clone())),
                None => bail!("the Hugging Face model has no tensor for {name} (a titan bug: the shapes agreed)"),
            },
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

/// What a rank's starting state is built from: the job, the model in this rank's shapes, how its
/// weights are laid out (FSDP shards or whole) and which tensors it holds.
pub struct StartInputs<'a, B: Backend> {
    pub cfg: &'a Config,
    pub model: &'a Decoder<B>,
    /// The job (one process: None).
    pub dist: Option<&'a Distributed>,
    /// Whether it shards with FSDP, and the experts' shard groups under expert parallelism (see
    /// `Fsdp::new`).
    pub fsdp: bool,
    pub experts: Option<ExpertShards>,
    pub reshard: ReshardPolicy,
    pub param_dtype: ParamDtype,
    pub reduce_dtype: ReduceDtype,
    /// A pipeline rank's: whether its stages hold a tensor, and which stage holds it (to tell a
    /// checkpoint written with other stages); None without a pipeline.
    pub held: Option<&'a (dyn Fn(&str) -> bool + Sync)>,
    pub holder: Option<&'a (dyn Fn(&str) -> usize + Sync)>,
}

/// Builds the starting state of `inputs.model` for this rank: from its checkpoint when it resumes,
/// else from `[checkpoint] initial_load_path` or a fresh initialisation; as FSDP shards or whole.
pub fn start_state<B: Backend>(be: &B, inputs: StartInputs<'_, B>) -> Result<StartState<B>> {
    let resume_dir = resume_dir(inputs.cfg, inputs.dist)?;
    let ckpt = read_checkpoint(&inputs, resume_dir.as_ref())?;
    // No checkpoint of its own: the run may start from another model's weights.
    let initial = match &ckpt {
        None if !inputs.cfg.checkpoint.initial_load_path.is_empty() => {
            Some(Initial::open(inputs.cfg, &inputs.model.args)?)
        }
        _ => None,
    };
    let initial_expert_bias = match &initial {
        Some(Initial::Hf(_, bias)) => bias.clone(),
        _ => None,
    };
    let source = Source::new(&inputs, ckpt, initial);
    let mut state = match inputs.dist.filter(|_| inputs.fsdp) {
        Some(d) => sharded_start(be, &source, d, inputs)?,
        None => whole_start(be, &source, inputs.cfg)?,
    };
    state.resumed = match (source.ckpt, resume_dir) {
        (Some(ckpt), Some((folder_step, dir))) => Some(Resumed {
            state: ckpt.state,
            folder_step,
            dir,
        }),
        _ => None,
    };
    state.initial_expert_bias = initial_expert_bias;
    Ok(state)
}

/// The checkpoint step a run resumes from and its folder: `[checkpoint] load_step`, else the
/// latest complete one that verifies (an unreadable latest falls back to the one before, with a
/// warning); None without checkpointing or before the first checkpoint. Rank 0 chooses and every
/// rank checks that it has that step (`checkpoint::resume`): collective over the job.
fn resume_dir(cfg: &Config, dist: Option<&Distributed>) -> Result<Option<(u64, PathBuf)>> {
    if !cfg.checkpoint.enable {
        return Ok(None);
    }
    let folder = cfg.checkpoint_folder();
    let load_step = u64::try_from(cfg.checkpoint.load_step).ok();
    let chosen = match dist {
        Some(d) if d.rank != 0 => Ok(None),
        _ => checkpoint::resume::choose(&folder, load_step).map_err(cannot_resume),
    };
    let step = match dist {
        Some(d) => checkpoint::resume::agree(d.groups.all.as_ref(), &folder, chosen)?,
        None => chosen?,
    };
    Ok(step.map(|s| (s, checkpoint::step_dir(&folder, s))))
}

/// A checkpoint that cannot be read, with the way out: the run must not silently start afresh.
fn cannot_resume(e: anyhow::Error) -> anyhow::Error {
    anyhow!("cannot resume: {e:#}\n(remove the bad checkpoint folder or choose another with --checkpoint.load_step N)")
}

/// The checkpoint in `resume` (the step and its folder) as this rank reads it: a rank of the
/// layout that wrote a sharded checkpoint (FSDP, TP or both) its own files only (its shards, or its
/// tensor-parallel parts, as they were saved), else the whole tensors.
fn read_checkpoint<B: Backend>(
    inputs: &StartInputs<'_, B>,
    resume: Option<&(u64, PathBuf)>,
) -> Result<Option<HostCheckpoint>> {
    let Some((_, dir)) = resume else {
        return Ok(None);
    };
    let (args, local) = (&inputs.model.args, &inputs.model.local);
    let writer = inputs
        .dist
        .and_then(|d| d.groups.writers.as_ref().map(|w| (d, w)))
        .map(|(d, w)| WriterPlace {
            rank: w.rank(),
            size: w.size(),
            tp: local.tp,
            pp: d.mesh.degree("pp"),
            experts: checkpoint::sharded::ExpertParts::of_shapes(local),
        });
    let ckpt = match writer {
        Some(w) => HostCheckpoint::read_for_writer(dir, args, w),
        None => HostCheckpoint::read(dir, args),
    }
    .map_err(cannot_resume)?;
    let saved = &ckpt.state.model_args.lora;
    if saved != &args.lora {
        return Err(cannot_resume(anyhow!(
            "checkpoint {} was saved with LoRA adapters {saved:?}; this job configures {:?} (the [lora] section and [model] converters must match to resume)",
            dir.display(),
            args.lora
        )));
    }
    let excluded = inputs.cfg.checkpoint.excludes_optimizer();
    let ours = super::optimizer::saved_optimizer(&inputs.cfg.optimizer);
    match &ckpt.state.optimizer {
        Some(saved) if !excluded && saved != &ours => {
            return Err(cannot_resume(anyhow!(
                "checkpoint {} holds the state of {saved}; this job configures {ours}. Its state would mean something else: keep [optimizer] name and the param groups' match patterns, or start the optimizer afresh with --checkpoint.exclude_from_loading '[\"optimizer\"]'",
                dir.display()
            )))
        }
        _ => {}
    }
    // A pipeline rank whose stages hold other tensors than when the checkpoint was written
    // merges it instead of reading its own files.
    Ok(Some(match inputs.holder {
        Some(h) if !ckpt.same_stages(h) => {
            HostCheckpoint::read(dir, args).map_err(cannot_resume)?
        }
        _ => ckpt,
    }))
}

/// Where this rank's start values of each tensor come from: its checkpoint when it resumes, else
/// the initial model (`[checkpoint] initial_load_path`), else a fresh initialisation; each cut
/// to this rank's tensor-parallel part.
struct Source<'a, B: Backend> {
    model: &'a Decoder<B>,
    seed: u64,
    /// The tensors whole (`global`), as checkpoints and initial values hold them, and this rank's
    /// tensor-parallel part of each (`specs`).
    global: Vec<(String, Vec<usize>)>,
    specs: Vec<(String, Vec<usize>)>,
    held: Option<&'a (dyn Fn(&str) -> bool + Sync)>,
    ckpt: Option<HostCheckpoint>,
    initial: Option<Initial>,
    /// The checkpoint's optimizer state is not loaded (`[checkpoint] exclude_from_loading`).
    fresh_optimizer: bool,
}

impl<'a, B: Backend> Source<'a, B> {
    fn new(
        inputs: &StartInputs<'a, B>,
        ckpt: Option<HostCheckpoint>,
        initial: Option<Initial>,
    ) -> Self {
        Source {
            model: inputs.model,
            seed: inputs.cfg.training.seed,
            global: crate::model::params::param_specs(&inputs.model.args),
            specs: inputs.model.param_specs(),
            held: inputs.held,
            ckpt,
            initial,
            fresh_optimizer: inputs.cfg.checkpoint.excludes_optimizer(),
        }
    }

    /// Whether this rank holds tensor `i`: a pipeline rank holds (and reads) only its stages'
    /// tensors, an expert-parallel rank only its experts.
    fn here(&self, i: usize) -> bool {
        let name = &self.global[i].0;
        self.held.is_none_or(|h| h(name)) && self.model.local.holds(name)
    }

    /// This rank's tensor-parallel part of the whole `values` of tensor `i`.
    fn tp_part(&self, i: usize, values: Vec<f32>) -> Vec<f32> {
        let (tp, tp_rank) = (self.model.local.tp, self.model.local.tp_rank);
        if tp == 1 {
            return values;
        }
        let (name, shape) = &self.global[i];
        TpSharding::of(name).cut(&values, shape, tp, tp_rank)
    }

    /// Whole values of tensor `i` (or, with `moment`, of an AdamW moment) a run starts from without
    /// a checkpoint of its own: the initial model's, else a fresh initialisation (moments zero).
    fn fresh(&self, moment: Option<&str>, i: usize) -> Result<Vec<f32>> {
        let (name, shape) = &self.global[i];
        let numel = shape.iter().product();
        if let Some(from) = self.initial.as_ref().map(|x| x.values(moment, name, shape)) {
            if let Some(values) = from? {
                return Ok(values);
            }
        }
        Ok(match moment {
            None => crate::model::init::init_param(&self.model.args, name, numel, self.seed),
            Some(_) => vec![0.0; numel],
        })
    }

    /// Tensor `i` (or a moment) from `ckpt`: this rank's shard as it was saved, else its
    /// tensor-parallel part of the whole values.
    fn checkpointed(
        &self,
        ckpt: &HostCheckpoint,
        moment: Option<&str>,
        i: usize,
    ) -> Result<StartValues> {
        if moment.is_some() && self.fresh_optimizer {
            // `exclude_from_loading = ["optimizer"]`: zero moments.
            return Ok(StartValues::Full(vec![
                0.0;
                self.specs[i].1.iter().product()
            ]));
        }
        let (name, shape) = &self.global[i];
        let own = ckpt
            .own_shard(moment, name, &self.specs[i].1)
            .map_err(cannot_resume)?;
        match own {
            Some(shard) => Ok(StartValues::Shard(shard)),
            None => ckpt
                .values(moment, name, shape)
                .map(|v| StartValues::Full(self.tp_part(i, v)))
                .map_err(cannot_resume),
        }
    }

    /// FSDP's start values of tensor `i` (or a moment): nothing for a tensor another pipeline rank
    /// holds, else the checkpoint's or the fresh ones.
    fn start_values(&self, moment: Option<&str>, i: usize) -> Result<StartValues> {
        if !self.here(i) {
            return Ok(StartValues::Full(Vec::new()));
        }
        match &self.ckpt {
            Some(ckpt) => self.checkpointed(ckpt, moment, i),
            None => Ok(StartValues::Full(self.tp_part(i, self.fresh(moment, i)?))),
        }
    }
}

/// FSDP: this rank's shards of the weights and the AdamW moments (the full values cut one tensor
/// at a time on the host); the weights and gradients are unallocated working sets.
fn sharded_start<B: Backend>(
    be: &B,
    source: &Source<'_, B>,
    d: &Distributed,
    inputs: StartInputs<'_, B>,
) -> Result<StartState<B>> {
    let shard = d.groups.shard.clone().expect("FSDP mode has a shard group");
    // A pipeline rank shards only its stages' tensors; the others are empty here.
    let fsdp_specs: Vec<(String, Vec<usize>)> = source
        .specs
        .iter()
        .enumerate()
        .map(|(i, (n, s))| (n.clone(), if source.here(i) { s.clone() } else { vec![0] }))
        .collect();
    let f = Fsdp::new(
        be,
        shard,
        d.groups.replicate.clone(),
        inputs.experts,
        inputs.model,
        &fsdp_specs,
        &|i| source.start_values(None, i),
        inputs.reshard,
        (inputs.param_dtype, inputs.reduce_dtype),
    )?;
    let optimizer = &inputs.cfg.optimizer;
    let second = |i: usize| {
        let (name, shape) = &source.global[i];
        keeps_second_moment(optimizer, name, shape)
    };
    let opt = Optimizer::from_state(
        be,
        f.moment_shards_from(be, &|i| source.start_values(Some("exp_avg."), i), |_| true)?,
        f.moment_shards_from(be, &|i| source.start_values(Some("exp_avg_sq."), i), second)?,
        optimizer.clone(),
        &source.global,
    );
    Ok(StartState {
        params: ParamSet::unallocated(be, &source.specs),
        grads: ParamSet::unallocated(be, &source.specs),
        opt,
        fsdp: Some(f),
        resumed: None,
        initial_expert_bias: None,
    })
}

/// Whole weights and AdamW moments on this rank (one process, DDP, or the tensor-parallel parts):
/// the checkpoint's, the initial model's or freshly initialised; gradients zero.
fn whole_start<B: Backend>(be: &B, source: &Source<'_, B>, cfg: &Config) -> Result<StartState<B>> {
    let specs = &source.specs;
    let mut params = ParamSet::zeros(be, specs);
    // Frozen weights (LoRA's base) get neither gradients nor moments.
    let trains = |name: &str| lora::trainable(source.model.args.lora.as_ref(), name);
    let optimizer = &cfg.optimizer;
    let (mut exp_avg, mut exp_avg_sq) =
        Optimizer::zero_state(be, specs, &source.global, optimizer, trains);
    let grads = ParamSet::zeros_where(be, specs, trains);
    let tp = source.model.local.tp;
    match &source.ckpt {
        Some(ckpt) => {
            for (set, moment) in [
                (&mut params, None),
                (&mut exp_avg, Some("exp_avg.")),
                (&mut exp_avg_sq, Some("exp_avg_sq.")),
            ] {
                // A moment is read where the optimizer keeps one (frozen tensors and Muon's
                // second moments have none).
                let held: Vec<usize> = (0..source.global.len())
                    .filter(|&i| source.here(i) && (moment.is_none() || be.len(&set.bufs[i]) > 0))
                    .collect();
                for i in held {
                    let (StartValues::Shard(values) | StartValues::Full(values)) =
                        source.checkpointed(ckpt, moment, i)?;
                    set.bufs[i] = be.upload(&values);
                }
            }
        }
        None if tp == 1 && source.initial.is_none() => {
            params = init_params(be, &source.model.args, source.seed)
        }
        None => {
            for (set, moment) in [
                (&mut params, None),
                (&mut exp_avg, Some("exp_avg.")),
                (&mut exp_avg_sq, Some("exp_avg_sq.")),
            ] {
                if moment.is_some() && source.initial.is_none() {
                    continue; // zero_state's zeros
                }
                let kept: Vec<usize> = (0..source.global.len())
                    .filter(|&i| moment.is_none() || be.len(&set.bufs[i]) > 0)
                    .collect();
                for i in kept {
                    set.bufs[i] = be.upload(&source.tp_part(i, source.fresh(moment, i)?));
                }
            }
        }
    }
    let opt = Optimizer::from_state(be, exp_avg, exp_avg_sq, optimizer.clone(), &source.global);
    Ok(StartState {
        params,
        grads,
        opt,
        fsdp: None,
        resumed: None,
        initial_expert_bias: None,
    })
}
