//! Memory accounting known from the config alone (the way TorchTitan builds on the meta device):
//! a job that cannot fit is refused with the estimate before anything is allocated.

use std::collections::BTreeMap;

use anyhow::{bail, Result};

use crate::backend::Backend;
use crate::config::muon_updates;
use crate::memory_timeline::Category;
use crate::model::{
    activation_checkpoint::{ActivationDtype, ActivationPlan},
    decoder::{WorkspaceFloats, WorkspacePart},
    params::{local_param_specs, param_specs},
    LocalShapes, ModelArgs,
};

/// What a device adds to a rank's memory estimate beyond the model's tensors, and the memory the
/// estimate is compared with: a backend's own accounting (every `Backend`), or a device that
/// `titan plan` sizes without having it.
pub trait DeviceSizing {
    /// Kernel scratch of one step over `tokens` rows (`Backend::scratch_bytes`).
    fn scratch_bytes(&self, tokens: usize, dim: usize, hidden: usize, vocab: usize) -> u64;
    /// Bytes per value of the activations' bf16 copies (`Backend::activation_copy_bytes`).
    fn activation_copy_bytes(&self) -> u64;
    /// Bytes per value of the f32 storage of buffers the device may keep in bf16 alone.
    fn bf16_activation_f32_bytes(&self) -> u64;
    /// Bytes per parameter of the bf16 compute copy.
    fn compute_copy_bytes_per_param(&self) -> u64;
    /// The device's free memory (None: the host's memory is what counts).
    fn device_free_memory(&self) -> Option<u64>;
    /// Whether float8 casts also keep their codes (`Backend::keeps_float8_codes`).
    fn keeps_float8_codes(&self) -> bool;
}

impl<B: Backend> DeviceSizing for B {
    fn scratch_bytes(&self, tokens: usize, dim: usize, hidden: usize, vocab: usize) -> u64 {
        Backend::scratch_bytes(self, tokens, dim, hidden, vocab)
    }
    fn activation_copy_bytes(&self) -> u64 {
        Backend::activation_copy_bytes(self)
    }
    fn bf16_activation_f32_bytes(&self) -> u64 {
        Backend::bf16_activation_f32_bytes(self)
    }
    fn compute_copy_bytes_per_param(&self) -> u64 {
        Backend::compute_copy_bytes_per_param(self)
    }
    fn device_free_memory(&self) -> Option<u64> {
        Backend::device_free_memory(self)
    }
    fn keeps_float8_codes(&self) -> bool {
        Backend::keeps_float8_codes(self)
    }
}

/// Values of one tensor-parallel rank's parameters (`m.tp`): all of them, those outside the
/// blocks, and one block's as the rank gathers it (under expert parallelism, with its own experts
/// only).
fn local_param_counts(args: &ModelArgs, m: &LocalShapes) -> (u64, u64, u64) {
    local_counts(args, m, false)
}

/// `local_param_counts` of the parameters that train (all but LoRA's frozen base): those with
/// gradients and AdamW state.
fn local_trainable_counts(args: &ModelArgs, m: &LocalShapes) -> (u64, u64, u64) {
    local_counts(args, m, true)
}

fn local_counts(args: &ModelArgs, m: &LocalShapes, trainable_only: bool) -> (u64, u64, u64) {
    let specs = local_param_specs(args, m.tp);
    let lora = args.lora.as_ref();
    let count = |keep: &dyn Fn(&str) -> bool| -> u64 {
        specs
            .iter()
            .filter(|(name, _)| keep(name))
            .filter(|(name, _)| !trainable_only || crate::model::lora::trainable(lora, name))
            .map(|(_, shape)| shape.iter().product::<usize>() as u64)
            .sum()
    };
    (
        count(&|_| true),
        count(&|name| !name.starts_with("layers.")),
        count(&|name| name.starts_with("layers.0.") && m.holds(name)),
    )
}

/// Parameters of this rank's largest block (blocks differ: dense and mixture-of-experts).
fn largest_block_params(args: &ModelArgs, m: &LocalShapes) -> u64 {
    let specs = local_param_specs(args, m.tp);
    (0..args.n_layers)
        .map(|l| {
            let prefix = format!("layers.{l}.");
            specs
                .iter()
                .filter(|(name, _)| name.starts_with(&prefix) && m.holds(name))
                .map(|(_, shape)| shape.iter().product::<usize>() as u64)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

/// Where Muon's matrices are spread (`MemoryEstimate::with_muon`): the share of the model a
/// pipeline rank holds, the ranks holding each of its stage's matrices (all of a stage's ranks but
/// none of another's), and the shards FSDP cuts a matrix into.
#[derive(Debug, Clone, Copy)]
pub struct MuonSizing {
    pub held: f64,
    pub holders: usize,
    pub shard: usize,
    /// Whether the matrices travel (`parallel::muon_exchange`: a job of several ranks); one
    /// process orthogonalises its momentum updates where they are.
    pub exchanged: bool,
}

/// Bytes a single-process fp32 training job needs: weights, gradients, two AdamW moments, the
/// activation workspace of one micro-batch, and the backend's own scratch (the loss's logit block,
/// bf16 operand copies on CUDA; `Backend::scratch_bytes`).
#[derive(Debug, Clone, Copy)]
pub struct MemoryEstimate {
    pub params: u64,
    /// Of `params`, what stays held between steps: this rank's shards under FSDP, else all.
    pub param_shards: u64,
    pub grads: u64,
    /// Of `grads`, what stays held between steps: this rank's shards under FSDP, else all.
    pub grad_shards: u64,
    pub optimizer: u64,
    pub activations: u64,
    /// Working memory of the backend's kernels.
    pub scratch: u64,
    /// The bf16-rounded compute copy of the weights (bf16 mixed precision without FSDP): f32, and on
    /// CUDA its bf16 twin too.
    pub compute_copy: u64,
    /// bf16 copies the backend's kernels keep beside activations for the GEMMs that read them
    /// (CUDA with bf16 GEMMs; `Backend::activation_copy_bytes`).
    pub activation_copies: u64,
    /// f32 storage the backend leaves out for buffers it keeps in bf16 alone (already taken off
    /// `activations`; it comes back when the copies are turned off).
    pub f32_left_out: u64,
    /// What the optimizer step holds for a moment, after the activations are freed: Muon's
    /// whole matrices this rank orthogonalises and the exchange's buffers (0 for AdamW).
    pub optimizer_step: u64,
    /// How the residual stream between blocks and the activations the blocks keep are stored
    /// (in `activations`).
    pub stored_dtype: ActivationDtype,
}

impl MemoryEstimate {
    /// One tensor-parallel rank of shapes `m` (the whole model when `m.tp` is 1), its blocks
    /// keeping the activations `plan` says (activation checkpointing).
    pub fn new(
        args: &ModelArgs,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: &ActivationPlan,
    ) -> Self {
        let p = local_param_counts(args, m).0 * 4;
        let trained = local_trainable_counts(args, m).0 * 4;
        MemoryEstimate {
            params: p,
            param_shards: p,
            grads: trained,
            grad_shards: trained,
            optimizer: 2 * trained,
            activations: WorkspaceFloats::of(m, batch, seq, plan, WorkspacePart::Whole).all as u64
                * 4,
            scratch: 0,
            compute_copy: 0,
            activation_copies: 0,
            f32_left_out: 0,
            optimizer_step: 0,
            stored_dtype: plan.dtype,
        }
    }

    /// Adds the scratch `be` needs for a step of this model at this batch and sequence, and the
    /// bf16 copies its kernels keep beside activations.
    pub fn with_backend_scratch(
        mut self,
        be: &dyn DeviceSizing,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: &ActivationPlan,
    ) -> Self {
        self.scratch = be.scratch_bytes(batch * m.local_seq(seq), m.dim, m.max_ffn(), m.vocab);
        let whole = WorkspaceFloats::of(m, batch, seq, plan, WorkspacePart::Whole);
        self.with_workspaces(be, whole)
    }

    /// The activations of `floats` (a rank's workspaces), with the bf16 copies `be` keeps
    /// beside them and without the f32 storage of what it keeps in bf16 alone.
    pub fn with_workspaces(mut self, be: &dyn DeviceSizing, floats: WorkspaceFloats) -> Self {
        self.activation_copies = floats.copied as u64 * be.activation_copy_bytes();
        self.f32_left_out = floats.bf16_alone as u64 * (4 - be.bf16_activation_f32_bytes());
        self.activations = floats.all as u64 * 4 - self.f32_left_out;
        self
    }

    /// One FSDP rank's share with `shard` ranks sharding (each a tensor-parallel rank of shapes `m`): its shards of the weights, gradients and
    /// AdamW state, plus the full tensors it holds while it computes: the parameters outside the
    /// blocks and `blocks_gathered` gathered blocks (`parallel::fsdp::ReshardPolicy::blocks_gathered`),
    /// and the gradients outside the blocks, one block's, and the packed gradients of the
    /// reduce-scatters in flight (`parallel::fsdp::REDUCE_SCATTER_BLOCKS`).
    pub fn sharded(
        mut self,
        args: &ModelArgs,
        m: &LocalShapes,
        shard: usize,
        blocks_gathered: usize,
        reduce_scatter_blocks: usize,
    ) -> Self {
        // Each rank's share of the experts' shards is the same with expert parallelism (`1 / ep`
        // of them over `shard / ep` ranks) or without.
        let (all, outside_blocks, block) = local_param_counts(args, m);
        let (all, outside_blocks, block) = (all * 4, outside_blocks * 4, block * 4);
        let shard = shard.max(1) as u64;
        self.params = all.div_ceil(shard) + outside_blocks + blocks_gathered as u64 * block;
        self.param_shards = all.div_ceil(shard);
        // Gradients exist only for the parameters that train (LoRA: the adapters).
        let (all, outside_blocks, block) = local_trainable_counts(args, m);
        let (all, outside_blocks, block) = (all * 4, outside_blocks * 4, block * 4);
        self.grads =
            all.div_ceil(shard) + outside_blocks + (1 + reduce_scatter_blocks as u64) * block;
        self.grad_shards = all.div_ceil(shard);
        self.optimizer = self.optimizer.div_ceil(shard);
        self
    }

    /// A pipeline rank's share: `held` of the weights with their gradients and AdamW state, the
    /// three sharded over `fsdp_shard` ranks when given (the stage's parameters are then gathered
    /// whole, with whole gradients, for the step's pipeline pass). Its activations are its
    /// workspaces' (`with_workspaces`, `WorkspaceFloats::pipelined`).
    pub fn pipelined(mut self, held: f64, fsdp_shard: Option<usize>) -> Self {
        let part = |x: u64| (x as f64 * held).ceil() as u64;
        let (params, grads, optimizer) =
            (part(self.params), part(self.grads), part(self.optimizer));
        (self.params, self.grads, self.optimizer) = match fsdp_shard {
            Some(n) => {
                let n = n.max(1) as u64;
                let shard = |x: u64| x.div_ceil(n);
                self.param_shards = shard(params);
                self.grad_shards = shard(grads);
                (
                    shard(params) + params,
                    shard(grads) + grads,
                    optimizer.div_ceil(n),
                )
            }
            None => {
                self.param_shards = params;
                self.grad_shards = grads;
                (params, grads, optimizer)
            }
        };
        self
    }

    /// A pipeline rank under FSDP with bf16 mixed precision (after `pipelined`): the
    /// `held_block_params` gathered block weights held for the pass as bf16 pairs, and one block's
    /// (the largest) unpacked in f32 while it computes (`parallel::fsdp::StagePairs`).
    pub fn with_stage_pairs(
        mut self,
        (args, m): (&ModelArgs, &LocalShapes),
        held_block_params: u64,
    ) -> Self {
        self.params = self.params - 4 * held_block_params
            + 2 * held_block_params
            + 4 * largest_block_params(args, m);
        self
    }

    /// Adds the compute copy of the weights that bf16 mixed precision keeps outside FSDP, as `be`
    /// stores it (`Backend::compute_copy_bytes_per_param`): the parameters outside the blocks
    /// (`held` of them on a pipeline rank) and the largest block's, one block existing at a time
    /// (`parallel::param_state::WholeParams`).
    pub fn with_compute_copy(
        mut self,
        be: &dyn DeviceSizing,
        (args, m): (&ModelArgs, &LocalShapes),
        held: f64,
    ) -> Self {
        let outside = local_param_counts(args, m).1;
        let copied = (outside as f64 * held).ceil() as u64 + largest_block_params(args, m);
        self.compute_copy = copied * be.compute_copy_bytes_per_param();
        self
    }

    /// The estimate by memory-timeline category: at its peak when `peak` (what a refused run
    /// would have needed), else what stays held for the whole run (FSDP adds the blocks it gathers,
    /// the full gradients and the packed buffers of its collectives as it goes). `sharded`: this is
    /// an FSDP rank's estimate (`sharded`).
    pub fn by_category(&self, sharded: bool, peak: bool) -> Vec<(Category, u64)> {
        let (shard, grad_shard) = (self.param_shards, self.grad_shards);
        let (weights, gathered, grads) = match (sharded, peak) {
            (true, true) => (shard, self.params - shard, self.grads),
            (true, false) => (shard, 0, grad_shard),
            (false, _) => (self.params + self.compute_copy, 0, self.grads),
        };
        vec![
            (Category::Weights, weights),
            (Category::Gradients, grads),
            (Category::OptimizerState, self.optimizer),
            (
                Category::Activations,
                self.activations + self.activation_copies,
            ),
            (Category::GatheredBlocks, gathered),
            (Category::CommBuffers, 0),
            (Category::KernelScratch, self.scratch),
        ]
    }

    pub fn total(&self) -> u64 {
        let step = self.activations + self.scratch + self.activation_copies;
        self.params
            + self.grads
            + self.optimizer
            + self.compute_copy
            + step.max(self.optimizer_step)
    }

    /// Muon's state and step (`[optimizer] name = "Muon"`): one state, the momentum, for the
    /// matrices Muon updates instead of AdamW's two moments; and the step's transient memory:
    /// the momentum updates of its pieces and, when the matrices travel, this rank's share of the
    /// stage's whole matrices (spread over the `holders` ranks holding the stage) received,
    /// assembled and sent back (×3), with its pieces downloaded, sent and received back (×3 more).
    pub fn with_muon(mut self, args: &ModelArgs, m: &LocalShapes, muon: MuonSizing) -> Self {
        let whole: BTreeMap<String, Vec<usize>> = param_specs(args).into_iter().collect();
        let lora = args.lora.as_ref();
        let (mut matrices, mut others) = (0u64, 0u64);
        for (name, shape) in local_param_specs(args, m.tp) {
            if !crate::model::lora::trainable(lora, &name) || !m.holds(&name) {
                continue;
            }
            let n = shape.iter().product::<usize>() as u64;
            match muon_updates(&name, &whole[&name]) {
                true => matrices += n,
                false => others += n,
            }
        }
        let all_moments = 2 * (matrices + others);
        let kept = matrices + 2 * others;
        self.optimizer =
            (self.optimizer as u128 * kept as u128 / all_moments.max(1) as u128) as u64;
        // The whole model's matrices; a pipeline rank's stages hold `held` of them.
        let all_matrices: u64 = whole
            .iter()
            .filter(|(name, shape)| {
                crate::model::lora::trainable(lora, name) && muon_updates(name, shape)
            })
            .map(|(_, shape)| shape.iter().product::<usize>() as u64)
            .sum();
        let owned = (all_matrices as f64 * muon.held / muon.holders.max(1) as f64) as u64 * 4;
        let pieces = (matrices as f64 * muon.held / muon.shard.max(1) as f64) as u64 * 4;
        self.optimizer_step = match muon.exchanged {
            true => 3 * owned + 4 * pieces,
            false => pieces,
        };
        self
    }

    /// How the activations the blocks keep for their backward are stored, given the f32 bytes
    /// per value a backend's GEMM-only activations take (`Backend::bf16_activation_f32_bytes`):
    /// `bfloat16` (bf16 mixed precision: as bf16 pairs, the per-row statistics in f32);
    /// otherwise `float32`; `float32+bfloat16` (bf16 copies beside f32 activations, for the
    /// GEMMs); `bfloat16+float32` (GEMM-only activations in bf16 alone, the others f32).
    pub fn activation_dtype(&self, gemm_only_f32_bytes: u64) -> &'static str {
        if self.stored_dtype == ActivationDtype::BFloat16 {
            return "bfloat16";
        }
        match (gemm_only_f32_bytes, self.activation_copies > 0) {
            (0, _) => "bfloat16+float32",
            (_, true) => "float32+bfloat16",
            _ => "float32",
        }
    }

    /// `activation_dtype` and the residual stream's storage, for the start-up memory line.
    pub fn describe_activations(&self, gemm_only_f32_bytes: u64) -> String {
        format!(
            "{}, residual stream {}",
            self.activation_dtype(gemm_only_f32_bytes),
            self.stored_dtype.name()
        )
    }
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Memory the OS says is available (`MemAvailable`), if known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident memory of this process (`VmHWM`), in bytes.
pub fn peak_memory() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Refuses a job whose estimate (one rank's) exceeds the available memory: the device's free
/// memory where the backend reports it, else the host's, shared by `ranks_sharing` ranks (those
/// on this GPU, or on this host).
pub fn check_fits(
    est: &MemoryEstimate,
    what: &str,
    device_free: Option<u64>,
    ranks_sharing: usize,
) -> Result<()> {
    let (avail, place) = match device_free {
        Some(free) => (Some(free), "GPU"),
        None => (available_memory(), "host"),
    };
    let ranks = ranks_sharing.max(1) as u64;
    if let Some(avail) = avail {
        let needed = est.total() * ranks;
        if needed > avail {
            let net = est.activation_copies.saturating_sub(est.f32_left_out);
            let copies_hint = if net > 0 {
                format!(
                    ", or set TITAN_CUDA_BF16_COPIES=off to drop the activations' bf16 copies ({:.1} GiB net of the f32 storage they replace; GEMMs then convert instead)",
                    gib(net)
                )
            } else {
                String::new()
            };
            let per_rank = if ranks > 1 {
                format!(" for {ranks} ranks on this {place}, each")
            } else {
                String::new()
            };
            bail!(
                "{what} needs about {:.1} GiB ({} bytes{per_rank}: weights {:.1} GiB, gradients {:.1} GiB, optimizer state {:.1} GiB, activations {:.1} GiB and their bf16 copies {:.1} GiB, kernel scratch {:.1} GiB, bf16 compute copy {:.1} GiB) but only {:.1} GiB is available; \
                 choose a smaller flavor, batch or seq_len{copies_hint}",
                gib(needed),
                needed,
                gib(est.params),
                gib(est.grads),
                gib(est.optimizer),
                gib(est.activations),
                gib(est.activation_copies),
                gib(est.scratch),
                gib(est.compute_copy),
                gib(avail)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fsdp_rank_holds_its_shards_and_the_gathered_blocks() {
        // Llama 3.1 8B on 8 GPUs, TorchTitan's flagship layout: 128 GB of weights, gradients and
        // AdamW state in all, of which each rank holds an eighth plus what it gathers.
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let one = LocalShapes::whole(&args);
        let everything = ActivationPlan::keep_everything(args.n_layers);
        let whole = MemoryEstimate::new(&args, &one, 1, 8192, &everything);
        let state = |e: &MemoryEstimate| e.params + e.grads + e.optimizer;
        assert!(gib(state(&whole)) > 110.0, "{:.1} GiB", gib(state(&whole)));
        let rank = whole.sharded(&args, &one, 8, 3, 3);
        let block = args.params_per_layer() as u64 * 4;
        let outside = args.num_params() as u64 * 4 - block * args.n_layers as u64;
        assert_eq!(rank.optimizer, whole.optimizer.div_ceil(8));
        assert_eq!(rank.params, whole.params.div_ceil(8) + outside + 3 * block);
        assert_eq!(rank.grads, whole.grads.div_ceil(8) + outside + 4 * block);
        assert!(gib(state(&rank)) < 30.0, "{:.1} GiB", gib(state(&rank)));
        assert_eq!(rank.activations, whole.activations);
        // One rank alone holds everything once and the gathered working set on top.
        let alone = whole.sharded(&args, &one, 1, 3, 3);
        assert!(state(&alone) > state(&whole));
    }

    #[test]
    fn muon_keeps_one_state_per_matrix_and_spreads_its_gathered_matrices() {
        // Llama 3.1 8B: Muon's matrices (every block projection) keep a momentum alone, the
        // embedding, output head and norms AdamW's two moments.
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let one = LocalShapes::whole(&args);
        let plan = ActivationPlan::keep_everything(args.n_layers);
        let adamw = MemoryEstimate::new(&args, &one, 1, 1024, &plan);
        let alone = MuonSizing {
            held: 1.0,
            holders: 1,
            shard: 1,
            exchanged: false,
        };
        let muon = adamw.with_muon(&args, &one, alone);
        let (d, f, kv, vocab) = (4096u64, 14336u64, 1024u64, 128256u64);
        let matrices = 32 * (2 * d * d + 2 * d * kv + 3 * d * f);
        let others = 2 * vocab * d + 65 * d;
        assert_eq!(muon.optimizer, 4 * (matrices + 2 * others));
        assert_eq!(adamw.optimizer, 4 * 2 * (matrices + others));
        // One process orthogonalises the momentum updates where they are.
        assert_eq!(muon.optimizer_step, 4 * matrices);
        // Under FSDP 8 each rank holds an eighth of the state and of the gathered matrices.
        let fsdp = MuonSizing {
            held: 1.0,
            holders: 8,
            shard: 8,
            exchanged: true,
        };
        let rank = adamw
            .sharded(&args, &one, 8, 3, 3)
            .with_muon(&args, &one, fsdp);
        assert_eq!(
            rank.optimizer,
            (adamw.optimizer.div_ceil(8) as u128 * (matrices + 2 * others) as u128
                / (2 * (matrices + others)) as u128) as u64
        );
        assert_eq!(rank.optimizer_step, 7 * 4 * matrices / 8);
        // The step's transient memory comes after the activations are freed: the larger counts.
        let step = rank.activations + rank.scratch + rank.activation_copies;
        assert_eq!(
            rank.total(),
            rank.params + rank.grads + rank.optimizer + step.max(rank.optimizer_step)
        );
    }

    #[test]
    fn lora_counts_gradients_and_adamw_state_of_the_adapters_only() {
        // Llama 3.1 8B with rank-16 adapters on every block projection: the weights grow by the
        // adapters, the gradients and moments are the adapters' alone (a few hundred MiB).
        let mut args = crate::model::families::llama3::flavor("8B").unwrap();
        let base = MemoryEstimate::new(
            &args,
            &LocalShapes::whole(&args),
            1,
            1024,
            &ActivationPlan::keep_everything(args.n_layers),
        );
        args.lora = Some(crate::model::lora::LoraArgs {
            rank: 16,
            alpha: 32.0,
            target_modules: Vec::new(),
        });
        let one = LocalShapes::whole(&args);
        let plan = ActivationPlan::keep_everything(args.n_layers);
        let lora = MemoryEstimate::new(&args, &one, 1, 1024, &plan);
        let (d, f, kv) = (4096u64, 14336u64, 1024u64);
        let per_layer = 16 * ((d + d) + (d + kv) * 2 + (d + d) + 2 * (d + f) + (f + d));
        let adapters = 32 * per_layer * 4;
        assert_eq!(lora.params, base.params + adapters);
        assert_eq!(lora.grads, adapters);
        assert_eq!(lora.optimizer, 2 * adapters);
        assert!(gib(lora.grads + lora.optimizer) < 0.5);
        // Under FSDP each rank holds its shards of the adapters' gradients, and one block's.
        let rank = lora.sharded(&args, &one, 8, 3, 3);
        assert_eq!(rank.optimizer, lora.optimizer.div_ceil(8));
        assert_eq!(rank.grads, adapters.div_ceil(8) + 4 * (adapters / 32));
    }

    #[test]
    fn a_pipeline_rank_holds_its_stages_and_the_microbatches_in_flight() {
        use crate::model::activation_checkpoint::AcMode;
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let one = LocalShapes::whole(&args);
        let everything = ActivationPlan::keep_everything(args.n_layers);
        let whole = MemoryEstimate::new(&args, &one, 8, 8192, &everything);
        // PP 8 with 1F1B: the first rank holds an eighth of the model and 8 microbatches.
        let rank = whole.pipelined(1.0 / 8.0, None);
        assert_eq!(rank.params, whole.params.div_ceil(8));
        assert_eq!(rank.optimizer, whole.optimizer.div_ceil(8));
        // With FSDP 2 inside the stage: half of the stage's shards, plus the stage gathered whole.
        let sharded = whole.pipelined(1.0 / 8.0, Some(2));
        assert_eq!(sharded.optimizer, rank.optimizer.div_ceil(2));
        assert_eq!(sharded.params, rank.params.div_ceil(2) + rank.params);
        assert!(rank.total() < whole.total());
        // Its workspaces: 8 microbatches' block inputs and kept activations, of its own 4 blocks
        // only, and one transient set (the recomputed block, the backward's scratch) they share.
        let (rows, d) = (8192, args.dim);
        for mode in [AcMode::None, AcMode::Full, AcMode::Op] {
            let stage = mode.plan(args.n_layers).only(|l| l < 4);
            let part = |p| WorkspaceFloats::of(&one, 1, 8192, &stage, p).all;
            let (kept, transient) = (
                part(WorkspacePart::PerMicrobatch),
                part(WorkspacePart::Transient),
            );
            assert_eq!(part(WorkspacePart::Whole), kept + transient, "{mode:?}");
            let floats = WorkspaceFloats::pipelined(&one, (1, 8192), &stage, 8);
            assert_eq!(floats.all, 8 * kept + transient, "{mode:?}");
            assert!(transient > 0 && kept > 0, "{mode:?}");
            // Blocks 0..4 read inputs 0..4 and write input 4; input 32 is the head's (held
            // whole on every rank, one buffer): six of the 33 block inputs.
            assert_eq!(stage.block_inputs_held(), 6);
            if mode == AcMode::Full {
                // Full checkpointing keeps block inputs, the carried gradient and the final
                // norm's buffers only.
                assert_eq!(kept, 6 * rows * d + rows * d + rows * (d + 1));
            }
        }
    }

    #[test]
    fn llama_8b_at_seq_8192_under_fsdp_8_fits_80_gb_with_activation_checkpointing() {
        use crate::model::activation_checkpoint::AcMode;
        // TorchTitan's 8B recipe: FSDP 8, local batch 1, seq 8192; activations counted in f32
        // (the CPU's storage; a GPU keeps some in bf16 alone and adds bf16 copies of others).
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let one = LocalShapes::whole(&args);
        let rank = |mode: AcMode| {
            let plan = mode.plan(args.n_layers);
            MemoryEstimate::new(&args, &one, 1, 8192, &plan).sharded(&args, &one, 8, 3, 3)
        };
        let gpu = 80e9;
        let none = rank(AcMode::None);
        let (op, full) = (rank(AcMode::Op), rank(AcMode::Full));
        for (what, e) in [("none", &none), ("op", &op), ("full", &full)] {
            errln!(
                "8B, FSDP 8, seq 8192, AC {what}: {:.1} GiB per rank, of which activations {:.1} GiB",
                gib(e.total()),
                gib(e.activations)
            );
        }
        assert!(none.total() as f64 > gpu, "{:.1} GiB", gib(none.total()));
        assert!((op.total() as f64) < gpu && (full.total() as f64) < gpu);
        assert!(full.activations < op.activations && op.activations < none.activations / 2);
    }

    #[test]
    fn a_tensor_parallel_rank_holds_its_parts_and_the_replicated_norms() {
        // Llama 3.1 70B at TP 8: every weight but the norms split eight ways.
        let args = crate::model::families::llama3::flavor("70B").unwrap();
        let everything = ActivationPlan::keep_everything(args.n_layers);
        let whole = MemoryEstimate::new(&args, &LocalShapes::whole(&args), 1, 8192, &everything);
        let tp8 = LocalShapes::sharded(&args, 8, 3).unwrap();
        let rank = MemoryEstimate::new(&args, &tp8, 1, 8192, &everything);
        let norms = ((2 * args.n_layers + 1) * args.dim) as u64 * 4;
        assert_eq!(rank.params, (whole.params - norms) / 8 + norms);
        assert!(rank.activations < whole.activations / 4);
        // 70B's 8 key/value heads do not split 16 ways.
        let e = LocalShapes::sharded(&args, 16, 0).unwrap_err().to_string();
        assert!(
            e.contains("n_kv_heads 8") && e.contains("tensor_parallel_degree = 16"),
            "{e}"
        );
    }
}
