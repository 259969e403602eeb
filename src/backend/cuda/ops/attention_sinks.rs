//! Attention sinks on the device (`kernels/attention.cu`: `attention_sinks`,
//! `attention_sinks_grad`): folded into a finished attention, and their gradient.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AttnSaved, AttnShape};

impl CudaBackend {
    pub(super) fn attention_sinks_forward_untimed(
        &self,
        out: &mut Buf,
        lse: &mut Buf,
        sinks: &Buf,
        s: AttnShape,
    ) {
        let rows = s.batch * s.q_len * s.n_heads;
        for (what, len, need) in [
            ("out", out.len(), rows * s.head_dim),
            ("lse", lse.len(), rows),
            ("sinks", sinks.len(), s.n_heads),
        ] {
            check_len("attention_sinks_forward", what, len, need);
        }
        if rows == 0 {
            return;
        }
        let [b, ql, h, d] = sink_dims(s);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "attention_sinks",
            cfg,
            out,
            lse,
            sinks,
            &b,
            &ql,
            &h,
            &d
        );
    }

    pub(super) fn attention_sinks_backward_untimed(
        &self,
        dsinks: &mut Buf,
        dout: &Buf,
        saved: AttnSaved<'_, Buf>,
        sinks: &Buf,
        s: AttnShape,
    ) {
        let rows = s.batch * s.q_len * s.n_heads;
        for (what, len, need) in [
            ("dout", dout.len(), rows * s.head_dim),
            ("out", saved.out.len(), rows * s.head_dim),
            ("lse", saved.lse.len(), rows),
            ("sinks", sinks.len(), s.n_heads),
            ("dsinks", dsinks.len(), s.n_heads),
        ] {
            check_len("attention_sinks_backward", what, len, need);
        }
        if rows == 0 {
            return;
        }
        let [b, ql, h, d] = sink_dims(s);
        let cfg = LaunchConfig {
            grid_dim: (s.n_heads as u32, 1, 1),
            // ATTN_SINK_THREADS in the source.
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (out, lse) = (saved.out, saved.lse);
        launch!(
            self,
            "attention_sinks_grad",
            cfg,
            dsinks,
            dout,
            out,
            lse,
            sinks,
            &b,
            &ql,
            &h,
            &d
        );
    }
}

/// The sink kernels' shape arguments: batch, queries, heads, head width.
fn sink_dims(s: AttnShape) -> [i32; 4] {
    [s.batch, s.q_len, s.n_heads, s.head_dim].map(|v| v as i32)
}
