//! `titan cuda`: what a GPU machine offers (`info`), the NVRTC build of every kernel for chosen
//! architectures without a GPU (`compile`), and the CUDA-vs-CPU check of every op plus a short
//! training run on both devices (`check`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::backend::cpu::CpuBackend;
use crate::backend::crosscheck::{
    check_float8_gemms, check_ops, format_table, panic_message, OpCheck, Tolerances,
};
use crate::backend::cuda::libs::{device_count, CudaLib};
use crate::backend::cuda::{kernels, CudaBackend, GemmPrecision};
use crate::config::Config;
use crate::train::{train, RunOptions};

#[derive(clap::Subcommand, Debug)]
pub enum CudaCommand {
    /// Which CUDA libraries load, and the GPUs they see.
    Info,
    /// Compile every kernel with NVRTC for the given architectures (no GPU needed).
    Compile {
        /// Comma-separated architectures, e.g. sm_80,sm_90.
        #[arg(long, default_value = "sm_80,sm_90")]
        arch: String,
        /// Write each architecture's device code to DIR/titan_<arch>.cubin.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print ptxas's registers, shared memory and spills per kernel.
        #[arg(long)]
        verbose: bool,
    },
    /// Every op on GPU 0 against the CPU on fresh random inputs, then the debug model trained on
    /// both devices; exits non-zero when anything is outside its tolerance.
    Check(CheckArgs),
    /// NCCL on GPU 0 as a one-rank group: communicator setup through the store, each collective
    /// checked against the expected values.
    NcclCheck,
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// GEMM arithmetic on the GPU: float32 (tolerance 1e-5), tfloat32 or bfloat16 (1e-2).
    #[arg(long, default_value = "float32")]
    pub precision: String,
    /// Steps of the debug model on each device (0 skips the training comparison).
    #[arg(long, default_value_t = 20)]
    pub train_steps: u64,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Query heads of the debug model in the training comparison (4 gives head_dim 64, 2 gives
    /// 128: the shapes of the tensor-core attention kernels).
    #[arg(long)]
    pub model_heads: Option<usize>,
    /// Key/value heads of the debug model in the training comparison.
    #[arg(long)]
    pub model_kv_heads: Option<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

pub fn run(cmd: &CudaCommand) -> Result<()> {
    match cmd {
        CudaCommand::Info => info(),
        CudaCommand::Compile { arch, out, verbose } => compile(arch, out.as_ref(), *verbose),
        CudaCommand::Check(args) => check(args),
        CudaCommand::NcclCheck => nccl_check(),
    }
}

fn info() -> Result<()> {
    for lib in [
        CudaLib::Driver,
        CudaLib::Nvrtc,
        CudaLib::CublasLt,
        CudaLib::Nccl,
    ] {
        let state = if lib.is_present() { "found" } else { "MISSING" };
        outln!("{state:>8}  {}", lib.describe());
    }
    let n = device_count()?;
    outln!("{n} CUDA device(s)");
    for i in 0..n {
        let ctx = cudarc::driver::CudaContext::new(i).context("opening the CUDA device")?;
        let (major, minor) = ctx.compute_capability()?;
        outln!(
            "  {i}: {} (sm_{major}{minor}), {:.1} GiB",
            ctx.name()?,
            ctx.total_mem()? as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

fn compile(archs: &str, out: Option<&PathBuf>, verbose: bool) -> Result<()> {
    for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let compiled = kernels::compile(arch)?;
        outln!(
            "{}: {} kernels compiled by NVRTC, {} bytes of cubin",
            compiled.arch,
            kernels::KERNELS.len(),
            compiled.cubin.len()
        );
        if verbose {
            out!("{}", compiled.log);
        }
        if let Some(dir) = out {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = dir.join(format!("titan_{}.cubin", compiled.arch));
            std::fs::write(&path, &compiled.cubin)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Loss curves of the same job on two devices: the largest relative difference over the steps.
#[derive(Debug, serde::Serialize)]
struct TrainParity {
    steps: u64,
    cpu: Vec<f64>,
    cuda: Vec<f64>,
    max_rel_diff: f64,
    tolerance: f64,
    passed: bool,
    /// Why the CUDA run stopped early (an error or a panic), if it did.
    cuda_error: Option<String>,
    /// The CUDA run again with each activation-checkpointing mode, against the run without.
    activation_checkpoint: Vec<AcParity>,
}

/// A CUDA training run with activation checkpointing against the same run without it: the
/// recompute runs the same kernels, so the losses should agree to the bit.
#[derive(Debug, serde::Serialize)]
struct AcParity {
    mode: String,
    losses: Vec<f64>,
    max_rel_diff: f64,
    bit_identical: bool,
    passed: bool,
}

fn check(a: &CheckArgs) -> Result<()> {
    let precision = GemmPrecision::from_config(&a.precision)?;
    let be = CudaBackend::new(0, precision)?;
    outln!(
        "CUDA-vs-CPU check on {} ({}), GEMMs in {:?}, attention {:?}, bf16 activation copies {}",
        be.device_name(),
        be.arch(),
        precision,
        be.attention_kernels(),
        if be.activation_copies() { "on" } else { "off" }
    );
    let gemm_tol = match precision {
        GemmPrecision::Float32 => 1e-5,
        GemmPrecision::TFloat32 | GemmPrecision::BFloat16 => 1e-2,
    };
    let tol = Tolerances {
        exact: 1e-5,
        gemm: gemm_tol,
        // Attention runs on bf16 tensor cores only with bf16 GEMMs; otherwise in exact fp32.
        attention: if precision == GemmPrecision::BFloat16 {
            1e-2
        } else {
            1e-5
        },
    };
    let mut ops: Vec<OpCheck> = check_ops(&CpuBackend::new(), &be, tol, a.seed, true);
    ops.extend(crate::train::muon::check_newton_schulz(
        &CpuBackend::new(),
        &be,
        gemm_tol,
        a.seed,
    ));
    drop(be);
    ops.extend(float8_gemm_rows(a.seed)?);
    out!("{}", format_table(&ops));
    // Written now and again after training, so a run that dies in training keeps the op table.
    let write_json = |parity: Option<&TrainParity>| -> Result<()> {
        if let Some(path) = &a.json_out {
            let json = serde_json::json!({"ops": ops, "training": parity});
            std::fs::write(path, serde_json::to_string_pretty(&json)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    };
    write_json(None)?;
    let parity = if a.train_steps > 0 {
        Some(train_parity(a, gemm_tol.max(1e-4) * 10.0)?)
    } else {
        None
    };
    if let Some(p) = &parity {
        outln!(
            "training: {} steps of the debug model, loss {:.4} -> {:.4} (CPU) vs {:.4} -> {:.4} (CUDA), \
             max relative difference {:.2e} (tolerance {:.0e}): {}",
            p.steps,
            p.cpu.first().copied().unwrap_or(f64::NAN),
            p.cpu.last().copied().unwrap_or(f64::NAN),
            p.cuda.first().copied().unwrap_or(f64::NAN),
            p.cuda.last().copied().unwrap_or(f64::NAN),
            p.max_rel_diff,
            p.tolerance,
            if p.passed { "ok" } else { "FAIL" }
        );
        if let Some(e) = &p.cuda_error {
            outln!("training on CUDA failed: {e}");
        }
        for ac in &p.activation_checkpoint {
            outln!(
                "activation checkpointing {} on CUDA vs none: max relative loss difference {:.2e}{}: {}",
                ac.mode,
                ac.max_rel_diff,
                if ac.bit_identical { " (bit-identical)" } else { "" },
                if ac.passed { "ok" } else { "FAIL" }
            );
        }
    }
    write_json(parity.as_ref())?;
    let failed_ops = ops.iter().filter(|o| !o.passed).count();
    let train_failed = parity
        .as_ref()
        .is_some_and(|p| !p.passed || p.activation_checkpoint.iter().any(|ac| !ac.passed));
    if failed_ops > 0 || train_failed {
        bail!(
            "CUDA check failed: {failed_ops} op output(s) outside tolerance{}",
            if train_failed {
                ", and the loss curves differ (CPU vs CUDA, or with activation checkpointing)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// The float8 GEMMs (cuBLASLt on the casts' codes) against the CPU's emulated ones, and a row
/// saying whether each GEMM went the way it should (float8, or the dequantised values for a shape
/// float8 kernels do not take). None on a GPU without float8 tensor cores (before sm_89). The
/// other GEMMs run in exact fp32 here, so the dequantised fallback is compared at 1e-5 too.
fn float8_gemm_rows(seed: u64) -> Result<Vec<OpCheck>> {
    let mut be = CudaBackend::new(0, GemmPrecision::Float32)?;
    if let Err(e) = be.enable_fp8_gemms() {
        outln!("float8 GEMMs not checked: {e:#}");
        return Ok(Vec::new());
    }
    // Both sides multiply the same values (code · 1/scale), summed in another order.
    let (mut rows, want_fp8, want_emulated) =
        check_float8_gemms(&CpuBackend::new(), &be, 1e-5, seed);
    let (fp8, emulated) = be.fp8_gemm_counts();
    let right_way = fp8 == want_fp8 && emulated == want_emulated;
    rows.push(OpCheck {
        op: format!(
            "float8 GEMMs on cuBLASLt: {fp8} of {want_fp8} (+{emulated} of {want_emulated} dequantised)"
        ),
        rel_err: if right_way { 0.0 } else { 1.0 },
        tolerance: 0.0,
        passed: right_way,
    });
    Ok(rows)
}

fn train_parity(a: &CheckArgs, tolerance: f64) -> Result<TrainParity> {
    let dir = std::env::temp_dir().join(format!("titan-cuda-check-{}", std::process::id()));
    let run_with = |device: &str, ac: &[(&str, &str)]| -> Result<Vec<f64>> {
        let folder = dir.join(device);
        let mut overrides = vec![
            ("--training.device", device.to_string()),
            ("--training.steps", a.train_steps.to_string()),
            ("--training.mixed_precision_param", a.precision.clone()),
            ("--checkpoint.enable", "false".into()),
            ("--job.dump_folder", folder.display().to_string()),
        ];
        if let Some(h) = a.model_heads {
            overrides.push(("--model.n_heads", h.to_string()));
        }
        if let Some(h) = a.model_kv_heads {
            overrides.push(("--model.n_kv_heads", h.to_string()));
        }
        overrides.extend(ac.iter().map(|&(k, v)| (k, v.to_string())));
        let overrides: Vec<String> = overrides
            .into_iter()
            .flat_map(|(k, v)| [k.to_string(), v])
            .collect();
        let cfg = Config::load(None, &overrides)?;
        let summary = train(
            &cfg,
            &RunOptions {
                quiet: true,
                stop_after: None,
            },
        )?;
        Ok(summary.losses.iter().map(|&(_, l)| l).collect())
    };
    let run = |device: &str| run_with(device, &[]);
    let cpu = run("cpu")?;
    let (cuda, cuda_error) =
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run("cuda"))) {
            Ok(Ok(losses)) => (losses, None),
            Ok(Err(e)) => (Vec::new(), Some(format!("{e:#}"))),
            Err(payload) => (
                Vec::new(),
                Some(panic_message(payload.as_ref()).to_string()),
            ),
        };
    let rel_diff = |a: &[f64], b: &[f64]| {
        if a.len() == b.len() && b.iter().all(|l| l.is_finite()) {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs() / x.abs().max(1e-12))
                .fold(0.0, f64::max)
        } else {
            f64::NAN
        }
    };
    let max_rel_diff = rel_diff(&cpu, &cuda);
    let mut activation_checkpoint = Vec::new();
    if cuda_error.is_none() {
        let mode = "--activation_checkpoint.mode";
        let option = "--activation_checkpoint.selective_ac_option";
        for (name, ac) in [
            ("full", vec![(mode, "full")]),
            ("selective op", vec![(mode, "selective"), (option, "op")]),
            ("selective 2", vec![(mode, "selective"), (option, "2")]),
        ] {
            let losses = run_with("cuda", &ac).unwrap_or_default();
            let diff = rel_diff(&cuda, &losses);
            activation_checkpoint.push(AcParity {
                mode: name.into(),
                bit_identical: losses
                    .iter()
                    .map(|l| l.to_bits())
                    .eq(cuda.iter().map(|l| l.to_bits())),
                passed: diff <= tolerance,
                max_rel_diff: diff,
                losses,
            });
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(TrainParity {
        steps: a.train_steps,
        passed: max_rel_diff <= tolerance,
        cpu,
        cuda,
        max_rel_diff,
        tolerance,
        cuda_error,
        activation_checkpoint,
    })
}

fn nccl_check() -> Result<()> {
    use crate::backend::Backend;
    use crate::comm::device_group::DeviceGroup;
    use crate::comm::group::ReduceOp;
    use crate::comm::nccl::NcclGroup;
    use crate::comm::queue::{CollectiveQueue, DeviceQueue};
    use crate::comm::store::{StoreClient, StoreServer};
    use std::time::Duration;

    let be = CudaBackend::new(0, GemmPrecision::Float32)?;
    let secret = crate::comm::auth::JobSecret::generate();
    let server = StoreServer::start("127.0.0.1:0", &secret)?;
    let store = StoreClient::connect(&server.addr.to_string(), &secret, Duration::from_secs(10))?;
    let t = Duration::from_secs(30);
    let g = NcclGroup::connect(&store, "nccl-check", 0, 1, &be, t, t)?;
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut buf = be.upload(&values);
    g.all_reduce(&mut buf, ReduceOp::Sum)?;
    let mut failures = Vec::new();
    if be.download(&buf) != values {
        failures.push("all_reduce");
    }
    let mut gathered = be.zeros(values.len());
    g.all_gather(&buf, &mut gathered)?;
    if be.download(&gathered) != values {
        failures.push("all_gather");
    }
    let mut scattered = be.zeros(values.len());
    g.reduce_scatter(&buf, &mut scattered, ReduceOp::Avg)?;
    if be.download(&scattered) != values {
        failures.push("reduce_scatter");
    }
    // DDP's gradient sum: several buffers (one empty) in one NCCL group call.
    let mut grads = vec![be.upload(&values), be.zeros(0), be.upload(&values[..10])];
    g.all_reduce_each(&mut grads, ReduceOp::Sum)?;
    if be.download(&grads[0]) != values || be.download(&grads[2]) != values[..10] {
        failures.push("all_reduce_each");
    }
    // Collectives on the communication stream, ordered against compute by events: a value the
    // compute stream writes just before a start is what the collective reads; two collectives are
    // in flight at once with compute queued between them; compute queued after a wait reads the
    // result.
    let mut x = be.upload(&values);
    be.fill(&mut x, 3.0);
    let mut all_x = be.zeros(values.len());
    let gather = g.start_all_gather(&x, &mut all_x)?;
    let mut y = be.upload(&values);
    be.scale(&mut y, 2.0);
    let mut part = be.zeros(values.len());
    let scatter = g.start_reduce_scatter(&y, &mut part, ReduceOp::Sum)?;
    g.wait(gather)?;
    g.wait(scatter)?;
    be.scale(&mut all_x, 0.5);
    let doubled: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
    if be.download(&all_x) != vec![1.5; values.len()] || be.download(&part) != doubled {
        failures.push("ordering against compute");
    }
    // Expert parallelism's rows and CP's ring: an all-to-all with uneven parts, here the one
    // rank sending itself its part (an empty part moves nothing).
    let mut received = be.zeros(values.len());
    let all_to_all = g.start_all_to_all(&buf, &[values.len()], &mut received, &[values.len()])?;
    g.wait(all_to_all)?;
    if be.download(&received) != values {
        failures.push("all_to_all");
    }
    // TP's vocabulary-parallel loss: the row maxima through `ncclMax` (one rank: unchanged).
    let mut maxima = be.upload(&values);
    let max = DeviceGroup::start_all_reduce_max(&g, &be, &mut maxima)?;
    DeviceGroup::wait(&g, max)?;
    if be.download(&maxima) != values {
        failures.push("all_reduce_max");
    }
    // FSDP's queue on NCCL, with HSDP's all-reduce across replicas after each reduce-scatter (two
    // more one-rank groups): collectives finish in the order they started, each with its output.
    let shard = NcclGroup::connect(&store, "nccl-check-shard", 0, 1, &be, t, t)?;
    let replicas = NcclGroup::connect(&store, "nccl-check-replicas", 0, 1, &be, t, t)?;
    let mut queue: DeviceQueue<CudaBackend> = DeviceQueue::new(
        "FSDP",
        std::sync::Arc::new(shard),
        Some(std::sync::Arc::new(replicas)),
    );
    queue.start_gather(&be, be.upload(&values))?;
    queue.start_reduce_scatter(&be, be.upload(&doubled))?;
    let (gathered, reduced) = (queue.finish_oldest(&be)?, queue.finish_oldest(&be)?);
    if be.download(&gathered) != values || be.download(&reduced) != doubled {
        failures.push("FSDP queue");
    }
    let mut big = be.zeros(64 << 20);
    let t0 = std::time::Instant::now();
    for _ in 0..10 {
        g.all_reduce(&mut big, ReduceOp::Sum)?;
    }
    let per_call = t0.elapsed().as_secs_f64() / 10.0;
    outln!(
        "NCCL one-rank group on {}: all_reduce, all_reduce_each, all_gather, reduce_scatter, all_to_all, ordering against compute, FSDP queue {}; 256 MiB all_reduce {:.2} ms",
        be.device_name(),
        if failures.is_empty() { "ok" } else { "FAILED" },
        per_call * 1e3
    );
    if !failures.is_empty() {
        bail!("NCCL check failed: {}", failures.join(", "));
    }
    Ok(())
}
