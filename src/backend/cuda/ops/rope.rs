//! Rotary position embeddings: one kernel rotates each pair of a head's values, by the position's
//! angle forward and back by it in the backward.

use cudarc::driver::PushKernelArg;

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::{elementwise_config, CudaBackend};
use crate::backend::RopeShape;

impl CudaBackend {
    pub(super) fn rope_rotate(
        &self,
        x: &mut Buf,
        cos: &Buf,
        sin: &Buf,
        shape: RopeShape,
        direction: f32,
    ) {
        let RopeShape {
            batch,
            seq,
            heads,
            head_dim,
            pos_offset,
            per_token,
        } = shape;
        assert!(
            head_dim.is_multiple_of(2),
            "rope: head_dim {head_dim} is odd; RoPE rotates pairs"
        );
        let pairs = batch * seq * heads * head_dim / 2;
        check_len("rope", "x", x.len(), pairs * 2);
        check_len("rope", "cos", cos.len(), shape.table_rows() * head_dim / 2);
        check_len("rope", "sin", sin.len(), shape.table_rows() * head_dim / 2);
        if pairs == 0 {
            return;
        }
        // The kernel reads row `pos_offset + token % seq`: tables per token are one sequence of
        // every token, from row 0.
        let (seq, pos_offset) = match per_token {
            true => (batch * seq, 0),
            false => (seq, pos_offset),
        };
        let (n, s, h, d, p) = (
            pairs as i64,
            seq as i32,
            heads as i32,
            head_dim as i32,
            pos_offset as i32,
        );
        let (twin, x32, x16) = self.begin_output(x, pairs * 2, "rope", false);
        launch!(
            self,
            "rope_rotate",
            elementwise_config(pairs),
            &x32,
            &x16,
            cos,
            sin,
            &n,
            &s,
            &h,
            &d,
            &p,
            &direction
        );
        Self::keep_twin(x, twin);
    }
}
