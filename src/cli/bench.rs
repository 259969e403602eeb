//! `titan bench train`: a few training steps on random tokens, timed after warm-up, of any layout
//! (`--nproc N` and `[parallelism]` overrides) composed as `titan train` composes it; prints the
//! median tokens/s (global and per device), GFLOP/s (TorchTitan's FLOP count), the largest rank's
//! peak memory beside its estimate and, with tensor parallelism, the communication the step left
//! exposed. One process on the debug model is comparable with `shared/bench/torch_llama_cpu.py`.
//! Also `bench gemm` and `bench comm`.

use crate::backend::{GemmOutput, GemmShape};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::bench_report::{BenchReport, CommClocks, JobFigures, Timing};
use crate::backend::cpu::CpuBackend;
use crate::backend::transfers::Transfers;
use crate::backend::Backend;
use crate::config::Config;
use crate::launch::Distributed;
use crate::train::compose::{compose_rank, ComposedRank, RankPlace};
use crate::train::step::train_step;
use crate::train::threads::{init_rank_threads, init_threads};
use crate::train::trainer::{cuda_backend, select_device, Device};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchTrainArgs {
    /// A TOML job config to start from (default: the built-in debug model job); the options
    /// below and the trailing overrides change it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// `[model] flavor` (default: the config's, debugmodel).
    #[arg(long)]
    pub flavor: Option<String>,
    /// `[training] local_batch_size` (default: the config's, 8).
    #[arg(long)]
    pub batch: Option<usize>,
    /// `[training] seq_len` (default: the config's, 256).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Timed steps (after warm-up).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// CPU threads per rank (`[training] threads`; 0: the cores shared out among the ranks).
    #[arg(long)]
    pub threads: Option<usize>,
    /// `[model] n_kv_heads`: override the flavor's number of KV heads (grouped-query attention).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Local ranks to start, one process each, laid out by `[parallelism]` (e.g.
    /// `--parallelism.tensor_parallel_degree 2`).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Time every kernel and print where rank 0's timed steps went (on CUDA each op then waits
    /// for the GPU, so the profiled step is slower than a plain one).
    #[arg(long)]
    pub profile_ops: bool,
    /// `[training] device`: cpu or cuda (default: cpu).
    #[arg(long)]
    pub device: Option<String>,
    /// `[training] mixed_precision_param`: bfloat16 (bf16 weights in compute; bf16 tensor-core
    /// GEMMs on CUDA), tfloat32 (CUDA) or float32. Default: bfloat16 on CUDA, float32 on the CPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// Float8 linears with this recipe (rowwise, rowwise_with_gw_hp or tensorwise): sets
    /// `[model] converters = ["quantize.linear.float8"]` and `[quantize.linear.float8]
    /// recipe_name`: float8 GEMMs on CUDA (sm_89+; `--quantize.linear.float8.emulate true` emulates
    /// them there too), emulated on the CPU. Compare its step with a run without it.
    #[arg(long, value_name = "RECIPE")]
    pub float8: Option<String>,
    /// Peak TFLOP/s of one device for MFU; 0 uses the device default (989 for an H100/H200 in bf16).
    #[arg(long, default_value_t = 0.0)]
    pub peak_tflops: f64,
    /// Any other config key: --section.key VALUE (after the options above).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "--section.key VALUE"
    )]
    pub overrides: Vec<String>,
}

impl BenchTrainArgs {
    /// The job the benchmark runs: the config with the options and overrides applied, on
    /// synthetic tokens, without checkpoints.
    fn config(&self) -> Result<Config> {
        let device = self.device.clone().unwrap_or_else(|| "cpu".into());
        let precision = self.precision.clone().unwrap_or_else(|| {
            if device == "cuda" {
                "bfloat16"
            } else {
                "float32"
            }
            .into()
        });
        let mut overrides: Vec<String> = Vec::new();
        let mut set = |key: &str, value: String| {
            overrides.extend([format!("--{key}"), value]);
        };
        if let Some(f) = &self.flavor {
            set("model.flavor", f.clone());
        }
        if let Some(b) = self.batch {
            set("training.local_batch_size", b.to_string());
        }
        if let Some(s) = self.seq {
            set("training.seq_len", s.to_string());
        }
        if let Some(t) = self.threads {
            set("training.threads", t.to_string());
        }
        if let Some(kv) = self.kv_heads {
            set("model.n_kv_heads", kv.to_string());
        }
        if let Some(recipe) = &self.float8 {
            set("model.converters", crate::config::FLOAT8_LINEAR.into());
            set(
                "quantize.linear.float8.recipe_name",
                format!("\"{recipe}\""),
            );
        }
        set("training.device", format!("\"{device}\""));
        set("training.mixed_precision_param", format!("\"{precision}\""));
        set("training.steps", (self.warmup + self.steps).to_string());
        set("checkpoint.enable", "false".into());
        overrides.extend(self.overrides.iter().cloned());
        Config::load(self.config.as_deref(), &overrides)
    }
}

pub fn run_train(a: &BenchTrainArgs) -> Result<()> {
    let cfg = a.config()?;
    if crate::launch::env::WorkerEnv::detect()?.is_none() && a.nproc > 1 {
        // Refuse a mesh the workers would refuse, then start them with this same command.
        crate::launch::check_mesh(&cfg, a.nproc)?;
        let o = crate::launch::launcher::LaunchOptions::local(
            a.nproc,
            std::env::args().skip(1).collect(),
        );
        return crate::launch::launcher::launch(&o);
    }
    init_rank_threads(&cfg)?;
    match select_device(&cfg)? {
        Device::Cpu => {
            let be = if a.profile_ops {
                CpuBackend::profiled()
            } else {
                CpuBackend::new()
            };
            let place = RankPlace::cpu(&cfg)?;
            let probes = BackendProbes {
                on_warm: &|| be.profiler.reset(),
                transfers: &|| be.transfers.read(),
            };
            if let Some(timed_s) = bench_on(&be, &cfg, a, place, &probes)? {
                if a.profile_ops {
                    out!("{}", be.profiler.report(timed_s));
                }
            }
            Ok(())
        }
        Device::Cuda => {
            let local_rank = crate::launch::env::WorkerEnv::detect()?.map_or(0, |e| e.local_rank);
            let mut be = cuda_backend(&cfg, local_rank)?;
            if a.profile_ops {
                be.enable_profiling();
            }
            let place = RankPlace::cuda(&cfg, &be, a.json)?;
            let probes = BackendProbes {
                on_warm: &|| be.profiler.reset(),
                transfers: &|| be.transfers.read(),
            };
            if let Some(timed_s) = bench_on(&be, &cfg, a, place, &probes)? {
                if a.profile_ops {
                    out!("{}", be.profiler.report(timed_s));
                }
            }
            Ok(())
        }
    }
}

/// What a bench run reads of its backend beyond the `Backend` trait.
struct BackendProbes<'a> {
    /// Called once the warm-up steps are done (the op profiler starts afresh).
    on_warm: &'a dyn Fn(),
    /// The backend's host↔device copies so far (`backend::transfers`).
    transfers: &'a dyn Fn() -> Transfers,
}

/// This rank's timed steps of the composed layout; `probes.on_warm` is called once the warm-up
/// steps are done. Rank 0 prints the job's figures and returns the seconds its timed steps took; the other
/// ranks return None.
fn bench_on<B: Backend>(
    be: &B,
    cfg: &Config,
    a: &BenchTrainArgs,
    place: RankPlace,
    probes: &BackendProbes<'_>,
) -> Result<Option<f64>> {
    let dist = place.dist.as_ref();
    let (rank, dp_rank) = dist.map_or((0, 0), |d| (d.rank, d.groups.dp.rank()));
    let setup = Instant::now();
    let mut composed = compose_rank(be, cfg, &place)?;
    be.synchronize();
    if rank == 0 {
        errln!(
            "bench setup of {} (parameters, optimizer, buffers): {:.1} s",
            cfg.model.flavor,
            setup.elapsed().as_secs_f64()
        );
    }
    let batches = random_batches(cfg, composed.args.vocab_size, composed.accum, dp_rank);
    let mut saves = BenchSaves {
        cfg,
        dist,
        writer: crate::checkpoint::writer::AsyncWriter::new(),
    };
    let timing = time_steps(
        be,
        &mut composed,
        &batches,
        a,
        rank == 0,
        probes,
        &mut saves,
    )?;
    // The last asynchronous save's tail, after the timed steps.
    saves.writer.wait()?;
    // Every rank takes part in the gathering (collectives); rank 0 alone reports.
    let job = JobFigures::gather(
        be,
        &mut composed.layout,
        dist,
        &composed.estimate,
        &timing,
        a.steps,
    )?;
    if rank != 0 {
        return Ok(None);
    }
    let timed_s = timing.timed_s();
    let report = BenchReport::new(be, cfg, a.peak_tflops, &composed, dist, timing, job)?;
    if a.json {
        outln!("{}", report.json());
    } else {
        outln!("{}", report.text());
    }
    Ok(Some(timed_s))
}

/// Random tokens for `4 × accum` micro-batches of `[training]`'s shape: each data-parallel rank
/// its own, the ranks of a tensor-parallel group the same.
fn random_batches(cfg: &Config, vocab_size: usize, accum: usize, dp_rank: usize) -> Vec<Vec<u32>> {
    let (batch, seq) = (cfg.training.local_batch_size, cfg.training.seq_len);
    let mut rng = ChaCha8Rng::seed_from_u64(1 + dp_rank as u64);
    (0..4 * accum)
        .map(|_| {
            (0..batch * (seq + 1))
                .map(|_| rng.gen_range(0..vocab_size as u32))
                .collect()
        })
        .collect()
}

/// Checkpoint saves during a bench run (`--checkpoint.enable true --checkpoint.interval N`):
/// every `interval` steps, inside the step's time, as `titan train` saves.
struct BenchSaves<'a> {
    cfg: &'a Config,
    dist: Option<&'a Distributed>,
    writer: crate::checkpoint::writer::AsyncWriter,
}

impl BenchSaves<'_> {
    /// Saves step `step` when one is due.
    fn save_if_due<B: Backend>(&mut self, be: &B, c: &ComposedRank<B>, step: u64) -> Result<()> {
        let ck = &self.cfg.checkpoint;
        if !ck.enable || !step.is_multiple_of(ck.interval) {
            return Ok(());
        }
        let state = crate::checkpoint::TrainState {
            format_version: crate::checkpoint::FORMAT_VERSION,
            step,
            model_args: c.args.clone(),
            seed: self.cfg.training.seed,
            data: Default::default(),
            tokenizer_path: self.cfg.model.tokenizer_path.clone(),
            sharding: None,
            files: Default::default(),
            expert_bias: c.layout.model.expert_bias(),
            optimizer: Some(crate::train::optimizer::saved_optimizer(
                &self.cfg.optimizer,
            )),
        };
        let (cfg, dist) = (self.cfg, self.dist);
        crate::train::save::save_checkpoint(
            be,
            cfg,
            dist,
            &c.layout,
            &c.opt,
            &mut self.writer,
            state,
        )?;
        Ok(())
    }
}

/// Runs the warm-up and the timed steps over `batches`, rank 0 (`log`) printing each, with the
/// checkpoint saves `saves` asks for. At the end of warm-up it calls `probes.on_warm`, reads the
/// clocks and the backend's copies so far
/// and drops the warm-up's pipeline bubbles (a collective of the pipeline group, so that the
/// report's bubbles are the timed steps').
fn time_steps<B: Backend>(
    be: &B,
    c: &mut ComposedRank<B>,
    batches: &[Vec<u32>],
    a: &BenchTrainArgs,
    log: bool,
    probes: &BackendProbes<'_>,
    saves: &mut BenchSaves<'_>,
) -> Result<Timing> {
    let mut timing = Timing::default();
    let mut copies_at_warm = (probes.transfers)();
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            (probes.on_warm)();
            copies_at_warm = (probes.transfers)();
            timing.at_warm = CommClocks::read(&c.layout.model);
            c.layout.pipeline_bubbles()?;
            c.layout.state.take_gathered_bytes();
        }
        be.synchronize();
        let t0 = Instant::now();
        let first = (i * c.accum) % batches.len();
        let micro = &batches[first..first + c.accum];
        let outcome = train_step(
            be,
            &mut c.layout,
            &mut c.opt,
            micro,
            8e-4,
            i as u64 + 1,
            1.0,
            None,
        )?;
        let loss = outcome.loss;
        saves.save_if_due(be, c, i as u64 + 1)?;
        be.synchronize();
        let dt = t0.elapsed().as_secs_f64();
        if log {
            errln!(
                "bench step {}/{}{}: {dt:.3} s, loss {loss:.4}",
                i + 1,
                a.warmup + a.steps,
                if i < a.warmup { " (warm-up)" } else { "" }
            );
        }
        timing.losses.push(loss);
        if i >= a.warmup {
            timing.times.push(dt);
            timing.optimizer_times.push(outcome.optimizer_s);
        }
    }
    let gathered = c.layout.state.take_gathered_bytes();
    timing.fsdp_gathered_bytes = gathered.map(|b| b as f64 / a.steps.max(1) as f64);
    timing.host_device = (probes.transfers)().since(copies_at_warm);
    Ok(timing)
}

/// Best-of-5 GFLOP/s of `out[m,n] = a[m,k]·b[k,n]` through the backend's matmul.
pub fn run_gemm(threads: usize, extra: &[String]) -> Result<()> {
    use crate::backend::Backend;
    init_threads(threads);
    let be = CpuBackend::new();
    let mut shapes: Vec<(usize, usize, usize, bool, bool)> = vec![
        (4096, 4096, 4096, false, false),
        (2048, 2048, 2048, false, false),
        (2048, 256, 768, false, false),
        (2048, 768, 256, false, false),
        (2048, 256, 2048, false, false),
        (64, 16, 256, false, false),
        (64, 256, 16, false, false),
    ];
    for s in extra {
        let bad = || anyhow::anyhow!("--shape {s}: expected MxKxN, optionally :TT with T = n or t");
        let (dims, ops) = s.split_once(':').unwrap_or((s, "nn"));
        let dims: Vec<usize> = dims
            .split('x')
            .map(|d| d.parse())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        let ops: Vec<bool> = ops
            .chars()
            .map(|c| match c {
                'n' => Ok(false),
                't' => Ok(true),
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?;
        anyhow::ensure!(dims.len() == 3 && ops.len() == 2, bad());
        shapes.push((dims[0], dims[1], dims[2], ops[0], ops[1]));
    }
    for (m, k, n, trans_a, trans_b) in shapes {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut out = vec![0.0f32; m * n];
        let reps = (2e9 / (2.0 * (m * k * n) as f64)).clamp(1.0, 10000.0) as usize;
        let mut best = f64::MAX;
        for _ in 0..6 {
            let t0 = Instant::now();
            for _ in 0..reps {
                be.matmul(
                    &mut out,
                    &a,
                    &b,
                    GemmShape {
                        m,
                        k,
                        n,
                        trans_a,
                        trans_b,
                    },
                    GemmOutput::Overwrite,
                );
            }
            best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        let op = |t: bool| if t { "t" } else { "n" };
        outln!(
            "gemm {m}x{k}x{n}:{}{}: {:.1} GFLOP/s ({} threads)",
            op(trans_a),
            op(trans_b),
            2.0 * (m * k * n) as f64 / best / 1e9,
            rayon::current_num_threads()
        );
    }
    Ok(())
}

#[derive(clap::Args, Debug, Clone)]
pub struct BenchCommArgs {
    /// Local ranks to start (each a process).
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Message sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    pub sizes_mib: Vec<usize>,
    /// Timed iterations per size (after one warm-up).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// One JSON object per size (median seconds of each collective) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Bus bandwidth (NCCL's definition) of all-reduce, all-gather and reduce-scatter across `nproc`
/// local ranks of the CPU transport. Started plainly it launches the ranks; each rank runs the loop.
pub fn run_comm(a: &BenchCommArgs) -> Result<()> {
    use crate::comm::group::{ProcessGroup, ReduceOp};
    use crate::launch::env::WorkerEnv;
    let Some(env) = WorkerEnv::detect()? else {
        let mut worker_args = vec![
            "bench".to_string(),
            "comm".into(),
            "--nproc".into(),
            a.nproc.to_string(),
            "--iters".into(),
            a.iters.to_string(),
            "--sizes-mib".into(),
        ];
        worker_args.push(
            a.sizes_mib
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
        if a.json {
            worker_args.push("--json".into());
        }
        let o = crate::launch::launcher::LaunchOptions::local(a.nproc, worker_args);
        return crate::launch::launcher::launch(&o);
    };
    let timeout = std::time::Duration::from_secs(300);
    let (g, _store) = crate::launch::world_group(&env, "bench", timeout, timeout)?;
    let n = g.size() as f64;
    if g.rank() == 0 && !a.json {
        outln!(
            "{:>9} {:>16} {:>16} {:>16}   (bus bandwidth GB/s, {} ranks, median of {})",
            "size",
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            g.size(),
            a.iters
        );
    }
    for &mib in &a.sizes_mib {
        let floats = (mib << 20) / 4 / g.size() * g.size();
        let bytes = (floats * 4) as f64;
        let mut buf = vec![1.0f32; floats];
        let mut shard = vec![0.0f32; floats / g.size()];
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            f()?;
            let mut t = Vec::new();
            for _ in 0..a.iters {
                let t0 = Instant::now();
                f()?;
                t.push(t0.elapsed().as_secs_f64());
            }
            t.sort_by(|x, y| x.total_cmp(y));
            Ok(t[t.len() / 2])
        };
        let ar = time(&mut || g.all_reduce(&mut buf, ReduceOp::Sum))?;
        let input = vec![1.0f32; floats / g.size()];
        let mut gathered = vec![0.0f32; floats];
        let ag = time(&mut || g.all_gather(&input, &mut gathered))?;
        let rs = time(&mut || g.reduce_scatter(&buf, &mut shard, ReduceOp::Sum))?;
        if g.rank() == 0 && a.json {
            let row = serde_json::json!({"ranks": g.size(), "bytes": bytes, "all_reduce_s": ar, "all_gather_s": ag, "reduce_scatter_s": rs});
            outln!("{row}");
        } else if g.rank() == 0 {
            let bw = |t: f64, factor: f64| bytes / t * factor / 1e9;
            outln!(
                "{:>6} MiB {:>16.2} {:>16.2} {:>16.2}",
                mib,
                bw(ar, 2.0 * (n - 1.0) / n),
                bw(ag, (n - 1.0) / n),
                bw(rs, (n - 1.0) / n)
            );
        }
    }
    Ok(())
}
