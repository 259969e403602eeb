//! `titan plan --calibrate`: this CPU as the cost model sees it, measured by short `titan bench`
//! runs of this very binary (one process of the debug model at one thread for batches 1 and 8,
//! once with gradient accumulation, once on every core; the MoE debug model; two ranks of tensor
//! and of context parallelism, TP 2 × DDP 2 on four; collectives between two local ranks),
//! stored as JSON (`$TITAN_PLAN_CALIBRATION`, else `~/.cache/titan/plan_cpu.json`) and reused
//! while the host's CPU model and core count are the same.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::cost::Prediction;
use super::device::{Compute, Device, Link};
use super::layout::{AcChoice, Layout};
use super::Job;
use crate::backend::cpu::CpuBackend;
use crate::model::ModelArgs;

/// A stored calibration: the host it was measured on and the device it makes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calibration {
    pub host: String,
    pub device: Device,
    /// The measured step times (seconds) the device was fitted to, for the record.
    pub measured: Measured,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Measured {
    pub seq: usize,
    /// One thread: batch 1, batch 8, and batch 1 accumulated 8 times.
    pub one_thread_batch1_s: f64,
    pub one_thread_batch8_s: f64,
    pub one_thread_accum8_s: f64,
    /// Every core, batch 8.
    pub all_cores_batch8_s: f64,
    /// (bytes, all-gather s, reduce-scatter s) between two ranks.
    pub two_rank_collectives: Vec<(f64, f64, f64)>,
    /// Two ranks of tensor parallelism, batch 8: the step and its TP collectives' time.
    pub tp2_step_s: f64,
    /// Tensor parallelism 2 × DDP 2 on four ranks (the host saturated: its waits cost nothing).
    pub tp2_dp2_step_s: f64,
    /// Two ranks of context parallelism, batch 8.
    pub cp2_step_s: f64,
    /// One process of the MoE debug model (Qwen3 `debugmodel_moe`) on every core, batch 8.
    pub moe_step_s: f64,
    /// One process of the debug model with float8 rowwise linears (emulated) on every core, batch
    /// 8; None in a calibration stored before it was measured (the default rate then).
    #[serde(default)]
    pub float8_step_s: Option<f64>,
}

/// The CPU's model name and core count (a calibration is reused only on the same).
pub fn host() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{model} × {} cores", cores())
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn path() -> PathBuf {
    if let Some(p) = std::env::var_os("TITAN_PLAN_CALIBRATION") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").map_or(PathBuf::from("."), PathBuf::from);
    home.join(".cache/titan/plan_cpu.json")
}

/// The stored calibration of this host, or a fresh one (measured and stored) when there is none,
/// it was made on another host, or `force`.
pub fn cpu(force: bool) -> Result<Calibration> {
    let file = path();
    if !force {
        if let Ok(text) = std::fs::read_to_string(&file) {
            let stored: Calibration = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{}: not a titan plan calibration (delete it or run titan plan --calibrate)",
                    file.display()
                )
            })?;
            if stored.host == host() {
                return Ok(stored);
            }
            errln!(
                "titan plan: {} was measured on {}; calibrating this host ({})",
                file.display(),
                stored.host,
                host()
            );
        } else {
            errln!(
                "titan plan: no CPU calibration at {}; measuring this host (about a minute)",
                file.display()
            );
        }
    }
    let c = measure()?;
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&c)?;
    std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))?;
    errln!("titan plan: calibration stored in {}", file.display());
    Ok(c)
}

const SEQ: usize = 256;

/// Runs the benchmarks and fits the device: the slope of batch 8 over batch 1 is the compute
/// rate, the accumulated run separates the per-microbatch cost from the per-step optimizer's,
/// the all-core run the threads' efficiency, the two-rank collectives the host link.
fn measure() -> Result<Calibration> {
    let run = |extra: &[&str]| -> Result<serde_json::Value> {
        let seq = SEQ.to_string();
        let mut args = vec![
            "bench", "train", "--json", "--steps", "4", "--warmup", "2", "--seq", &seq,
        ];
        args.extend(extra);
        let out = titan(&args)?;
        Ok(serde_json::from_str(last_line(&out)?)?)
    };
    let step = |row: &serde_json::Value| {
        row["step_s_median"]
            .as_f64()
            .context("bench train --json without step_s_median")
    };
    let bench = |threads: usize, batch: usize, global: usize| -> Result<f64> {
        let (t, b, g) = (threads.to_string(), batch.to_string(), global.to_string());
        step(&run(&[
            "--threads",
            &t,
            "--batch",
            &b,
            "--training.global_batch_size",
            &g,
        ])?)
    };
    let (t1, t8, acc8) = (bench(1, 1, 1)?, bench(1, 8, 8)?, bench(1, 1, 8)?);
    let all = bench(cores(), 8, 8)?;
    let tp2 = run(&[
        "--nproc",
        "2",
        "--batch",
        "8",
        "--parallelism.tensor_parallel_degree",
        "2",
    ])?;
    let tp2_dp2 = run(&[
        "--nproc",
        "4",
        "--batch",
        "8",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ])?;
    let cp2 = run(&[
        "--nproc",
        "2",
        "--batch",
        "8",
        "--parallelism.context_parallel_degree",
        "2",
    ])?;
    let moe = run(&[
        "--batch",
        "8",
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel_moe",
    ])?;
    let float8 = run(&["--batch", "8", "--float8", "rowwise"])?;
    let comm = titan(&[
        "bench",
        "comm",
        "--json",
        "--nproc",
        "2",
        "--sizes-mib",
        "1,16",
        "--iters",
        "5",
    ])?;
    let mut collectives = Vec::new();
    for line in comm.lines().filter(|l| l.starts_with('{')) {
        let row: serde_json::Value = serde_json::from_str(line)?;
        let f = |k: &str| row[k].as_f64().context("bench comm --json row");
        collectives.push((f("bytes")?, f("all_gather_s")?, f("reduce_scatter_s")?));
    }
    let measured = Measured {
        seq: SEQ,
        one_thread_batch1_s: t1,
        one_thread_batch8_s: t8,
        one_thread_accum8_s: acc8,
        all_cores_batch8_s: all,
        two_rank_collectives: collectives,
        tp2_step_s: step(&tp2)?,
        tp2_dp2_step_s: step(&tp2_dp2)?,
        cp2_step_s: step(&cp2)?,
        moe_step_s: step(&moe)?,
        float8_step_s: Some(step(&float8)?),
    };
    Ok(Calibration {
        host: host(),
        device: fit(&measured)?,
        measured,
    })
}

/// The CPU device the measurements make (see `measure`).
pub fn fit(m: &Measured) -> Result<Device> {
    let args =
        crate::model::families::flavor(&crate::model::families::llama3::Llama3, "debugmodel")?;
    let seq_flops = args.flops_per_token(m.seq) * m.seq as f64;
    // t1 = opt + mb + x, t8 = opt + mb + 8x, acc8 = opt + 8·(mb + x).
    let x = (m.one_thread_batch8_s - m.one_thread_batch1_s) / 7.0;
    let microbatch = ((m.one_thread_accum8_s - m.one_thread_batch1_s) / 7.0 - x).max(0.0);
    let optimizer = (m.one_thread_batch1_s - microbatch - x).max(0.0);
    if x <= 0.0 {
        bail!("titan plan --calibrate: batch 8 ran no slower than batch 1 ({:.4} s vs {:.4} s); the machine was too noisy, run it again", m.one_thread_batch8_s, m.one_thread_batch1_s);
    }
    let n = cores();
    let thread_efficiency = (m.one_thread_batch8_s / (n as f64 * m.all_cores_batch8_s)).min(1.0);
    let link = host_link(&m.two_rank_collectives)?;
    let rate = seq_flops / x;
    let mut device = Device {
        name: "cpu".into(),
        peak_tflops: rate * n as f64 / 1e12,
        memory_bytes: None,
        compute: Compute {
            flops_per_s: rate,
            block_overhead_s: microbatch / args.n_layers as f64,
            optimizer_s_per_param: optimizer / args.num_params() as f64,
        },
        intra: link,
        inter: link,
        per_node: usize::MAX,
        wire_bytes: 4,
        overlaps: false,
        cores: n,
        thread_efficiency,
        step_alpha_s: 0.0,
        tp_efficiency: 1.0,
        cp_efficiency: 1.0,
        moe_efficiency: 1.0,
        // Fitted below from the float8 run; this rate where a stored calibration has none.
        float8_speedup: super::device::emulated_float8_speedup(),
        // The calibrated `moe_efficiency` covers the experts' small GEMMs on the CPU.
        grouped_gemm: None,
    };
    fit_parallel_costs(&mut device, m, &args)?;
    Ok(device)
}

/// The one-process debug job of `local_batch` sequences, as a layout.
fn one(local_batch: usize) -> Layout {
    Layout {
        pp: 1,
        dp_replicate: 1,
        dp_shard: 1,
        cp: 1,
        tp: 1,
        ep: 1,
        schedule: None,
        microbatch_size: local_batch,
        local_batch,
        ac: AcChoice::None,
    }
}

/// The calibration's float8 run: rowwise linears (`titan bench train --float8 rowwise`).
const FLOAT8_ROWWISE: [&str; 4] = [
    "--model.converters",
    "quantize.linear.float8",
    "--quantize.linear.float8.recipe_name",
    "rowwise",
];

/// The MoE, TP and CP efficiencies, the in-step wait and float8's rate, each fitted through the
/// planner's own prediction of its run.
fn fit_parallel_costs(device: &mut Device, m: &Measured, args: &ModelArgs) -> Result<()> {
    let moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"];
    // The efficiencies where the host is saturated (no waits count), then the wait per in-step
    // collective as what the two-rank TP step leaves unexplained, then CP's with those waits.
    device.moe_efficiency = fit_efficiency(
        device,
        |d, e| d.moe_efficiency = e,
        (one(8), &moe),
        m.moe_step_s,
    )?;
    let tp2_dp2 = Layout {
        tp: 2,
        dp_replicate: 2,
        ..one(8)
    };
    device.tp_efficiency = fit_efficiency(
        device,
        |d, e| d.tp_efficiency = e,
        (tp2_dp2, &[]),
        m.tp2_dp2_step_s,
    )?;
    let tp2 = predict(device, Layout { tp: 2, ..one(8) }, &[])?;
    let collectives = (8 * args.n_layers + 2) as f64;
    device.step_alpha_s = ((m.tp2_step_s - tp2.step_s) / collectives).max(0.0);
    device.cp_efficiency = fit_efficiency(
        device,
        |d, e| d.cp_efficiency = e,
        (Layout { cp: 2, ..one(8) }, &[]),
        m.cp2_step_s,
    )?;
    if let Some(measured) = m.float8_step_s {
        device.float8_speedup = fit_efficiency(
            device,
            |d, e| d.float8_speedup = e,
            (one(8), &FLOAT8_ROWWISE),
            measured,
        )?;
    }
    Ok(())
}

/// The efficiency (set on the device by `set`) that makes `layout`'s predicted step `measured`:
/// bisection, the predicted step falling as the efficiency rises.
fn fit_efficiency(
    device: &Device,
    set: fn(&mut Device, f64),
    (layout, model): (Layout, &[&str]),
    measured: f64,
) -> Result<f64> {
    let (mut low, mut high) = (0.05, 1.5);
    for _ in 0..40 {
        let mid = (low + high) / 2.0;
        let mut trial = device.clone();
        set(&mut trial, mid);
        match predict(&trial, layout.clone(), model)?.step_s > measured {
            true => low = mid,
            false => high = mid,
        }
    }
    Ok((low + high) / 2.0)
}

/// The planner's prediction of `layout` of the debug job (with `model`'s overrides).
fn predict(device: &Device, layout: Layout, model: &[&str]) -> Result<Prediction> {
    let cpu = CpuBackend::new();
    let world = layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp;
    let job = Job {
        config: None,
        overrides: model.iter().map(|s| s.to_string()).collect(),
        world,
        device: device.clone(),
        sizing: &cpu,
        ranks_sharing_memory: world,
        vary_ac: false,
    };
    Ok(job.weigh(&layout)?.prediction)
}

/// Alpha and beta of the host's transport from two ranks' all-gathers and reduce-scatters at two
/// sizes (each moves half the bytes: `t = α + bytes/2 · β`).
fn host_link(rows: &[(f64, f64, f64)]) -> Result<Link> {
    let [small, large] = rows else {
        bail!(
            "titan plan --calibrate: bench comm gave {} sizes, expected 2",
            rows.len()
        );
    };
    let t = |r: &(f64, f64, f64)| (r.1 + r.2) / 2.0;
    let beta = ((t(large) - t(small)) / ((large.0 - small.0) / 2.0)).max(1e-12);
    let alpha = (t(small) - small.0 / 2.0 * beta).max(0.0);
    Ok(Link {
        alpha_s: alpha,
        beta_s_per_byte: beta,
    })
}

/// This binary's output for `args`, failing with its stderr.
fn titan(args: &[&str]) -> Result<String> {
    let exe = std::env::current_exe().context("cannot find the titan binary")?;
    let out = Command::new(&exe)
        .args(args)
        .env_remove("RAYON_NUM_THREADS")
        .output()
        .with_context(|| format!("cannot run {}", exe.display()))?;
    if !out.status.success() {
        bail!(
            "titan plan --calibrate: `titan {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn last_line(text: &str) -> Result<&str> {
    text.lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line in the benchmark's output")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 2-core Xeon's measurements (this file's own calibration of 2026-12-03).
    fn measured() -> Measured {
        Measured {
            seq: 256,
            one_thread_batch1_s: 0.135,
            one_thread_batch8_s: 0.771,
            one_thread_accum8_s: 0.862,
            all_cores_batch8_s: 0.435,
            two_rank_collectives: vec![
                (1048576.0, 2.18e-4, 1.59e-4),
                (16777216.0, 1.83e-3, 2.18e-3),
            ],
            tp2_step_s: 0.518,
            tp2_dp2_step_s: 0.890,
            cp2_step_s: 0.546,
            moe_step_s: 0.567,
            float8_step_s: Some(0.525),
        }
    }

    #[test]
    fn a_calibration_stored_before_float8_speedup_existed_still_loads() {
        let d = fit(&measured()).unwrap();
        let mut json = serde_json::to_value(&d).unwrap();
        json.as_object_mut().unwrap().remove("float8_speedup");
        let read: Device = serde_json::from_value(json).unwrap();
        let default = crate::plan::device::emulated_float8_speedup();
        assert_eq!(
            read,
            Device {
                float8_speedup: default,
                ..d
            }
        );
        let mut json = serde_json::to_value(measured()).unwrap();
        json.as_object_mut().unwrap().remove("float8_step_s");
        let old: Measured = serde_json::from_value(json).unwrap();
        assert_eq!(old.float8_step_s, None);
        // Without the float8 run the fit keeps the measured-once rate.
        assert_eq!(fit(&old).unwrap().float8_speedup, default);
    }

    #[test]
    fn the_fitted_cpu_predicts_its_own_calibration_runs() {
        let m = measured();
        let d = fit(&m).unwrap();
        let moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"];
        let runs: [(Layout, &[&str], f64); 5] = [
            (one(8), &moe, m.moe_step_s),
            (one(8), &FLOAT8_ROWWISE, m.float8_step_s.unwrap()),
            (
                Layout {
                    tp: 2,
                    dp_replicate: 2,
                    ..one(8)
                },
                &[],
                m.tp2_dp2_step_s,
            ),
            (Layout { tp: 2, ..one(8) }, &[], m.tp2_step_s),
            (Layout { cp: 2, ..one(8) }, &[], m.cp2_step_s),
        ];
        for (layout, model, want) in runs {
            let got = predict(&d, layout.clone(), model).unwrap().step_s;
            // The in-step wait is never negative: a host on which TP 2's step is explained
            // without one predicts it no faster than measured.
            let clamped = layout.tp == 2 && layout.dp_replicate == 1 && d.step_alpha_s == 0.0;
            assert!(
                (clamped && got >= want) || (got - want).abs() <= 1e-3 * want,
                "{}: predicted {got} s, measured {want} s ({d:?})",
                layout.describe()
            );
        }
        let (alpha, beta) = (d.intra.alpha_s, d.intra.beta_s_per_byte);
        assert!(
            alpha > 0.0 && (1e-11..1e-9).contains(&beta),
            "{:?}",
            d.intra
        );
        assert!(
            d.compute.flops_per_s > 1e10 && d.thread_efficiency <= 1.0,
            "{d:?}"
        );
    }

    #[test]
    fn a_calibration_that_cannot_be_fitted_says_so() {
        let m = Measured {
            one_thread_batch8_s: 0.1,
            ..measured()
        };
        let e = fit(&m).unwrap_err();
        assert!(format!("{e}").contains("too noisy"), "{e}");
    }
}
