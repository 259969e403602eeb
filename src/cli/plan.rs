//! `titan plan`: the command line of the planner (`crate::plan`): which devices, how many, the
//! job's config and overrides; prints the best layouts as a table and the best one's TOML
//! sections, or a JSON list for tools (`--json`).

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::backend::cpu::CpuBackend;
use crate::plan::device::{self, PlannedGpu};
use crate::plan::layout::Layout;
use crate::plan::{calibrate, Candidate, Job, Plan};
use crate::train::memory::gib;

#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// A TOML job config (default: the built-in debug model job); the overrides change it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// GPUs in the job (with --gpu).
    #[arg(long)]
    pub ngpu: Option<usize>,
    /// The GPU kind: h100, h200 or b200.
    #[arg(long, default_value = "h100")]
    pub gpu: String,
    /// Memory per GPU in GiB, when it is not the kind's usual (TorchTitan's H100s had 95).
    #[arg(long)]
    pub gpu_memory_gib: Option<f64>,
    /// Plan N CPU ranks on this machine instead (its calibration, measured once and stored).
    #[arg(long)]
    pub nproc: Option<usize>,
    /// Measure this CPU again (short `titan bench` runs) and store the result.
    #[arg(long)]
    pub calibrate: bool,
    /// Keep the config's activation checkpointing instead of weighing none, op and full.
    #[arg(long)]
    pub keep_ac: bool,
    /// Rows of the table.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// A JSON list, best first, instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Any config key: --section.key VALUE (as `titan train`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "--section.key VALUE"
    )]
    pub overrides: Vec<String>,
}

pub fn run(a: &PlanArgs) -> Result<()> {
    let cpu = CpuBackend::new();
    let gpu_sizing;
    let (job, what) = match (a.nproc, a.ngpu) {
        (Some(_), Some(_)) => {
            bail!("titan plan: give --nproc N (CPU ranks here) or --ngpu N --gpu KIND, not both")
        }
        (None, None) if a.calibrate => {
            let c = calibrate::cpu(true)?;
            outln!("{}", serde_json::to_string_pretty(&c)?);
            return Ok(());
        }
        (None, None) => bail!(
            "titan plan: give --ngpu N (with --gpu {}) or --nproc N (CPU ranks on this machine)",
            device::GPUS.join("|")
        ),
        (Some(n), None) => {
            let c = calibrate::cpu(a.calibrate)?;
            let job = Job {
                config: a.config.clone(),
                overrides: a.overrides.clone(),
                world: n,
                device: c.device,
                sizing: &cpu,
                ranks_sharing_memory: n,
                vary_ac: !a.keep_ac,
            };
            (job, format!("{n} CPU ranks on {}", c.host))
        }
        (None, Some(n)) => {
            let (device, overrides, sizing) = gpu(a)?;
            gpu_sizing = sizing;
            let what = format!(
                "{n} × {} ({:.0} GiB each)",
                a.gpu,
                gib(gpu_sizing.memory_bytes)
            );
            let job = Job {
                config: a.config.clone(),
                overrides,
                world: n,
                device,
                sizing: &gpu_sizing,
                ranks_sharing_memory: 1,
                vary_ac: !a.keep_ac,
            };
            (job, what)
        }
    };
    let plan = job.plan()?;
    if !plan.candidates.iter().any(Candidate::fits) {
        bail!("{}", nothing_fits(&job, &plan, &what));
    }
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&json(&plan, a.top))?);
    } else {
        out!("{}", table(&plan, &what, a.top));
    }
    Ok(())
}

/// The GPU of `--gpu` (with `--gpu-memory-gib`), the job's overrides (bf16 unless they say
/// otherwise, as on CUDA) and how the CUDA backend would size its memory.
fn gpu(a: &PlanArgs) -> Result<(device::Device, Vec<String>, PlannedGpu)> {
    let mut device = device::gpu(&a.gpu)?;
    if let Some(g) = a.gpu_memory_gib {
        if !(g > 0.0 && g < 1e5) {
            bail!("titan plan: --gpu-memory-gib {g} is not a memory size in GiB");
        }
        device.memory_bytes = Some((g * (1u64 << 30) as f64) as u64);
    }
    let memory_bytes = device.memory_bytes.expect("a GPU has its memory");
    let mut overrides = vec![
        "--training.mixed_precision_param".to_string(),
        "bfloat16".into(),
    ];
    overrides.extend(a.overrides.iter().cloned());
    let cfg = crate::config::Config::load(a.config.as_deref(), &overrides)?;
    let sizing = PlannedGpu {
        memory_bytes,
        bf16: cfg.training.mixed_precision_param == "bfloat16",
        float8_gemms: cfg.wants_float8_gemms(),
    };
    Ok((device, overrides, sizing))
}

/// The JSON list: the best `top` that fit, then the best of those that do not (with why).
fn json(plan: &Plan, top: usize) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = plan
        .candidates
        .iter()
        .filter(|c| c.fits())
        .take(top)
        .chain(plan.candidates.iter().filter(|c| !c.fits()).take(top))
        .map(|c| {
            let p = &c.prediction;
            serde_json::json!({
                "layout": c.layout.describe(),
                "overrides": c.overrides,
                "fits": c.fits(),
                "memory_gib": gib(c.memory_bytes),
                "why": c.why,
                "tokens_per_s": c.fits().then_some(p.tokens_per_s),
                "step_s": c.fits().then_some(p.step_s),
                "mfu_pct": c.fits().then_some(p.mfu * 100.0),
                "bubble": p.bubble,
                "exposed_comm_s": p.exposed_comm_s,
                "activation_checkpoint": c.layout.ac.name(),
            })
        })
        .collect();
    serde_json::Value::Array(rows)
}

fn table(plan: &Plan, what: &str, top: usize) -> String {
    let fitting = plan.candidates.iter().filter(|c| c.fits()).count();
    let m = &plan.base.model;
    let mut s = format!(
        "titan plan: {} {} on {what}, seq_len {}: {} layouts weighed, {fitting} fit, {} do not, {} refused by titan's checks\n",
        m.name,
        m.flavor,
        plan.base.training.seq_len,
        plan.candidates.len() + plan.refused,
        plan.candidates.len() - fitting,
        plan.refused
    );
    s += &format!(
        "{:>3}  {:<54} {:>4} {:>5} {:>9} {:>12} {:>11} {:>6} {:>7} {:>10}\n",
        "#",
        "layout",
        "ac",
        "batch",
        "GiB/rank",
        "tokens/s",
        "tok/s/dev",
        "MFU%",
        "bubble",
        "comm ms"
    );
    let world = plan_world(plan);
    for (i, c) in plan
        .candidates
        .iter()
        .filter(|c| c.fits())
        .take(top)
        .enumerate()
    {
        let p = &c.prediction;
        s += &format!(
            "{:>3}  {:<54} {:>4} {:>5} {:>9.2} {:>12.1} {:>11.1} {:>6.1} {:>6.1}% {:>10.1}\n",
            i + 1,
            c.layout.describe(),
            c.layout.ac.name(),
            c.layout.local_batch,
            gib(c.memory_bytes),
            p.tokens_per_s,
            p.tokens_per_s / world as f64,
            p.mfu * 100.0,
            p.bubble * 100.0,
            p.exposed_comm_s * 1e3
        );
    }
    let best = plan.candidates.iter().find(|c| c.fits()).expect("checked");
    s += "\nThe best layout, to paste into the job's TOML:\n";
    s += &toml_sections(&best.layout);
    s += &format!("(or on the command line: {})\n", best.overrides.join(" "));
    s
}

fn plan_world(plan: &Plan) -> usize {
    plan.candidates.first().map_or(1, |c| {
        let l = &c.layout;
        l.pp * l.dp_replicate * l.dp_shard * l.cp * l.tp
    })
}

/// The layout's `[parallelism]`, `[training]` and `[activation_checkpoint]` keys.
/// Each section once, in the order the overrides first name it (a layout's overrides may come
/// back to a section: a second header of it would be invalid TOML).
fn toml_sections(l: &Layout) -> String {
    let overrides = l.overrides();
    let mut sections: Vec<(&str, String)> = Vec::new();
    for pair in overrides.chunks(2) {
        let (key, value) = (&pair[0][2..], &pair[1]);
        let (sec, name) = key.split_once('.').expect("section.key");
        let line = match value.parse::<f64>().is_err() {
            true => format!("{name} = \"{value}\"\n"),
            false => format!("{name} = {value}\n"),
        };
        match sections.iter_mut().find(|(s, _)| *s == sec) {
            Some((_, lines)) => lines.push_str(&line),
            None => sections.push((sec, line)),
        }
    }
    sections
        .into_iter()
        .map(|(sec, lines)| format!("[{sec}]\n{lines}"))
        .collect()
}

/// The answer when no layout fits: the smallest rank of all and, for GPUs, the smallest device
/// count (doubling) at which one would.
fn nothing_fits(job: &Job, plan: &Plan, what: &str) -> String {
    let Some(smallest) = plan.candidates.first() else {
        return format!("titan plan: titan's checks refused every layout of this job on {what} ({} tried); check the model's heads, layers and batch against the device count", plan.refused);
    };
    let mut s = format!(
        "titan plan: no layout fits on {what}: the smallest needs {:.1} GiB per rank ({}, activation checkpointing {}):\n{}",
        gib(smallest.memory_bytes),
        smallest.layout.describe(),
        smallest.layout.ac.name(),
        smallest.why.as_deref().unwrap_or("")
    );
    if job.ranks_sharing_memory == 1 {
        for factor in [2, 4, 8, 16, 32, 64] {
            let bigger = Job {
                vary_ac: true,
                ..job.resized(job.world * factor)
            };
            if let Ok(p) = bigger.plan() {
                if p.candidates.iter().any(Candidate::fits) {
                    s += &format!(
                        "\nThe smallest device count tried that fits: {} (--ngpu {})",
                        bigger.world, bigger.world
                    );
                    return s;
                }
            }
        }
        s += &format!("\nNo count up to {} devices fits either.", job.world * 64);
    }
    s
}
