//! The single-process training loop: build everything from the config, resume from the latest
//! complete checkpoint, then for each step accumulate micro-batch gradients (loss normalised by the
//! step's total number of targets), clip by global norm, AdamW, log, checkpoint.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::compose::{compose_rank, init_rank_threads, ComposedRank, RankPlace};
use super::lr::LrSchedule;
use super::memory::{gib, peak_memory};
use super::metrics::{default_peak_tflops, ExpertLoad, MetricsLogger, StepMetrics};
use super::save::save_checkpoint;
use super::step::train_step;
use super::validate::Validator;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, GemmPrecision};
use crate::backend::Backend;
use crate::checkpoint::{self, TrainState};
use crate::config::Config;
use crate::data::{load_tokenizer, DataLoader};
use crate::memory_timeline;

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
    CudaBackend::new(local_rank % gpus, precision)
}

/// Sizes rayon's global pool once per process (`threads = 0` keeps rayon's default: every core).
pub fn init_threads(threads: usize) {
    if threads > 0 {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
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
        eprintln!("warning: rank {rank}: memory snapshot not written: {e:#}");
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
                println!(
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

/// Trains on `be` from this rank's `place` in the job.
fn train_on<B: Backend>(
    be: &B,
    cfg: &Config,
    opts: &RunOptions,
    place: RankPlace<B>,
) -> Result<TrainSummary> {
    let dist = place.dist.as_ref();
    let t = &cfg.training;
    let seq = t.seq_len;
    let (rank, dp_rank, dp_size) = dist.map_or((0, 0, 1), |d| (d.rank, d.dp.rank(), d.dp.size()));
    let fsdp_mode = dist.is_some_and(|d| d.shard.is_some());
    let quiet = opts.quiet || rank != 0;
    let say = |s: String| {
        if !quiet {
            println!("{s}");
        }
    };
    let args = cfg.model_args()?;
    let tokenizer = load_tokenizer(&cfg.model.tokenizer_path)?;
    if tokenizer.vocab_size() > args.vocab_size {
        bail!("tokenizer {} has {} tokens but the model's vocabulary holds {}: use a model with vocab_size >= {} (--model.vocab_size)", cfg.model.tokenizer_path, tokenizer.vocab_size(), args.vocab_size, tokenizer.vocab_size());
    }
    // The ranks of a tensor-parallel group read the same batches.
    let mut loader = DataLoader::from_config(cfg, tokenizer, args.vocab_size, dp_rank, dp_size)?;
    let ComposedRank {
        args,
        local,
        mut layout,
        mut opt,
        estimate: est,
        accum,
        global_batch,
        resumed,
        collectives_on_device,
    } = compose_rank(be, cfg, dist, place.device_comm, place.ranks_sharing_memory)?;

    let ckpt_folder = cfg.checkpoint_folder();
    let mut start_step = 0;
    let mut resumed_from = None;
    let mut last_good = None;
    if let Some(r) = resumed {
        loader.restore(r.state.data)?;
        if let Some(bias) = &r.state.expert_bias {
            layout.model.set_expert_bias(bias)?;
        }
        start_step = r.state.step;
        resumed_from = Some(r.folder_step);
        last_good = Some(r.folder_step);
        say(format!(
            "resumed from {} (step {})",
            r.dir.display(),
            r.folder_step
        ));
    }

    let mut writer = checkpoint::writer::AsyncWriter::new();
    let tokens_per_step = (global_batch * seq) as f64;
    let flops_per_token = args.flops_per_token(seq);
    let threads = rayon::current_num_threads();
    let peak_tflops = if cfg.metrics.peak_tflops > 0.0 {
        cfg.metrics.peak_tflops
    } else {
        default_peak_tflops(be, threads) * dist.map_or(1, |d| d.world) as f64
    };
    say(format!(
        "titan | model {} {} | {:.2}M parameters ({:.2}M non-embedding{}) | {:.1} MFLOPs/token | backend {} × {threads} threads | MFU of {peak_tflops:.3} TFLOP/s{}",
        cfg.model.name,
        cfg.model.flavor,
        args.num_params() as f64 / 1e6,
        (args.num_params() - args.embedding_params()) as f64 / 1e6,
        if args.moe.is_some() {
            format!(", {:.2}M active", args.active_params() as f64 / 1e6)
        } else {
            String::new()
        },
        flops_per_token / 1e6,
        be.name(),
        match (cfg.metrics.peak_tflops > 0.0, be.name()) {
            (true, _) => " ([metrics] peak_tflops)",
            (false, "cpu") => " (measured fp32 FMA peak)",
            (false, _) => " (datasheet)",
        }
    ));
    say(format!(
        "memory{}: weights {:.3} GiB, gradients {:.3} GiB, AdamW {:.3} GiB, activations {:.3} GiB{}, kernel scratch {:.3} GiB | data: {} | global batch {} × {seq} tokens, {dp_size} data-parallel rank(s) × {accum} micro-batch(es)/step",
        if dist.is_some() { " per rank" } else { "" },
        gib(est.params),
        gib(est.grads),
        gib(est.optimizer),
        gib(est.activations),
        if est.activation_copies > 0 {
            format!(" + bf16 copies {:.3} GiB", gib(est.activation_copies))
        } else {
            String::new()
        },
        gib(est.scratch),
        loader.describe(),
        global_batch
    ));

    if let Some(p) = &layout.pipeline {
        say(p.describe());
    }
    if let Some(d) = dist {
        // Each rank's own share (the estimate is per rank): DDP replicates everything, FSDP keeps
        // 1/dp_shard of it plus the tensors gathered while it computes; TP keeps 1/tp of the
        // split weights.
        let how = match (fsdp_mode, d.replicate.is_some(), dp_size > 1) {
            (true, true, _) => "sharded, HSDP",
            (true, false, _) => "sharded, FSDP",
            (false, _, true) => "replicated, DDP",
            (false, _, false) => "no data parallel",
        };
        let how = if local.tp > 1 {
            format!(
                "{how}, tensor parallel {} (rank {} of its group)",
                local.tp, local.tp_rank
            )
        } else {
            how.to_string()
        };
        let how = if local.cp > 1 {
            let seq = t.seq_len;
            let chunks = crate::model::crossings::context::SequenceShard {
                degree: local.cp,
                rank: local.cp_rank,
            }
            .chunks(seq);
            format!(
                "{how}, context parallel {} ({}, positions {chunks:?} of {seq})",
                local.cp, cfg.parallelism.context_parallel_rotate_method
            )
        } else {
            how
        };
        let how = match &layout.pipeline {
            Some(p) => format!(
                "{how}, pipeline stages {:?} of {}",
                p.schedule.stages_of(p.group().rank()),
                p.schedule.stages()
            ),
            None => how,
        };
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let path = if collectives_on_device {
            ", collectives through NCCL"
        } else {
            ""
        };
        println!("rank {} of {}: parameters {:.2} MiB, gradients {:.2} MiB, AdamW state {:.2} MiB ({how}{path})", d.rank, d.world, mib(est.params), mib(est.grads), mib(est.optimizer));
    }
    let schedule = LrSchedule::new(cfg.optimizer.lr, &cfg.lr_scheduler, t.steps);
    let mut validator = Validator::from_config(be, cfg, &local, args.vocab_size, dp_rank, dp_size)?;
    let mut logger = if rank != 0 {
        None
    } else {
        Some(MetricsLogger::new(
            &cfg.dump_folder(),
            cfg.metrics
                .enable_tensorboard
                .then(|| cfg.dump_folder().join(&cfg.metrics.save_tb_folder))
                .as_deref(),
        )?)
    };
    let bar = if quiet || start_step >= t.steps {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(t.steps)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(start_step);

    let mut losses = Vec::new();
    let last_step = opts.stop_after.map_or(t.steps, |s| s.min(t.steps));
    let crash_at = crash_drill(rank)?;
    for step in start_step + 1..=last_step {
        if crash_at == Some(step) {
            eprintln!("TITAN_CRASH_AT: rank {rank} exits abruptly at step {step} (fault drill)");
            std::process::abort();
        }
        let (profiled, write_trace) = cfg.profiling.phase(step);
        // The pipeline's measured bubble covers the profiled steps only.
        let first_profiled = step == start_step + 1 || !cfg.profiling.phase(step - 1).0;
        if profiled && cfg.profiling.enable_profiling && first_profiled {
            layout.pipeline_bubbles()?;
        }
        crate::trace::set_recording(profiled && cfg.profiling.enable_profiling);
        memory_timeline::set_recording(profiled && cfg.profiling.enable_memory_snapshot);
        let t0 = Instant::now();
        let data_span = crate::trace::span("data", "data loading");
        let micro: Vec<Vec<u32>> = (0..accum)
            .map(|_| loader.next_batch())
            .collect::<Result<_>>()?;
        drop(data_span);
        let data_time = t0.elapsed().as_secs_f64();
        let lr = schedule.lr(step);
        let (loss, norm) = train_step(be, &mut layout, &mut opt, &micro, lr, step, t.max_norm)?;
        if !loss.is_finite() || !norm.is_finite() {
            let keep = match last_good {
                Some(s) => format!(
                    "the last good checkpoint is {}",
                    checkpoint::step_dir(&ckpt_folder, s).display()
                ),
                None => "no checkpoint was written".into(),
            };
            bail!("non-finite loss or gradient at step {step} (loss {loss}, grad norm {norm}); training stopped before the update, {keep}. Lower [optimizer] lr or set [training] max_norm");
        }
        let moe = layout.moe_step_stats()?;
        if let Some(m) = &moe {
            layout.model.update_expert_bias(&m.load);
        }
        let step_time = t0.elapsed().as_secs_f64();
        losses.push((step, loss));

        let tokens_per_s = tokens_per_step / step_time;
        let tflops = tokens_per_s * flops_per_token / 1e12;
        let m = StepMetrics {
            step,
            loss,
            grad_norm: norm,
            lr,
            tokens_per_s,
            tokens_per_s_per_device: tokens_per_s / dist.map_or(1, |d| d.world) as f64,
            tflops,
            mfu: 100.0 * tflops / peak_tflops,
            step_time_s: step_time,
            data_time_pct: 100.0 * data_time / step_time,
            peak_memory_bytes: be.device_peak_memory().unwrap_or_else(peak_memory),
            moe_expert_load: moe.as_ref().map(|m| ExpertLoad::of(&m.load)),
            moe_aux_loss: moe.as_ref().and_then(|m| m.aux_loss),
        };
        if step % cfg.metrics.log_freq == 0 || step == 1 || step == t.steps {
            if let Some(logger) = &mut logger {
                logger.log(&m)?;
            }
            if !quiet {
                emit(&bar, m.console_line());
            }
        }
        if let Some(v) = validator
            .as_mut()
            .filter(|_| step % cfg.validation.freq == 0 || step == t.steps)
        {
            let m = v.run(be, &mut layout, step)?;
            if let Some(logger) = &mut logger {
                logger.log_validation(&m)?;
            }
            if !quiet {
                emit(&bar, m.console_line());
            }
        }
        bar.set_message(format!("loss {loss:.4}"));
        bar.inc(1);

        let save_now =
            cfg.checkpoint.enable && (step % cfg.checkpoint.interval == 0 || step == t.steps);
        if save_now {
            let state = TrainState {
                format_version: checkpoint::FORMAT_VERSION,
                step,
                model_args: args.clone(),
                seed: t.seed,
                data: loader.state(),
                tokenizer_path: cfg.model.tokenizer_path.clone(),
                sharding: None,
                files: Default::default(),
                expert_bias: layout.model.expert_bias(),
            };
            let _span = crate::trace::span("checkpoint", "checkpoint save");
            let written = save_checkpoint(be, cfg, dist, &layout, &opt, &mut writer, state)?;
            last_good = Some(step);
            if let (Some(dir), false) = (written, quiet) {
                emit(&bar, format!("saved checkpoint {}", dir.display()));
            }
        }
        if (write_trace || step == last_step) && memory_timeline::recording() {
            memory_timeline::set_recording(false);
            let dir = cfg
                .dump_folder()
                .join(&cfg.profiling.save_memory_snapshot_folder)
                .join(format!("iteration_{step}"));
            let stem = format!("rank{rank}_memory");
            match memory_timeline::write(&dir, &stem, rank, memory_timeline::take()) {
                Ok(()) if !quiet => emit(
                    &bar,
                    format!("memory timeline {}/{stem}.svg", dir.display()),
                ),
                Ok(()) => {}
                Err(e) => eprintln!("warning: rank {rank}: memory timeline not written: {e:#}"),
            }
        }
        if (write_trace || step == last_step) && crate::trace::recording() {
            if let Some(b) = layout.pipeline_bubbles()? {
                let per_rank: Vec<String> = b
                    .iter()
                    .enumerate()
                    .map(|(r, x)| format!("rank {r} {x:.3}"))
                    .collect();
                if !quiet {
                    emit(
                        &bar,
                        format!(
                            "pipeline bubble measured over the profiled steps (share of the schedule's time waiting for other ranks): {}",
                            per_rank.join(", ")
                        ),
                    );
                }
            }
            crate::trace::set_recording(false);
            let events = crate::trace::take();
            let path = cfg
                .dump_folder()
                .join(&cfg.profiling.save_traces_folder)
                .join(format!("iteration_{step}"))
                .join(format!("rank{rank}_trace.json"));
            // A trace that cannot be written costs the trace, not the run.
            match crate::trace::write(&path, rank, &events) {
                Ok(()) if !quiet => emit(&bar, format!("profiler trace {}", path.display())),
                Ok(()) => {}
                Err(e) => eprintln!("warning: rank {rank}: profiler trace not written: {e:#}"),
            }
        }
    }
    if let (Some(dir), false) = (writer.wait()?, quiet) {
        emit(&bar, format!("saved checkpoint {}", dir.display()));
    }
    bar.finish_and_clear();
    if let Some(&(s, l)) = losses.last() {
        say(format!(
            "done: step {s}, loss {l:.4}, peak memory {:.0} MiB",
            be.device_peak_memory().unwrap_or_else(peak_memory) as f64 / (1 << 20) as f64
        ));
    } else {
        say(format!(
            "nothing to do: the checkpoint is already at step {start_step} of {}",
            t.steps
        ));
    }
    Ok(TrainSummary {
        losses,
        final_step: t.steps.max(start_step),
        resumed_from,
    })
}

/// Fault drills: `TITAN_CRASH_AT=RANK:STEP` makes that rank die abruptly (abort, no cleanup) when it
/// reaches that step, in the first launch only (`TITAN_GENERATION` 0), so that restarts, timeouts and
/// resume can be tested the way a real crash happens.
fn crash_drill(rank: usize) -> Result<Option<u64>> {
    let Ok(spec) = std::env::var("TITAN_CRASH_AT") else {
        return Ok(None);
    };
    if std::env::var("TITAN_GENERATION").is_ok_and(|g| g != "0") {
        return Ok(None);
    }
    let (r, s) = spec
        .split_once(':')
        .ok_or_else(|| anyhow!("TITAN_CRASH_AT={spec}: expected RANK:STEP"))?;
    let (r, s): (usize, u64) = (
        r.parse()
            .map_err(|_| anyhow!("TITAN_CRASH_AT={spec}: bad rank"))?,
        s.parse()
            .map_err(|_| anyhow!("TITAN_CRASH_AT={spec}: bad step"))?,
    );
    Ok((r == rank).then_some(s))
}

/// A line above the progress bar, or plainly when the bar is hidden (output is not a terminal).
fn emit(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        println!("{line}");
    } else {
        bar.println(line);
    }
}
