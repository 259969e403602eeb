//! `CudaBuf`, the CUDA backend's buffer: f32 device memory, and optionally a bf16 copy of it that
//! bf16 GEMMs read instead of converting the operand again.
//!
//! The copy is only ever made by a kernel that writes the f32 values and their bf16 rounding
//! together (the bf16 compute copy of the parameters, `copy_rounded_to_bf16_all`), and every way to
//! write the f32 values goes through a `&mut self` method of this file that drops it first. So a
//! buffer's bf16 copy, when it has one, always equals its values rounded to bf16, and a GEMM that
//! uses it computes exactly what converting the operand would.
//!
//! The same write paths bump the buffer's version, so `(id, version)` names the buffer's current
//! contents: the GEMM's bf16 scratch remembers which contents it holds and skips converting the
//! same operand again (the q, k and v projections of one input; a gradient used by both of its
//! backward GEMMs).
//!
//! A float8 operand (`float8_fake_quantized` with float8 GEMMs on) carries its 8-bit codes and the
//! reciprocals of its scales as well (`Fp8Copy`), written by the same kernel as its dequantised
//! values, and dropped by every write like the bf16 copy: a float8 GEMM that reads the codes
//! multiplies exactly the values the buffer holds.
//!
//! A buffer made by `bf16_only` holds its values in bf16 alone (SwiGLU's output, which only bf16
//! GEMMs read): it has no f32 storage, and every f32 accessor panics naming the mistake, so a
//! reader that would need f32 values fails loudly instead of reading stale memory.

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr};

/// A float8 operand's codes, laid out for the GEMM that reads it (`float8_fake_quantized`).
pub struct Fp8Copy {
    /// One code a value: row-major `[rows, cols]`, or `[cols, rows]` when `transposed` (the
    /// GEMM's summed dimension contiguous either way).
    pub codes: CudaSlice<u8>,
    pub format: crate::backend::float8::Fp8Format,
    pub transposed: bool,
    /// Length of the codes' contiguous runs: the GEMM's summed dimension.
    pub contiguous: usize,
    /// `1/scale`: one for the tensor, or one per index of the dimension not summed over.
    pub inverse_scales: CudaSlice<f32>,
}

/// Source of buffer ids: never reused within a process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One f32 device buffer. Holds at least one element: the driver refuses zero-byte allocations,
/// and the model does ask for empty buffers (unused gradient slots, empty FSDP shards).
pub struct CudaBuf {
    data: CudaSlice<f32>,
    len: usize,
    /// `data` rounded to bf16 (nearest even), ⌈len/2⌉·2 values, when a kernel wrote both.
    bf16: Option<CudaSlice<u16>>,
    id: u64,
    /// Bumped by every write path.
    version: u64,
    /// The values live in `bf16` alone (`data` is a one-element placeholder).
    bf16_only: bool,
    /// The float8 codes of the values, when the cast kernel wrote both.
    fp8: Option<Fp8Copy>,
}

impl CudaBuf {
    /// A buffer of `len` logical elements over `data` (which holds at least one).
    pub(super) fn new(data: CudaSlice<f32>, len: usize) -> Self {
        CudaBuf {
            data,
            len,
            bf16: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            version: 0,
            bf16_only: false,
            fp8: None,
        }
    }

    /// A buffer of `len` values kept in bf16 alone, in `copy` (⌈len/2⌉·2 values, written by the
    /// kernels that produce it through `take_bf16_storage`); `placeholder` is one f32.
    pub(super) fn bf16_only(copy: CudaSlice<u16>, placeholder: CudaSlice<f32>, len: usize) -> Self {
        CudaBuf {
            bf16: Some(copy),
            bf16_only: true,
            ..CudaBuf::new(placeholder, len)
        }
    }

    /// Whether the values live in bf16 alone (see the module doc).
    pub fn is_bf16_only(&self) -> bool {
        self.bf16_only
    }

    /// The f32 storage; a bf16-only buffer has none.
    fn f32_storage(&self) -> &CudaSlice<f32> {
        assert!(
            !self.bf16_only,
            "a CUDA buffer of {} values kept in bf16 only (`zeros_bf16_activation`) was read or written as \
             f32: a titan bug",
            self.len
        );
        &self.data
    }

    /// `(id, version)`: names this buffer's current contents; any write changes it.
    pub fn contents(&self) -> (u64, u64) {
        (self.id, self.version)
    }

    /// Before any write: the bf16 copy no longer matches, and the contents change.
    fn begin_write(&mut self) {
        self.bf16 = None;
        self.fp8 = None;
        self.version += 1;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device memory, for reading.
    pub fn data(&self) -> &CudaSlice<f32> {
        self.f32_storage()
    }

    /// The device memory, for writing: the bf16 copy no longer matches and is dropped.
    pub fn data_mut(&mut self) -> &mut CudaSlice<f32> {
        self.f32_storage();
        self.begin_write();
        &mut self.data
    }

    /// A view of `range` (within the logical length).
    pub fn slice(&self, range: std::ops::Range<usize>) -> CudaView<'_, f32> {
        assert!(range.end <= self.len, "slice beyond the buffer");
        self.f32_storage().slice(range)
    }

    /// A writable view of `range`; drops the bf16 copy.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> CudaViewMut<'_, f32> {
        assert!(range.end <= self.len, "slice beyond the buffer");
        self.data_mut().slice_mut(range)
    }

    /// Raw device address for reading, for libraries that take pointers (NCCL). The caller orders
    /// its use on the backend's stream.
    pub fn device_address(&self, stream: &CudaStream) -> u64 {
        let (ptr, _sync) = self.f32_storage().device_ptr(stream);
        ptr
    }

    /// Raw device address for writing; drops the bf16 copy.
    pub fn device_address_mut(&mut self, stream: &CudaStream) -> u64 {
        self.begin_write();
        self.device_address(stream)
    }

    /// The bf16 copy's address, when the buffer has one.
    pub fn bf16_address(&self, stream: &CudaStream) -> Option<u64> {
        self.bf16.as_ref().map(|copy| {
            let (ptr, _sync) = copy.device_ptr(stream);
            ptr
        })
    }

    /// The bf16 copy, when the buffer has one (a bf16-only buffer's values).
    pub(super) fn bf16_copy(&self) -> Option<&CudaSlice<u16>> {
        self.bf16.as_ref()
    }

    /// Takes the bf16 copy of a buffer that also holds f32 values, for an op that changes the f32
    /// values without changing their bf16 rounding (rounding them to bf16) and hands it back
    /// with `keep_bf16_copy`. None for a bf16-only buffer, whose copy is its values.
    pub(super) fn take_bf16_copy(&mut self) -> Option<CudaSlice<u16>> {
        match self.bf16_only {
            true => None,
            false => self.bf16.take(),
        }
    }

    /// Storage for a kernel that is about to write this buffer's values and their bf16 rounding
    /// together (this counts as the write): the old copy's memory when it is large enough, else
    /// `alloc(⌈len/2⌉·2)`. Hand it back with `keep_bf16_copy` once that kernel is queued.
    pub(super) fn take_bf16_storage(
        &mut self,
        alloc: impl FnOnce(usize) -> CudaSlice<u16>,
    ) -> CudaSlice<u16> {
        let capacity = self.len.div_ceil(2) * 2;
        self.version += 1;
        self.fp8 = None;
        match self.bf16.take() {
            Some(copy) if copy.len() >= capacity => copy,
            _ => alloc(capacity),
        }
    }

    /// The float8 codes of the values, when the buffer has them.
    pub fn fp8(&self) -> Option<&Fp8Copy> {
        self.fp8.as_ref()
    }

    /// Records `copy` as the codes of this buffer's values. Only for the cast kernel that has just
    /// been queued to write both (see the module doc).
    pub(super) fn keep_fp8_copy(&mut self, copy: Fp8Copy) {
        self.fp8 = Some(copy);
    }

    /// Records `copy` as this buffer's bf16 copy. Only for the kernel that has just been queued to
    /// write both (see the module doc): anything else would break the invariant GEMMs rely on.
    pub(super) fn keep_bf16_copy(&mut self, copy: CudaSlice<u16>) {
        self.bf16 = Some(copy);
    }
}
