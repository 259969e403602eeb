//! `[training]`: batch and sequence sizes, steps, clipping, the dataset, the device and the
//! parameters' precision, with the accepted dataset kinds, devices and precisions; with its checks.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    pub local_batch_size: usize,
    /// Sequences per optimizer step; a multiple of `local_batch_size` (accumulation). -1: no accumulation.
    pub global_batch_size: i64,
    pub seq_len: usize,
    pub steps: u64,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub max_norm: f64,
    pub dataset: String,
    pub dataset_path: String,
    pub seed: u64,
    pub device: String,
    /// CPU threads; 0 uses every core.
    pub threads: usize,
    /// Precision of the parameters in the forward and backward (TorchTitan's key and values;
    /// titan defaults to float32, the CPU reference): `bfloat16` computes with bf16-rounded weights (FSDP all-gathers bf16; CUDA GEMMs
    /// run on bf16 tensor cores), `tfloat32` keeps fp32 weights with TF32 GEMMs on CUDA, `float32`
    /// is exact fp32. Master weights, gradients, reductions and AdamW state are fp32 in every case.
    pub mixed_precision_param: String,
    /// The dtype of the gradients' reduction across data-parallel ranks (TorchTitan's key):
    /// `float32` (the default) or `bfloat16`, each rank's gradient rounded to bf16 before FSDP's
    /// reduce-scatter or DDP's all-reduce and the sum rounded to bf16 after it.
    pub mixed_precision_reduce: String,
    /// For token shards (`tokens_u16`, `tokens_u32`): the id that starts a document, so that
    /// block-causal attention (`[model] attn_mask_type`) finds the documents; absent, a shard's
    /// sequences are one document each. Document sources start theirs with the tokenizer's BOS.
    pub document_start_id: Option<u32>,
    /// How documents become samples (TorchTitan's packing configs): `concat_then_split` (the
    /// default: windows of the concatenated stream) or `first_fit` (whole documents, padded).
    pub packing: String,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        TrainingConfig {
            local_batch_size: 8,
            global_batch_size: -1,
            seq_len: 256,
            steps: 200,
            max_norm: 1.0,
            dataset: "synthetic".into(),
            dataset_path: String::new(),
            seed: 42,
            device: "cpu".into(),
            mixed_precision_param: "float32".into(),
            mixed_precision_reduce: "float32".into(),
            threads: 0,
            document_start_id: None,
            packing: "concat_then_split".into(),
        }
    }
}

/// The dataset kinds `[training] dataset` accepts.
pub const DATASETS: &[&str] = &[
    "synthetic",
    "text",
    "jsonl",
    "parquet",
    "tokens_u16",
    "tokens_u32",
    "chat",
];
pub const DEVICES: &[&str] = &["cpu", "cuda", "auto"];
pub const PRECISIONS: &[&str] = &["bfloat16", "tfloat32", "float32"];
pub const REDUCE_PRECISIONS: &[&str] = &["float32", "bfloat16"];

impl Config {
    /// Sequences per optimizer step with `dp_size` data-parallel ranks (-1: one micro-batch per
    /// rank per step).
    pub fn global_batch_size_for(&self, dp_size: usize) -> usize {
        if self.training.global_batch_size < 0 {
            self.training.local_batch_size * dp_size
        } else {
            self.training.global_batch_size as usize
        }
    }

    pub(super) fn validate_training(&self) -> Result<()> {
        let t = &self.training;
        if t.local_batch_size == 0 || t.seq_len == 0 || t.steps == 0 {
            bail!(
                "[training] local_batch_size, seq_len and steps must be positive (got {}, {}, {})",
                t.local_batch_size,
                t.seq_len,
                t.steps
            );
        }
        if t.global_batch_size != -1
            && (t.global_batch_size <= 0
                || !(t.global_batch_size as usize).is_multiple_of(t.local_batch_size))
        {
            bail!("[training] global_batch_size = {} must be -1 or a positive multiple of local_batch_size = {}", t.global_batch_size, t.local_batch_size);
        }
        if t.max_norm < 0.0 {
            bail!(
                "[training] max_norm must be >= 0 (0 disables clipping), got {}",
                t.max_norm
            );
        }
        if !DATASETS.contains(&t.dataset.as_str()) {
            bail!(
                "[training] dataset = `{}` is not known (accepted: {})",
                t.dataset,
                DATASETS.join(", ")
            );
        }
        if t.dataset != "synthetic" && t.dataset_path.is_empty() {
            bail!("[training] dataset = `{}` needs dataset_path", t.dataset);
        }
        if !PRECISIONS.contains(&t.mixed_precision_param.as_str()) {
            bail!(
                "[training] mixed_precision_param = `{}` is not known (accepted: {})",
                t.mixed_precision_param,
                PRECISIONS.join(", ")
            );
        }
        if !REDUCE_PRECISIONS.contains(&t.mixed_precision_reduce.as_str()) {
            bail!(
                "[training] mixed_precision_reduce = `{}` is not known (accepted: {})",
                t.mixed_precision_reduce,
                REDUCE_PRECISIONS.join(", ")
            );
        }
        crate::data::packing::Packing::parse(&t.packing)?;
        if !DEVICES.contains(&t.device.as_str()) {
            bail!(
                "[training] device = `{}` is not known (accepted: {})",
                t.device,
                DEVICES.join(", ")
            );
        }
        Ok(())
    }
}
