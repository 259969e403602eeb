//! `titan bench train`: a few training steps on random tokens, timed after warm-up; prints the median
//! tokens/s, GFLOP/s (TorchTitan's FLOP count) and peak resident memory, comparable with
//! `shared/bench/torch_llama_cpu.py`.

use std::time::Instant;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, GemmPrecision};
use crate::backend::Backend;
use crate::config::OptimizerConfig;
use crate::model::{init_params, Llama, ModelArgs, ParamSet, Workspace};
use crate::parallel::plan::{ParamState, RankLayout};
use crate::train::memory::peak_memory;
use crate::train::metrics::default_peak_tflops;
use crate::train::optimizer::AdamW;
use crate::train::step::train_step;
use crate::train::trainer::init_threads;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchTrainArgs {
    #[arg(long, default_value = "debugmodel")]
    pub flavor: String,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Timed steps (after warm-up).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// CPU threads (0: every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Override the flavor's number of KV heads (grouped-query attention).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Print one JSON object instead of a line of text.
    #[arg(long)]
    pub json: bool,
    /// Time every kernel and print where the timed steps went (on CUDA each op then waits for the
    /// GPU, so the profiled step is slower than a plain one).
    #[arg(long)]
    pub profile_ops: bool,
    /// cpu or cuda (GPU 0).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// `mixed_precision_param`: bfloat16 (bf16 weights in compute; bf16 tensor-core GEMMs on
    /// CUDA), tfloat32 (CUDA) or float32. Default: bfloat16 on CUDA, float32 on the CPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// Peak TFLOP/s for MFU; 0 uses the device default (989 for an H100/H200 in bf16).
    #[arg(long, default_value_t = 0.0)]
    pub peak_tflops: f64,
}

impl BenchTrainArgs {
    fn precision(&self) -> &str {
        self.precision.as_deref().unwrap_or("float32")
    }
}

pub fn run_train(a: &BenchTrainArgs) -> Result<()> {
    init_threads(a.threads);
    if let Some(p) = &a.precision {
        if !crate::config::PRECISIONS.contains(&p.as_str()) {
            bail!(
                "--precision `{p}` is not known (accepted: {})",
                crate::config::PRECISIONS.join(", ")
            );
        }
    }
    let mut a = a.clone();
    a.precision.get_or_insert_with(|| {
        if a.device == "cuda" {
            "bfloat16"
        } else {
            "float32"
        }
        .to_string()
    });
    let a = &a;
    match a.device.as_str() {
        "cpu" => {
            let be = if a.profile_ops {
                CpuBackend::profiled()
            } else {
                CpuBackend::new()
            };
            let timed_s = bench_on(&be, a, &|| be.profiler.reset())?;
            if a.profile_ops {
                print!("{}", be.profiler.report(timed_s));
            }
            Ok(())
        }
        "cuda" => {
            let mut be = CudaBackend::new(0, GemmPrecision::from_config(a.precision())?)?;
            if a.profile_ops {
                be.enable_profiling();
            }
            let timed_s = bench_on(&be, a, &|| be.profiler.reset())?;
            if a.profile_ops {
                print!("{}", be.profiler.report(timed_s));
            }
            Ok(())
        }
        other => bail!("--device `{other}` is not known (accepted: cpu, cuda)"),
    }
}

/// Runs the timed steps; `on_warm` is called once the warm-up steps are done. Returns the seconds
/// spent in timed steps.
fn bench_on<B: Backend>(be: &B, a: &BenchTrainArgs, on_warm: &dyn Fn()) -> Result<f64> {
    let mut args = ModelArgs::flavor(&a.flavor)?;
    if let Some(kv) = a.kv_heads {
        args.n_kv_heads = kv;
    }
    args.validate()?;
    let param_dtype = crate::model::ParamDtype::from_config(a.precision());
    let local = crate::model::LocalShapes::whole(&args);
    let mut estimate = crate::train::memory::MemoryEstimate::new(&args, &local, a.batch, a.seq)
        .with_backend_scratch(be, &local, a.batch, a.seq);
    if param_dtype == crate::model::ParamDtype::BFloat16 {
        estimate = estimate.with_compute_copy(be);
    }
    crate::train::memory::check_fits(
        &estimate,
        &format!("bench of {} at {}×{}", a.flavor, a.batch, a.seq),
        be.device_free_memory(),
        1,
    )?;
    let setup = Instant::now();
    let model = Llama::new(be, args.clone(), a.seq)?;
    let specs = model.param_specs();
    let state = ParamState::Whole {
        params: init_params(be, &args, 0),
        grads: ParamSet::zeros(be, &specs),
        bf16_copy: (param_dtype == crate::model::ParamDtype::BFloat16)
            .then(|| ParamSet::zeros(be, &specs)),
        ddp: None,
    };
    let mut layout = RankLayout::new(model, state, None, None);
    let mut opt = AdamW::new(be, &specs, OptimizerConfig::default());
    let mut ws = Workspace::new(be, &args, a.batch, a.seq);
    be.synchronize();
    eprintln!(
        "bench setup of {} (parameters, optimizer, buffers): {:.1} s",
        a.flavor,
        setup.elapsed().as_secs_f64()
    );
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let batches: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            (0..a.batch * (a.seq + 1))
                .map(|_| rng.gen_range(0..args.vocab_size as u32))
                .collect()
        })
        .collect();
    let mut times = Vec::new();
    let mut losses = Vec::new();
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            on_warm();
        }
        be.synchronize();
        let t0 = Instant::now();
        let (loss, _) = train_step(
            be,
            &mut layout,
            &mut opt,
            &mut ws,
            std::slice::from_ref(&batches[i % batches.len()]),
            8e-4,
            i as u64 + 1,
            1.0,
        )?;
        be.synchronize();
        let dt = t0.elapsed().as_secs_f64();
        eprintln!(
            "bench step {}/{}{}: {dt:.3} s, loss {loss:.4}",
            i + 1,
            a.warmup + a.steps,
            if i < a.warmup { " (warm-up)" } else { "" }
        );
        losses.push(loss);
        if i >= a.warmup {
            times.push(dt);
        }
    }
    let timed_s: f64 = times.iter().sum();
    times.sort_by(|x, y| x.total_cmp(y));
    let median = times[times.len() / 2];
    let tokens = (a.batch * a.seq) as f64;
    let tok_s = tokens / median;
    let gflops = tok_s * args.flops_per_token(a.seq) / 1e9;
    let peak_rss = peak_memory();
    let device_peak = be.device_peak_memory();
    let threads = rayon::current_num_threads();
    let peak_tflops = if a.peak_tflops > 0.0 {
        a.peak_tflops
    } else {
        default_peak_tflops(be, threads)
    };
    let mfu = 100.0 * gflops / 1e3 / peak_tflops;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"device": be.name(), "precision": a.precision(), "flavor": a.flavor, "batch": a.batch, "seq": a.seq, "threads": threads, "n_kv_heads": args.n_kv_heads,
                "step_s_median": median, "step_s_min": times[0], "step_s_max": times[times.len()-1], "tokens_per_s": tok_s,
                "gflops": gflops, "tflops": gflops / 1e3, "mfu_pct": mfu, "peak_tflops": peak_tflops,
                "peak_rss_mib": mib(peak_rss), "peak_device_mib": device_peak.map(mib),
                "loss_first": losses[0], "loss_last": losses[losses.len()-1]})
        );
    } else {
        let memory = match device_peak {
            Some(b) => format!("peak device memory {:.0} MiB", mib(b)),
            None => format!("peak RSS {:.0} MiB", mib(peak_rss)),
        };
        println!(
            "bench train | {} {} b={} s={} threads={threads} | tok/s {tok_s:.0} | step {:.1} ms (min {:.1}, max {:.1}) | GFLOP/s {gflops:.1} | MFU {mfu:.1}% | {memory} | loss {:.3} -> {:.3}",
            be.name(),
            a.flavor,
            a.batch,
            a.seq,
            median * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            losses[0],
            losses[losses.len() - 1]
        );
    }
    Ok(timed_s)
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
        let o = crate::launch::launcher::LaunchOptions {
            nproc: a.nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            max_restarts: 0,
            worker_args,
        };
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
