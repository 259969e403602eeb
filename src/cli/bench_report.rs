//! What a `titan bench train` run measured and how rank 0 reports it: the model's communication
//! clocks and this rank's timed steps (`Timing`, filled by `bench::time_steps`), the job-wide
//! figures gathered over the ranks (`JobFigures`), and the report printed as one JSON object or
//! one line of text (`BenchReport`).

use anyhow::Result;

use crate::backend::transfers::Transfers;
use crate::backend::Backend;
use crate::comm::group::ReduceOp;
use crate::config::Config;
use crate::launch::Distributed;
use crate::model::{Decoder, ModelArgs};
use crate::parallel::layout::RankLayout;
use crate::train::compose::ComposedRank;
use crate::train::memory::{peak_memory, MemoryEstimate};
use crate::train::metrics::{default_peak_tflops, ExpertLoad};

/// The model's running clocks (seconds since it was built) of the communication and attention
/// the bench reports per step: read once at the end of warm-up and once after the timed steps,
/// their difference is the timed steps' share.
#[derive(Clone, Copy, Default)]
pub(super) struct CommClocks {
    /// Tensor-parallel communication the step waited for, and all of it.
    exposed_tp: f64,
    comm_tp: f64,
    /// Context-parallel attention.
    attention_cp: f64,
    /// Expert-parallel token exchange (all-to-all).
    exchange_ep: f64,
}

impl CommClocks {
    pub(super) fn read<B: Backend>(model: &Decoder<B>) -> Self {
        CommClocks {
            exposed_tp: model.tp().exposed_comm_seconds(),
            comm_tp: model.tp().comm_seconds(),
            attention_cp: model.cp().attention_seconds(),
            exchange_ep: model.ep().exchange_seconds(),
        }
    }
}

/// What this rank's timing loop measured.
#[derive(Default)]
pub(super) struct Timing {
    /// Seconds of each timed step, in order.
    pub(super) times: Vec<f64>,
    /// Every step's loss, the warm-up's included.
    pub(super) losses: Vec<f64>,
    /// The clocks at the end of warm-up (zero if no step was timed).
    pub(super) at_warm: CommClocks,
    /// FSDP: the bytes this rank's parameter all-gathers received per timed step.
    pub(super) fsdp_gathered_bytes: Option<f64>,
    /// Seconds of each timed step's optimizer update (rank 0's; collective with distributed Muon).
    pub(super) optimizer_times: Vec<f64>,
    /// This rank's host↔device copies over the timed steps (`backend::transfers`).
    pub(super) host_device: Transfers,
}

impl Timing {
    /// Seconds the timed steps took together.
    pub(super) fn timed_s(&self) -> f64 {
        self.times.iter().sum()
    }

    /// Seconds per timed step each clock advanced since warm-up, `now` being their reading after
    /// the `steps` timed steps.
    fn per_step(&self, now: CommClocks, steps: usize) -> CommClocks {
        let per_step = |total: f64, at_warm: f64| (total - at_warm) / steps.max(1) as f64;
        let w = &self.at_warm;
        CommClocks {
            exposed_tp: per_step(now.exposed_tp, w.exposed_tp),
            comm_tp: per_step(now.comm_tp, w.comm_tp),
            attention_cp: per_step(now.attention_cp, w.attention_cp),
            exchange_ep: per_step(now.exchange_ep, w.exchange_ep),
        }
    }
}

/// The job-wide figures of a bench run, gathered over the ranks after the timed steps: the
/// largest rank's memory and the slowest rank's communication, the pipeline bubbles, the experts'
/// balance and the context-parallel ranks' spread.
pub(super) struct JobFigures {
    /// The largest rank's peak RSS, peak device memory (0 without a device count) and memory
    /// estimate, in bytes.
    peak_rss: f64,
    device_peak: f64,
    estimate_bytes: f64,
    /// The slowest rank's seconds per step: tensor-parallel communication exposed and in all,
    /// expert-parallel exchange.
    exposed_tp_s: f64,
    comm_tp_s: f64,
    exchange_ep_s: f64,
    /// Mixture of experts: the least balanced block's busiest expert over the mean, all steps.
    expert_balance: Option<f64>,
    /// Each pipeline rank's share of the timed steps spent waiting for another rank, and the
    /// schedule's bubble at unit cost.
    bubbles: Option<Vec<f64>>,
    unit_bubble: Option<f64>,
    /// Context parallel: every rank's figures (the load balance).
    cp: Option<CpPerRank>,
    /// How the kept activations are stored (`MemoryEstimate::activation_dtype`).
    activation_dtype: &'static str,
    /// How the residual stream between blocks is stored (`ActivationDtype::name`).
    residual_dtype: &'static str,
    /// Rank 0's float8 GEMMs over the whole run and those that multiplied dequantised values
    /// (`Backend::float8_gemm_counts`; None without float8 GEMMs).
    float8_gemms: Option<(u64, u64)>,
}

impl JobFigures {
    /// Every rank calls this together: its collectives (the MoE load sum, the pipeline bubbles'
    /// all-gather, the CP all-gather, the Max all-reduce) come in the same order on every rank.
    pub(super) fn gather<B: Backend>(
        be: &B,
        layout: &mut RankLayout<B>,
        dist: Option<&Distributed>,
        estimate: &MemoryEstimate,
        timing: &Timing,
        steps: usize,
    ) -> Result<Self> {
        let expert_balance = layout.moe_step_stats(be)?.map(|load| {
            ExpertLoad::of(&load.load)
                .iter()
                .map(|l| l.max_over_mean)
                .fold(0.0, f64::max)
        });
        let bubbles = layout.pipeline_bubbles()?;
        let unit_bubble = match &layout.pipeline {
            Some(p) => Some(p.schedule.unit_bubble()?),
            None => None,
        };
        let per_step = timing.per_step(CommClocks::read(&layout.model), steps);
        let cp = match dist.filter(|_| layout.model.local.cp > 1) {
            Some(d) => Some(CpPerRank::gather(d, per_step.attention_cp)?),
            None => None,
        };
        let peak_rss = peak_memory() as f64;
        let device_peak = be.device_peak_memory().map(|b| b as f64);
        let [peak_rss, device_peak, estimate_bytes, exposed_tp_s, comm_tp_s, exchange_ep_s] =
            job_max(dist, peak_rss, device_peak, estimate.total(), per_step)?;
        Ok(JobFigures {
            peak_rss,
            device_peak,
            estimate_bytes,
            exposed_tp_s,
            comm_tp_s,
            exchange_ep_s,
            expert_balance,
            bubbles,
            unit_bubble,
            float8_gemms: be.float8_gemm_counts(),
            cp,
            activation_dtype: estimate.activation_dtype(be.bf16_activation_f32_bytes()),
            residual_dtype: estimate.stored_dtype.name(),
        })
    }
}

/// The largest rank's memory (peak RSS, device peak, estimate) and its per-step TP exposed, TP
/// and EP communication, in that order: one Max all-reduce over the job (through f32), or this
/// rank's own figures in one process.
fn job_max(
    dist: Option<&Distributed>,
    peak_rss: f64,
    device_peak: Option<f64>,
    estimate_total: u64,
    per_step: CommClocks,
) -> Result<[f64; 6]> {
    Ok(match dist {
        Some(d) => {
            let mut v = [
                peak_rss as f32,
                device_peak.unwrap_or(0.0) as f32,
                estimate_total as f32,
                per_step.exposed_tp as f32,
                per_step.comm_tp as f32,
                per_step.exchange_ep as f32,
            ];
            d.groups.all.all_reduce(&mut v, ReduceOp::Max)?;
            v.map(f64::from)
        }
        None => [
            peak_rss,
            device_peak.unwrap_or(0.0),
            estimate_total as f64,
            per_step.exposed_tp,
            per_step.comm_tp,
            per_step.exchange_ep,
        ],
    })
}

/// Context parallel: every rank's attention seconds per step and peak memory in MiB, in rank
/// order, to show how evenly the sequence's load is split.
struct CpPerRank {
    attention: Vec<f64>,
    peaks: Vec<f64>,
}

impl CpPerRank {
    /// All-gathers this rank's attention seconds per step and peak RSS over the job (every rank
    /// calls this together).
    fn gather(d: &Distributed, attention_s: f64) -> Result<Self> {
        let mine = [attention_s as f32, peak_memory() as f32];
        let mut all = vec![0f32; 2 * d.world];
        d.groups.all.all_gather(&mine, &mut all)?;
        let (attention, peaks) = all
            .chunks(2)
            .map(|x| (x[0] as f64, x[1] as f64 / (1 << 20) as f64))
            .unzip();
        Ok(CpPerRank { attention, peaks })
    }

    /// The slowest rank's attention time over the fastest's.
    fn spread(&self) -> f64 {
        let (lo, hi) = self
            .attention
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        hi / lo.max(1e-12)
    }

    /// The text line's part: attention ms per rank, their spread and peak MiB per rank.
    fn text(&self) -> String {
        let ms: Vec<String> = self
            .attention
            .iter()
            .map(|x| format!("{:.1}", x * 1e3))
            .collect();
        let mib: Vec<String> = self.peaks.iter().map(|x| format!("{x:.0}")).collect();
        format!(
            " | CP attention ms/step per rank {} (slowest/fastest {:.3}), peak MiB per rank {}",
            ms.join(" "),
            self.spread(),
            mib.join(" ")
        )
    }
}

/// Bytes in MiB, as the report shows memory.
fn mib(bytes: f64) -> f64 {
    bytes / (1 << 20) as f64
}

/// The rates the median timed step gives: tokens/s over the job, GFLOP/s (TorchTitan's FLOP
/// count) and the MFU against the job's peak.
struct Rates {
    /// Seconds of the median timed step.
    median: f64,
    tok_s: f64,
    gflops: f64,
    /// The job's peak TFLOP/s (every device's), and the share of it used, in percent.
    peak_tflops: f64,
    mfu: f64,
}

/// What rank 0 prints of a bench run: the job and its layout, the timed steps and the rates they
/// give, and the job-wide figures; as one JSON object (`--json`) or one line of text.
pub(super) struct BenchReport<'a> {
    cfg: &'a Config,
    args: &'a ModelArgs,
    device: &'static str,
    /// Devices (ranks) in the job.
    world: usize,
    /// Micro-batches per step, and the sequences per step over the job.
    accum: usize,
    global_batch: usize,
    threads: usize,
    layout_name: String,
    /// The activation checkpointing, described.
    ac: String,
    /// The model's context- and expert-parallel degrees as this rank runs them.
    cp: usize,
    ep: usize,
    pipeline_schedule: Option<String>,
    /// The timed steps' seconds, sorted.
    times: Vec<f64>,
    /// FSDP: rank 0's parameter all-gather bytes per timed step.
    fsdp_gathered_bytes: Option<f64>,
    /// Rank 0's host↔device copies over the timed steps.
    host_device: Transfers,
    optimizer_s_median: f64,
    /// Every step's loss, the warm-up's included.
    losses: Vec<f64>,
    rates: Rates,
    /// The largest rank's peak device memory (bytes) on a backend that counts it; the text then
    /// shows it instead of the peak RSS.
    peak_device: Option<f64>,
    job: JobFigures,
}

impl<'a> BenchReport<'a> {
    /// The report of composed rank `c`'s run: its steps' `timing` (sorted here for the median)
    /// and the `job`'s gathered figures; `peak_tflops` is one device's (0: the backend's default).
    pub(super) fn new<B: Backend>(
        be: &B,
        cfg: &'a Config,
        peak_tflops: f64,
        c: &'a ComposedRank<B>,
        dist: Option<&Distributed>,
        mut timing: Timing,
        job: JobFigures,
    ) -> Result<Self> {
        timing.times.sort_by(|x, y| x.total_cmp(y));
        timing.optimizer_times.sort_by(|x, y| x.total_cmp(y));
        let world = dist.map_or(1, |d| d.world);
        let seq = cfg.training.seq_len;
        let median = timing.times[timing.times.len() / 2];
        let tok_s = (c.global_batch * seq) as f64 / median;
        let gflops = tok_s * c.args.flops_per_token(seq) / 1e9;
        let threads = rayon::current_num_threads();
        let peak_tflops = world as f64
            * if peak_tflops > 0.0 {
                peak_tflops
            } else {
                default_peak_tflops(be, threads)
            };
        let rates = Rates {
            median,
            tok_s,
            gflops,
            peak_tflops,
            mfu: 100.0 * gflops / 1e3 / peak_tflops,
        };
        let local = &c.layout.model.local;
        Ok(BenchReport {
            cfg,
            args: &c.args,
            device: be.name(),
            world,
            accum: c.accum,
            global_batch: c.global_batch,
            threads,
            layout_name: layout_name(dist, local.ep),
            ac: cfg.activation_checkpoint.mode()?.describe(),
            cp: local.cp,
            ep: local.ep,
            pipeline_schedule: c.layout.pipeline.as_ref().map(|p| p.schedule.name.clone()),
            times: timing.times,
            fsdp_gathered_bytes: timing.fsdp_gathered_bytes,
            host_device: timing.host_device,
            optimizer_s_median: timing.optimizer_times[timing.optimizer_times.len() / 2],
            losses: timing.losses,
            rates,
            peak_device: be.device_peak_memory().map(|_| job.device_peak),
            job,
        })
    }

    /// The float8 or MXFP8 linears' recipe, when `[model] converters` has them.
    fn float8_recipe(&self) -> Option<&str> {
        self.cfg.linear_recipe_name()
    }

    /// The `--json` object.
    pub(super) fn json(&self) -> serde_json::Value {
        let (cfg, r, j) = (self.cfg, &self.rates, &self.job);
        let p = &cfg.parallelism;
        let tp = p.tensor_parallel_degree;
        let (times, losses, ep) = (&self.times, &self.losses, self.ep);
        let mut object = serde_json::json!({"device": self.device, "precision": cfg.training.mixed_precision_param, "flavor": cfg.model.flavor, "batch": cfg.training.local_batch_size, "seq": cfg.training.seq_len, "threads": self.threads, "n_kv_heads": self.args.n_kv_heads,
            "nproc": self.world, "layout": self.layout_name, "global_batch": self.global_batch, "micro_batches": self.accum,
            "tensor_parallel_degree": tp, "async_tensor_parallel": p.enable_async_tensor_parallel,
            "activation_checkpoint": self.ac,
            "step_s_median": r.median, "step_s_min": times[0], "step_s_max": times[times.len()-1],
            "tokens_per_s": r.tok_s, "tokens_per_s_per_device": r.tok_s / self.world as f64,
            "gflops": r.gflops, "tflops": r.gflops / 1e3, "mfu_pct": r.mfu, "peak_tflops": r.peak_tflops,
            "peak_rss_mib": mib(j.peak_rss), "peak_device_mib": self.peak_device.map(mib),
            "memory_estimate_mib": mib(j.estimate_bytes),
            "tp_exposed_comm_ms_per_step": (tp > 1).then_some(j.exposed_tp_s * 1e3),
            "tp_comm_ms_per_step": (tp > 1).then_some(j.comm_tp_s * 1e3),
            "pipeline_schedule": self.pipeline_schedule,
            "pipeline_bubble_unit_cost": j.unit_bubble,
            "pipeline_bubble_measured_per_rank": j.bubbles,
            "context_parallel_degree": self.cp,
            "expert_parallel_degree": ep,
            "ep_all_to_all_ms_per_step": (ep > 1).then_some(j.exchange_ep_s * 1e3),
            "moe_expert_load_max_over_mean": j.expert_balance,
            "active_params": self.args.active_params(),
            "cp_attention_s_per_step_per_rank": j.cp.as_ref().map(|c| &c.attention),
            "cp_attention_slowest_over_fastest": j.cp.as_ref().map(CpPerRank::spread),
            "peak_rss_mib_per_rank": j.cp.as_ref().map(|c| &c.peaks),
            "loss_first": losses[0], "loss_last": losses[losses.len()-1]});
        object["activation_dtype"] = serde_json::json!(j.activation_dtype);
        object["residual_dtype"] = serde_json::json!(j.residual_dtype);
        object["reduce_dtype"] = serde_json::json!(cfg.training.mixed_precision_reduce);
        object["float8"] = serde_json::json!(self.float8_recipe());
        object["float8_gemms"] = serde_json::json!(j.float8_gemms.map(|g| g.0));
        object["float8_gemms_dequantised"] = serde_json::json!(j.float8_gemms.map(|g| g.1));
        // Saves every few steps show in the mean, not the median.
        object["step_s_mean"] = serde_json::json!(times.iter().sum::<f64>() / times.len() as f64);
        object["optimizer"] = serde_json::json!(cfg.optimizer.name);
        object["optimizer_ms_per_step"] = serde_json::json!(self.optimizer_s_median * 1e3);
        object["fsdp_all_gather_mib_per_step"] =
            serde_json::json!(self.fsdp_gathered_bytes.map(mib));
        let per_step = |n: u64| n as f64 / times.len() as f64;
        object["host_device_copies_per_step"] =
            serde_json::json!(per_step(self.host_device.copies));
        object["host_device_bytes_per_step"] = serde_json::json!(per_step(self.host_device.bytes));
        object
    }

    /// The line of text printed without `--json`.
    pub(super) fn text(&self) -> String {
        let (cfg, r, j) = (self.cfg, &self.rates, &self.job);
        let (batch, seq) = (cfg.training.local_batch_size, cfg.training.seq_len);
        let (layout_name, threads, ac) = (&self.layout_name, self.threads, &self.ac);
        let (tok_s, gflops, mfu) = (r.tok_s, r.gflops, r.mfu);
        let memory = match self.peak_device {
            Some(device_peak) => format!("peak device memory {:.0} MiB", mib(device_peak)),
            None => format!("peak RSS {:.0} MiB", mib(j.peak_rss)),
        };
        let exposed = self.communication_text();
        let (times, losses) = (&self.times, &self.losses);
        // MFU counts the FLOPs the model has, whatever precision computes them.
        let (float8, mfu_kind) = match self.float8_recipe() {
            Some(r) if r.starts_with("mxfp8") => {
                (format!(" {r} (emulated)"), " (bf16-equivalent FLOPs)")
            }
            Some(r) if self.device == "cuda" && cfg.wants_float8_gemms() => {
                let (run, dequantised) = self.job.float8_gemms.unwrap_or((0, 0));
                (
                    format!(" float8 {r} ({run} float8 GEMMs, {dequantised} dequantised)"),
                    " (bf16-equivalent FLOPs)",
                )
            }
            Some(r) => (
                format!(" float8 {r} (emulated)"),
                " (bf16-equivalent FLOPs)",
            ),
            None => (String::new(), ""),
        };
        format!(
            "bench train | {} {} {layout_name} b={batch} s={seq} threads={threads} AC {ac}{float8} | tok/s {tok_s:.0} ({:.0}/device) | step {:.1} ms (min {:.1}, max {:.1}) | GFLOP/s {gflops:.1} | MFU {mfu:.1}%{mfu_kind} | {memory} (estimate {:.0} MiB){exposed} | loss {:.3} -> {:.3}",
            self.device,
            cfg.model.flavor,
            tok_s / self.world as f64,
            r.median * 1e3,
            times[0] * 1e3,
            times[times.len() - 1] * 1e3,
            mib(j.estimate_bytes),
            losses[0],
            losses[losses.len() - 1]
        )
    }

    /// The text line's parts of the layout's own figures, each shown only where the layout has
    /// it: TP communication, pipeline bubbles, expert balance, EP exchange, CP spread.
    fn communication_text(&self) -> String {
        let j = &self.job;
        let mut exposed = if self.cfg.parallelism.tensor_parallel_degree > 1 {
            format!(
                " | TP comm {:.1} ms/step, exposed {:.1}",
                j.comm_tp_s * 1e3,
                j.exposed_tp_s * 1e3
            )
        } else {
            String::new()
        };
        if let (Some(b), Some(unit)) = (&j.bubbles, j.unit_bubble) {
            let per_rank: Vec<String> = b.iter().map(|x| format!("{x:.3}")).collect();
            exposed += &format!(
                " | pipeline bubble measured {} (unit-cost {unit:.3})",
                per_rank.join(" ")
            );
        }
        if let Some(bytes) = self.fsdp_gathered_bytes {
            exposed += &format!(" | FSDP all-gathers {:.2} MiB/step", mib(bytes));
        }
        if let Some(balance) = j.expert_balance {
            exposed += &format!(" | experts max/mean {balance:.2}");
        }
        if self.ep > 1 {
            exposed += &format!(
                " | EP all-to-all {:.1} ms/step (slowest rank)",
                j.exchange_ep_s * 1e3
            );
        }
        if let Some(cp) = &j.cp {
            exposed += &cp.text();
        }
        exposed
    }
}

/// The layout's name in the report: the mesh's dimensions above 1 (`tp 2 × dp_shard 2`), or
/// `one process`.
fn layout_name(dist: Option<&Distributed>, ep: usize) -> String {
    dist.map_or("one process".to_string(), |d| {
        // Expert parallelism borrows its ranks from dp_shard × cp.
        match ep > 1 {
            true => format!("{} × (ep {ep})", d.mesh.describe()),
            false => d.mesh.describe(),
        }
    })
}
