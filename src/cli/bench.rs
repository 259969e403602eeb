//! `titan bench train`: a few training steps on random tokens, timed after warm-up, of any layout
//! (`--nproc N` and `[parallelism]` overrides) composed as `titan train` composes it; prints the
//! median tokens/s (global and per device), GFLOP/s (TorchTitan's FLOP count), the largest rank's
//! peak memory beside its estimate and, with tensor parallelism, the communication the step left
//! exposed. One process on the debug model is comparable with `shared/bench/torch_llama_cpu.py`.
//! Also `bench gemm` and `bench comm`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::comm::group::ReduceOp;
use crate::config::Config;
use crate::train::compose::{compose_rank, init_rank_threads, ComposedRank, RankPlace};
use crate::train::memory::peak_memory;
use crate::train::metrics::default_peak_tflops;
use crate::train::step::train_step;
use crate::train::trainer::{cuda_backend, init_threads, select_device, Device};

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
            if let Some(timed_s) = bench_on(&be, &cfg, a, place, &|| be.profiler.reset())? {
                if a.profile_ops {
                    print!("{}", be.profiler.report(timed_s));
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
            if let Some(timed_s) = bench_on(&be, &cfg, a, place, &|| be.profiler.reset())? {
                if a.profile_ops {
                    print!("{}", be.profiler.report(timed_s));
                }
            }
            Ok(())
        }
    }
}

/// This rank's timed steps of the composed layout; `on_warm` is called once the warm-up steps are
/// done. Rank 0 prints the job's figures and returns the seconds its timed steps took; the other
/// ranks return None.
fn bench_on<B: Backend>(
    be: &B,
    cfg: &Config,
    a: &BenchTrainArgs,
    place: RankPlace<B>,
    on_warm: &dyn Fn(),
) -> Result<Option<f64>> {
    let dist = place.dist.as_ref();
    let (rank, world, dp_rank) = dist.map_or((0, 1, 0), |d| (d.rank, d.world, d.dp.rank()));
    let (batch, seq) = (cfg.training.local_batch_size, cfg.training.seq_len);
    let setup = Instant::now();
    let ComposedRank {
        args,
        mut layout,
        mut opt,
        estimate,
        accum,
        global_batch,
        ..
    } = compose_rank(be, cfg, dist, place.device_comm, place.ranks_sharing_memory)?;
    be.synchronize();
    if rank == 0 {
        eprintln!(
            "bench setup of {} (parameters, optimizer, buffers): {:.1} s",
            cfg.model.flavor,
            setup.elapsed().as_secs_f64()
        );
    }
    // Random tokens: each data-parallel rank its own, the ranks of a tensor-parallel group the same.
    let mut rng = ChaCha8Rng::seed_from_u64(1 + dp_rank as u64);
    let batches: Vec<Vec<u32>> = (0..4 * accum)
        .map(|_| {
            (0..batch * (seq + 1))
                .map(|_| rng.gen_range(0..args.vocab_size as u32))
                .collect()
        })
        .collect();
    let mut times = Vec::new();
    let mut losses = Vec::new();
    let (mut exposed_at_warm, mut comm_at_warm, mut attention_at_warm) = (0.0, 0.0, 0.0);
    let mut exchange_at_warm = 0.0;
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            on_warm();
            exposed_at_warm = layout.model.tp().exposed_comm_seconds();
            comm_at_warm = layout.model.tp().comm_seconds();
            attention_at_warm = layout.model.cp().attention_seconds();
            exchange_at_warm = layout.model.ep().exchange_seconds();
            layout.pipeline_bubbles()?;
        }
        be.synchronize();
        let t0 = Instant::now();
        let first = (i * accum) % batches.len();
        let (loss, _) = train_step(
            be,
            &mut layout,
            &mut opt,
            &batches[first..first + accum],
            8e-4,
            i as u64 + 1,
            1.0,
        )?;
        be.synchronize();
        let dt = t0.elapsed().as_secs_f64();
        if rank == 0 {
            eprintln!(
                "bench step {}/{}{}: {dt:.3} s, loss {loss:.4}",
                i + 1,
                a.warmup + a.steps,
                if i < a.warmup { " (warm-up)" } else { "" }
            );
        }
        losses.push(loss);
        if i >= a.warmup {
            times.push(dt);
        }
    }
    let timed_s: f64 = times.iter().sum();
    // Mixture of experts: the least balanced block's busiest expert over the mean, all steps.
    let expert_balance = layout.moe_step_stats()?.map(|load| {
        crate::train::metrics::ExpertLoad::of(&load.load)
            .iter()
            .map(|l| l.max_over_mean)
            .fold(0.0, f64::max)
    });
    // Each pipeline rank's share of the timed steps spent waiting for another rank.
    let bubbles = layout.pipeline_bubbles()?;
    let unit_bubble = match &layout.pipeline {
        Some(p) => Some(p.schedule.unit_bubble()?),
        None => None,
    };
    let per_step = |total: f64, at_warm: f64| (total - at_warm) / a.steps.max(1) as f64;
    let exposed_tp_s = per_step(layout.model.tp().exposed_comm_seconds(), exposed_at_warm);
    let comm_tp_s = per_step(layout.model.tp().comm_seconds(), comm_at_warm);
    let exchange_ep_s = per_step(layout.model.ep().exchange_seconds(), exchange_at_warm);
    // Context parallel: every rank's attention time per step and peak memory (the load balance).
    let cp = layout.model.local.cp;
    let attention_s = per_step(layout.model.cp().attention_seconds(), attention_at_warm);
    let per_rank = match dist.filter(|_| cp > 1) {
        Some(d) => {
            let mine = [attention_s as f32, peak_memory() as f32];
            let mut all = vec![0f32; 2 * d.world];
            d.all.all_gather(&mine, &mut all)?;
            let (attention, peaks): (Vec<f64>, Vec<f64>) = all
                .chunks(2)
                .map(|x| (x[0] as f64, x[1] as f64 / (1 << 20) as f64))
                .unzip();
            Some((attention, peaks))
        }
        None => None,
    };
    let attention_spread = per_rank.as_ref().map(|(a, _)| {
        let (lo, hi) = a
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        hi / lo.max(1e-12)
    });
    // Job-wide figures: the largest rank's memory, its estimate and its exposed TP communication.
    let peak_rss = peak_memory() as f64;
    let device_peak = be.device_peak_memory().map(|b| b as f64);
    let [peak_rss, device_peak, estimate_bytes, exposed_tp_s, comm_tp_s, exchange_ep_s] = match dist
    {
        Some(d) => {
            let mut v = [
                peak_rss as f32,
                device_peak.unwrap_or(0.0) as f32,
                estimate.total() as f32,
                exposed_tp_s as f32,
                comm_tp_s as f32,
                exchange_ep_s as f32,
            ];
            d.all.all_reduce(&mut v, ReduceOp::Max)?;
            v.map(f64::from)
        }
        None => [
            peak_rss,
            device_peak.unwrap_or(0.0),
            estimate.total() as f64,
            exposed_tp_s,
            comm_tp_s,
            exchange_ep_s,
        ],
    };
    if rank != 0 {
        return Ok(None);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let median = times[times.len() / 2];
    let tok_s = (global_batch * seq) as f64 / median;
    let gflops = tok_s * args.flops_per_token(seq) / 1e9;
    let threads = rayon::current_num_threads();
    let peak_tflops = world as f64
        * if a.peak_tflops > 0.0 {
            a.peak_tflops
        } else {
            default_peak_tflops(be, threads)
        };
    let mfu = 100.0 * gflops / 1e3 / peak_tflops;
    let mib = |b: f64| b / (1 << 20) as f64;
    let p = &cfg.parallelism;
    let tp = p.tensor_parallel_degree;
    let ep = layout.model.local.ep;
    let layout_name = dist.map_or("one process".to_string(), |d| {
        let mut dims: Vec<String> = crate::comm::mesh::DIMS
            .iter()
            .zip(d.mesh.degrees)
            .filter(|(_, n)| *n > 1)
            .map(|(dim, n)| format!("{dim} {n}"))
            .collect();
        // Expert parallelism borrows its ranks from dp_shard × cp.
        if ep > 1 {
            dims.push(format!("(ep {ep})"));
        }
        dims.join(" × ")
    });
    let precision = &cfg.training.mixed_precision_param;
    let ac = cfg.activation_checkpoint.mode()?.describe();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"device": be.name(), "precision": precision, "flavor": cfg.model.flavor, "batch": batch, "seq": seq, "threads": threads, "n_kv_heads": args.n_kv_heads,
                "nproc": world, "layout": layout_name, "global_batch": global_batch, "micro_batches": accum,
                "tensor_parallel_degree": tp, "async_tensor_parallel": p.enable_async_tensor_parallel,
                "activation_checkpoint": ac,
                "step_s_median": median, "step_s_min": times[0], "step_s_max": times[times.len()-1],
                "tokens_per_s": tok_s, "tokens_per_s_per_device": tok_s / world as f64,
                "gflops": gflops, "tflops": gflops / 1e3, "mfu_pct": mfu, "peak_tflops": peak_tflops,
                "peak_rss_mib": mib(peak_rss), "peak_device_mib": be.device_peak_memory().map(|_| mib(device_peak)),
                "memory_estimate_mib": mib(estimate_bytes),
                "tp_exposed_comm_ms_per_step": (tp > 1).then_some(exposed_tp_s * 1e3),
                "tp_comm_ms_per_step": (tp > 1).then_some(comm_tp_s * 1e3),
                "pipeline_schedule": layout.pipeline.as_ref().map(|p| p.schedule.name.clone()),
                "pipeline_bubble_unit_cost": unit_bubble,
                "pipeline_bubble_measured_per_rank": bubbles,
                "context_parallel_degree": cp,
                "expert_parallel_degree": ep,
                "ep_all_to_all_ms_per_step": (ep > 1).then_some(exchange_ep_s * 1e3),
                "moe_expert_load_max_over_mean": expert_balance,
                "active_params": args.active_params(),
                "cp_attention_s_per_step_per_rank": per_rank.as_ref().map(|(a, _)| a),
                "cp_attention_slowest_over_fastest": attention_spread,
                "peak_rss_mib_per_rank": per_rank.as_ref().map(|(_, m)| m),
                "loss_first": losses[0], "loss_last": losses[losses.len()-1]})
        );
    } else {
        let memory = match be.device_peak_memory() {
            Some(_) => format!("peak device memory {:.0} MiB", mib(device_peak)),
            None => format!("peak RSS {:.0} MiB", mib(peak_rss)),
        };
        let mut exposed = if tp > 1 {
            format!(
                " | TP comm {:.1} ms/step, exposed {:.1}",
                comm_tp_s * 1e3,
                exposed_tp_s * 1e3
            )
        } else {
            String::new()
        };
        if let (Some(b), Some(unit)) = (&bubbles, unit_bubble) {
            let per_rank: Vec<String> = b.iter().map(|x| format!("{x:.3}")).collect();
            exposed += &format!(
                " | pipeline bubble measured {} (unit-cost {unit:.3})",
                per_rank.join(" ")
            );
        }
        if let Some(balance) = expert_balance {
            exposed += &format!(" | experts max/mean {balance:.2}");
        }
        if ep > 1 {
            exposed += &format!(
                " | EP all-to-all {:.1} ms/step (slowest rank)",
                exchange_ep_s * 1e3
            );
        }
        if let (Some((attention, peaks)), Some(spread)) = (&per_rank, attention_spread) {
            let ms: Vec<String> = attention
                .iter()
                .map(|x| format!("{:.1}", x * 1e3))
                .collect();
            let mib: Vec<String> = peaks.iter().map(|x| format!("{x:.0}")).collect();
            exposed += &format!(
                " | CP attention ms/step per rank {} (slowest/fastest {spread:.3}), peak MiB per rank {}",
                ms.join(" "),
                mib.join(" ")
            );
        }
        println!(
            "bench train | {} {} {layout_name} b={batch} s={seq} threads={threads} AC {ac} | tok/s {tok_s:.0} ({:.0}/device) | step {:.1} ms (min {:.1}, max {:.1}) | GFLOP/s {gflops:.1} | MFU {mfu:.1}% | {memory} (estimate {:.0} MiB){exposed} | loss {:.3} -> {:.3}",
            be.name(),
            cfg.model.flavor,
            tok_s / world as f64,
            median * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            mib(estimate_bytes),
            losses[0],
            losses[losses.len() - 1]
        );
    }
    Ok(Some(timed_s))
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
                be.matmul(&mut out, &a, &b, m, k, n, trans_a, trans_b, false);
            }
            best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        let op = |t: bool| if t { "t" } else { "n" };
        println!(
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
        let o = crate::launch::launcher::LaunchOptions::local(a.nproc, worker_args);
        return crate::launch::launcher::launch(&o);
    };
    let timeout = std::time::Duration::from_secs(300);
    let (g, _store) = crate::launch::world_group(&env, "bench", timeout, timeout)?;
    let n = g.size() as f64;
    if g.rank() == 0 {
        println!(
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
        if g.rank() == 0 {
            let bw = |t: f64, factor: f64| bytes / t * factor / 1e9;
            println!(
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
