//! Training metrics: one console line every `log_freq` steps, the same figures as JSON lines in
//! `{dump_folder}/metrics.jsonl`, and TensorBoard scalars when enabled.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use super::tensorboard::EventWriter;
use crate::backend::Backend;

#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    /// The whole job's tokens per second.
    pub tokens_per_s: f64,
    /// Per device (TorchTitan's `tps`): `tokens_per_s` over every rank of the job.
    pub tokens_per_s_per_device: f64,
    pub tflops: f64,
    pub mfu: f64,
    pub step_time_s: f64,
    pub data_time_pct: f64,
    pub peak_memory_bytes: u64,
    /// Ranks in the job this step (an elastic job's changes with its membership; `titan plot`
    /// marks the changes).
    pub world_size: usize,
    /// Mixture-of-experts models: each block's tokens per expert over the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_expert_load: Option<Vec<ExpertLoad>>,
    /// Mixture-of-experts models with `router_aux_loss_coef`: the step's auxiliary loss (not in
    /// `loss`, which stays the language model's; the gradients carry both).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe_aux_loss: Option<f64>,
    /// FSDP: the bytes this rank's parameter all-gathers received over the step (forward and
    /// backward; a quarter of fp32's for weights gathered in float8).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsdp_all_gather_bytes: Option<u64>,
    /// Muon: the matrices orthogonalised in this step over every rank (each matrix once), and the
    /// busiest rank's share of the step's Newton–Schulz FLOPs (1 in one process).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub muon_matrices: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub muon_max_rank_ns_share: Option<f64>,
    /// Replica-group fault tolerance: the replica groups live in this step's quorum.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live_replicas: Option<usize>,
}

/// One mixture-of-experts block's expert load over a step.
#[derive(Debug, Clone, Serialize)]
pub struct ExpertLoad {
    pub layer: usize,
    pub tokens_per_expert: Vec<u64>,
    /// The busiest and the idlest expert's tokens over the mean (1 and 1: perfectly balanced).
    pub max_over_mean: f64,
    pub min_over_mean: f64,
    /// Auxiliary-loss-free load balancing: the block's routing bias after the step, its lowest
    /// and highest entry (`with_routing_bias`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_min: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_max: Option<f32>,
}

impl ExpertLoad {
    /// Every mixture-of-experts block's load from `[layer][expert]` token counts (a dense
    /// block, with no tokens routed, is left out).
    pub fn of(load: &[Vec<u64>]) -> Vec<ExpertLoad> {
        load.iter()
            .enumerate()
            .filter(|(_, tokens)| tokens.iter().any(|&t| t > 0))
            .map(|(layer, tokens)| {
                let mean = tokens.iter().sum::<u64>() as f64 / tokens.len().max(1) as f64;
                let ratio = |x: u64| if mean > 0.0 { x as f64 / mean } else { 0.0 };
                ExpertLoad {
                    layer,
                    max_over_mean: ratio(tokens.iter().copied().max().unwrap_or(0)),
                    min_over_mean: ratio(tokens.iter().copied().min().unwrap_or(0)),
                    tokens_per_expert: tokens.clone(),
                    bias_min: None,
                    bias_max: None,
                }
            })
            .collect()
    }

    /// Each block's routing bias range from `bias` (`[layer][expert]`, the model's after the
    /// step's update).
    pub fn with_routing_bias(loads: &mut [ExpertLoad], bias: &[Vec<f32>]) {
        for l in loads.iter_mut() {
            let Some(b) = bias.get(l.layer).filter(|b| !b.is_empty()) else {
                continue;
            };
            l.bias_min = b.iter().copied().reduce(f32::min);
            l.bias_max = b.iter().copied().reduce(f32::max);
        }
    }
}

impl StepMetrics {
    pub fn console_line(&self) -> String {
        // The least balanced block's busiest expert, for MoE models.
        let experts = self.moe_expert_load.as_ref().map_or(String::new(), |l| {
            let worst = l.iter().map(|x| x.max_over_mean).fold(0.0, f64::max);
            format!(" | experts max/mean {worst:.2}")
        });
        let experts = match self.moe_aux_loss {
            Some(aux) => format!("{experts} | aux loss {aux:.5}"),
            None => experts,
        };
        format!(
            "step {:>5} | loss {:>8.4} | grad_norm {:>7.3} | lr {:.2e} | tok/s {:>8.0} | TFLOP/s {:>6.3} | MFU {:>5.1}% | step {:>6.3}s | data {:>4.1}% | mem {:>6.0} MiB{experts}",
            self.step,
            self.loss,
            self.grad_norm,
            self.lr,
            self.tokens_per_s,
            self.tflops,
            self.mfu,
            self.step_time_s,
            self.data_time_pct,
            self.peak_memory_bytes as f64 / (1 << 20) as f64
        )
    }
}

pub struct MetricsLogger {
    jsonl: File,
    tensorboard: Option<EventWriter>,
}

impl MetricsLogger {
    pub fn new(dump_folder: &Path, tensorboard_dir: Option<&Path>) -> Result<Self> {
        std::fs::create_dir_all(dump_folder)
            .with_context(|| format!("cannot create dump folder {}", dump_folder.display()))?;
        let path = dump_folder.join("metrics.jsonl");
        let jsonl = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let tensorboard = tensorboard_dir.map(EventWriter::create).transpose()?;
        Ok(MetricsLogger { jsonl, tensorboard })
    }

    pub fn log(&mut self, m: &StepMetrics) -> Result<()> {
        writeln!(self.jsonl, "{}", serde_json::to_string(m)?)?;
        if let Some(tb) = &mut self.tensorboard {
            tb.scalars(
                m.step,
                &[
                    ("loss_metrics/global_avg_loss", m.loss),
                    ("grad_norm", m.grad_norm),
                    ("lr", m.lr),
                    ("throughput(tps)", m.tokens_per_s),
                    ("tflops", m.tflops),
                    ("mfu(%)", m.mfu),
                    ("time_metrics/step_time(s)", m.step_time_s),
                    ("time_metrics/data_loading(%)", m.data_time_pct),
                    ("memory/peak_bytes", m.peak_memory_bytes as f64),
                    ("world_size", m.world_size as f64),
                ],
            )?;
            if let Some(bytes) = m.fsdp_all_gather_bytes {
                tb.scalars(m.step, &[("comm/fsdp_all_gather_bytes", bytes as f64)])?;
            }
            if let Some(aux) = m.moe_aux_loss {
                tb.scalars(m.step, &[("moe/aux_loss", aux)])?;
            }
            for l in m.moe_expert_load.iter().flatten() {
                tb.scalars(
                    m.step,
                    &[
                        (
                            &format!("moe/layer{}_max_over_mean", l.layer),
                            l.max_over_mean,
                        ),
                        (
                            &format!("moe/layer{}_min_over_mean", l.layer),
                            l.min_over_mean,
                        ),
                    ],
                )?;
                if let (Some(lo), Some(hi)) = (l.bias_min, l.bias_max) {
                    let (min, max) = (
                        format!("moe/layer{}_bias_min", l.layer),
                        format!("moe/layer{}_bias_max", l.layer),
                    );
                    tb.scalars(m.step, &[(&min, lo as f64), (&max, hi as f64)])?;
                }
            }
        }
        Ok(())
    }
}

/// The last step line of an earlier run's `{dump_folder}/metrics.jsonl` that recorded its ranks:
/// (step, world size). What a restarted run repeats is read from it (None without one).
pub fn last_recorded_step(dump_folder: &Path) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(dump_folder.join("metrics.jsonl")).ok()?;
    text.lines().rev().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        Some((v.get("step")?.as_u64()?, v.get("world_size")?.as_u64()?))
    })
}

/// The loss on held-out data after a step (`[validation]`).
#[derive(Debug, Clone, Serialize)]
pub struct ValidationMetrics {
    pub step: u64,
    pub validation_loss: f64,
    pub validation_perplexity: f64,
}

impl ValidationMetrics {
    pub fn console_line(&self) -> String {
        format!(
            "step {:>5} | validation loss {:>8.4} | perplexity {:>9.2}",
            self.step, self.validation_loss, self.validation_perplexity
        )
    }
}

impl MetricsLogger {
    /// A `metrics.jsonl` line with the validation figures beside the step, and their
    /// TensorBoard scalars.
    pub fn log_validation(&mut self, m: &ValidationMetrics) -> Result<()> {
        writeln!(self.jsonl, "{}", serde_json::to_string(m)?)?;
        if let Some(tb) = &mut self.tensorboard {
            tb.scalars(
                m.step,
                &[
                    ("validation_metrics/loss", m.validation_loss),
                    ("validation_metrics/perplexity", m.validation_perplexity),
                ],
            )?;
        }
        Ok(())
    }
}

/// Peak TFLOP/s for MFU when the config gives none: the GPU's datasheet figure at the precision in
/// use (`backend::cuda::specs`); for a GPU titan does not know, the H100's dense bf16 989 TFLOP/s
/// (said once on stderr); on the CPU the fp32 FMA rate of `threads` threads, measured
/// (`backend::cpu::peak`).
pub fn default_peak_tflops<B: Backend>(be: &B, threads: usize) -> f64 {
    match (be.peak_tflops(), be.name()) {
        (Some(peak), _) => peak,
        (None, "cuda") => {
            errln!(
                "note: MFU is against 989 TFLOP/s (H100 dense bf16): this GPU is not in titan's \
                 table; set [metrics] peak_tflops to its figure"
            );
            989.0
        }
        (None, _) => crate::backend::cpu::peak::peak_tflops(threads),
    }
}
