//! `titan plan`: the fastest layout that fits. Every candidate layout of a job over `world`
//! devices (`layout`) is composed by the trainer's own checks and sized by its own memory
//! estimate (`train::compose::RankPlan::sized`, on shape-only groups), so a layout the planner
//! accepts is one `titan train` accepts and its memory is the figure `titan train` refuses
//! with; the ones that fit are ranked by the cost model (`cost`) of the device (`device`: the
//! GPU table, or this CPU as `calibrate` measured it).

pub mod calibrate;
pub mod cost;
pub mod device;
mod experts;
pub mod layout;

use std::path::PathBuf;

use anyhow::{Context, Result};
use rayon::prelude::*;

use crate::backend::cpu::CpuBackend;
use crate::comm::mesh::DeviceMesh;
use crate::config::Config;
use crate::launch::launcher::Replan;
use crate::model::activation_checkpoint::AcMode;
use crate::train::compose::RankPlan;
use crate::train::memory::{check_fits, DeviceSizing};
use crate::train::place::MeshPlace;
use cost::{Prediction, Weighing};
use device::Device;
use layout::{Layout, Space};

/// A job to plan: its config (file and overrides), the devices and how their memory is sized.
pub struct Job<'a> {
    pub config: Option<PathBuf>,
    pub overrides: Vec<String>,
    pub world: usize,
    pub device: Device,
    /// The memory accounting of one device (a planned GPU, or the CPU backend's).
    pub sizing: &'a (dyn DeviceSizing + Sync),
    /// Ranks sharing one memory (a CPU host's ranks; 1 for GPUs).
    pub ranks_sharing_memory: usize,
    /// Weigh `none`/`op`/`full` checkpointing (else only the config's mode).
    pub vary_ac: bool,
}

/// One legal layout, sized and (when it fits) predicted.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub layout: Layout,
    /// The flags that select it (`--section.key value`, in pairs).
    pub overrides: Vec<String>,
    /// The memory estimate of its largest rank.
    pub memory_bytes: u64,
    /// Why it does not fit (the estimate's refusal), None when it fits.
    pub why: Option<String>,
    pub prediction: Prediction,
}

impl Candidate {
    pub fn fits(&self) -> bool {
        self.why.is_none()
    }
}

/// What a plan found: the legal candidates (those that fit first, fastest first; then the
/// others, smallest first) and how many layouts titan's checks refused.
pub struct Plan {
    pub candidates: Vec<Candidate>,
    pub refused: usize,
    pub base: Config,
}

impl<'a> Job<'a> {
    fn load(&self, extra: &[String]) -> Result<Config> {
        let all: Vec<String> = self.overrides.iter().chain(extra).cloned().collect();
        Config::load(self.config.as_deref(), &all)
    }

    /// The same job over `world` devices.
    pub fn resized(&self, world: usize) -> Job<'a> {
        Job {
            config: self.config.clone(),
            overrides: self.overrides.clone(),
            world,
            device: self.device.clone(),
            sizing: self.sizing,
            ranks_sharing_memory: self.ranks_sharing_memory,
            vary_ac: self.vary_ac,
        }
    }

    /// Every candidate of the job, weighed.
    pub fn plan(&self) -> Result<Plan> {
        let base = self.load(&[])?;
        let args = base.model_args()?;
        let space = Space {
            world: self.world,
            max_tp: self.device.per_node.min(self.world),
            max_pp: args.n_layers,
            experts: (0..args.n_layers)
                .find_map(|i| args.moe_at(i))
                .map(|m| m.router.num_experts),
            global_batch: (base.training.global_batch_size > 0)
                .then_some(base.training.global_batch_size as usize),
            local_batch: base.training.local_batch_size,
            vary_ac: self.vary_ac,
            fixed_ac: match base.activation_checkpoint.mode()? {
                AcMode::None => layout::AcChoice::None,
                AcMode::Full => layout::AcChoice::Full,
                AcMode::Op => layout::AcChoice::Op,
                AcMode::EveryNth(n) if !self.vary_ac => anyhow::bail!(
                    "titan plan --keep-ac: [activation_checkpoint] selective_ac_option = \"{n}\" (every N-th block, N = {n}) is not modelled; titan plan weighs none, op and full (drop --keep-ac, or keep op or full)"
                ),
                AcMode::EveryNth(_) => layout::AcChoice::Full,
            },
        };
        let layouts = layout::enumerate(&space);
        let weighed: Vec<Result<Candidate>> = layouts.par_iter().map(|l| self.weigh(l)).collect();
        let refused = weighed.iter().filter(|w| w.is_err()).count();
        let mut candidates: Vec<Candidate> = weighed.into_iter().flatten().collect();
        candidates.sort_by(|a, b| match (a.fits(), b.fits()) {
            (true, true) => b
                .prediction
                .tokens_per_s
                .total_cmp(&a.prediction.tokens_per_s),
            (false, false) => a.memory_bytes.cmp(&b.memory_bytes),
            (a_fits, _) => fitting_first(a_fits),
        });
        Ok(Plan {
            candidates,
            refused,
            base,
        })
    }

    /// One layout through titan's checks, its memory against the device's, its prediction.
    pub fn weigh(&self, layout: &Layout) -> Result<Candidate> {
        let overrides = layout.overrides();
        let cfg = self.load(&overrides)?;
        let mesh = crate::launch::check_mesh(&cfg, self.world)?;
        let ep = cfg.parallelism.expert_parallel_degree;
        let plans = pipeline_ranks(&mesh)
            .into_iter()
            .map(|rank| RankPlan::sized(self.sizing, &cfg, MeshPlace::planned(&mesh, rank, ep)))
            .collect::<Result<Vec<RankPlan>>>()?;
        let plan = plans
            .iter()
            .max_by_key(|p| p.estimate.total())
            .context("a mesh has a first pipeline rank")?;
        let what = format!("{} on {} ranks", layout.describe(), self.world);
        let free = self.sizing.device_free_memory();
        let why = check_fits(&plan.estimate, &what, free, self.ranks_sharing_memory)
            .err()
            .map(|e| format!("{e:#}"));
        let prediction = Weighing {
            layout,
            args: &plan.args,
            seq: cfg.training.seq_len,
            accum: plan.accum,
            device: &self.device,
            world: self.world,
            pipeline: plans[0].pipeline.as_ref(),
            async_tp: cfg.parallelism.enable_async_tensor_parallel,
            float8_params: plan.float8.params_per_token(&plan.args) as f64,
        }
        .predict();
        Ok(Candidate {
            layout: layout.clone(),
            overrides,
            memory_bytes: plan.estimate.total(),
            why,
            prediction,
        })
    }
}

/// The order of a fitting and a non-fitting candidate: the one that fits first.
fn fitting_first(a_fits: bool) -> std::cmp::Ordering {
    match a_fits {
        true => std::cmp::Ordering::Less,
        false => std::cmp::Ordering::Greater,
    }
}

/// The ranks whose memory can differ most: the first and last pipeline ranks (the embedding and
/// the most microbatches in flight; the head), each at the mesh's first place otherwise.
fn pipeline_ranks(mesh: &DeviceMesh) -> Vec<usize> {
    let pp = mesh.degree("pp");
    let per_stage = mesh.world / pp;
    let mut ranks = vec![0];
    if pp > 1 {
        ranks.push((pp - 1) * per_stage);
    }
    ranks
}

/// `titan train --replan`: the overrides of the best layout of a CPU job over `world` ranks,
/// `ranks_per_host` to a host (this host's calibration, measured now if it has none), for the
/// launcher to ask at each generation.
pub fn replanner(
    cfg: &Config,
    config: Option<PathBuf>,
    overrides: Vec<String>,
    ranks_per_host: usize,
) -> Result<Replan> {
    if cfg.training.device != "cpu" {
        anyhow::bail!("titan train --replan plans CPU jobs (this host's calibration); for GPUs run `titan plan --ngpu N --gpu KIND` and pass the overrides it prints");
    }
    let calibration = calibrate::cpu(false)?;
    let mut device = calibration.device;
    device.per_node = ranks_per_host;
    Ok(Replan(std::sync::Arc::new(move |world| {
        let cpu = CpuBackend::new();
        let job = Job {
            config: config.clone(),
            overrides: overrides.clone(),
            world,
            device: device.clone(),
            sizing: &cpu,
            ranks_sharing_memory: ranks_per_host,
            vary_ac: true,
        };
        let plan = job.plan()?;
        match plan.candidates.into_iter().find(Candidate::fits) {
            Some(best) => Ok(best.overrides),
            None => anyhow::bail!(
                "no layout of the job fits on {world} ranks ({ranks_per_host} to a host)"
            ),
        }
    })))
}
