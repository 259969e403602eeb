//! The float8 checks of `crosscheck`: amaxes along each axis, the quantise-dequantise of every
//! recipe's operand kinds (e4m3 and e5m2, power-of-two scales), and FSDP's float8 codes both ways.
//! The test backend must give the reference's numbers exactly (tolerance 0): an emulated float8
//! GEMM on the GPU reads the CPU's operands.

use super::Checker;
use crate::backend::float8::{Fp8Format, Quantization, ScaleAxis};
use crate::backend::Backend;

impl<R: Backend, T: Backend> Checker<'_, R, T> {
    pub(super) fn float8(&mut self) {
        let (rows, cols) = (67, 96);
        // Values over many powers of two, so some fall below each format's normals and some
        // saturate under the scales of their smaller neighbours.
        let mut x = self.random(rows * cols, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v *= ((i % 29) as f32 - 18.0).exp2();
        }
        let (rx, tx) = self.both(&x);
        for axis in [ScaleAxis::Tensor, ScaleAxis::Rows, ScaleAxis::Columns] {
            let amaxes = self.reference.float8_amaxes(&rx, rows, cols, axis);
            let test_amaxes = self.test.float8_amaxes(&tx, rows, cols, axis);
            self.record(&format!("float8_amax {axis:?}"), &test_amaxes, &amaxes, 0.0);
            for (format, power_of_two_scales) in [
                (Fp8Format::E4M3, false),
                (Fp8Format::E5M2, false),
                (Fp8Format::E4M3, true),
            ] {
                let q = Quantization {
                    format,
                    axis,
                    power_of_two_scales,
                };
                let r = self.reference.float8_fake_quantized(&rx, cols, q, &amaxes);
                let t = self.test.float8_fake_quantized(&tx, cols, q, &amaxes);
                let pow2 = if power_of_two_scales { " pow2" } else { "" };
                let name = format!("float8_fake_quantize {axis:?} {format:?}{pow2}");
                self.compare(&name, &r, &t, 0.0);
            }
        }
        // An odd count: the last word padded.
        let odd = self.random(rows * cols - 3, 2.0);
        let (ro, to) = self.both(&odd);
        let scale = 37.5;
        let (rc, tc) = (
            self.reference.float8_encoded(&ro, scale, Fp8Format::E4M3),
            self.test.float8_encoded(&to, scale, Fp8Format::E4M3),
        );
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        let (r_bits, t_bits) = (
            bits(self.reference.download(&rc)),
            bits(self.test.download(&tc)),
        );
        let differ = r_bits.iter().zip(&t_bits).filter(|(a, b)| a != b).count()
            + r_bits.len().abs_diff(t_bits.len());
        self.record("float8_encoded codes", &[differ as f32], &[0.0], 0.0);
        let r = self.reference.float8_decoded(&rc, Fp8Format::E4M3);
        let t = self.test.float8_decoded(&tc, Fp8Format::E4M3);
        self.compare("float8_decoded", &r, &t, 0.0);
    }
}
