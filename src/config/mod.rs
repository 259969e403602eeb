//! Job configuration: TOML files with TorchTitan's section and key names, `--section.key value`
//! overrides on the command line, and validation whose errors name the file, the key and what is
//! accepted. The built-in defaults are `configs/debug_model.toml` (embedded at build time), so
//! `titan train` with no arguments trains the debug model on the synthetic corpus.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The embedded default job (kept identical to `configs/debug_model.toml`, which a test checks).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/debug_model.toml");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[derive(Default)]
pub struct Config {
    pub job: JobConfig,
    pub model: ModelConfig,
    pub optimizer: OptimizerConfig,
    pub lr_scheduler: LrSchedulerConfig,
    pub training: TrainingConfig,
    pub parallelism: ParallelismConfig,
    pub checkpoint: CheckpointConfig,
    pub activation_checkpoint: ActivationCheckpointConfig,
    pub validation: ValidationConfig,
    pub profiling: ProfilingConfig,
    pub metrics: MetricsConfig,
    pub comm: CommConfig,
}

/// `[activation_checkpoint]` (TorchTitan's keys): what each block keeps from its forward for its
/// backward (`model::activation_checkpoint`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointConfig {
    /// `none`, `full` (a block keeps only its input) or `selective`.
    pub mode: String,
    /// With `selective`: `op` (keep the GEMMs' and attention's outputs, recompute the rest) or N
    /// (every N-th block fully checkpointed), as a string or an integer.
    #[serde(deserialize_with = "string_or_integer")]
    pub selective_ac_option: String,
}

impl Default for ActivationCheckpointConfig {
    fn default() -> Self {
        ActivationCheckpointConfig {
            mode: "none".into(),
            selective_ac_option: "2".into(),
        }
    }
}

impl ActivationCheckpointConfig {
    pub fn mode(&self) -> Result<crate::model::activation_checkpoint::AcMode> {
        crate::model::activation_checkpoint::AcMode::parse(&self.mode, &self.selective_ac_option)
    }
}

/// `[profiling]` (TorchTitan's keys): Chrome traces of profiled steps (`crate::trace`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfilingConfig {
    pub enable_profiling: bool,
    /// Under `job.dump_folder`: `{folder}/iteration_{step}/rank{r}_trace.json`.
    pub save_traces_folder: String,
    /// Every `profile_freq` steps, the last `profiler_active` are recorded, after
    /// `profiler_warmup` unrecorded ones (TorchTitan's wait, warm-up and active phases).
    pub profile_freq: u64,
    pub profiler_warmup: u64,
    pub profiler_active: u64,
    /// The memory timeline of the same profiled steps (`crate::memory_timeline`), under
    /// `job.dump_folder`: `{folder}/iteration_{step}/rank{r}_memory.{json,svg}`.
    pub enable_memory_snapshot: bool,
    pub save_memory_snapshot_folder: String,
}

impl Default for ProfilingConfig {
    fn default() -> Self {
        ProfilingConfig {
            enable_profiling: false,
            save_traces_folder: "profile_traces".into(),
            profile_freq: 10,
            profiler_warmup: 3,
            profiler_active: 1,
            enable_memory_snapshot: false,
            save_memory_snapshot_folder: "memory_snapshot".into(),
        }
    }
}

impl ProfilingConfig {
    /// Whether `step` (from 1) is recorded, and whether it is the last recorded step of its
    /// period (its trace is written after it).
    pub fn phase(&self, step: u64) -> (bool, bool) {
        if !self.enable_profiling && !self.enable_memory_snapshot {
            return (false, false);
        }
        let pos = (step - 1) % self.profile_freq;
        let active = pos >= self.profile_freq - self.profiler_active;
        (active, active && pos == self.profile_freq - 1)
    }
}

/// `[validation]` (TorchTitan's keys): the loss on held-out data every `freq` steps, under the
/// training's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValidationConfig {
    pub enabled: bool,
    /// A dataset kind of `[training] dataset`; `synthetic` is another stream than training's.
    pub dataset: String,
    pub dataset_path: String,
    /// -1: the training's.
    pub local_batch_size: i64,
    pub seq_len: i64,
    pub freq: u64,
    /// Batches per validation (each validation reads the same ones, from the dataset's start).
    pub steps: i64,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            enabled: false,
            dataset: "synthetic".into(),
            dataset_path: String::new(),
            local_batch_size: -1,
            seq_len: -1,
            freq: 10,
            steps: 10,
        }
    }
}

/// TorchTitan writes `selective_ac_option = "2"`; `2` reads the same.
fn string_or_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        S(String),
        I(i64),
    }
    Ok(match Either::deserialize(d)? {
        Either::S(s) => s,
        Either::I(i) => i.to_string(),
    })
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    pub data_parallel_replicate_degree: usize,
    /// -1 fills what the other degrees leave of the world size.
    pub data_parallel_shard_degree: i64,
    pub tensor_parallel_degree: usize,
    pub pipeline_parallel_degree: usize,
    pub context_parallel_degree: usize,
    /// Context parallelism: how the ranks exchange keys and values, `allgather` (all at once,
    /// TorchTitan's default) or `alltoall` (rotated around the ring, peer to peer).
    pub context_parallel_rotate_method: String,
    /// Mixture of experts: ranks the experts are split over (TorchTitan's `expert_parallel_degree`),
    /// borrowed from `dp_shard × cp`; tokens travel to their experts' ranks by all-to-all.
    pub expert_parallel_degree: usize,
    /// FSDP: free a block's gathered parameters after its forward (`default`, `always`) or keep them
    /// until its backward (`never`).
    pub fsdp_reshard_after_forward: String,
    /// With tensor parallelism: compute the cross-entropy from the gathered logits instead of over
    /// the vocabulary shards (same loss; more traffic).
    pub disable_loss_parallel: bool,
    /// With tensor parallelism: overlap the sequence-parallel all-gathers and reduce-scatters with
    /// the GEMMs next to them, in chunks.
    pub enable_async_tensor_parallel: bool,
    /// Pipeline parallelism: the schedule (`parallel::pipeline::schedule::SCHEDULE_NAMES`).
    pub pipeline_parallel_schedule: String,
    /// A custom schedule in TorchTitan's CSV format (overrides `pipeline_parallel_schedule`).
    pub pipeline_parallel_schedule_csv: String,
    /// Sequences per microbatch: the local batch is cut into local_batch_size / this microbatches.
    pub pipeline_parallel_microbatch_size: usize,
    /// Units (blocks; the embedding and the output count as one each) per stage; -1: the
    /// schedule's stages per rank, balanced.
    pub pipeline_parallel_layers_per_stage: i64,
    /// The blocks that start stages 1, 2, … (`layers.N`); empty: balanced. A list, or one string
    /// of comma-separated names (`--parallelism.pipeline_parallel_split_points layers.2,layers.4`).
    #[serde(deserialize_with = "list_or_commas")]
    pub pipeline_parallel_split_points: Vec<String>,
}

/// A list of strings, or one string of comma-separated items (as a command-line override gives it).
fn list_or_commas<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Items {
        List(Vec<String>),
        Commas(String),
    }
    Ok(match Items::deserialize(d)? {
        Items::List(v) => v,
        Items::Commas(s) => s
            .split(',')
            .map(|x| x.trim().to_string())
            .filter(|x| !x.is_empty())
            .collect(),
    })
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        ParallelismConfig {
            data_parallel_replicate_degree: 1,
            data_parallel_shard_degree: -1,
            tensor_parallel_degree: 1,
            pipeline_parallel_degree: 1,
            context_parallel_degree: 1,
            context_parallel_rotate_method: "allgather".into(),
            expert_parallel_degree: 1,
            fsdp_reshard_after_forward: "default".into(),
            disable_loss_parallel: false,
            enable_async_tensor_parallel: false,
            pipeline_parallel_schedule: "1F1B".into(),
            pipeline_parallel_schedule_csv: String::new(),
            pipeline_parallel_microbatch_size: 1,
            pipeline_parallel_layers_per_stage: -1,
            pipeline_parallel_split_points: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommConfig {
    /// Rendezvous and group set-up.
    pub init_timeout_seconds: u64,
    /// Every collective during training.
    pub train_timeout_seconds: u64,
    /// Flight recorder: the latest operations each process group keeps for a dump when a
    /// collective fails (0 turns it off).
    pub trace_buf_size: usize,
    /// Where the dumps go, under the dump folder (`rank_{r}.json`).
    pub save_traces_folder: String,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            init_timeout_seconds: 300,
            train_timeout_seconds: 100,
            trace_buf_size: 20000,
            save_traces_folder: "comm_traces".into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    pub dump_folder: String,
    pub description: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub name: String,
    pub flavor: String,
    /// A Hugging Face `tokenizer.json`; empty selects the built-in byte-level tokenizer.
    pub tokenizer_path: String,
    // Optional overrides of the flavor's shapes (research and tests).
    pub dim: Option<usize>,
    pub n_layers: Option<usize>,
    pub n_heads: Option<usize>,
    pub n_kv_heads: Option<usize>,
    pub vocab_size: Option<usize>,
    pub multiple_of: Option<usize>,
    pub ffn_dim_multiplier: Option<f64>,
    pub rope_theta: Option<f64>,
    pub norm_eps: Option<f32>,
    /// Mixture-of-experts models: auxiliary-loss-free load balancing, the step of the expert
    /// bias after each step (TorchTitan's `load_balance_coeff`; absent: none).
    pub load_balance_coeff: Option<f32>,
    /// Mixture-of-experts models: the sequence-wise auxiliary balance loss's coefficient (the
    /// name Hugging Face configs use; absent: none).
    pub router_aux_loss_coef: Option<f32>,
    /// Mixture-of-experts models: the hidden width of shared experts every token goes through
    /// besides its routed ones (DeepSeek-V3's; absent: the flavor's, none for Qwen3-MoE).
    pub moe_shared_hidden: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub name: String,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayType {
    Linear,
    Sqrt,
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedulerConfig {
    pub warmup_steps: u64,
    /// Share of the steps spent decaying at the end; absent means every step after warm-up decays.
    pub decay_ratio: Option<f64>,
    pub decay_type: DecayType,
    pub min_lr_factor: f64,
}

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
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    pub enable: bool,
    pub interval: u64,
    /// Checkpoints to keep (oldest removed first); 0 keeps all.
    pub keep_latest_k: usize,
    /// Relative to `job.dump_folder` unless absolute.
    pub folder: String,
    /// Step to resume from; -1 picks the latest complete checkpoint.
    pub load_step: i64,
    /// `disabled` (saves block the step) or `async` (a writer thread writes while training goes on;
    /// whole checkpoints only, sharded saves stay synchronous). TorchTitan's key.
    pub async_mode: String,
    /// A titan checkpoint (a `step-N` folder) or, with `initial_load_in_hf`, a Hugging Face Llama
    /// folder to start from when the run's own checkpoint folder holds none (continued
    /// pretraining); empty: a fresh model.
    pub initial_load_path: String,
    pub initial_load_in_hf: bool,
    /// Only the weights (fresh AdamW state, step 0); false also takes a titan checkpoint's
    /// moments.
    pub initial_load_model_only: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    pub log_freq: u64,
    pub enable_tensorboard: bool,
    /// Relative to `job.dump_folder`.
    pub save_tb_folder: String,
    /// Peak TFLOP/s used for MFU; 0 uses the documented default of the device (see README).
    pub peak_tflops: f64,
}

impl Default for JobConfig {
    fn default() -> Self {
        JobConfig {
            dump_folder: "./outputs".into(),
            description: "Llama 3 debug model on the built-in corpus".into(),
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: "llama3".into(),
            flavor: "debugmodel".into(),
            tokenizer_path: String::new(),
            dim: None,
            n_layers: None,
            n_heads: None,
            n_kv_heads: None,
            vocab_size: None,
            multiple_of: None,
            ffn_dim_multiplier: None,
            rope_theta: None,
            norm_eps: None,
            load_balance_coeff: None,
            router_aux_loss_coef: None,
            moe_shared_hidden: None,
        }
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: "AdamW".into(),
            lr: 8e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

impl Default for LrSchedulerConfig {
    fn default() -> Self {
        LrSchedulerConfig {
            warmup_steps: 20,
            decay_ratio: None,
            decay_type: DecayType::Linear,
            min_lr_factor: 0.0,
        }
    }
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
            threads: 0,
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            enable: true,
            interval: 100,
            keep_latest_k: 3,
            folder: "checkpoint".into(),
            load_step: -1,
            async_mode: "disabled".into(),
            initial_load_path: String::new(),
            initial_load_in_hf: false,
            initial_load_model_only: true,
        }
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            log_freq: 10,
            enable_tensorboard: false,
            save_tb_folder: "tb".into(),
            peak_tflops: 0.0,
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
];
pub const DEVICES: &[&str] = &["cpu", "cuda", "auto"];
pub const PRECISIONS: &[&str] = &["bfloat16", "tfloat32", "float32"];

impl Config {
    /// Reads `path` (or the built-in defaults when `None`) and applies `--section.key value` overrides.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config> {
        let (source, text) = match path {
            Some(p) => (
                p.display().to_string(),
                std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read config file {}", p.display()))?,
            ),
            None => (
                "built-in defaults (configs/debug_model.toml)".to_string(),
                DEFAULT_CONFIG_TOML.to_string(),
            ),
        };
        let mut table: toml::Table =
            toml::from_str(&text).map_err(|e| anyhow!("config {source}: {e}"))?;
        let pairs = parse_overrides(overrides)?;
        for (section, key, value) in &pairs {
            let entry = table
                .entry(section.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            match entry {
                toml::Value::Table(t) => {
                    t.insert(key.clone(), value.clone());
                }
                _ => bail!("override --{section}.{key}: `{section}` is not a section"),
            }
        }
        let with = if pairs.is_empty() {
            String::new()
        } else {
            format!(
                " with overrides {}",
                pairs
                    .iter()
                    .map(|(s, k, _)| format!("--{s}.{k}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        };
        let cfg: Config = Config::deserialize(toml::Value::Table(table))
            .map_err(|e| anyhow!("config {source}{with}: {e}"))?;
        cfg.validate()
            .map_err(|e| anyhow!("config {source}{with}: {e}"))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        self.base_model_args()?;
        if self.optimizer.name != "AdamW" {
            bail!(
                "[optimizer] name = `{}` is not supported (accepted: AdamW)",
                self.optimizer.name
            );
        }
        if !(self.optimizer.lr > 0.0 && self.optimizer.lr.is_finite()) {
            bail!(
                "[optimizer] lr must be a positive number, got {}",
                self.optimizer.lr
            );
        }
        for (k, v) in [
            ("beta1", self.optimizer.beta1),
            ("beta2", self.optimizer.beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                bail!("[optimizer] {k} must be in [0, 1), got {v}");
            }
        }
        if let Some(r) = self.lr_scheduler.decay_ratio {
            if !(0.0..=1.0).contains(&r) {
                bail!("[lr_scheduler] decay_ratio must be in [0, 1], got {r}");
            }
        }
        if !(0.0..=1.0).contains(&self.lr_scheduler.min_lr_factor) {
            bail!(
                "[lr_scheduler] min_lr_factor must be in [0, 1], got {}",
                self.lr_scheduler.min_lr_factor
            );
        }
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
        if !DEVICES.contains(&t.device.as_str()) {
            bail!(
                "[training] device = `{}` is not known (accepted: {})",
                t.device,
                DEVICES.join(", ")
            );
        }
        let p = &self.parallelism;
        if p.tensor_parallel_degree == 0 {
            bail!("[parallelism] tensor_parallel_degree must be at least 1");
        }
        if p.pipeline_parallel_degree == 0 {
            bail!("[parallelism] pipeline_parallel_degree must be at least 1");
        }
        if p.context_parallel_degree == 0 {
            bail!("[parallelism] context_parallel_degree must be at least 1");
        }
        if p.expert_parallel_degree == 0 {
            bail!("[parallelism] expert_parallel_degree must be at least 1");
        }
        if p.context_parallel_degree > 1 {
            let cp = p.context_parallel_degree;
            crate::parallel::cp::RotateMethod::parse(&p.context_parallel_rotate_method)?;
            for (section, seq) in [
                ("training", t.seq_len),
                ("validation", self.validation_shape().1),
            ] {
                if section == "validation" && !self.validation.enabled {
                    continue;
                }
                if !seq.is_multiple_of(2 * cp) {
                    bail!("[{section}] seq_len = {seq} does not split into 2 × context_parallel_degree = {} equal chunks (each rank holds two, head and tail, for balanced causal attention); make it a multiple of {}", 2 * cp, 2 * cp);
                }
            }
        }
        if p.pipeline_parallel_degree > 1 {
            if p.pipeline_parallel_schedule_csv.is_empty() {
                crate::parallel::pipeline::schedule::ScheduleKind::parse(
                    &p.pipeline_parallel_schedule,
                )?;
            }
            let mb = p.pipeline_parallel_microbatch_size;
            if mb == 0 || !t.local_batch_size.is_multiple_of(mb) {
                bail!("[parallelism] pipeline_parallel_microbatch_size = {mb} must divide [training] local_batch_size = {} (microbatches = local batch / microbatch size)", t.local_batch_size);
            }
        }
        self.activation_checkpoint.mode()?;
        let pr = &self.profiling;
        if (pr.enable_profiling || pr.enable_memory_snapshot)
            && (pr.profile_freq == 0
                || pr.profiler_active == 0
                || pr.profiler_warmup + pr.profiler_active > pr.profile_freq)
        {
            bail!("[profiling] profile_freq = {} must be positive and at least profiler_warmup {} + profiler_active {} (active at least 1)", pr.profile_freq, pr.profiler_warmup, pr.profiler_active);
        }
        let c = &self.checkpoint;
        if c.initial_load_path.is_empty() && c.initial_load_in_hf {
            bail!("[checkpoint] initial_load_in_hf = true needs initial_load_path (the Hugging Face folder)");
        }
        if c.initial_load_in_hf && !c.initial_load_model_only {
            bail!("[checkpoint] initial_load_model_only = false with initial_load_in_hf: a Hugging Face folder holds no optimizer state");
        }
        let v = &self.validation;
        if v.enabled {
            if !DATASETS.contains(&v.dataset.as_str()) {
                bail!(
                    "[validation] dataset = `{}` is not known (accepted: {})",
                    v.dataset,
                    DATASETS.join(", ")
                );
            }
            if v.dataset != "synthetic" && v.dataset_path.is_empty() {
                bail!(
                    "[validation] dataset = `{}` needs a dataset_path",
                    v.dataset
                );
            }
            for (key, value) in [
                ("local_batch_size", v.local_batch_size),
                ("seq_len", v.seq_len),
            ] {
                if value == 0 || value < -1 {
                    bail!("[validation] {key} = {value} must be positive (or -1: the training's)");
                }
            }
            if v.freq == 0 {
                bail!("[validation] freq must be positive");
            }
            if v.steps <= 0 {
                bail!("[validation] steps = {}: give a positive number of batches (titan does not run a validation set to its end: -1 is not supported)", v.steps);
            }
        }
        if !["default", "always", "never"].contains(&p.fsdp_reshard_after_forward.as_str()) {
            bail!("[parallelism] fsdp_reshard_after_forward = `{}` is not known (accepted: default, always, never)", p.fsdp_reshard_after_forward);
        }
        if self.comm.init_timeout_seconds == 0 || self.comm.train_timeout_seconds == 0 {
            bail!("[comm] init_timeout_seconds and train_timeout_seconds must be positive");
        }
        if self.checkpoint.interval == 0 {
            bail!("[checkpoint] interval must be positive");
        }
        match self.checkpoint.async_mode.as_str() {
            "disabled" | "async" => {}
            "async_with_pinned_mem" => bail!(
                "[checkpoint] async_mode = \"async_with_pinned_mem\" is not built (pinned host memory \
                 only speeds up GPU-to-host copies); use \"async\""
            ),
            other => bail!(
                "[checkpoint] async_mode = `{other}` is not known (accepted: disabled, async)"
            ),
        }
        if self.metrics.log_freq == 0 {
            bail!("[metrics] log_freq must be positive");
        }
        Ok(())
    }

    /// `[validation]`'s local batch size and sequence length (the training's where -1).
    pub fn validation_shape(&self) -> (usize, usize) {
        let or = |v: i64, training: usize| if v < 0 { training } else { v as usize };
        (
            or(
                self.validation.local_batch_size,
                self.training.local_batch_size,
            ),
            or(self.validation.seq_len, self.training.seq_len),
        )
    }

    /// Sequences per optimizer step with `dp_size` data-parallel ranks (-1: one micro-batch per
    /// rank per step).
    pub fn global_batch_size_for(&self, dp_size: usize) -> usize {
        if self.training.global_batch_size < 0 {
            self.training.local_batch_size * dp_size
        } else {
            self.training.global_batch_size as usize
        }
    }

    pub fn dump_folder(&self) -> PathBuf {
        PathBuf::from(&self.job.dump_folder)
    }

    pub fn checkpoint_folder(&self) -> PathBuf {
        self.dump_folder().join(&self.checkpoint.folder)
    }

    /// Model shapes: the flavor, with any `[model]` overrides applied.
    /// The published shapes of `[model] name` and `flavor`, before the config's overrides.
    fn base_model_args(&self) -> Result<crate::model::ModelArgs> {
        let m = &self.model;
        match m.name.as_str() {
            "llama3" => crate::model::ModelArgs::flavor(&m.flavor),
            "qwen3" => crate::model::ModelArgs::qwen3_flavor(&m.flavor),
            other => bail!("[model] name = `{other}` is not supported (accepted: llama3, qwen3)"),
        }
        .map_err(|e| anyhow!("[model] flavor: {e}"))
    }

    pub fn model_args(&self) -> Result<crate::model::ModelArgs> {
        let m = &self.model;
        let mut a = self.base_model_args()?;
        let llama = m.name == "llama3";
        let base_mult = match m.flavor.as_str() {
            _ if !llama => None,
            "1B" => Some(1.5),
            "3B" => Some(1.0),
            "8B" | "70B" => Some(1.3),
            "405B" => Some(1.2),
            _ => None,
        };
        let base_multiple = match m.flavor.as_str() {
            "8B" => 1024,
            "70B" | "405B" => 4096,
            _ => 256,
        };
        if let Some(v) = m.dim {
            a.dim = v;
        }
        if let Some(v) = m.n_layers {
            a.n_layers = v;
        }
        if let Some(v) = m.n_heads {
            a.n_heads = v;
            if m.n_kv_heads.is_none() && a.n_kv_heads > v {
                a.n_kv_heads = v;
            }
        }
        if let Some(v) = m.n_kv_heads {
            a.n_kv_heads = v;
        }
        if let Some(v) = m.vocab_size {
            a.vocab_size = v;
        }
        if let Some(v) = m.rope_theta {
            a.rope_theta = v;
        }
        if let Some(v) = m.norm_eps {
            a.norm_eps = v;
        }
        if m.dim.is_some() || m.multiple_of.is_some() || m.ffn_dim_multiplier.is_some() {
            a.ffn_hidden = crate::model::args::ffn_hidden(
                a.dim,
                m.multiple_of.unwrap_or(base_multiple),
                m.ffn_dim_multiplier.or(base_mult),
            );
        }
        if let Some(c) = m.load_balance_coeff {
            match a.moe.as_mut() {
                Some(moe) => moe.load_balance_coeff = Some(c),
                None => bail!("[model] load_balance_coeff = {c} needs a mixture-of-experts model (flavor {} of {} has none)", m.flavor, m.name),
            }
        }
        if let Some(h) = m.moe_shared_hidden {
            match a.moe.as_mut() {
                Some(moe) => moe.shared_hidden = Some(h),
                None => bail!("[model] moe_shared_hidden = {h} needs a mixture-of-experts model (flavor {} of {} has none)", m.flavor, m.name),
            }
        }
        if let Some(c) = m.router_aux_loss_coef {
            match a.moe.as_mut() {
                Some(moe) => moe.aux_loss_coef = Some(c),
                None => bail!("[model] router_aux_loss_coef = {c} needs a mixture-of-experts model (flavor {} of {} has none)", m.flavor, m.name),
            }
        }
        a.validate().map_err(|e| anyhow!("[model]: {e}"))?;
        Ok(a)
    }
}

/// Splits `--section.key value` / `--section.key=value` pairs; values parse as TOML (number, bool,
/// string, array), falling back to a plain string.
pub fn parse_overrides(args: &[String]) -> Result<Vec<(String, String, toml::Value)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        let Some(flag) = arg.strip_prefix("--") else {
            bail!("unexpected argument `{arg}`: overrides look like --section.key value");
        };
        let (name, value) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), v.to_string()),
            None => {
                let v = args
                    .get(i + 1)
                    .ok_or_else(|| anyhow!("override --{flag} needs a value"))?;
                i += 1;
                (flag.to_string(), v.clone())
            }
        };
        let Some((section, key)) = name.split_once('.') else {
            bail!("override --{name} must name a section and a key, like --training.steps 100");
        };
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or(toml::Value::String(value.clone()));
        out.push((section.to_string(), key.to_string(), parsed));
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_equal_the_rust_defaults() {
        assert_eq!(Config::load(None, &[]).unwrap(), Config::default());
    }

    #[test]
    fn overrides_apply_with_types() {
        let args: Vec<String> = [
            "--training.steps",
            "7",
            "--model.flavor=8B",
            "--job.dump_folder",
            "/tmp/x",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let c = Config::load(None, &args).unwrap();
        assert_eq!(c.training.steps, 7);
        assert_eq!(c.model.flavor, "8B");
        assert_eq!(c.job.dump_folder, "/tmp/x");
    }

    #[test]
    fn unknown_key_names_the_key_and_accepted_ones() {
        let e = Config::load(None, &["--training.stepz".into(), "3".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("stepz") && e.contains("steps") && e.contains("--training.stepz"),
            "{e}"
        );
        let e = Config::load(None, &["--trainin.steps".into(), "3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("trainin") && e.contains("training"), "{e}");
    }

    #[test]
    fn invalid_values_name_the_key() {
        let cases = [
            (vec!["--lr_scheduler.decay_type", "exp"], "cosine"),
            (vec!["--training.steps", "-3"], "steps"),
            (
                vec![
                    "--training.global_batch_size",
                    "12",
                    "--training.local_batch_size",
                    "8",
                ],
                "global_batch_size",
            ),
            (vec!["--training.dataset", "c5"], "synthetic"),
            (vec!["--model.flavor", "7B"], "405B"),
            (vec!["--training.device", "tpu"], "cuda"),
            (vec!["--optimizer.lr", "\"fast\""], "lr"),
        ];
        for (args, needle) in cases {
            let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            let e = Config::load(None, &args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn malformed_file_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, "[training]\nsteps = 10\nseq_len = = 4\n").unwrap();
        let e = Config::load(Some(&p), &[]).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("line 3"), "{e}");
    }
}
