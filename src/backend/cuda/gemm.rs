//! Row-major GEMMs on cuBLASLt with f32 storage and a chosen compute precision: exact fp32, TF32 or
//! bf16 tensor cores (cuBLASLt rounds the f32 inputs to bf16 and accumulates in fp32).
//!
//! cuBLASLt is column-major; a row-major `[r, c]` buffer is the column-major `[c, r]` matrix, so
//! `out = op(a)·op(b)` is computed as `outᵀ = op(b)ᵀ·op(a)ᵀ` with the operands swapped. Layouts,
//! descriptors and the heuristic's algorithm are cached per shape: after the first step no call
//! allocates or queries the heuristic again.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct GemmKey {
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
}

/// The cuBLASLt objects of one shape.
struct GemmPlan {
    desc: sys::cublasLtMatmulDesc_t,
    /// Layouts of cuBLASLt's A (our `b`), B (our `a`) and C = D (our `out`).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the plan's handles are plain descriptors; cuBLASLt allows using them from any thread as
// long as calls on one plan do not race, which the cache's mutex guarantees.
unsafe impl Send for GemmPlan {}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once.
        unsafe {
            for l in self.layouts {
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
    warned_fallback: AtomicBool,
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
    pub fn new(stream: Arc<CudaStream>, precision: GemmPrecision) -> Result<Self> {
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
            warned_fallback: AtomicBool::new(false),
        })
    }

    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// The plan in the configured precision; if cuBLASLt has no tensor-core algorithm for a shape,
    /// that shape runs in exact fp32 instead (said once on stderr) rather than failing the step.
    fn plan(&self, key: GemmKey) -> Result<GemmPlan> {
        match self.plan_with(key, self.precision.compute_type()) {
            Ok(plan) => Ok(plan),
            Err(e) if self.precision != GemmPrecision::Float32 => {
                if !self.warned_fallback.swap(true, Ordering::Relaxed) {
                    eprintln!("warning: {e:#}; such GEMMs run in fp32");
                }
                self.plan_with(key, GemmPrecision::Float32.compute_type())
            }
            Err(e) => Err(e),
        }
    }

    fn plan_with(&self, key: GemmKey, compute: sys::cublasComputeType_t) -> Result<GemmPlan> {
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let desc =
            lt::create_matmul_desc(compute, f32t).map_err(|e| lt_err("matmul descriptor", e))?;
        // cuBLASLt's A is our b, its B is our a (see the module doc).
        let (op_a, op_b) = (key.trans_b as i32, key.trans_a as i32);
        // SAFETY: desc is live; the attribute values are i32 as cuBLASLt documents.
        unsafe {
            for (attr, op) in [
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    &op_a,
                ),
                (
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    &op_b,
                ),
            ] {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    op as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
                .map_err(|e| lt_err("transpose attribute", e))?;
            }
        }
        let (m, k, n) = (key.m as u64, key.k as u64, key.n as u64);
        // Stored (rows, cols, ld) of each operand in column-major terms.
        let b_layout = if key.trans_b { (k, n, k) } else { (n, k, n) };
        let a_layout = if key.trans_a { (m, k, m) } else { (k, m, k) };
        let c_layout = (n, m, n);
        let mut layouts = [std::ptr::null_mut(); 3];
        for (slot, (r, c, ld)) in layouts.iter_mut().zip([b_layout, a_layout, c_layout]) {
            *slot = lt::create_matrix_layout(f32t, r, c, ld as i64)
                .map_err(|e| lt_err("matrix layout", e))?;
        }
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: all handles are live and the workspace attribute is a usize.
        let heuristic = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(|e| lt_err("workspace preference", e))?;
            let h = lt::get_matmul_algo_heuristic(
                self.handle,
                desc,
                layouts[0],
                layouts[1],
                layouts[2],
                layouts[2],
                pref,
            );
            let _ = lt::destroy_matmul_pref(pref);
            h
        };
        let heuristic = heuristic.map_err(|e| {
            anyhow!(
                "cuBLASLt has no algorithm for a {}x{}x{} GEMM (trans_a {}, trans_b {}) in {:?}: {e:?}",
                key.m,
                key.k,
                key.n,
                key.trans_a,
                key.trans_b,
                self.precision
            )
        })?;
        Ok(GemmPlan {
            desc,
            layouts,
            algo: heuristic.algo,
        })
    }

    /// `out[m,n] (+)= op(a)[m,k] · op(b)[k,n]`, row-major, as in `Backend::matmul`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        out: &mut impl DevicePtrMut<f32>,
        a: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        // cuBLASLt runs on the calling thread's current context.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))?;
        let key = GemmKey {
            m,
            k,
            n,
            trans_a,
            trans_b,
        };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = match plans.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(slot) => slot.insert(self.plan(key)?),
        };
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0f32 };
        let (a_ptr, _ra) = a.device_ptr(&self.stream);
        let (b_ptr, _rb) = b.device_ptr(&self.stream);
        let (ws_ptr, _rw) = self.workspace.device_ptr(&self.stream);
        let (out_ptr, _ro) = out.device_ptr_mut(&self.stream);
        // SAFETY: the pointers are live device buffers at least as large as the shapes (checked by
        // the caller), and every handle belongs to this plan.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b_ptr as *const c_void,
                plan.layouts[0],
                a_ptr as *const c_void,
                plan.layouts[1],
                out_ptr as *const c_void,
                plan.layouts[2],
                out_ptr as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws_ptr as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("matmul", e))
    }
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
