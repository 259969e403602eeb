//! The devices `titan plan` plans for: what one computes (achieved FLOP/s of TorchTitan's count,
//! a per-step optimizer cost, a cost per block and microbatch), how its ranks talk (alpha-beta
//! links within a node and between nodes), and how much memory it has. The GPUs come from a table
//! (datasheet peaks, efficiencies read off TorchTitan's published runs, NVLink and 400 Gb/s
//! network figures; docs/plan.md names the sources); the CPU from `titan plan --calibrate`.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::backend::cuda::bf16_operand_scratch_bytes;
use crate::train::memory::DeviceSizing;

/// A link's alpha-beta cost: `alpha` seconds per message step, `beta` seconds per byte a rank
/// moves.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Link {
    pub alpha_s: f64,
    pub beta_s_per_byte: f64,
}

impl Link {
    /// A link of `gb_per_s` (10⁹ bytes per second each rank moves) and `alpha_us`.
    pub const fn new(alpha_us: f64, gb_per_s: f64) -> Self {
        Link {
            alpha_s: alpha_us * 1e-6,
            beta_s_per_byte: 1e-9 / gb_per_s,
        }
    }
}

/// How a device computes, in TorchTitan's FLOP count.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Compute {
    /// Achieved FLOP/s of a rank with the device to itself (one CPU thread for the CPU).
    pub flops_per_s: f64,
    /// Seconds per block per microbatch beyond the FLOPs (kernel launches, small ops).
    pub block_overhead_s: f64,
    /// Seconds of the optimizer step per parameter a rank holds.
    pub optimizer_s_per_param: f64,
}

/// How a GPU runs a mixture of experts' grouped GEMMs (`plan::experts`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct GroupedGemm {
    /// Output rows per GEMM tile.
    pub tile_rows: f64,
    /// Achieved memory bandwidth reading weights, bytes per second.
    pub weight_bytes_per_s: f64,
}

impl GroupedGemm {
    /// 128-row tiles (cuBLAS's and CUTLASS's Hopper and Blackwell grouped kernels) and 80% of the
    /// datasheet's memory bandwidth (`tb_per_s`), what a streaming read achieves.
    const fn gpu(tb_per_s: f64) -> Self {
        GroupedGemm {
            tile_rows: 128.0,
            weight_bytes_per_s: 0.8 * tb_per_s * 1e12,
        }
    }
}

/// A device kind and its links.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Device {
    pub name: String,
    /// Datasheet peak TFLOP/s (bf16 on GPUs; the calibrated rate on the CPU), for MFU.
    pub peak_tflops: f64,
    /// Memory per device in bytes; None: the host's, shared by its ranks.
    pub memory_bytes: Option<u64>,
    pub compute: Compute,
    /// Links within a node (NVLink; the host's memory for CPU ranks) and between nodes.
    pub intra: Link,
    pub inter: Link,
    /// Devices per node (a group wider than a node crosses the network).
    pub per_node: usize,
    /// Bytes per value of activations and gathered weights on the wire (2: bf16; 4: f32).
    pub wire_bytes: u64,
    /// Whether collectives overlap compute (GPU streams); CPU ranks' copies share their cores.
    pub overlaps: bool,
    /// CPU cores the host's ranks share (0 for GPUs: each rank has its device).
    pub cores: usize,
    /// Parallel efficiency of a rank using all `cores` threads against one thread each.
    pub thread_efficiency: f64,
    /// Seconds each collective inside the step (TP, CP, EP, pipeline transfers: the ranks wait
    /// on each other) costs beyond its link's alpha-beta: on a CPU host, the ranks' skew on
    /// shared cores (calibrated); 0 on GPUs.
    pub step_alpha_s: f64,
    /// Compute efficiency kept under tensor parallelism (narrower GEMMs, the sequence-parallel
    /// copies), the same at any degree above 1 (on this CPU TP 4 keeps what TP 2 keeps, measured
    /// by scripts/plan_check.py): calibrated on the CPU; 1 on GPUs, whose GEMMs stay large.
    pub tp_efficiency: f64,
    /// The same under context parallelism (ring attention's chunks).
    pub cp_efficiency: f64,
    /// Compute efficiency of a mixture-of-experts model against its FLOP count (routing,
    /// dispatch, the experts' smaller GEMMs): calibrated on the CPU; 1 on GPUs (no measurement).
    pub moe_efficiency: f64,
    /// How much faster a float8 linear's FLOPs run than bf16 ones: read off TorchTitan's
    /// Llama 3.1 8B on 8 H100s (6,667 → 8,532 tok/s/GPU with float8 rowwise, +28%, at a 72% share
    /// of linear FLOPs: 1.43) for the GPUs; on the CPU the emulated casts make them slower, fitted
    /// by the calibration's float8 run (a calibration stored before it had one reads 0.78, from
    /// docs/float8.md's debug model: step 1.24× with rowwise at 85% linear FLOPs).
    #[serde(default = "emulated_float8_speedup")]
    pub float8_speedup: f64,
    /// A GPU's grouped expert GEMMs (tiles, weight reads); None on CPU ranks, whose calibrated
    /// `moe_efficiency` stands for them.
    #[serde(default)]
    pub grouped_gemm: Option<GroupedGemm>,
}

/// `Device::float8_speedup` of CPU ranks: the emulated casts' measured cost.
pub fn emulated_float8_speedup() -> f64 {
    0.78
}

/// An H100 as TorchTitan ran them (8 per host over NVLink, 400 Gb/s per GPU between hosts); the
/// compute efficiency is read off its published Llama 3.1 8B FSDP run on 8 of them (docs/plan.md).
fn h100() -> Device {
    Device {
        name: "h100".into(),
        peak_tflops: 989.0,
        memory_bytes: Some(80 << 30),
        compute: Compute {
            flops_per_s: 989e12 * 0.36,
            block_overhead_s: 0.2e-3,
            optimizer_s_per_param: 28.0 / 2.4e12,
        },
        // NCCL's bus bandwidth over NVLink 4 (450 GB/s a direction) reaches about 360 GB/s on
        // large messages; 400 Gb/s of RDMA per GPU about 45 GB/s.
        intra: Link::new(10.0, 360.0),
        inter: Link::new(20.0, 45.0),
        per_node: 8,
        wire_bytes: 2,
        overlaps: true,
        cores: 0,
        thread_efficiency: 1.0,
        step_alpha_s: 0.0,
        tp_efficiency: 1.0,
        cp_efficiency: 1.0,
        moe_efficiency: 1.0,
        float8_speedup: 1.43,
        // HBM3: 3.35 TB/s.
        grouped_gemm: Some(GroupedGemm::gpu(3.35)),
    }
}

/// The GPUs `titan plan --gpu` knows.
pub const GPUS: [&str; 3] = ["h100", "h200", "b200"];

/// The table entry of `name` (any case).
pub fn gpu(name: &str) -> Result<Device> {
    let base = h100();
    Ok(match name.to_ascii_lowercase().as_str() {
        "h100" => base,
        "h200" => Device {
            name: "h200".into(),
            memory_bytes: Some(141 << 30),
            compute: Compute {
                optimizer_s_per_param: 28.0 / 4.8e12,
                ..base.compute
            },
            // HBM3e: 4.8 TB/s.
            grouped_gemm: Some(GroupedGemm::gpu(4.8)),
            ..base
        },
        "b200" => Device {
            name: "b200".into(),
            peak_tflops: 2250.0,
            memory_bytes: Some(180 << 30),
            compute: Compute {
                flops_per_s: 2250e12 * 0.36,
                optimizer_s_per_param: 28.0 / 8e12,
                ..base.compute
            },
            // NVLink 5: 900 GB/s a direction.
            intra: Link::new(10.0, 720.0),
            // HBM3e: 8 TB/s.
            grouped_gemm: Some(GroupedGemm::gpu(8.0)),
            ..base
        },
        other => bail!(
            "titan plan: unknown GPU `{other}`; known: {} (or plan CPU ranks with --nproc N)",
            GPUS.join(", ")
        ),
    })
}

impl Device {
    /// A rank's FLOP/s on the threads it has, and how crowded the host is, for `ranks` ranks on
    /// one node: a GPU rank has its device (crowd 1); CPU ranks share the host's cores
    /// (`[training] threads = 0`: the cores shared out, at least one thread each), the crowd
    /// being how many threads want each core (above 1 the host is saturated).
    pub fn rank_rate(&self, ranks: usize) -> (f64, f64) {
        if self.cores == 0 {
            return (self.compute.flops_per_s, 1.0);
        }
        let ranks = ranks.max(1);
        let threads = (self.cores / ranks).max(1);
        let span = (self.cores.max(2) - 1) as f64;
        let efficiency = self.thread_efficiency.powf((threads - 1) as f64 / span);
        let crowd = ((ranks * threads) as f64 / self.cores as f64).max(1.0);
        (
            self.compute.flops_per_s * threads as f64 * efficiency,
            crowd,
        )
    }
}

/// A GPU titan sizes without having it: the CUDA backend's accounting (in bf16: bf16 GEMMs and
/// the activations' bf16 copies, its defaults; else f32 activations alone), against the table's
/// memory.
pub struct PlannedGpu {
    pub memory_bytes: u64,
    /// `[training] mixed_precision_param = "bfloat16"`.
    pub bf16: bool,
    /// Float8 linears with float8 GEMMs (`Config::wants_float8_gemms`): the casts keep codes.
    pub float8_gemms: bool,
}

impl DeviceSizing for PlannedGpu {
    fn scratch_bytes(&self, tokens: usize, dim: usize, hidden: usize, vocab: usize) -> u64 {
        match self.bf16 {
            true => bf16_operand_scratch_bytes(tokens, dim, hidden, vocab),
            false => 0,
        }
    }
    fn activation_copy_bytes(&self) -> u64 {
        2 * self.bf16 as u64
    }
    fn bf16_activation_f32_bytes(&self) -> u64 {
        4 * !self.bf16 as u64
    }
    fn compute_copy_bytes_per_param(&self) -> u64 {
        4 + 2
    }
    fn device_free_memory(&self) -> Option<u64> {
        Some(self.memory_bytes)
    }
    fn keeps_float8_codes(&self) -> bool {
        self.float8_gemms
    }
}
