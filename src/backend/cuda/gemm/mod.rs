//! Row-major GEMMs on cuBLASLt with f32 storage and a chosen compute precision: exact fp32, TF32 or
//! bf16 tensor cores. For bf16 both operands are read as bf16: an operand's own bf16 copy where it
//! has one (the parameters' compute copy, `CudaBuf`), else its values rounded into a bf16 scratch
//! buffer by one conversion kernel. cuBLASLt then runs its native bf16 kernels, which read half the
//! bytes and run about twice as fast as its f32-input "fast bf16" mode; products accumulate in fp32
//! and the output is f32, or bf16 for an output kept in bf16 alone (`matmul_to_bf16`).
//!
//! cuBLASLt is column-major; a row-major `[r, c]` buffer is the column-major `[c, r]` matrix, so
//! `out = op(a)·op(b)` is computed as `outᵀ = op(b)ᵀ·op(a)ᵀ` with the operands swapped. Layouts,
//! descriptors and the heuristic's algorithm are cached per shape: after the first step no call
//! allocates or queries the heuristic again.

mod fp8;

pub use fp8::Fp8Input;

use crate::backend::{GemmOutput, GemmShape};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

/// Arithmetic of the GEMMs (storage stays f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPrecision {
    /// IEEE fp32 multiply-adds: what the CUDA-vs-CPU checks use.
    Float32,
    /// TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation).
    TFloat32,
    /// bf16 tensor cores (inputs rounded to bf16, fp32 accumulation).
    BFloat16,
}

impl GemmPrecision {
    /// From `[training] mixed_precision_param`.
    pub fn from_config(name: &str) -> Result<Self> {
        Ok(match name {
            "float32" => GemmPrecision::Float32,
            "tfloat32" => GemmPrecision::TFloat32,
            "bfloat16" => GemmPrecision::BFloat16,
            other => bail!(
                "[training] mixed_precision_param = `{other}` is not known (accepted: bfloat16, \
                 tfloat32, float32)"
            ),
        })
    }

    fn compute_type(self) -> sys::cublasComputeType_t {
        match self {
            GemmPrecision::Float32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            GemmPrecision::TFloat32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            GemmPrecision::BFloat16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        }
    }
}

/// One GEMM input by device address: f32 values and, where the buffer has one, their bf16 copy
/// (`CudaBuf`), which a bf16 GEMM reads as is instead of converting the f32 values again.
#[derive(Debug, Clone, Copy)]
pub struct GemmInput {
    pub f32: u64,
    pub bf16: Option<u64>,
    /// The buffer's `CudaBuf::contents` when the input is a whole buffer: a conversion of the same
    /// contents still in the scratch is used again.
    pub contents: Option<(u64, u64)>,
    /// The f32 values were not written (only `bf16` holds them): an fp32 GEMM widens the bf16
    /// values instead of reading stale f32 ones.
    pub f32_stale: bool,
    /// The float8 codes of the values, when the buffer has them (`fp8.rs`).
    pub fp8: Option<Fp8Input>,
}

impl GemmInput {
    /// f32 values with no bf16 copy (a view: never matched against the scratch).
    pub fn f32(values: &impl DevicePtr<f32>, stream: &CudaStream) -> Self {
        let (f32, _sync) = values.device_ptr(stream);
        GemmInput {
            f32,
            bf16: None,
            contents: None,
            f32_stale: false,
            fp8: None,
        }
    }
}

/// A bf16 scratch buffer for one operand position, and which buffer contents (and how many
/// values of them) it holds.
#[derive(Default)]
struct ScratchSlot {
    copy: Option<CudaSlice<u16>>,
    holds: Option<(u64, u64, usize)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct GemmKey {
    shape: GemmShape,
    /// The output (cuBLASLt's C and D) is bf16: bf16 inputs only, no fallback to fp32.
    bf16_output: bool,
}

/// What a plan is made of: the compute type, whether cuBLASLt's A and B are transposed, and the
/// element type and stored (rows, cols, ld) of A, B and C = D in column-major terms.
struct PlanSpec {
    compute: sys::cublasComputeType_t,
    transposes: [bool; 2],
    layouts: [(sys::cudaDataType, (u64, u64, u64)); 3],
}

/// The cuBLASLt objects of one shape.
struct GemmPlan {
    desc: sys::cublasLtMatmulDesc_t,
    /// Layouts of cuBLASLt's A (our `b`), B (our `a`) and C = D (our `out`).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
    /// A and B are bf16 (converted into the scratch buffers before the call).
    bf16_inputs: bool,
}

// SAFETY: the plan's handles are plain descriptors; cuBLASLt allows using them from any thread as
// long as calls on one plan do not race, which the cache's mutex guarantees.
unsafe impl Send for GemmPlan {}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once.
        unsafe {
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    precision: GemmPrecision,
    plans: Mutex<HashMap<GemmKey, GemmPlan>>,
    /// Shapes cuBLASLt has no bf16-output algorithm for (asked once each).
    no_bf16_output: Mutex<std::collections::HashSet<GemmKey>>,
    warned_fallback: AtomicBool,
    /// The `f32_to_bf16` kernel.
    to_bf16: CudaFunction,
    /// The `bf16_pairs_to_f32` kernel: widens an operand kept in bf16 alone for an fp32 GEMM.
    to_f32: CudaFunction,
    /// bf16 copies of the two operands, grown to the largest GEMM and then reused.
    scratch: Mutex<[ScratchSlot; 2]>,
    /// The float8 GEMMs (`fp8.rs`).
    fp8: fp8::Fp8Gemms,
}

// SAFETY: the cuBLASLt handle is thread-safe; the plan cache is behind a mutex.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

/// cuBLASLt workspace: 32 MiB, what NVIDIA recommends for Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

fn lt_err(what: &str, e: lt::CublasError) -> anyhow::Error {
    anyhow!("cuBLASLt {what} failed: {e:?}")
}

impl Gemm {
    pub fn new(
        stream: Arc<CudaStream>,
        precision: GemmPrecision,
        [to_bf16, to_f32, scale_fp8_product]: [CudaFunction; 3],
    ) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| lt_err("create", e))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| anyhow!("allocating the cuBLASLt workspace: {e}"))?;
        Ok(Gemm {
            handle,
            stream,
            workspace,
            precision,
            plans: Mutex::new(HashMap::new()),
            no_bf16_output: Mutex::new(Default::default()),
            warned_fallback: AtomicBool::new(false),
            to_bf16,
            to_f32,
            scratch: Mutex::new(Default::default()),
            fp8: fp8::Fp8Gemms::new(scale_fp8_product),
        })
    }

    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Float8 GEMMs run, and GEMMs of float8 operands that multiplied dequantised values.
    pub fn fp8_counts(&self) -> (u64, u64) {
        self.fp8.counts()
    }

    /// The plan in the configured precision; if cuBLASLt has no tensor-core algorithm for a shape,
    /// that shape runs in exact fp32 instead (said once on stderr) rather than failing the step.
    fn plan(&self, key: GemmKey) -> Result<GemmPlan> {
        if key.bf16_output {
            return self.plan_with(key, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, true);
        }
        let wanted = match self.precision {
            GemmPrecision::BFloat16 => {
                self.plan_with(key, sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, true)
            }
            other => self.plan_with(key, other.compute_type(), false),
        };
        match wanted {
            Ok(plan) => Ok(plan),
            Err(e) if self.precision != GemmPrecision::Float32 => {
                if !self.warned_fallback.swap(true, Ordering::Relaxed) {
                    errln!("warning: {e:#}; such GEMMs run in fp32");
                }
                self.plan_with(key, GemmPrecision::Float32.compute_type(), false)
            }
            Err(e) => Err(e),
        }
    }

    fn plan_with(
        &self,
        key: GemmKey,
        compute: sys::cublasComputeType_t,
        bf16_inputs: bool,
    ) -> Result<GemmPlan> {
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let bf16t = sys::cudaDataType::CUDA_R_16BF;
        let input_type = if bf16_inputs { bf16t } else { f32t };
        let output_type = if key.bf16_output { bf16t } else { f32t };
        let (m, k, n) = (key.shape.m as u64, key.shape.k as u64, key.shape.n as u64);
        // Stored (rows, cols, ld) of each operand in column-major terms.
        let b_layout = if key.shape.trans_b {
            (k, n, k)
        } else {
            (n, k, n)
        };
        let a_layout = if key.shape.trans_a {
            (m, k, m)
        } else {
            (k, m, k)
        };
        let spec = PlanSpec {
            compute,
            // cuBLASLt's A is our b, its B is our a (see the module doc).
            transposes: [key.shape.trans_b, key.shape.trans_a],
            layouts: [
                (input_type, b_layout),
                (input_type, a_layout),
                (output_type, (n, m, n)),
            ],
        };
        let mut plan = self.make_plan(&spec).map_err(|e| {
            anyhow!(
                "cuBLASLt has no algorithm for a {}x{}x{} GEMM (trans_a {}, trans_b {}) with \
                 {compute:?}{}{}: {e}",
                key.shape.m,
                key.shape.k,
                key.shape.n,
                key.shape.trans_a,
                key.shape.trans_b,
                if bf16_inputs { " on bf16 inputs" } else { "" },
                if key.bf16_output { " into bf16" } else { "" },
            )
        })?;
        plan.bf16_inputs = bf16_inputs;
        Ok(plan)
    }

    /// The descriptor, layouts and heuristic's best algorithm of `spec` (f32 alpha and beta).
    fn make_plan(&self, spec: &PlanSpec) -> Result<GemmPlan> {
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let desc = lt::create_matmul_desc(spec.compute, f32t)
            .map_err(|e| lt_err("matmul descriptor", e))?;
        // The plan owns the handles from here: dropped on every error below.
        let mut plan = GemmPlan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            bf16_inputs: false,
        };
        // SAFETY: desc is live; the attribute values are i32 as cuBLASLt documents.
        unsafe {
            for (attr, transposed) in [
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            ]
            .into_iter()
            .zip(spec.transposes)
            {
                let op = transposed as i32;
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    &op as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
                .map_err(|e| lt_err("transpose attribute", e))?;
            }
        }
        for (slot, (dtype, (r, c, ld))) in plan.layouts.iter_mut().zip(spec.layouts) {
            *slot = lt::create_matrix_layout(dtype, r, c, ld as i64)
                .map_err(|e| lt_err("matrix layout", e))?;
        }
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: all handles are live and the workspace attribute is a usize.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            );
            let l = plan.layouts;
            let h = set.and_then(|()| {
                lt::get_matmul_algo_heuristic(self.handle, desc, l[0], l[1], l[2], l[2], pref)
            });
            // Destroyed on every path (the plan's own handles drop with it).
            let _ = lt::destroy_matmul_pref(pref);
            h
        };
        plan.algo = heuristic.map_err(|e| anyhow!("{e:?}"))?.algo;
        Ok(plan)
    }

    /// Whether the GEMM of this shape reads its operands in bf16 (bf16 precision, and cuBLASLt
    /// had a tensor-core algorithm for it): then a producer may write an operand in bf16 only at
    /// no extra cost (an fp32 GEMM would widen it first).
    pub fn reads_bf16(&self, shape: GemmShape) -> Result<bool> {
        let key = GemmKey {
            shape,
            bf16_output: false,
        };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        Ok(self.cached_plan(&mut plans, key)?.bf16_inputs)
    }

    /// Whether cuBLASLt can write the product of this shape in bf16 (`matmul_to_bf16`): bf16
    /// precision and an algorithm for bf16 inputs and output.
    pub fn writes_bf16(&self, shape: GemmShape) -> bool {
        if self.precision != GemmPrecision::BFloat16 {
            return false;
        }
        let key = GemmKey {
            shape,
            bf16_output: true,
        };
        let mut refused = self
            .no_bf16_output
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if refused.contains(&key) {
            return false;
        }
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let ok = self.cached_plan(&mut plans, key).is_ok();
        if !ok {
            refused.insert(key);
        }
        ok
    }

    /// The plan of `key`, made on first use.
    fn cached_plan<'p>(
        &self,
        plans: &'p mut HashMap<GemmKey, GemmPlan>,
        key: GemmKey,
    ) -> Result<&'p mut GemmPlan> {
        Ok(match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(slot) => slot.insert(self.plan(key)?),
        })
    }

    /// `out[m,n] (+)= op(a)[m,k] · op(b)[k,n]`, row-major, as in `Backend::matmul`.
    pub fn matmul(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        a: GemmInput,
        b: GemmInput,
        shape: GemmShape,
        output: GemmOutput,
    ) -> Result<()> {
        let accumulate = output.accumulates();
        let addend = if accumulate {
            Addend::Output
        } else {
            Addend::None
        };
        let (out, _ro) = out.device_ptr_mut(&self.stream);
        self.matmul_with(Output::F32(out), addend, a, b, shape)
    }

    /// `out[m,n] = op(a)[m,k] · op(b)[k,n]` written in bf16 (rounded from the fp32 accumulator),
    /// for an output kept in bf16 alone; only where `writes_bf16` said so.
    pub fn matmul_to_bf16(
        &self,
        out: &mut CudaSlice<u16>,
        a: GemmInput,
        b: GemmInput,
        shape: GemmShape,
    ) -> Result<()> {
        assert!(out.len() >= shape.m * shape.n, "bf16 GEMM output too small");
        let (out, _ro) = out.device_ptr_mut(&self.stream);
        self.matmul_with(Output::Bf16(out), Addend::None, a, b, shape)
    }

    /// `out[m,n] = addend[m,n] + op(a)[m,k] · op(b)[k,n]` with `addend` an f32 device address of
    /// m·n values that does not overlap `out` (cuBLASLt's C beside its D): a residual connection
    /// without copying the residual into `out` first.
    pub fn matmul_add(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        addend: u64,
        a: GemmInput,
        b: GemmInput,
        shape: GemmShape,
    ) -> Result<()> {
        let (out, _ro) = out.device_ptr_mut(&self.stream);
        self.matmul_with(Output::F32(out), Addend::Other(addend), a, b, shape)
    }

    fn matmul_with(
        &self,
        out: Output,
        addend: Addend,
        a: GemmInput,
        b: GemmInput,
        shape: GemmShape,
    ) -> Result<()> {
        let GemmShape { m, k, n, .. } = shape;
        if m == 0 || n == 0 {
            return Ok(());
        }
        // cuBLASLt runs on the calling thread's current context.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        if self.try_fp8(out, addend, (a, b), shape)? {
            return Ok(());
        }
        let (out_ptr, bf16_output) = match out {
            Output::F32(address) => (address, false),
            Output::Bf16(address) => (address, true),
        };
        let key = GemmKey { shape, bf16_output };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = self.cached_plan(&mut plans, key)?;
        // An fp32 plan (cuBLASLt had no bf16 algorithm for this shape) reading an operand kept in
        // bf16 alone reads it widened to f32: its exact values, one more pass.
        let mut widened = [None, None];
        if !plan.bf16_inputs {
            for (slot, (input, len)) in widened.iter_mut().zip([(a, m * k), (b, k * n)]) {
                if input.f32_stale {
                    *slot = Some(self.widen_to_f32(input, len)?);
                }
            }
        }
        let beta = if matches!(addend, Addend::None) {
            0.0f32
        } else {
            1.0f32
        };
        let address = |w: &Option<CudaSlice<f32>>, f32: u64| {
            w.as_ref().map_or(f32, |w| w.device_ptr(&self.stream).0)
        };
        let (mut a_ptr, mut b_ptr) = (address(&widened[0], a.f32), address(&widened[1], b.f32));
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if plan.bf16_inputs {
            a_ptr = match a.bf16 {
                Some(copy) => copy,
                None => self.convert_to_bf16(&mut scratch[0], a, m * k)?,
            };
            b_ptr = match b.bf16 {
                Some(copy) => copy,
                None => self.convert_to_bf16(&mut scratch[1], b, k * n)?,
            };
        }
        let c_ptr = match addend {
            Addend::Other(address) => address,
            Addend::None | Addend::Output => out_ptr,
        };
        // SAFETY: the pointers are live device buffers at least as large as the shapes (checked by
        // the caller).
        unsafe { self.run_plan(plan, [b_ptr, a_ptr], [c_ptr, out_ptr], beta) }
    }

    /// cuBLASLt's `D = A·B + beta·C` of `plan` on the stream (alpha 1): `[A, B]` are our `b` and
    /// `a` (see the module doc), `[C, D]` addresses of the output's layout.
    ///
    /// # Safety
    /// Every address is a live device buffer at least as large as the plan's layout says.
    unsafe fn run_plan(
        &self,
        plan: &GemmPlan,
        [a_ptr, b_ptr]: [u64; 2],
        [c_ptr, d_ptr]: [u64; 2],
        beta: f32,
    ) -> Result<()> {
        let alpha = 1.0f32;
        let (ws_ptr, _rw) = self.workspace.device_ptr(&self.stream);
        lt::matmul(
            self.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a_ptr as *const c_void,
            plan.layouts[0],
            b_ptr as *const c_void,
            plan.layouts[1],
            c_ptr as *const c_void,
            plan.layouts[2],
            d_ptr as *mut c_void,
            plan.layouts[2],
            &plan.algo,
            ws_ptr as *mut c_void,
            WORKSPACE_BYTES,
            self.stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(|e| lt_err("matmul", e))
    }
}

/// Where a GEMM writes, by device address: f32 values, or bf16 ones.
#[derive(Clone, Copy)]
enum Output {
    F32(u64),
    Bf16(u64),
}

/// What a GEMM adds its product to: nothing, the output's own values, or another buffer.
#[derive(Clone, Copy)]
enum Addend {
    None,
    Output,
    Other(u64),
}

impl Gemm {
    /// The `len` values of an operand kept in bf16 alone, widened into new f32 memory (queued on
    /// the GEMM's stream; freed in stream order after the GEMM that reads it).
    fn widen_to_f32(&self, input: GemmInput, len: usize) -> Result<CudaSlice<f32>> {
        let words = input.bf16.ok_or_else(|| {
            anyhow!("a GEMM operand holds its values neither in f32 nor in bf16 (a titan bug)")
        })?;
        let mut out = self
            .stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| anyhow!("allocating {len} f32 GEMM operands: {e}"))?;
        let cfg = LaunchConfig {
            grid_dim: (len.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = len as i64;
        let mut builder = self.stream.launch_builder(&self.to_f32);
        builder.arg(&mut out).arg(&words).arg(&n);
        // SAFETY: bf16_pairs_to_f32(float* out, const u32* words, i64 n): out holds len floats
        // and words ⌈len/2⌉ pairs (the operand's bf16 copy, sized by its producer).
        unsafe { builder.launch(cfg) }
            .map_err(|e| anyhow!("CUDA kernel `bf16_pairs_to_f32` failed: {e}"))?;
        Ok(out)
    }

    /// Rounds the first `len` f32 values of `input` into `slot` (grown when too small) and
    /// returns the bf16 copy's address; when the slot already holds those values of the same
    /// buffer contents, only returns it. Queued on the GEMM's stream, so it is ready for the call.
    fn convert_to_bf16(&self, slot: &mut ScratchSlot, input: GemmInput, len: usize) -> Result<u64> {
        let wanted = input.contents.map(|(id, version)| (id, version, len));
        let capacity = len.div_ceil(2) * 2;
        if slot.copy.as_ref().is_none_or(|s| s.len() < capacity) {
            slot.copy = None;
            slot.holds = None;
            slot.copy = Some(
                self.stream
                    .alloc_zeros::<u16>(capacity)
                    .map_err(|e| anyhow!("allocating {len} bf16 GEMM operands: {e}"))?,
            );
        }
        let dst = slot.copy.as_mut().expect("allocated above");
        if wanted.is_none() || slot.holds != wanted {
            launch_to_bf16(&self.stream, &self.to_bf16, dst, input.f32, len)?;
            slot.holds = wanted;
        }
        let (ptr, _sync) = dst.device_ptr(&self.stream);
        Ok(ptr)
    }
}

/// Queues `f32_to_bf16`: the `len` f32 values at device address `src` rounded (nearest even) into
/// `dst`, which holds at least ⌈len/2⌉·2 values.
pub(super) fn launch_to_bf16(
    stream: &CudaStream,
    to_bf16: &CudaFunction,
    dst: &mut CudaSlice<u16>,
    src: u64,
    len: usize,
) -> Result<()> {
    assert!(
        dst.len() >= len.div_ceil(2) * 2,
        "bf16 destination too small"
    );
    if len == 0 {
        return Ok(());
    }
    let pairs = len.div_ceil(2);
    let cfg = LaunchConfig {
        grid_dim: (pairs.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let n = len as i64;
    let mut builder = stream.launch_builder(to_bf16);
    builder.arg(dst).arg(&src).arg(&n);
    // SAFETY: f32_to_bf16(u32* out_pairs, const float* in, i64 n): dst holds ⌈len/2⌉ pairs (checked
    // above) and src is a live device buffer of at least len floats (the callers' shape checks).
    unsafe { builder.launch(cfg) }
        .map(|_| ())
        .map_err(|e| anyhow!("CUDA kernel `f32_to_bf16` failed: {e}"))
}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // SAFETY: the handle was created in `new` and every plan using it is gone.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
