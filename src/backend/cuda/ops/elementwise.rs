//! Elementwise ops and per-row reductions: SwiGLU (gpt-oss's clamped form too), residual adds, scaling, row dot products and
//! the sum of squares.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::clamped_swiglu::Clamp;
use crate::backend::cuda::{elementwise_config, CudaBackend};
use crate::backend::Backend;

impl CudaBackend {
    pub(super) fn elementwise_len(&self, op: &str, bufs: &[(&str, usize)]) -> usize {
        let n = bufs[0].1;
        for (what, len) in bufs {
            assert_eq!(*len, n, "{op}: `{what}` has {len} floats, expected {n}");
        }
        n
    }

    pub(super) fn swiglu_forward_untimed(&self, out: &mut Buf, gate: &Buf, up: &Buf) {
        let n = self.elementwise_len(
            "swiglu_forward",
            &[("out", out.len()), ("gate", gate.len()), ("up", up.len())],
        );
        let ((gate32, gate16), (up32, up16)) =
            (self.activation_input(gate), self.activation_input(up));
        let (twin, out32, out16) = self.begin_output(out, n, "swiglu_forward", true);
        launch_elementwise!(
            self,
            "swiglu_forward",
            n,
            &out32,
            &out16,
            &gate32,
            &up32,
            &gate16,
            &up16
        );
        Self::keep_twin(out, twin);
    }

    pub(super) fn swiglu_backward_untimed(
        &self,
        dgate: &mut Buf,
        dup: &mut Buf,
        dout: &Buf,
        gate: &Buf,
        up: &Buf,
    ) {
        let n = self.elementwise_len(
            "swiglu_backward",
            &[
                ("dgate", dgate.len()),
                ("dup", dup.len()),
                ("dout", dout.len()),
                ("gate", gate.len()),
                ("up", up.len()),
            ],
        );
        let (dout32, dout16) = self.activation_input(dout);
        let ((gate32, gate16), (up32, up16)) =
            (self.activation_input(gate), self.activation_input(up));
        let (dgate_twin, dgate32, dgate16) = self.begin_output(dgate, n, "swiglu_backward", true);
        let (dup_twin, dup32, dup16) = self.begin_output(dup, n, "swiglu_backward", true);
        launch_elementwise!(
            self,
            "swiglu_backward",
            n,
            &dgate32,
            &dup32,
            &dgate16,
            &dup16,
            &dout32,
            &gate32,
            &up32,
            &dout16,
            &gate16,
            &up16
        );
        Self::keep_twin(dgate, dgate_twin);
        Self::keep_twin(dup, dup_twin);
    }

    pub(super) fn add_untimed(&self, out: &mut Buf, a: &Buf, b: &Buf) {
        let n = self.elementwise_len("add", &[("out", out.len()), ("a", a.len()), ("b", b.len())]);
        launch_elementwise!(self, "add_f32", n, out, a, b);
    }

    pub(super) fn add_assign_untimed(&self, acc: &mut Buf, x: &Buf) {
        let n = self.elementwise_len("add_assign", &[("acc", acc.len()), ("x", x.len())]);
        launch_elementwise!(self, "add_assign_f32", n, acc, x);
    }

    pub(super) fn add_range_untimed(
        &self,
        acc: &mut Buf,
        acc_offset: usize,
        x: &Buf,
        x_offset: usize,
        len: usize,
    ) {
        check_len("add_range", "acc", acc.len(), acc_offset + len);
        check_len("add_range", "x", x.len(), x_offset + len);
        let mut window = acc.slice_mut(acc_offset..acc_offset + len);
        let part = x.slice(x_offset..x_offset + len);
        launch_elementwise!(self, "add_assign_f32", len, &mut window, &part);
    }

    pub(super) fn scale_untimed(&self, buf: &mut Buf, factor: f32) {
        let n = buf.len();
        launch_elementwise!(self, "scale_f32", n, buf, &factor);
    }

    pub(super) fn scale_rows_untimed(&self, buf: &mut Buf, scales: &[f32], width: usize) {
        self.scale_rows_by_untimed(buf, &self.upload(scales), width);
    }

    pub(super) fn scale_rows_by_untimed(&self, buf: &mut Buf, scales: &Buf, width: usize) {
        check_len("scale_rows", "buf", buf.len(), scales.len() * width);
        let width = width as i64;
        launch_elementwise!(self, "scale_rows_f32", buf.len(), buf, scales, &width);
    }

    pub(super) fn row_dots_untimed(&self, a: &Buf, b: &Buf, width: usize) -> Buf {
        let rows = a.len() / width.max(1);
        check_len("row_dots", "a", a.len(), rows * width);
        check_len("row_dots", "b", b.len(), rows * width);
        let mut out = self.uninit(rows);
        if rows > 0 {
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let (rows_arg, width_arg) = (rows as i64, width as i64);
            launch!(
                self,
                "row_dots_f32",
                cfg,
                &mut out,
                a,
                b,
                &rows_arg,
                &width_arg
            );
        }
        out
    }

    pub(super) fn sum_squares_untimed(&self, buf: &Buf) -> f64 {
        let n = buf.len();
        if n == 0 {
            return 0.0;
        }
        const BLOCKS: usize = 256;
        let mut partials = self.alloc::<f64>(BLOCKS);
        let cfg = LaunchConfig {
            grid_dim: (BLOCKS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let len = n as i64;
        launch!(self, "sum_squares_partial", cfg, &mut partials, buf, &len);
        self.to_host(&partials)
            .unwrap_or_else(|e| panic!("CUDA: downloading partial sums failed: {e}"))
            .iter()
            .sum()
    }

    pub(super) fn clamped_swiglu_forward_untimed(
        &self,
        act: &mut Buf,
        (gate, up): (&Buf, &Buf),
        (alpha, limit): Clamp,
    ) {
        let lens = [("act", act.len()), ("gate", gate.len()), ("up", up.len())];
        let n = self.elementwise_len("clamped_swiglu_forward", &lens);
        launch_elementwise!(
            self,
            "clamped_swiglu_forward",
            n,
            act,
            gate,
            up,
            &alpha,
            &limit
        );
    }

    pub(super) fn clamped_swiglu_backward_untimed(
        &self,
        (dgate, dup): (&mut Buf, &mut Buf),
        dact: &Buf,
        (gate, up): (&Buf, &Buf),
        (alpha, limit): Clamp,
    ) {
        let lens = [
            ("dgate", dgate.len()),
            ("dup", dup.len()),
            ("dact", dact.len()),
            ("gate", gate.len()),
            ("up", up.len()),
        ];
        let n = self.elementwise_len("clamped_swiglu_backward", &lens);
        launch_elementwise!(
            self,
            "clamped_swiglu_backward",
            n,
            dgate,
            dup,
            dact,
            gate,
            up,
            &alpha,
            &limit
        );
    }
}
