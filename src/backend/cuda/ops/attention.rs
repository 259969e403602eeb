//! Attention: forward, backward and the merge of partial results, on the tensor-core kernels
//! (kernels/attention_tc.cu) where they apply and the one-warp-per-row kernels elsewhere, and the
//! choice between them.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::kernels::{ATTN_MAX_HEAD_DIM, ATTN_WARPS};
use crate::backend::cuda::{
    AttentionKernels, CudaBackend, TensorCoreBackward, FUSED_BACKWARD_KERNELS,
};
use crate::backend::{AttnGrads, AttnInputs, AttnMask, AttnSaved, AttnShape};

impl CudaBackend {
    pub(super) fn attention_forward_untimed(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        x: AttnInputs<'_, Buf>,
    ) {
        let AttnInputs {
            q,
            k,
            v,
            shape: s,
            mask,
        } = x;
        check_attention_shape(&s);
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let kv_floats = s.batch * s.kv_capacity * s.n_kv_heads * s.head_dim;
        check_len("attention_forward", "q", q.len(), q_floats);
        check_len("attention_forward", "out", out.len(), q_floats);
        check_len("attention_forward", "k", k.len(), kv_floats);
        check_len("attention_forward", "v", v.len(), kv_floats);
        check_len(
            "attention_forward",
            "lse",
            lse.len(),
            s.batch * s.n_heads * s.q_len,
        );
        if q_floats == 0 {
            return;
        }
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        if let Some(kernels) = self.tensor_core_attention(&s, &mask) {
            let (seq, h, kvh) = (s.q_len as i32, s.n_heads as i32, s.n_kv_heads as i32);
            let cfg = tensor_core_config(s.q_len, s.n_heads, s.batch, kernels.forward_rows);
            let documents = DeviceMask::upload(self, &mask, &s);
            let (q, k, v) = (
                self.to_bf16(q, q_floats),
                self.to_bf16(k, kv_floats),
                self.to_bf16(v, kv_floats),
            );
            let (twin, out32, out16) = self.begin_output(out, q_floats, "attention_forward", false);
            launch!(
                self,
                kernels.forward,
                cfg,
                &out32,
                &out16,
                lse,
                &q.address,
                &k.address,
                &v.address,
                &seq,
                &h,
                &kvh,
                &scale,
                &documents.positions
            );
            Self::keep_twin(out, twin);
            return;
        }
        let (ql, kl, kc, h, kvh, d, off) = (
            s.q_len as i32,
            s.kv_len as i32,
            s.kv_capacity as i32,
            s.n_heads as i32,
            s.n_kv_heads as i32,
            s.head_dim as i32,
            s.q_offset as i32,
        );
        let on_device = DeviceMask::upload(self, &mask, &s);
        let cfg = attention_config(s.q_len, s.n_heads, s.batch);
        launch!(
            self,
            "attention_forward",
            cfg,
            out,
            lse,
            q,
            k,
            v,
            &ql,
            &kl,
            &kc,
            &h,
            &kvh,
            &d,
            &off,
            &scale,
            &on_device.positions,
            &on_device.window
        );
    }

    pub(super) fn attention_backward_untimed(
        &self,
        grads: AttnGrads<'_, Buf>,
        dout: &Buf,
        x: AttnInputs<'_, Buf>,
        saved: AttnSaved<'_, Buf>,
    ) {
        let AttnGrads { dq, dk, dv } = grads;
        let AttnInputs {
            q,
            k,
            v,
            shape: s,
            mask,
        } = x;
        let AttnSaved { out, lse } = saved;
        check_attention_shape(&s);
        assert!(
            s.kv_capacity == s.kv_len,
            "attention_backward: keys with spare capacity (a KV cache) have no backward"
        );
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let kv_floats = s.batch * s.kv_len * s.n_kv_heads * s.head_dim;
        for (what, len, need) in [
            ("dq", dq.len(), q_floats),
            ("dout", dout.len(), q_floats),
            ("q", q.len(), q_floats),
            ("out", out.len(), q_floats),
            ("dk", dk.len(), kv_floats),
            ("dv", dv.len(), kv_floats),
            ("k", k.len(), kv_floats),
            ("v", v.len(), kv_floats),
            ("lse", lse.len(), s.batch * s.n_heads * s.q_len),
        ] {
            check_len("attention_backward", what, len, need);
        }
        if q_floats == 0 {
            return;
        }
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        let delta = self.attention_backward_delta(dout, out, &s);
        let reads = BackwardReads {
            dout,
            q,
            k,
            v,
            lse,
            delta: &delta,
            scale,
        };
        let on_device = DeviceMask::upload(self, &mask, &s);
        match self.tensor_core_attention(&s, &mask) {
            Some(kernels) => {
                let grads = AttnGrads { dq, dk, dv };
                self.tensor_core_backward(kernels.backward, grads, &reads, &s, &on_device)
            }
            None => self.per_row_backward(AttnGrads { dq, dk, dv }, &reads, &s, &on_device),
        }
    }

    /// `delta`, which every backward pass reads: per query row, the dot product of the output
    /// with its gradient (the row term of the softmax backward).
    fn attention_backward_delta(&self, dout: &Buf, out: &Buf, s: &AttnShape) -> CudaSlice<f32> {
        let mut delta = self.alloc::<f32>(s.batch * s.n_heads * s.q_len);
        let (seq, h, d) = (s.q_len as i32, s.n_heads as i32, s.head_dim as i32);
        let per_query = attention_config(s.q_len, s.n_heads, s.batch);
        launch!(
            self,
            "attention_backward_delta",
            per_query,
            &mut delta,
            dout,
            out,
            &seq,
            &h,
            &d
        );
        delta
    }

    /// The backward on the tensor-core kernels, which read bf16 copies of `dout`, q, k and v: the
    /// split passes (dQ, then dK and dV), or the fused kernel, which adds into a zeroed dQ.
    fn tensor_core_backward(
        &self,
        kernels: TensorCoreBackwardKernels,
        grads: AttnGrads<'_, Buf>,
        r: &BackwardReads,
        s: &AttnShape,
        documents: &DeviceMask,
    ) {
        let AttnGrads { dq, dk, dv } = grads;
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let kv_floats = s.batch * s.kv_len * s.n_kv_heads * s.head_dim;
        let (dout, q, k, v) = (
            self.to_bf16(r.dout, q_floats),
            self.to_bf16(r.q, q_floats),
            self.to_bf16(r.k, kv_floats),
            self.to_bf16(r.v, kv_floats),
        );
        let (seq, h, kvh) = (s.q_len as i32, s.n_heads as i32, s.n_kv_heads as i32);
        let (lse, delta, scale) = (r.lse, r.delta, &r.scale);
        match kernels {
            TensorCoreBackwardKernels::Split { dq: dq_pass, dkdv } => {
                let per_query = tensor_core_config(s.q_len, s.n_heads, s.batch, 64);
                let per_key = tensor_core_config(s.q_len, s.n_kv_heads, s.batch, 64);
                let (dout, q, k, v) = (&dout.address, &q.address, &k.address, &v.address);
                let docs = &documents.positions;
                launch!(
                    self, dq_pass, per_query, dq, dout, q, k, v, lse, delta, &seq, &h, &kvh, scale,
                    docs
                );
                for pass in dkdv {
                    launch!(
                        self, pass, per_key, &mut *dk, &mut *dv, dout, q, k, v, lse, delta, &seq,
                        &h, &kvh, scale, docs
                    );
                }
            }
            TensorCoreBackwardKernels::Fused {
                kernel,
                warps,
                ordered,
            } => {
                self.fill_untimed(dq, 0.0);
                // One zeroed counter per (batch, head, 64-query tile) for the turns, and
                // one last for the blocks' tickets (attention_tc.cu, `dq_order`).
                let counters = s.batch * s.n_heads * s.q_len.div_ceil(64) + 1;
                let turns = ordered.then(|| self.alloc::<i32>(counters));
                let turns_address = self.address_or_null(turns.as_ref());
                let cfg = LaunchConfig {
                    grid_dim: (
                        s.q_len.div_ceil(16 * warps) as u32,
                        s.n_kv_heads as u32,
                        s.batch as u32,
                    ),
                    block_dim: (32 * warps as u32, 1, 1),
                    shared_mem_bytes: TensorCoreBackward::fused_shared_bytes(s.head_dim, warps)
                        as u32,
                };
                launch!(
                    self,
                    kernel,
                    cfg,
                    &mut *dq,
                    &mut *dk,
                    &mut *dv,
                    &dout.address,
                    &q.address,
                    &k.address,
                    &v.address,
                    lse,
                    delta,
                    &turns_address,
                    &seq,
                    &h,
                    &kvh,
                    scale
                );
            }
        }
    }

    /// The backward on the one-warp-per-row kernels, for every shape the tensor cores do not
    /// take: dQ one query row per warp, then dK and dV one key row per warp.
    fn per_row_backward(
        &self,
        grads: AttnGrads<'_, Buf>,
        r: &BackwardReads,
        s: &AttnShape,
        mask: &DeviceMask,
    ) {
        let AttnGrads { dq, dk, dv } = grads;
        let (seq, h, kvh, d) = (
            s.q_len as i32,
            s.n_heads as i32,
            s.n_kv_heads as i32,
            s.head_dim as i32,
        );
        let (kv_len, q_offset) = (s.kv_len as i32, s.q_offset as i32);
        let (dout, q, k, v, lse, delta, scale) = (r.dout, r.q, r.k, r.v, r.lse, r.delta, &r.scale);
        let per_query = attention_config(s.q_len, s.n_heads, s.batch);
        launch!(
            self,
            "attention_backward_dq",
            per_query,
            dq,
            dout,
            q,
            k,
            v,
            lse,
            delta,
            &seq,
            &kv_len,
            &q_offset,
            &h,
            &kvh,
            &d,
            scale,
            &mask.positions,
            &mask.window
        );
        let per_key = attention_config(s.kv_len, s.n_kv_heads, s.batch);
        launch!(
            self,
            "attention_backward_dkdv",
            per_key,
            dk,
            dv,
            dout,
            q,
            k,
            v,
            lse,
            delta,
            &seq,
            &kv_len,
            &q_offset,
            &h,
            &kvh,
            &d,
            scale,
            &mask.positions,
            &mask.window
        );
    }

    pub(super) fn attention_merge_untimed(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        part_out: &Buf,
        part_lse: &Buf,
        s: AttnShape,
    ) {
        let q_floats = s.batch * s.q_len * s.n_heads * s.head_dim;
        let rows = s.batch * s.q_len * s.n_heads;
        for (what, len, need) in [
            ("out", out.len(), q_floats),
            ("part_out", part_out.len(), q_floats),
            ("lse", lse.len(), rows),
            ("part_lse", part_lse.len(), rows),
        ] {
            check_len("attention_merge", what, len, need);
        }
        if rows == 0 {
            return;
        }
        let (b, ql, h, d) = (
            s.batch as i32,
            s.q_len as i32,
            s.n_heads as i32,
            s.head_dim as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "attention_merge",
            cfg,
            out,
            lse,
            part_out,
            part_lse,
            &b,
            &ql,
            &h,
            &d
        );
    }
}

fn check_attention_shape(s: &AttnShape) {
    assert!(
        s.head_dim <= ATTN_MAX_HEAD_DIM,
        "attention: head_dim {} is above the CUDA kernels' limit of {ATTN_MAX_HEAD_DIM}",
        s.head_dim
    );
    assert!(
        s.n_kv_heads > 0 && s.n_heads.is_multiple_of(s.n_kv_heads),
        "attention: {} heads are not a multiple of {} kv heads",
        s.n_heads,
        s.n_kv_heads
    );
    assert!(
        s.kv_len <= s.kv_capacity,
        "attention: kv_len {} is above the capacity {}",
        s.kv_len,
        s.kv_capacity
    );
}

/// What every backward pass reads besides the gradients it writes: the output's gradient, the
/// forward's inputs and log-sum-exp, `delta` (see `attention_backward_delta`) and the score scale.
/// A call's mask as the one-warp-per-row kernels read it: the queries' document positions on the
/// device (a null address without documents) and the window (0: none).
struct DeviceMask {
    /// Kept alive until the kernels that read it are queued (the stream orders the free).
    _memory: Option<CudaSlice<u32>>,
    positions: u64,
    window: i32,
}

impl DeviceMask {
    fn upload(be: &CudaBackend, mask: &AttnMask, s: &AttnShape) -> Self {
        let memory = mask
            .positions
            .map(|p| be.upload_ids(&p[..s.batch * s.q_len]));
        let window = mask.window.map_or(0, |w| {
            i32::try_from(w).expect("attention window beyond i32 (a titan bug: configs bound it)")
        });
        DeviceMask {
            positions: be.address_or_null(memory.as_ref()),
            _memory: memory,
            window,
        }
    }
}

struct BackwardReads<'a> {
    dout: &'a Buf,
    q: &'a Buf,
    k: &'a Buf,
    v: &'a Buf,
    lse: &'a Buf,
    delta: &'a CudaSlice<f32>,
    scale: f32,
}

/// The tensor-core attention kernels for one head dimension (kernels/attention_tc.cu). They read
/// bf16 copies of their inputs, made per call.
struct TensorCoreAttention {
    forward: &'static str,
    /// Query rows per block of the forward (64, or 128 with 32 rows per warp).
    forward_rows: usize,
    backward: TensorCoreBackwardKernels,
}

enum TensorCoreBackwardKernels {
    /// A dQ pass, then one pass computing dK and dV, or two (head_dim 128, so the accumulators
    /// fit in registers).
    Split {
        dq: &'static str,
        dkdv: &'static [&'static str],
    },
    /// One pass adding into a zeroed dQ; `warps` warps of 16 keys per block, taking turns at each
    /// query tile when `ordered`.
    Fused {
        kernel: &'static str,
        warps: usize,
        ordered: bool,
    },
}

impl TensorCoreBackwardKernels {
    /// The kernels of `choice` at `head_dim`: the given split passes, or the fused kernel when the
    /// device gives a block the shared memory it needs (`shared_memory_per_block`; else the split
    /// passes, which fit everywhere).
    fn choose(
        choice: TensorCoreBackward,
        head_dim: usize,
        shared_memory_per_block: usize,
        dq: &'static str,
        dkdv: &'static [&'static str],
    ) -> Self {
        if let TensorCoreBackward::Fused { warps, ordered } = choice {
            let fits = TensorCoreBackward::fused_fits(head_dim, warps, shared_memory_per_block);
            let kernel = FUSED_BACKWARD_KERNELS
                .into_iter()
                .find(|&(_, d, w)| d == head_dim && w == warps);
            if let (true, Some((kernel, _, _))) = (fits, kernel) {
                return TensorCoreBackwardKernels::Fused {
                    kernel,
                    warps,
                    ordered,
                };
            }
        }
        TensorCoreBackwardKernels::Split { dq, dkdv }
    }
}

impl CudaBackend {
    /// The tensor-core kernels when they apply: the backend allows them (`attention`, chosen in
    /// `CudaBackend::new`), head_dim is 64 or 128, the shape is training's (no KV cache), and the
    /// mask causal or block-causal (sliding windows run on the one-warp-per-row kernels). With
    /// documents the backward is the split passes (the fused kernel takes none).
    fn tensor_core_attention(&self, s: &AttnShape, mask: &AttnMask) -> Option<TensorCoreAttention> {
        let training_shape = s.q_offset == 0 && s.kv_len == s.q_len && s.kv_capacity == s.q_len;
        if mask.window.is_some() {
            return None;
        }
        let AttentionKernels::TensorCores {
            wide_forward,
            backward,
        } = self.attention
        else {
            return None;
        };
        let backward = match mask.positions {
            Some(_) => TensorCoreBackward::Split,
            None => backward,
        };
        if !training_shape {
            return None;
        }
        match s.head_dim {
            64 => Some(TensorCoreAttention {
                forward: if wide_forward {
                    "attention_forward_tc64x2"
                } else {
                    "attention_forward_tc64"
                },
                forward_rows: if wide_forward { 128 } else { 64 },
                backward: TensorCoreBackwardKernels::choose(
                    backward,
                    64,
                    self.shared_memory_per_block,
                    "attention_backward_dq_tc64",
                    &["attention_backward_dkdv_tc64"],
                ),
            }),
            128 => Some(TensorCoreAttention {
                forward: "attention_forward_tc128",
                forward_rows: 64,
                backward: TensorCoreBackwardKernels::choose(
                    backward,
                    128,
                    self.shared_memory_per_block,
                    "attention_backward_dq_tc128",
                    &["attention_backward_dk_tc128", "attention_backward_dv_tc128"],
                ),
            }),
            _ => None,
        }
    }
}

/// `block_rows` rows (4 warps of 16 or 32) per block for the tensor-core kernels.
fn tensor_core_config(rows: usize, heads: usize, batch: usize, block_rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(block_rows) as u32, heads as u32, batch as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row: `rows` rows per (head, batch), `ATTN_WARPS` rows per block.
fn attention_config(rows: usize, heads: usize, batch: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ATTN_WARPS) as u32, heads as u32, batch as u32),
        block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}
