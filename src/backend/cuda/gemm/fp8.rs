//! cuBLASLt's float8 GEMMs, for operands that carry their 8-bit codes (`CudaBuf`'s `Fp8Copy`,
//! written by the cast kernel beside the dequantised values).
//!
//! cuBLASLt's float8 kernels take A transposed and B not (column-major terms): both operands with
//! the summed dimension contiguous, which is how the cast lays the codes out for the GEMM it
//! feeds. cuBLASLt multiplies the codes with unit scales into an f32 product, and one kernel
//! (`float8_scale_product`) multiplies each product by its row's and its column's reciprocal
//! scales and adds it where the GEMM adds. So one GEMM serves a scale per tensor (tensorwise) and
//! one per row or column (rowwise) whatever scaling modes the installed cuBLAS has, and it
//! multiplies exactly the values the emulation multiplies (code · 1/scale), summed in another
//! order.
//!
//! Anything else multiplies the dequantised values, as the emulation does: a GEMM whose operands
//! lack codes or have them laid out for another GEMM, two e5m2 operands (no such cuBLASLt kernel),
//! dimensions that are not multiples of 16, a bf16 output, or a shape cuBLASLt has no float8
//! algorithm for (said once on stderr). `counts` tells how many GEMMs went which way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use anyhow::{anyhow, Result};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::{Addend, Gemm, GemmInput, GemmPlan, Output, PlanSpec};
use crate::backend::float8::Fp8Format;
use crate::backend::GemmShape;

/// A float8 operand's codes by device address (`Fp8Copy`).
#[derive(Debug, Clone, Copy)]
pub struct Fp8Input {
    pub codes: u64,
    pub format: Fp8Format,
    /// The codes are the transpose of the values' row-major layout.
    pub transposed: bool,
    /// Length of the codes' contiguous runs: the summed dimension they were laid out for.
    pub contiguous: usize,
    /// Number of codes (the operand's values).
    pub len: usize,
    /// `1/scale` by device address: one, or one per index of the dimension not summed.
    pub inverse_scales: u64,
    pub scale_count: usize,
}

impl Fp8Input {
    /// Whether these codes are the operand `[rows, summed]` of a GEMM with the summed dimension
    /// contiguous, given whether the GEMM reads the values transposed (`stored_transposed`).
    fn fits(&self, rows: usize, summed: usize, stored_transposed: bool) -> bool {
        self.transposed == stored_transposed
            && self.len == rows * summed
            && self.contiguous == summed
            && (self.scale_count == 1 || self.scale_count == rows)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Fp8Key {
    m: usize,
    n: usize,
    k: usize,
    a: Fp8Format,
    b: Fp8Format,
}

/// cuBLASLt's float8 dimensions: multiples of 16 (its 16-byte alignment of 8-bit rows).
const FP8_MULTIPLE: usize = 16;

fn data_type(format: Fp8Format) -> sys::cudaDataType {
    match format {
        Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

/// The float8 GEMMs' plans (None: refused by cuBLASLt), the scaling kernel and the counts.
pub(super) struct Fp8Gemms {
    plans: Mutex<HashMap<Fp8Key, Option<GemmPlan>>>,
    scale_product: CudaFunction,
    /// The products of an accumulating GEMM (`try_fp8`), grown to the largest and reused.
    scratch: Mutex<Option<CudaSlice<f32>>>,
    run: AtomicU64,
    emulated: AtomicU64,
    warned: AtomicBool,
}

impl Fp8Gemms {
    pub(super) fn new(scale_product: CudaFunction) -> Self {
        Fp8Gemms {
            plans: Mutex::new(HashMap::new()),
            scale_product,
            scratch: Mutex::new(None),
            run: AtomicU64::new(0),
            emulated: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Counts a GEMM of float8 operands that multiplies their dequantised values: false.
    fn dequantised(&self) -> bool {
        self.emulated.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Float8 GEMMs run, and GEMMs of float8 operands that multiplied dequantised values.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.run.load(Ordering::Relaxed),
            self.emulated.load(Ordering::Relaxed),
        )
    }
}

impl Gemm {
    /// Runs `out (+)= op(a)·op(b)` as a float8 GEMM when both operands have codes that fit it
    /// (see the module doc); false: the caller multiplies the dequantised values.
    pub(super) fn try_fp8(
        &self,
        out: Output,
        addend: Addend,
        (a, b): (GemmInput, GemmInput),
        shape: GemmShape,
    ) -> Result<bool> {
        if a.fp8.is_none() && b.fp8.is_none() {
            return Ok(false);
        }
        let GemmShape { m, k, n, .. } = shape;
        let (Some(fa), Some(fb), Output::F32(out)) = (a.fp8, b.fp8, out) else {
            return Ok(self.fp8.dequantised());
        };
        let fits = fa.fits(m, k, shape.trans_a)
            && fb.fits(n, k, !shape.trans_b)
            && !(fa.format == Fp8Format::E5M2 && fb.format == Fp8Format::E5M2)
            && [m, n, k].iter().all(|d| d.is_multiple_of(FP8_MULTIPLE));
        if !fits {
            return Ok(self.fp8.dequantised());
        }
        let key = Fp8Key {
            m,
            n,
            k,
            a: fa.format,
            b: fb.format,
        };
        let mut plans = self.fp8.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = plans.entry(key).or_insert_with(|| {
            let plan = self.fp8_plan(key);
            if let Err(e) = &plan {
                self.warn_fp8_once(e);
            }
            plan.ok()
        });
        let Some(plan) = plan.as_ref() else {
            return Ok(self.fp8.dequantised());
        };
        // The products go straight into `out` unless it is accumulated into (then its values are
        // the addend, and the products wait in a scratch buffer kept for the next such GEMM).
        let mut scratch = self.fp8.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (product, addend) = match addend {
            Addend::None => (out, 0),
            Addend::Other(address) => (out, address),
            Addend::Output => (self.fp8_scratch(&mut scratch, m * n)?, out),
        };
        // SAFETY: the codes are live device buffers of m·k and n·k bytes (checked by `fits`), and
        // `product` holds m·n floats (`out`, or the scratch grown to it).
        let ran = unsafe { self.run_plan(plan, [fb.codes, fa.codes], [product, product], 0.0) };
        if let Err(e) = ran {
            // A plan cuBLASLt made but refuses to run (nothing was written): this shape multiplies
            // the dequantised values from now on, as a shape without a plan does.
            plans.insert(key, None);
            self.warn_fp8_once(&e);
            return Ok(self.fp8.dequantised());
        }
        drop(plans);
        self.scale_fp8_product(out, product, addend, (fa, fb), (m, n))?;
        self.fp8.run.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Says once per process that a float8 GEMM fell back to the dequantised values, and why.
    fn warn_fp8_once(&self, e: &anyhow::Error) {
        if !self.fp8.warned.swap(true, Ordering::Relaxed) {
            errln!("warning: {e:#}; such GEMMs multiply the dequantised values");
        }
    }

    /// The plan of a float8 GEMM: our `b` codes are cuBLASLt's A (`[n, k]` k-major, read
    /// transposed), our `a` codes its B (`[m, k]` k-major), the f32 product of codes its D.
    fn fp8_plan(&self, key: Fp8Key) -> Result<GemmPlan> {
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let spec = PlanSpec {
            compute: sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            transposes: [true, false],
            layouts: [
                (data_type(key.b), (k, n, k)),
                (data_type(key.a), (k, m, k)),
                (sys::cudaDataType::CUDA_R_32F, (n, m, n)),
            ],
        };
        self.make_plan(&spec).map_err(|e| {
            anyhow!(
                "cuBLASLt has no float8 algorithm for a {}x{}x{} GEMM of {:?} by {:?}: {e}",
                key.m,
                key.k,
                key.n,
                key.a,
                key.b
            )
        })
    }

    /// The address of the accumulation scratch, grown to at least `len` floats (its contents are
    /// written by the GEMM before they are read; the stream orders its reuse).
    fn fp8_scratch(&self, scratch: &mut Option<CudaSlice<f32>>, len: usize) -> Result<u64> {
        if scratch.as_ref().is_none_or(|s| s.len() < len) {
            *scratch = None;
            // SAFETY: every element read is first written by the GEMM that uses the scratch.
            let grown = unsafe { self.stream.alloc::<f32>(len) }
                .map_err(|e| anyhow!("allocating a float8 GEMM's {len} products: {e}"))?;
            *scratch = Some(grown);
        }
        let slice = scratch.as_ref().expect("allocated above");
        Ok(slice.device_ptr(&self.stream).0)
    }

    /// `out = addend + product · (1/scale_a · 1/scale_b)` per element (`addend` 0: none;
    /// `product` may be `out` itself).
    fn scale_fp8_product(
        &self,
        out: u64,
        product: u64,
        addend: u64,
        (a, b): (Fp8Input, Fp8Input),
        (m, n): (usize, usize),
    ) -> Result<()> {
        let len = m * n;
        let cfg = LaunchConfig {
            grid_dim: (len.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (a_per_row, b_per_col) = ((a.scale_count > 1) as i32, (b.scale_count > 1) as i32);
        let (n_i, len_i) = (n as i64, len as i64);
        let mut builder = self.stream.launch_builder(&self.fp8.scale_product);
        builder.arg(&out).arg(&product).arg(&addend);
        builder.arg(&a.inverse_scales).arg(&a_per_row);
        builder.arg(&b.inverse_scales).arg(&b_per_col);
        builder.arg(&n_i).arg(&len_i);
        // SAFETY: float8_scale_product(float* out, const float* product, const float* addend,
        // const float* inv_a, int a_per_row, const float* inv_b, int b_per_col, i64 n, i64 len):
        // out, product and a non-null addend hold m·n floats, the scales 1 or m (a), 1 or n (b).
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(|e| anyhow!("CUDA kernel `float8_scale_product` failed: {e}"))
    }
}
