//! The CUDA backend: every kernel of the `Backend` trait on one NVIDIA GPU.
//!
//! Buffers are f32 device memory (`CudaSlice<f32>`) from the driver's stream-ordered memory pool,
//! which this backend tells to keep freed memory (release threshold = ∞): after the first step no
//! call reaches `cudaMalloc`, and the pool's high-water mark is the peak memory in the metrics.
//! GEMMs go to cuBLASLt (`gemm`); every other op is CUDA C compiled at start-up by NVRTC
//! (`kernels`). All compute is queued on one stream; only `download`, the loss and `sum_squares`
//! wait for it. NCCL collectives run on a second stream (`comm_stream`), ordered against the first
//! by events (`comm::nccl`), so that they overlap compute. The libraries are loaded at run time
//! (`libs`), so titan builds and runs without CUDA.

mod buffer;
pub mod gemm;
pub mod kernels;
pub mod libs;
mod ops;
pub use ops::loss::bf16_operand_scratch_bytes;
pub mod specs;

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};

pub use buffer::CudaBuf;
pub use gemm::GemmPrecision;

use super::profile::{OpProfiler, WaitForDevice};
use libs::{require, CudaLib};

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The stream NCCL collectives run on, made on first use (`comm_stream`).
    comm_stream: std::sync::OnceLock<Arc<CudaStream>>,
    functions: HashMap<&'static str, CudaFunction>,
    gemm: gemm::Gemm,
    pool: Option<sys::CUmemoryPool>,
    device_name: String,
    arch: String,
    /// Per-op times when profiling (`titan bench train --profile-ops`); off by default.
    pub profiler: OpProfiler,
    /// Copies between host memory and the GPU (`backend::transfers`).
    pub transfers: crate::backend::transfers::TransferCounter,
    /// Which attention kernels the training shape uses (decided once, here).
    attention: AttentionKernels,
    /// Most shared memory one block may have on this device (with the kernel's consent).
    shared_memory_per_block: usize,
    /// Whether norm, attention and SwiGLU kernels write bf16 copies of their outputs for the GEMMs
    /// that read them (with bf16 GEMMs; `TITAN_CUDA_BF16_COPIES=off` turns it off, to compare).
    activation_copies: bool,
    /// Float8 casts keep their codes and float8 operands multiply in cuBLASLt's float8 GEMMs
    /// (`enable_fp8_gemms`); off: the emulated GEMMs on the dequantised values.
    fp8_gemms: bool,
    /// Compute capability as `major * 10 + minor` (90 on Hopper).
    capability: i32,
}

/// The attention kernels of the training shape. Tensor cores when GEMMs run in bf16 (the same
/// rounding the model already accepts there) on an sm_80+ GPU. `TITAN_CUDA_ATTENTION`, a
/// comma-separated list, overrides: `exact` keeps the fp32 kernels (a comparison or a suspected
/// fault); `narrow` runs the head_dim 64 forward with 16 query rows per warp instead of 32;
/// `fused` (64 keys per block) or `fused8` (128) computes the backward in one pass, its blocks
/// taking turns to add into dQ (deterministic, like the split passes), and with `unordered` too
/// without turns (racing atomics, not repeatable bit for bit), to compare them on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernels {
    Exact,
    TensorCores {
        wide_forward: bool,
        backward: TensorCoreBackward,
    },
}

/// The tensor-core backward: a dQ pass and dK/dV pass(es) (deterministic), or one fused pass with
/// `warps` warps of 16 keys per block whose dQ is summed by atomic additions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorCoreBackward {
    Split,
    Fused { warps: usize, ordered: bool },
}

impl TensorCoreBackward {
    /// The fused kernel's dynamic shared memory for head_dim `d` (FusedBackwardLayout in
    /// kernels/attention_tc.cu): the stages (two at head_dim 64, one above) of 64-query tiles of Q
    /// and dO, the block's keys (and values above 64) and its dS tile (bf16, rows padded by 8), and
    /// the stages of log-sum-exp and delta (f32).
    pub fn fused_shared_bytes(d: usize, warps: usize) -> usize {
        let (stride, keys) = (d + 8, 16 * warps);
        let stages = if d <= 64 { 2 } else { 1 };
        let key_value_tiles = if d <= 64 { 1 } else { 2 };
        let bf16_elements =
            2 * stages * 64 * stride + key_value_tiles * keys * stride + keys * (64 + 8);
        bf16_elements * 2 + 2 * stages * 64 * 4
    }

    /// Whether a device that gives a block at most `per_block` bytes of shared memory can run the
    /// fused kernel: its dynamic memory plus the few static bytes of its block ticket.
    pub fn fused_fits(d: usize, warps: usize, per_block: usize) -> bool {
        const STATIC_BYTES: usize = 16;
        Self::fused_shared_bytes(d, warps) + STATIC_BYTES <= per_block
    }
}

impl AttentionKernels {
    fn choose(precision: GemmPrecision, major: i32) -> Self {
        let setting = std::env::var("TITAN_CUDA_ATTENTION").unwrap_or_default();
        let words: Vec<&str> = setting
            .split(',')
            .map(str::trim)
            .filter(|w| !w.is_empty())
            .collect();
        if precision != GemmPrecision::BFloat16 || major < 8 || words.contains(&"exact") {
            return AttentionKernels::Exact;
        }
        let mut wide_forward = true;
        let mut fused_warps = None;
        let mut ordered = true;
        for word in words {
            match word {
                "narrow" => wide_forward = false,
                "fused" => fused_warps = Some(4),
                "fused8" => fused_warps = Some(8),
                "unordered" => ordered = false,
                other => errln!(
                    "warning: TITAN_CUDA_ATTENTION: `{other}` is not known (accepted, comma \
                     separated: exact, narrow, fused, fused8, unordered); ignoring it"
                ),
            }
        }
        let backward = match fused_warps {
            Some(warps) => TensorCoreBackward::Fused { warps, ordered },
            None => TensorCoreBackward::Split,
        };
        AttentionKernels::TensorCores {
            wide_forward,
            backward,
        }
    }
}

/// The fused attention backward kernels: name, head_dim, warps per block.
pub(crate) const FUSED_BACKWARD_KERNELS: [(&str, usize, usize); 4] = [
    ("attention_backward_fused_tc64", 64, 4),
    ("attention_backward_fused_tc64w8", 64, 8),
    ("attention_backward_fused_tc128", 128, 4),
    ("attention_backward_fused_tc128w8", 128, 8),
];

// SAFETY: the memory pool handle is only read through the driver, which is thread-safe; the other
// fields are Send + Sync themselves.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles the kernels for its architecture and creates the cuBLASLt handle.
    pub fn new(ordinal: usize, precision: GemmPrecision) -> Result<Self> {
        require(
            &[CudaLib::Driver, CudaLib::Nvrtc, CudaLib::CublasLt],
            "the CUDA backend (--training.device cuda)",
        )?;
        let count = libs::device_count()?;
        if ordinal >= count {
            return Err(anyhow!(
                "CUDA device {ordinal} requested but this machine has {count} (check \
                 CUDA_VISIBLE_DEVICES and the number of processes per node)"
            ));
        }
        let cuda = |what: &str, e: cudarc::driver::DriverError| anyhow!("CUDA {what}: {e}");
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda("context", e))?;
        // One stream, ordered by construction: the per-buffer event tracking of cudarc is not needed.
        // SAFETY: no buffer exists yet on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda("compute capability", e))?;
        let arch = format!("sm_{major}{minor}");
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let compiled = kernels::compile(&arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))
            .map_err(|e| {
                anyhow!(
                    "the driver refused titan's kernels compiled for {arch} ({e}); an NVRTC of a \
                     newer CUDA major version than the driver's cannot be used: put the NVRTC that \
                     matches the driver first on LD_LIBRARY_PATH"
                )
            })?;
        let mut functions = HashMap::new();
        for name in kernels::KERNELS {
            let f = module
                .load_function(name)
                .map_err(|e| anyhow!("kernel `{name}` missing from the compiled module: {e}"))?;
            functions.insert(*name, f);
        }
        // The fused attention backward takes more shared memory than the 48 KiB a kernel gets
        // without asking; each kernel is allowed what it needs where the device has it (the
        // others are not used, see `tensor_core_attention`).
        let shared_memory_per_block =
            ctx.attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| cuda("shared memory per block", e))? as usize;
        if major >= 8 {
            for (name, head_dim, warps) in FUSED_BACKWARD_KERNELS {
                if !TensorCoreBackward::fused_fits(head_dim, warps, shared_memory_per_block) {
                    continue;
                }
                let bytes = TensorCoreBackward::fused_shared_bytes(head_dim, warps);
                functions[name]
                    .set_attribute(
                        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(|e| cuda(&format!("shared memory limit of `{name}`"), e))?;
            }
        }
        let pool = keep_freed_memory(&ctx);
        let gemm = gemm::Gemm::new(
            stream.clone(),
            precision,
            ["f32_to_bf16", "bf16_pairs_to_f32", "float8_scale_product"]
                .map(|f| functions[f].clone()),
        )?;
        Ok(CudaBackend {
            ctx,
            stream,
            comm_stream: std::sync::OnceLock::new(),
            functions,
            gemm,
            pool,
            device_name,
            arch,
            profiler: OpProfiler::default(),
            transfers: Default::default(),
            attention: AttentionKernels::choose(precision, major),
            shared_memory_per_block,
            activation_copies: precision == GemmPrecision::BFloat16
                && std::env::var("TITAN_CUDA_BF16_COPIES").as_deref() != Ok("off"),
            fp8_gemms: false,
            capability: major * 10 + minor,
        })
    }

    /// Times every op from now on (each op then waits for the GPU; see `OpProfiler`).
    pub fn enable_profiling(&mut self) {
        self.profiler = OpProfiler::enabled();
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn precision(&self) -> GemmPrecision {
        self.gemm.precision()
    }

    /// The GPU's place on the PCI bus (domain, bus, device packed below 2^24), which names it
    /// among the node's GPUs whatever `CUDA_VISIBLE_DEVICES` each process sees.
    pub fn pci_location(&self) -> Result<u32> {
        use sys::CUdevice_attribute as A;
        let get = |a| {
            self.ctx
                .attribute(a)
                .map_err(|e| anyhow!("CUDA device attribute {a:?}: {e}"))
        };
        let (domain, bus, device) = (
            get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
        );
        Ok(((domain as u32 & 0x7ff) << 13) | ((bus as u32 & 0xff) << 5) | (device as u32 & 0x1f))
    }

    /// Float8 operands multiply in cuBLASLt's float8 GEMMs from now on (`[quantize.linear.float8]
    /// emulate = false`): the casts keep their codes, and a GEMM whose two operands have codes
    /// laid out for it runs on them (`gemm.rs`); any other GEMM, or a shape cuBLASLt refuses,
    /// multiplies the dequantised values as the emulation does. Needs an sm_89+ GPU (Ada, Hopper,
    /// Blackwell: float8 tensor cores).
    pub fn enable_fp8_gemms(&mut self) -> Result<()> {
        if self.capability < 89 {
            return Err(anyhow!(
                "[quantize.linear.float8] emulate = false: float8 GEMMs need a GPU with float8 \
                 tensor cores (sm_89 or newer: Ada, Hopper, Blackwell); {} is {}. Set \
                 [quantize.linear.float8] emulate = true to run the float8 numerics emulated on \
                 this GPU",
                self.device_name,
                self.arch
            ));
        }
        self.fp8_gemms = true;
        Ok(())
    }

    /// MXFP8 GEMMs (block-scaled, sm_100) are not built: a recipe that asks for them (`wanted`,
    /// as `Config::wanted_mx_gemms` names them) is refused, naming this GPU and the emulated
    /// recipe that runs the same numbers here.
    pub fn refuse_mx_gemms(&self, wanted: &[String]) -> Result<()> {
        let Some(first) = wanted.first() else {
            return Ok(());
        };
        let why = match self.capability >= 100 {
            true => "titan's block-scaled cuBLASLt GEMMs for it are not built yet".to_string(),
            false => format!(
                "they need an sm_100 GPU (Blackwell), and {} is {}",
                self.device_name, self.arch
            ),
        };
        Err(anyhow!(
            "{first}: MXFP8 GEMMs on CUDA: {why}. Set the recipe's emulated form (mxfp8_emulated, \
             mxfp8_emulated_rceil) to cast on the GPU and multiply in high precision, as the CPU does"
        ))
    }

    /// Whether float8 operands multiply in float8 GEMMs (`enable_fp8_gemms`).
    pub fn fp8_gemms(&self) -> bool {
        self.fp8_gemms
    }

    /// Float8 GEMMs run so far, and GEMMs of float8 operands that multiplied the dequantised
    /// values instead (a layout or shape cuBLASLt's float8 kernels do not take).
    pub fn fp8_gemm_counts(&self) -> (u64, u64) {
        self.gemm.fp8_counts()
    }

    /// Whether kernels write bf16 copies of activations for the GEMMs (`TITAN_CUDA_BF16_COPIES`).
    pub fn activation_copies(&self) -> bool {
        self.activation_copies
    }

    /// The attention kernels of the training shape (`AttentionKernels`).
    pub fn attention_kernels(&self) -> AttentionKernels {
        self.attention
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream every NCCL communicator of this process queues its collectives on, made on first
    /// use. One stream for all groups keeps the collectives of a process in the order they were
    /// issued (HSDP's all-reduce across replicas runs after the reduce-scatter it sums), which is
    /// also the order every rank issues them in. Non-blocking: it does not wait for the compute
    /// stream unless told to by an event.
    pub fn comm_stream(&self) -> Result<Arc<CudaStream>> {
        if let Some(s) = self.comm_stream.get() {
            return Ok(s.clone());
        }
        let made = self
            .ctx
            .new_stream()
            .map_err(|e| anyhow!("CUDA: creating the communication stream: {e}"))?;
        Ok(self.comm_stream.get_or_init(|| made).clone())
    }

    /// A stream of its own for one channel of point-to-point traffic (`comm::nccl::peers`): a
    /// receive waiting for its peer there holds up nothing else.
    pub fn channel_stream(&self) -> Result<Arc<CudaStream>> {
        self.ctx
            .new_stream()
            .map_err(|e| anyhow!("CUDA: creating a point-to-point stream: {e}"))
    }

    /// Waits for every queued kernel (benchmarks time whole steps).
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA synchronize: {e}"))
    }

    /// Highest number of bytes the memory pool has handed out since the last reset.
    pub fn peak_memory_bytes(&self) -> Option<u64> {
        let pool = self.pool?;
        let mut value = 0u64;
        // SAFETY: pool is the device's default pool; the attribute is a u64.
        let r = unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut value as *mut u64 as *mut std::ffi::c_void,
            )
        };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(value)
    }

    /// Total and free device memory in bytes.
    pub fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .ok()
            .map(|(free, total)| (total, free))
    }

    fn function(&self, name: &'static str) -> &CudaFunction {
        &self.functions[name]
    }

    /// Zeroed device memory for `len` elements (at least one, see `CudaBuf`).
    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> CudaSlice<T> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .unwrap_or_else(|e| panic!("CUDA: allocating {len} elements failed: {e}"))
    }

    /// Device memory for `len` elements (at least one) left as the pool hands it out: for per-call
    /// scratch that a kernel or GEMM writes in full before anything reads it (the loss's logit
    /// block, bf16 operand copies), where zeroing would be a wasted pass over gigabytes each step.
    fn alloc_unzeroed<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> CudaSlice<T> {
        // SAFETY: the callers write every element they later read (see each call), and the values
        // are plain numbers: any bit pattern is a valid T.
        unsafe { self.stream.alloc::<T>(len.max(1)) }
            .unwrap_or_else(|e| panic!("CUDA: allocating {len} elements failed: {e}"))
    }

    fn buffer(&self, len: usize) -> CudaBuf {
        CudaBuf::new(self.alloc(len), len)
    }
}

impl WaitForDevice for CudaBackend {
    fn wait_for_device(&self) {
        let _ = self.stream.synchronize();
    }
}

/// Sets the default memory pool's release threshold to the maximum so freed blocks stay cached,
/// and returns the pool for the peak-memory query (None when the device has no pools).
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Option<sys::CUmemoryPool> {
    if !ctx.has_async_alloc() {
        return None;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the device handle is valid; the threshold attribute is a u64.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) != sys::CUresult::CUDA_SUCCESS
        {
            return None;
        }
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        );
    }
    Some(pool)
}

/// Grid for a grid-stride loop over `n` elements.
fn elementwise_config(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    const MAX_BLOCKS: usize = 8192;
    LaunchConfig {
        grid_dim: ((n.div_ceil(THREADS)).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row, `threads` wide.
fn rows_config(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Block width for a per-row reduction over `dim` columns: a multiple of 32, at most 1024.
fn row_threads(dim: usize) -> u32 {
    (dim.div_ceil(32) * 32).clamp(32, 1024) as u32
}
