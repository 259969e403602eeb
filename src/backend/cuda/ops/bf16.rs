//! bf16 copies of f32 values: the bf16 twin that a kernel writes beside its output (`begin_output`,
//! `keep_twin`; see `CudaBuf`), activations kept in bf16 alone as kernel inputs, bf16 operands for
//! the kernels that read bf16, and the rounding and packing ops.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::gemm::launch_to_bf16;
use crate::backend::cuda::{elementwise_config, CudaBackend};

impl CudaBackend {
    /// Begins a kernel's write of all `written` values of `out`: storage for the bf16 copy it
    /// writes beside them (see CudaBuf) when the backend keeps such copies (`activation_copies`:
    /// GEMMs in bf16) and the kernel covers the whole buffer, and the kernel's two destinations:
    /// f32 (null for a bf16-only buffer, which only kernels that skip a null f32 output take:
    /// `f32_optional`) and bf16 (null without a copy). `keep_twin` records the copy once the
    /// kernel is queued.
    pub(super) fn begin_output(
        &self,
        out: &mut Buf,
        written: usize,
        op: &str,
        f32_optional: bool,
    ) -> (Option<CudaSlice<u16>>, u64, u64) {
        let twin = (self.activation_copies && written == out.len() && written > 0)
            .then(|| out.take_bf16_storage(|capacity| self.alloc_unzeroed::<u16>(capacity)));
        let bf16_only = out.is_bf16_only();
        assert!(
            !bf16_only || (f32_optional && twin.is_some()),
            "{op}: a bf16-only output must be written whole, by a kernel that takes a null f32 \
             destination"
        );
        let out32 = if bf16_only {
            0
        } else {
            out.device_address_mut(&self.stream)
        };
        let out16 = self.address_or_null(twin.as_ref());
        (twin, out32, out16)
    }

    /// An input of a kernel that reads activations kept in bf16 alone: (f32 address, null), or
    /// (null, bf16 address) for a bf16-only buffer. A buffer with f32 values is read in f32 even
    /// when it has a bf16 copy, so results do not depend on the copies.
    pub(super) fn activation_input(&self, buf: &Buf) -> (u64, u64) {
        if buf.is_bf16_only() {
            let bf16 = buf
                .bf16_address(&self.stream)
                .expect("a bf16-only buffer holds its values in bf16");
            (0, bf16)
        } else {
            (buf.device_address(&self.stream), 0)
        }
    }

    pub(super) fn keep_twin(buf: &mut Buf, twin: Option<CudaSlice<u16>>) {
        if let Some(t) = twin {
            buf.keep_bf16_copy(t);
        }
    }

    /// The first `len` values of `x` in bf16 (nearest even), for kernels that read bf16: the
    /// buffer's own bf16 copy when a kernel wrote one (see CudaBuf), else a conversion.
    pub(super) fn to_bf16(&self, x: &Buf, len: usize) -> Bf16Operand {
        if let Some(address) = x.bf16_address(&self.stream) {
            return Bf16Operand {
                address,
                _converted: None,
            };
        }
        // The conversion writes every pair, the odd count's padding included.
        let mut out = self.alloc_unzeroed::<u16>(len.div_ceil(2) * 2);
        let src = x.device_address(&self.stream);
        launch_to_bf16(
            &self.stream,
            self.function("f32_to_bf16"),
            &mut out,
            src,
            len,
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        let address = {
            let (ptr, _sync) = out.device_ptr(&self.stream);
            ptr
        };
        Bf16Operand {
            address,
            _converted: Some(out),
        }
    }

    /// Rounds `buf`'s values to bf16 in place. A bf16-only buffer's values are bf16 already; a
    /// buffer's bf16 copy still equals its values rounded (rounding twice changes nothing), so
    /// it is kept for the GEMMs that read it.
    pub(super) fn round_to_bf16_untimed(&self, buf: &mut Buf) {
        if buf.is_bf16_only() {
            return;
        }
        let copy = buf.take_bf16_copy();
        let n = buf.len();
        launch_elementwise!(self, "round_to_bf16", n, &mut *buf);
        if let Some(copy) = copy {
            buf.keep_bf16_copy(copy);
        }
    }

    pub(super) fn pack_bf16_pairs_untimed(&self, words: &mut Buf, src: &Buf) {
        let n = src.len();
        check_len("pack_bf16_pairs", "words", words.len() * 2, n);
        if src.is_bf16_only() {
            // Its bf16 values are laid out as the packed words already: a copy.
            let values = src
                .bf16_copy()
                .expect("a bf16-only buffer holds its values");
            let pairs = n.div_ceil(2) * 2;
            // SAFETY: any bit pattern is a valid u16; `words` holds ⌈n/2⌉ f32 words (checked).
            let mut dst = unsafe { words.data_mut().transmute_mut::<u16>(pairs) }
                .expect("the words hold n values as bf16 pairs");
            return self.copy_device(&values.slice(0..pairs), &mut dst);
        }
        // f32_to_bf16 writes the pairs as u32 words, the layout of tensor::pack_bf16_pairs.
        let (out, input) = (
            words.device_address_mut(&self.stream),
            src.device_address(&self.stream),
        );
        launch_elementwise!(self, "f32_to_bf16", n, &out, &input);
    }

    pub(super) fn unpack_bf16_pairs_untimed(&self, out: &mut Buf, words: &Buf) {
        let n = out.len();
        check_len("unpack_bf16_pairs", "words", words.len() * 2, n);
        if out.is_bf16_only() {
            // The words are its bf16 values as it lays them out: a copy into its storage.
            let pairs = n.div_ceil(2) * 2;
            let mut values = out.take_bf16_storage(|len| self.alloc::<u16>(len));
            // SAFETY: any bit pattern is a valid u16; `words` holds ⌈n/2⌉ f32 words (checked).
            let src = unsafe { words.data().transmute::<u16>(pairs) }
                .expect("the words hold n values as bf16 pairs");
            self.copy_device(&src, &mut values.slice_mut(0..pairs));
            out.keep_bf16_copy(values);
            return;
        }
        let input = words.device_address(&self.stream);
        launch_elementwise!(self, "bf16_pairs_to_f32", n, out, &input);
    }

    /// `dst = src` on the stream (the same length).
    fn copy_device(&self, src: &CudaView<'_, u16>, dst: &mut CudaViewMut<'_, u16>) {
        if !src.is_empty() {
            self.stream
                .memcpy_dtod(src, dst)
                .unwrap_or_else(|e| panic!("CUDA: device copy failed: {e}"));
        }
    }
}

/// A bf16 operand of a kernel: its device address, and the conversion's memory when it was made
/// for this call (held until the launch is queued; the pool frees it in stream order).
pub(super) struct Bf16Operand {
    pub(super) address: u64,
    _converted: Option<CudaSlice<u16>>,
}
