//! The start banner of a run: what it trains (parameters, FLOPs per token, backend, the MFU
//! reference), its memory estimate and data, the pipeline's schedule, and each rank's place in
//! the layout.

use super::memory::{gib, MemoryEstimate};
use crate::backend::Backend;
use crate::config::Config;
use crate::launch::Distributed;
use crate::model::crossings::context::SequenceShard;
use crate::model::{LocalShapes, ModelArgs};
use crate::parallel::layout::RankLayout;

/// What the banner reports.
pub struct Banner<'a, B: Backend> {
    pub be: &'a B,
    pub cfg: &'a Config,
    pub args: &'a ModelArgs,
    pub local: &'a LocalShapes,
    pub estimate: &'a MemoryEstimate,
    pub dist: Option<&'a Distributed>,
    pub layout: &'a RankLayout<B>,
    pub data: String,
    pub global_batch: usize,
    pub accum: usize,
    pub flops_per_token: f64,
    pub peak_tflops: f64,
    /// What carries the device collectives (NCCL), None when they go through the host.
    pub device_collectives: Option<&'static str>,
}

impl<B: Backend> Banner<'_, B> {
    /// The lines rank 0 prints: the model and the memory.
    pub fn lines(&self) -> Vec<String> {
        let (cfg, args, est) = (self.cfg, self.args, self.estimate);
        let threads = rayon::current_num_threads();
        let seq = cfg.training.seq_len;
        let dp_size = self.dist.map_or(1, |d| d.groups.dp.size());
        let active = match args.moe.is_some() {
            true => format!(", {:.2}M active", args.active_params() as f64 / 1e6),
            false => String::new(),
        };
        let reference = match (cfg.metrics.peak_tflops > 0.0, self.be.name()) {
            (true, _) => " ([metrics] peak_tflops)",
            (false, "cpu") => " (measured fp32 FMA peak)",
            (false, _) => " (datasheet)",
        };
        let copies = match est.activation_copies > 0 {
            true => format!(" + bf16 copies {:.3} GiB", gib(est.activation_copies)),
            false => String::new(),
        };
        let muon = match est.optimizer_step > 0 {
            true => format!(
                " (Muon's step: {:.3} GiB of gathered matrices)",
                gib(est.optimizer_step)
            ),
            false => String::new(),
        };
        let reduced = match dp_size > 1 {
            true => format!(" (reduced in {})", cfg.training.mixed_precision_reduce),
            false => String::new(),
        };
        let which = |period: usize| match period {
            1 => "every block".to_string(),
            2 => "blocks 0, 2, 4, …".to_string(),
            p => format!("blocks 0, {p}, {}, …", 2 * p),
        };
        let sinks = if args.attention_sinks {
            ", attention sinks"
        } else {
            ""
        };
        let bias = if args.attention_bias { ", biases" } else { "" };
        let sinks = format!("{sinks}{bias}");
        let attention = match args.sliding_window {
            Some(w) => format!(" (sliding window {} on {}{sinks})", w.size, which(w.period)),
            None if args.attention_sinks => " (attention sinks)".to_string(),
            None => String::new(),
        };
        let mut lines = vec![
            format!(
                "titan | model {} {}{attention} | {:.2}M parameters ({:.2}M non-embedding{active}) | {:.1} MFLOPs/token | backend {} × {threads} threads | MFU of {:.3} TFLOP/s{reference}",
                cfg.model.name,
                cfg.model.flavor,
                args.num_params() as f64 / 1e6,
                (args.num_params() - args.embedding_params()) as f64 / 1e6,
                self.flops_per_token / 1e6,
                self.be.name(),
                self.peak_tflops,
            ),
            format!(
                "memory{}: weights {:.3} GiB, gradients {:.3} GiB{reduced}, {} {:.3} GiB{muon}, activations {:.3} GiB ({}){copies}, kernel scratch {:.3} GiB | data: {} | global batch {} × {seq} tokens, {dp_size} data-parallel rank(s) × {} micro-batch(es)/step",
                if self.dist.is_some() { " per rank" } else { "" },
                gib(est.params),
                gib(est.grads),
                cfg.optimizer.name,
                gib(est.optimizer),
                gib(est.activations),
                est.describe_activations(self.be.bf16_activation_f32_bytes()),
                gib(est.scratch),
                self.data,
                self.global_batch,
                self.accum,
            ),
        ];
        if let Some(p) = &self.layout.pipeline {
            lines.push(p.describe());
        }
        lines.extend(self.float8_lines());
        lines.extend(self.lora_line());
        lines
    }

    /// `[lora]`: the adapters' shape and how much of the model trains.
    fn lora_line(&self) -> Option<String> {
        let l = self.args.lora.as_ref()?;
        let specs = crate::model::params::param_specs(self.args);
        let numel = |s: &[usize]| s.iter().product::<usize>();
        let adapters = specs
            .iter()
            .filter(|(n, _)| n.ends_with(crate::model::lora::LORA_A));
        let trained: usize = specs
            .iter()
            .filter(|(n, _)| crate::model::lora::is_adapter(n))
            .map(|(_, s)| numel(s))
            .sum();
        let all: usize = specs.iter().map(|(_, s)| numel(s)).sum();
        Some(format!(
            "LoRA | rank {}, alpha {} (scale {}) on {} linears ({}) | {:.3}M trainable parameters, {:.2}% of {:.2}M; every other weight frozen (no gradient, no AdamW state)",
            l.rank,
            l.alpha,
            l.scale(),
            adapters.count(),
            match l.target_modules.is_empty() {
                true => "every block projection".to_string(),
                false => l.target_modules.join(", "),
            },
            trained as f64 / 1e6,
            100.0 * trained as f64 / all as f64,
            all as f64 / 1e6,
        ))
    }

    /// `[model] converters`' float8 or MXFP8 linears: the recipe, how the GEMMs run, which linears were
    /// converted and which were left in high precision, with why.
    fn float8_lines(&self) -> Vec<String> {
        let quantizing = self
            .cfg
            .model
            .converters
            .iter()
            .any(|c| c != crate::config::LORA);
        if self.layout.model.float8().converted() == 0 && !quantizing {
            return Vec::new();
        }
        let async_tp = match self.cfg.parallelism.enable_async_tensor_parallel {
            true => "; async TP overlaps the row-parallel forwards only (a float8 cast reads its operand whole and may agree scales over the group)",
            false => "",
        };
        let kind = match self
            .cfg
            .model
            .converters
            .iter()
            .any(|c| c == crate::config::MX_LINEAR)
        {
            true => "MXFP8",
            false => "float8",
        };
        let recipe = self
            .cfg
            .linear_recipe_name()
            .unwrap_or("none (experts: rowwise)");
        let head = if self.be.name() == "cuda" && self.cfg.wants_float8_gemms() {
            format!("{kind} linears | recipe {recipe} | float8 GEMMs on cuBLASLt: each operand cast as torchao's, its codes multiplied and the products scaled back (a GEMM float8 kernels do not take multiplies the dequantised values){async_tp}")
        } else {
            let why = match (self.be.name(), kind) {
                ("cpu", _) => format!("the CPU has no {kind} GEMMs"),
                (_, "MXFP8") => "titan has no MXFP8 GEMMs on CUDA yet".to_string(),
                _ => "emulate = true".to_string(),
            };
            format!("{kind} linears | recipe {recipe} | emulated: each GEMM operand quantised and dequantised as torchao's, then multiplied in high precision ({why}){async_tp}")
        };
        std::iter::once(head)
            .chain(self.layout.model.float8().summary(self.args.n_layers))
            .collect()
    }

    /// The line every rank prints of its own share (the estimate is per rank): DDP replicates
    /// everything, FSDP keeps 1/dp_shard of it plus the tensors gathered while it computes; TP
    /// keeps 1/tp of the split weights. None in one process.
    pub fn rank_line(&self) -> Option<String> {
        let d = self.dist?;
        let (local, est) = (self.local, self.estimate);
        let fsdp_mode = d.groups.shard.is_some();
        let mut how = match (
            fsdp_mode,
            d.groups.replicate.is_some(),
            d.groups.dp.size() > 1,
        ) {
            (true, true, _) => "sharded, HSDP",
            (true, false, _) => "sharded, FSDP",
            (false, _, true) => "replicated, DDP",
            (false, _, false) => "no data parallel",
        }
        .to_string();
        if local.tp > 1 {
            how = format!(
                "{how}, tensor parallel {} (rank {} of its group)",
                local.tp, local.tp_rank
            );
        }
        if local.cp > 1 {
            let seq = self.cfg.training.seq_len;
            let chunks = SequenceShard {
                degree: local.cp,
                rank: local.cp_rank,
            }
            .chunks(seq);
            how = format!(
                "{how}, context parallel {} ({}, positions {chunks:?} of {seq})",
                local.cp, self.cfg.parallelism.context_parallel_rotate_method
            );
        }
        if let Some(p) = &self.layout.pipeline {
            how = format!(
                "{how}, pipeline stages {:?} of {}",
                p.schedule.stages_of(p.group().rank()),
                p.schedule.stages()
            );
        }
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let path = self
            .device_collectives
            .map_or(String::new(), |c| format!(", collectives through {c}"));
        Some(format!(
            "rank {} of {}: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB ({how}{path})",
            d.rank,
            d.world,
            mib(est.params),
            mib(est.grads),
            mib(est.optimizer)
        ))
    }
}
