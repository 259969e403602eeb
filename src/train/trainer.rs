//! The single-process training loop: build everything from the config, resume from the latest
//! complete checkpoint, then for each step accumulate micro-batch gradients (loss normalised by the
//! step's total number of targets), clip by global norm, AdamW, log, checkpoint.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::banner::Banner;
use super::compose::{compose_rank, ComposedRank, RankPlace};
use super::lr::LrSchedule;
use super::memory::peak_memory;
use super::metrics::{default_peak_tflops, ExpertLoad, MetricsLogger, StepMetrics};
use super::optimizer::Optimizer;
use super::profiler::StepProfiler;
use super::replicas::{ReplicaParts, ReplicaSync};
use super::save::save_checkpoint;
use super::step::train_step;
use super::threads::init_rank_threads;
use super::validate::Validator;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, GemmPrecision};
use crate::backend::Backend;
use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::{load_tokenizer, DataLoader};
use crate::memory_timeline;
use crate::model::ModelArgs;
use crate::parallel::layout::{MoeStepStats, RankLayout};

/// What a finished run reports (tests compare these).
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// `(step, loss)` of every step this run executed.
    pub losses: Vec<(u64, f64)>,
    pub final_step: u64,
    pub resumed_from: Option<u64>,
}

/// Options that are about this invocation rather than the job.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// No progress bar and no per-step console lines (tests, benchmarks).
    pub quiet: bool,
    /// End the run after this step as if interrupted (preemption drills and resume tests); the
    /// schedule still follows `[training] steps`.
    pub stop_after: Option<u64>,
}

/// The device a run trains on, from `[training] device` (`auto`: CUDA when a GPU and its libraries
/// are there, else the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

pub fn select_device(cfg: &Config) -> Result<Device> {
    match cfg.training.device.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda),
        "auto" if crate::backend::cuda::libs::cuda_usable() => Ok(Device::Cuda),
        "auto" => Ok(Device::Cpu),
        other => bail!("[training] device = `{other}` is not known (accepted: cpu, cuda, auto)"),
    }
}

/// The CUDA backend for this process: GPU `local_rank`, one process per GPU. With more local ranks
/// than GPUs the ranks share them round-robin: slower (collectives then go through the host), but
/// it lets a one-GPU machine run and check multi-process layouts.
pub fn cuda_backend(cfg: &Config, local_rank: usize) -> Result<CudaBackend> {
    let precision = GemmPrecision::from_config(&cfg.training.mixed_precision_param)?;
    let gpus = crate::backend::cuda::libs::device_count()?;
    if gpus == 0 {
        bail!("--training.device cuda: the NVIDIA driver sees no GPU");
    }
    // More local ranks than visible GPUs: either the launcher gave each rank its own GPU through
    // CUDA_VISIBLE_DEVICES, or ranks share GPUs (collectives::for_cuda finds out and says so).
    let mut be = CudaBackend::new(local_rank % gpus, precision)?;
    if cfg.wants_float8_gemms() {
        be.enable_fp8_gemms()?;
    }
    be.refuse_mx_gemms(&cfg.wanted_mx_gemms())?;
    Ok(be)
}

pub fn train(cfg: &Config, opts: &RunOptions) -> Result<TrainSummary> {
    let result = train_on_device(cfg, opts);
    if let Err(e) = &result {
        snapshot_failure(cfg, e);
    }
    result
}

/// With `[profiling] enable_memory_snapshot`: what this rank held when its run failed (a CUDA
/// allocation that did not fit, a collective that failed), after the samples recorded so far, in
/// `{snapshot folder}/failure/rank{r}_memory.{json,svg}`.
fn snapshot_failure(cfg: &Config, error: &anyhow::Error) {
    if !cfg.profiling.enable_memory_snapshot {
        return;
    }
    let rank = crate::launch::env::WorkerEnv::detect()
        .ok()
        .flatten()
        .map_or(0, |e| e.rank);
    memory_timeline::set_recording(false);
    let mut samples = memory_timeline::take();
    samples.push(memory_timeline::now(&format!("failed: {error:#}")));
    let dir = cfg
        .dump_folder()
        .join(&cfg.profiling.save_memory_snapshot_folder)
        .join("failure");
    if let Err(e) = memory_timeline::write(&dir, &format!("rank{rank}_memory"), rank, samples) {
        errln!("warning: rank {rank}: memory snapshot not written: {e:#}");
    }
}

fn train_on_device(cfg: &Config, opts: &RunOptions) -> Result<TrainSummary> {
    init_rank_threads(cfg)?;
    match select_device(cfg)? {
        Device::Cpu => train_on(&CpuBackend::new(), cfg, opts, RankPlace::cpu(cfg)?),
        Device::Cuda => {
            let local_rank = crate::launch::env::WorkerEnv::detect()?.map_or(0, |e| e.local_rank);
            let be = cuda_backend(cfg, local_rank)?;
            if !opts.quiet {
                outln!(
                    "device: {} ({}), GEMMs in {:?}",
                    be.device_name(),
                    be.arch(),
                    be.precision()
                );
            }
            let place = RankPlace::cuda(cfg, &be, opts.quiet)?;
            train_on(&be, cfg, opts, place)
        }
    }
}

/// Trains on `be` from this rank's `place` in the job: the rank composed and resumed, then the
/// loop, one step at a time.
fn train_on<B: Backend>(
    be: &B,
    cfg: &Config,
    opts: &RunOptions,
    place: RankPlace,
) -> Result<TrainSummary> {
    let mut run = TrainingRun::start(be, cfg, opts, place)?;
    let crash_at = crash_drill("TITAN_CRASH_AT", run.rank)?;
    let stall_at = crash_drill("TITAN_STALL_AT", run.rank)?;
    let mut step = run.first_step;
    while step <= run.last_step {
        step = run.sync_replicas(step)?;
        if step > run.last_step {
            break;
        }
        if crash_at == Some(step) {
            let rank = run.rank;
            errln!("TITAN_CRASH_AT: rank {rank} exits abruptly at step {step} (fault drill)");
            std::process::abort();
        }
        if stall_at == Some(step) {
            errln!("TITAN_STALL_AT: rank {} stops answering for {STALL_S} s at step {step} (fault drill)", run.rank);
            std::thread::sleep(std::time::Duration::from_secs(STALL_S));
        }
        let write_trace = run.profiler.begin(step, &mut run.layout)?;
        let t0 = Instant::now();
        let micro = next_batches(&mut run.loader, run.accum)?;
        let data_time = t0.elapsed().as_secs_f64();
        let lr = run.schedule.lr(step);
        let max_norm = cfg.training.max_norm;
        // The step's gathers only (not the validation's or the profiler's before it).
        run.layout.state.take_gathered_bytes();
        // Replica groups average gradients every step, unless they sync semi-synchronously.
        let per_step = run.replicas.as_mut().filter(|r| r.semi.is_none());
        let outcome = train_step(
            be,
            &mut run.layout,
            &mut run.opt,
            &micro,
            lr,
            step,
            max_norm,
            per_step,
        )?;
        let (loss, norm) = (outcome.loss, outcome.norm);
        if run.replicas.is_some() && !outcome.committed && loss.is_finite() {
            // A replica group was lost while averaging: the next batch trains this step again.
            continue;
        }
        if !loss.is_finite() || !norm.is_finite() {
            bail!("non-finite loss or gradient at step {step} (loss {loss}, grad norm {norm}); training stopped before the update, {}. Lower [optimizer] lr or set [training] max_norm", kept_checkpoint(cfg, run.saver.last_good));
        }
        let moe = run.layout.moe_step_stats(be)?;
        if let Some(m) = &moe {
            run.layout.model.update_expert_bias(be, &m.load);
        }
        let times = (t0.elapsed().as_secs_f64(), data_time);
        run.losses.push((step, loss));
        let mut m = run
            .rate
            .metrics(be, step, (loss, norm, lr), times, moe.as_ref());
        m.fsdp_all_gather_bytes = run.layout.state.take_gathered_bytes();
        m.live_replicas = run.replicas.as_ref().map(|r| r.live());
        let job = run.dist.as_ref().map(|d| d.groups.all.as_ref());
        (m.muon_matrices, m.muon_max_rank_ns_share) = run.opt.job_orthogonalized(job)?.unzip();
        if let (Some(loads), Some(bias)) =
            (m.moe_expert_load.as_mut(), run.layout.model.expert_bias())
        {
            ExpertLoad::with_routing_bias(loads, &bias);
        }
        run.reporter.report(be, &mut run.layout, &m)?;
        let out = |line: String| emit(&run.reporter.bar, line);
        run.profiler.end(step, write_trace, &mut run.layout, &out)?;
        let synced = run.semi_sync_after(step)?;
        if synced > step {
            // Behind the other replica groups: it goes on from their step.
            step = synced + 1;
            continue;
        }
        run.save_if_due(step)?;
        step += 1;
    }
    run.finish()
}

/// One rank's training run between its steps: the composed layout and optimizer, the data, the
/// schedule, and where the figures and checkpoints go.
struct TrainingRun<'a, B: Backend> {
    be: &'a B,
    cfg: &'a Config,
    /// None in one process.
    dist: Option<crate::launch::Distributed>,
    rank: usize,
    quiet: bool,
    args: ModelArgs,
    layout: RankLayout<B>,
    opt: Optimizer<B>,
    loader: DataLoader,
    accum: usize,
    schedule: LrSchedule,
    reporter: Reporter<'a, B>,
    saver: Saver,
    profiler: StepProfiler<'a>,
    rate: StepRate,
    losses: Vec<(u64, f64)>,
    /// Replica-group fault tolerance (`[fault_tolerance] enable`).
    replicas: Option<ReplicaSync>,
    /// The steps this run executes (`first_step > last_step`: nothing left to do).
    first_step: u64,
    last_step: u64,
    resumed_from: Option<u64>,
}

impl<'a, B: Backend> TrainingRun<'a, B> {
    /// Composes the rank, resumes it from the latest complete checkpoint and prints the banner.
    fn start(be: &'a B, cfg: &'a Config, opts: &RunOptions, place: RankPlace) -> Result<Self> {
        let dist = place.dist.as_ref();
        let t = &cfg.training;
        let (rank, dp_rank, dp_size) = dist.map_or((0, 0, 1), |d| {
            (d.rank, d.groups.dp.rank(), d.groups.dp.size())
        });
        let quiet = opts.quiet || rank != 0;
        let say = |s: String| {
            if !quiet {
                outln!("{s}");
            }
        };
        // Replica groups read shares of the data of their own, as HSDP's replicas do.
        let ft = &cfg.fault_tolerance;
        let (dp_rank, dp_size) = match ft.enable {
            true => (ft.replica_id * dp_size + dp_rank, ft.group_size * dp_size),
            false => (dp_rank, dp_size),
        };
        let mut loader = open_loader(cfg, dp_rank, dp_size)?;
        let mut composed = compose_rank(be, cfg, &place)?;
        let resume = Resume::of(be, &mut composed, &mut loader, &say)?;
        // A restarted generation (or a resumed run) says what it repeats; a fresh run does not
        // read an older run's metrics left in its dump folder.
        let restarted = std::env::var("TITAN_GENERATION").is_ok_and(|g| g != "0");
        if restarted || resume.resumed_from.is_some() {
            say_what_the_restart_repeats(cfg, dist, resume.start_step, &say);
        }
        let rate = StepRate::of(be, cfg, &composed, dist);
        let world = dist.map_or(1, |d| d.world);
        let replicas =
            ReplicaSync::from_config(cfg, rank, world, dist.map(|d| d.groups.all.clone()))?;
        print_banner(be, cfg, dist, &composed, &loader, &rate, &say);
        let last_step = opts.stop_after.map_or(t.steps, |s| s.min(t.steps));
        let bar = progress_bar(
            quiet || resume.start_step >= t.steps,
            resume.start_step,
            t.steps,
        );
        Ok(TrainingRun {
            dist: place.dist,
            be,
            cfg,
            rank,
            quiet,
            reporter: Reporter {
                cfg,
                validator: Validator::from_config(
                    be,
                    cfg,
                    &composed.local,
                    composed.args.vocab_size,
                    dp_rank,
                    dp_size,
                )?,
                logger: metrics_logger(cfg, rank)?,
                bar,
                quiet,
                logged_members: None,
            },
            saver: Saver {
                writer: checkpoint::writer::AsyncWriter::with_failure_warning(
                    cfg.save_failure_warns(),
                ),
                last_good: resume.last_good,
            },
            profiler: StepProfiler {
                cfg,
                rank,
                quiet,
                first_step: resume.start_step + 1,
                last_step,
            },
            schedule: LrSchedule::new(cfg.optimizer.lr, &cfg.lr_scheduler, t.steps),
            rate,
            args: composed.args,
            layout: composed.layout,
            opt: composed.opt,
            accum: composed.accum,
            loader,
            losses: Vec::new(),
            replicas,
            first_step: resume.start_step + 1,
            last_step,
            resumed_from: resume.resumed_from,
        })
    }

    /// With replica groups, before `step`: the quorum, and this replica's state from an
    /// up-to-date one when it is behind; the step to train next.
    fn sync_replicas(&mut self, step: u64) -> Result<u64> {
        let Some(replicas) = self.replicas.as_mut() else {
            return Ok(step);
        };
        // Semi-synchronous groups meet at their sync points only, and once at the start.
        if replicas.semi.is_some() && step != self.first_step {
            return Ok(step);
        }
        self.meet_replicas(step - 1).map(|committed| committed + 1)
    }

    /// Semi-synchronous training, after committing `step`: the sync when one is due; the step
    /// this replica has then committed (another group's, when it was behind).
    fn semi_sync_after(&mut self, step: u64) -> Result<u64> {
        match &self.replicas {
            Some(r) if r.syncs_after(step) => self.meet_replicas(step),
            _ => Ok(step),
        }
    }

    /// The replica groups' meeting having committed `committed`: the quorum, the semi-synchronous
    /// sync, the state from an up-to-date group when this one is behind; the step committed then.
    fn meet_replicas(&mut self, committed: u64) -> Result<u64> {
        let Some(replicas) = self.replicas.as_mut() else {
            return Ok(committed);
        };
        let mut parts = ReplicaParts {
            layout: &mut self.layout,
            opt: &mut self.opt,
            loader: &mut self.loader,
        };
        let start = replicas.start_step(self.be, committed, &mut parts)?;
        let change = replicas.membership_change();
        if self.quiet {
            return Ok(start.committed);
        }
        if let Some((before, now)) = change {
            emit(
                &self.reporter.bar,
                format!(
                    "[fault_tolerance] after step {}: live replica groups {before} → {now}",
                    start.committed
                ),
            );
        }
        if let Some(from) = start.recovered_from {
            emit(&self.reporter.bar, format!("[fault_tolerance] recovered step {} from replica group {from} (weights, optimizer state, data position); {} replica groups live", start.committed, replicas.live()));
        }
        Ok(start.committed)
    }

    /// A checkpoint of `step` when one is due (every `interval` steps and at the end).
    fn save_if_due(&mut self, step: u64) -> Result<()> {
        let c = &self.cfg.checkpoint;
        if !c.enable || (!step.is_multiple_of(c.interval) && step != self.cfg.training.steps) {
            return Ok(());
        }
        let state = train_state(self.cfg, &self.args, step, &self.loader, &self.layout);
        let parts = (&self.layout, &self.opt);
        let written = self
            .saver
            .save(self.be, self.cfg, self.dist.as_ref(), parts, state)?;
        if let (Some(dir), false) = (written, self.quiet) {
            emit(
                &self.reporter.bar,
                format!("saved checkpoint {}", dir.display()),
            );
        }
        Ok(())
    }

    /// Waits for the last checkpoint write and says where the run ended.
    fn finish(mut self) -> Result<TrainSummary> {
        if let (Some(dir), false) = (self.saver.writer.wait()?, self.quiet) {
            emit(
                &self.reporter.bar,
                format!("saved checkpoint {}", dir.display()),
            );
        }
        self.reporter.bar.finish_and_clear();
        let start_step = self.first_step - 1;
        let steps = self.cfg.training.steps;
        if !self.quiet {
            match self.losses.last() {
                Some(&(s, l)) => outln!(
                    "done: step {s}, loss {l:.4}, peak memory {:.0} MiB",
                    self.be.device_peak_memory().unwrap_or_else(peak_memory) as f64
                        / (1 << 20) as f64
                ),
                None => outln!(
                    "nothing to do: the checkpoint is already at step {start_step} of {steps}"
                ),
            }
        }
        Ok(TrainSummary {
            losses: self.losses,
            final_step: steps.max(start_step),
            resumed_from: self.resumed_from,
        })
    }
}

/// The start banner (rank 0 unless quiet) and each rank's own line.
fn print_banner<B: Backend>(
    be: &B,
    cfg: &Config,
    dist: Option<&crate::launch::Distributed>,
    composed: &ComposedRank<B>,
    loader: &DataLoader,
    rate: &StepRate,
    say: &dyn Fn(String),
) {
    let banner = Banner {
        be,
        cfg,
        args: &composed.args,
        local: &composed.local,
        estimate: &composed.estimate,
        dist,
        layout: &composed.layout,
        data: loader.describe(),
        global_batch: composed.global_batch,
        accum: composed.accum,
        flops_per_token: rate.flops_per_token,
        peak_tflops: rate.peak_tflops,
        device_collectives: composed.device_collectives,
    };
    banner.lines().into_iter().for_each(say);
    if let Some(line) = banner.rank_line() {
        outln!("{line}");
    }
}

/// The data loader of this data-parallel rank (the ranks of a tensor-parallel group read the
/// same batches), its tokenizer checked against the model's vocabulary.
fn open_loader(cfg: &Config, dp_rank: usize, dp_size: usize) -> Result<DataLoader> {
    let vocab = cfg.model_args()?.vocab_size;
    let tokenizer = load_tokenizer(&cfg.model.tokenizer_path)?;
    if tokenizer.vocab_size() > vocab {
        bail!("tokenizer {} has {} tokens but the model's vocabulary holds {vocab}: use a model with vocab_size >= {} (--model.vocab_size)", cfg.model.tokenizer_path, tokenizer.vocab_size(), tokenizer.vocab_size());
    }
    DataLoader::from_config(cfg, tokenizer, vocab, dp_rank, dp_size)
}

/// A step's `accum` micro-batches.
fn next_batches(loader: &mut DataLoader, accum: usize) -> Result<Vec<Vec<u32>>> {
    let _span = crate::trace::span("data", "data loading");
    (0..accum).map(|_| loader.next_batch()).collect()
}

/// Checkpoint saves (written by a thread with `async_mode`) and the latest known complete.
struct Saver {
    writer: checkpoint::writer::AsyncWriter,
    last_good: Option<u64>,
}

impl Saver {
    fn save<B: Backend>(
        &mut self,
        be: &B,
        cfg: &Config,
        dist: Option<&crate::launch::Distributed>,
        (layout, opt): (&RankLayout<B>, &Optimizer<B>),
        state: TrainState,
    ) -> Result<Option<std::path::PathBuf>> {
        let step = state.step;
        let _span = crate::trace::span("checkpoint", "checkpoint save");
        match save_checkpoint(be, cfg, dist, layout, opt, &mut self.writer, state) {
            Ok(written) => {
                self.last_good = Some(step);
                Ok(written)
            }
            // Every rank met the failure (`save_checkpoint` agrees on it): all train on.
            Err(e) if cfg.save_failure_warns() => {
                checkpoint::writer::warn_save_failed(&e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Where a step's figures go: the console (through the progress bar), `metrics.jsonl` and
/// TensorBoard on rank 0, and the validation that follows every `freq` steps.
struct Reporter<'a, B: Backend> {
    cfg: &'a Config,
    validator: Option<Validator<B>>,
    logger: Option<MetricsLogger>,
    bar: ProgressBar,
    quiet: bool,
    /// The membership (ranks, live replica groups) of the last step logged.
    logged_members: Option<(usize, Option<usize>)>,
}

impl<B: Backend> Reporter<'_, B> {
    /// Logs every `log_freq` steps, the first and the last, and any step whose membership differs
    /// from the last logged one's (so a change lasting fewer steps than `log_freq` is recorded,
    /// and `titan plot` marks it).
    fn report(&mut self, be: &B, layout: &mut RankLayout<B>, m: &StepMetrics) -> Result<()> {
        let (step, steps) = (m.step, self.cfg.training.steps);
        let members = Some((m.world_size, m.live_replicas));
        let periodic = step % self.cfg.metrics.log_freq == 0 || step == 1 || step == steps;
        if periodic || members != self.logged_members {
            self.logged_members = members;
            if let Some(logger) = &mut self.logger {
                logger.log(m)?;
            }
            if !self.quiet {
                emit(&self.bar, m.console_line());
            }
        }
        let validate_now = step % self.cfg.validation.freq == 0 || step == steps;
        if let Some(v) = self.validator.as_mut().filter(|_| validate_now) {
            let vm = v.run(be, layout, step)?;
            if let Some(logger) = &mut self.logger {
                logger.log_validation(&vm)?;
            }
            if !self.quiet {
                emit(&self.bar, vm.console_line());
            }
        }
        self.bar.set_message(format!("loss {:.4}", m.loss));
        self.bar.inc(1);
        Ok(())
    }
}

/// Rank 0's `metrics.jsonl` (and TensorBoard events when enabled); None on the other ranks.
fn metrics_logger(cfg: &Config, rank: usize) -> Result<Option<MetricsLogger>> {
    if rank != 0 {
        return Ok(None);
    }
    let tb = cfg
        .metrics
        .enable_tensorboard
        .then(|| cfg.dump_folder().join(&cfg.metrics.save_tb_folder));
    Ok(Some(MetricsLogger::new(&cfg.dump_folder(), tb.as_deref())?))
}

/// After a restart, what the run before it reached (its last step line in `metrics.jsonl`): the
/// steps run again since the checkpoint and, when the number of ranks changed (an elastic job's
/// membership), the old and new world and the new layout.
fn say_what_the_restart_repeats(
    cfg: &Config,
    dist: Option<&crate::launch::Distributed>,
    resumed_at: u64,
    say: &dyn Fn(String),
) {
    let Some((reached, before)) = super::metrics::last_recorded_step(&cfg.dump_folder()) else {
        return;
    };
    let world = dist.map_or(1, |d| d.world) as u64;
    let layout = dist.map_or("one process".to_string(), |d| d.mesh.describe());
    let lost = reached.saturating_sub(resumed_at);
    let repeats = match lost {
        0 => "no step is repeated".to_string(),
        n => format!("steps {}..={reached} run again ({n} lost)", resumed_at + 1),
    };
    match before != world {
        true => say(format!("membership change: {before} → {world} ranks, layout {layout}; resuming at step {resumed_at}, {repeats}")),
        false if lost > 0 => say(format!("restart: resuming at step {resumed_at}, {repeats}")),
        false => {}
    }
}

/// Where a run starts: step 0, or the checkpoint it resumed from.
struct Resume {
    start_step: u64,
    resumed_from: Option<u64>,
    /// The latest checkpoint known complete.
    last_good: Option<u64>,
}

impl Resume {
    /// The data position and expert bias of the checkpoint the rank resumed from, restored.
    fn of<B: Backend>(
        be: &B,
        rank: &mut ComposedRank<B>,
        loader: &mut DataLoader,
        say: &dyn Fn(String),
    ) -> Result<Self> {
        let Some(r) = rank.resumed.take() else {
            return Ok(Resume {
                start_step: 0,
                resumed_from: None,
                last_good: None,
            });
        };
        let state_file = r.dir.join("state.json");
        loader
            .restore(r.state.data)
            .map_err(|e| anyhow!("resuming from {}: {e:#}", state_file.display()))?;
        if let Some(bias) = &r.state.expert_bias {
            rank.layout.model.set_expert_bias(be, bias)?;
        }
        say(format!(
            "resumed from {} (step {})",
            r.dir.display(),
            r.folder_step
        ));
        Ok(Resume {
            start_step: r.state.step,
            resumed_from: Some(r.folder_step),
            last_good: Some(r.folder_step),
        })
    }
}

/// The figures a step's metrics are computed from.
struct StepRate {
    tokens_per_step: f64,
    flops_per_token: f64,
    peak_tflops: f64,
    devices: usize,
}

impl StepRate {
    /// The rates of `composed`'s steps: tokens per step over the job, FLOPs per token, and the
    /// peak the MFU is taken against (`[metrics] peak_tflops`, or the devices' measured peak).
    fn of<B: Backend>(
        be: &B,
        cfg: &Config,
        composed: &ComposedRank<B>,
        dist: Option<&crate::launch::Distributed>,
    ) -> Self {
        let devices = dist.map_or(1, |d| d.world);
        let peak_tflops = match cfg.metrics.peak_tflops > 0.0 {
            true => cfg.metrics.peak_tflops,
            false => default_peak_tflops(be, rayon::current_num_threads()) * devices as f64,
        };
        StepRate {
            tokens_per_step: (composed.global_batch * cfg.training.seq_len) as f64,
            flops_per_token: composed.args.flops_per_token(cfg.training.seq_len),
            peak_tflops,
            devices,
        }
    }

    fn metrics<B: Backend>(
        &self,
        be: &B,
        step: u64,
        (loss, grad_norm, lr): (f64, f64, f64),
        (step_time, data_time): (f64, f64),
        moe: Option<&MoeStepStats>,
    ) -> StepMetrics {
        let tokens_per_s = self.tokens_per_step / step_time;
        let tflops = tokens_per_s * self.flops_per_token / 1e12;
        StepMetrics {
            step,
            loss,
            grad_norm,
            lr,
            tokens_per_s,
            tokens_per_s_per_device: tokens_per_s / self.devices as f64,
            tflops,
            mfu: 100.0 * tflops / self.peak_tflops,
            step_time_s: step_time,
            data_time_pct: 100.0 * data_time / step_time,
            peak_memory_bytes: be.device_peak_memory().unwrap_or_else(peak_memory),
            world_size: self.devices,
            moe_expert_load: moe.map(|m| ExpertLoad::of(&m.load)),
            moe_aux_loss: moe.and_then(|m| m.aux_loss),
            fsdp_all_gather_bytes: None,
            muon_matrices: None,
            muon_max_rank_ns_share: None,
            live_replicas: None,
        }
    }
}

/// The training state a checkpoint of `step` records beside the weights.
fn train_state<B: Backend>(
    cfg: &Config,
    args: &ModelArgs,
    step: u64,
    loader: &DataLoader,
    layout: &RankLayout<B>,
) -> TrainState {
    TrainState {
        format_version: checkpoint::FORMAT_VERSION,
        step,
        model_args: args.clone(),
        seed: cfg.training.seed,
        data: loader.state(),
        tokenizer_path: cfg.model.tokenizer_path.clone(),
        sharding: None,
        files: Default::default(),
        expert_bias: layout.model.expert_bias(),
        optimizer: Some(super::optimizer::saved_optimizer(&cfg.optimizer)),
    }
}

/// Where a stopped run can restart from, for its error.
fn kept_checkpoint(cfg: &Config, last_good: Option<u64>) -> String {
    match last_good {
        Some(s) => format!(
            "the last good checkpoint is {}",
            checkpoint::step_dir(&cfg.checkpoint_folder(), s).display()
        ),
        None => "no checkpoint was written".into(),
    }
}

/// The progress bar of steps `start..=steps` (hidden for quiet ranks and finished runs).
fn progress_bar(hidden: bool, start: u64, steps: u64) -> ProgressBar {
    let bar = match hidden {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(steps),
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(start);
    bar
}

/// How long `TITAN_STALL_AT` stalls a rank.
const STALL_S: u64 = 4;

/// Fault drills, in the first launch only (`TITAN_GENERATION` 0), so that restarts, timeouts and
/// resume can be tested the way real faults happen: `TITAN_CRASH_AT=RANK:STEP` makes that rank die
/// abruptly (abort, no cleanup) when it reaches that step; `TITAN_STALL_AT=RANK:STEP` makes it stop
/// answering for `STALL_S` seconds there (a hung process, as SIGSTOP then SIGCONT). The step of
/// `var`'s drill for `rank`.
fn crash_drill(var: &str, rank: usize) -> Result<Option<u64>> {
    let Ok(spec) = std::env::var(var) else {
        return Ok(None);
    };
    if std::env::var("TITAN_GENERATION").is_ok_and(|g| g != "0") {
        return Ok(None);
    }
    let (r, s) = spec
        .split_once(':')
        .ok_or_else(|| anyhow!("{var}={spec}: expected RANK:STEP"))?;
    let (r, s): (usize, u64) = (
        r.parse().map_err(|_| anyhow!("{var}={spec}: bad rank"))?,
        s.parse().map_err(|_| anyhow!("{var}={spec}: bad step"))?,
    );
    Ok((r == rank).then_some(s))
}

/// A line above the progress bar, or plainly when the bar is hidden (output is not a terminal).
fn emit(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        outln!("{line}");
    } else {
        bar.println(line);
    }
}
