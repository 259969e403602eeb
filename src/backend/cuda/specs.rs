//! Datasheet peak throughput of the NVIDIA GPUs titan knows, for MFU. Dense figures (no
//! structured sparsity) of the SXM or named variant, per GEMM precision; the GPU is recognised by
//! the name the driver reports. An unknown GPU has no entry: MFU then falls back to the H100's bf16
//! figure and says so, and `[metrics] peak_tflops` sets the right one.

use super::GemmPrecision;

/// (name fragment, bf16, tf32, fp32) TFLOP/s; the first fragment found in the name wins, so the
/// more specific names come first.
const PEAKS: &[(&str, f64, f64, f64)] = &[
    ("B200", 2250.0, 1100.0, 75.0), // also GB200
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100 NVL", 835.0, 418.0, 60.0),
    ("H200", 989.0, 494.0, 67.0), // also GH200
    ("H100", 989.0, 494.0, 67.0),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("RTX 4090", 165.0, 82.6, 82.6),
];

/// Peak TFLOP/s of the GPU named `device_name` at `precision`, if titan knows it.
pub fn peak_tflops(device_name: &str, precision: GemmPrecision) -> Option<f64> {
    PEAKS
        .iter()
        .find(|(fragment, ..)| device_name.contains(fragment))
        .map(|&(_, bf16, tf32, fp32)| match precision {
            GemmPrecision::BFloat16 => bf16,
            GemmPrecision::TFloat32 => tf32,
            GemmPrecision::Float32 => fp32,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpus_by_driver_name_and_precision() {
        let bf16 = GemmPrecision::BFloat16;
        assert_eq!(peak_tflops("NVIDIA H200", bf16), Some(989.0));
        assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3", bf16), Some(989.0));
        assert_eq!(peak_tflops("NVIDIA H100 PCIe", bf16), Some(756.0));
        assert_eq!(peak_tflops("NVIDIA A100-SXM4-80GB", bf16), Some(312.0));
        assert_eq!(peak_tflops("NVIDIA GH200 480GB", bf16), Some(989.0));
        assert_eq!(
            peak_tflops("NVIDIA L40S", GemmPrecision::Float32),
            Some(91.6)
        );
        assert_eq!(peak_tflops("NVIDIA L40", bf16), Some(181.0));
        assert_eq!(peak_tflops("NVIDIA L4", bf16), Some(121.0));
        assert_eq!(
            peak_tflops("NVIDIA H200", GemmPrecision::TFloat32),
            Some(494.0)
        );
        assert_eq!(peak_tflops("Tesla T4", bf16), None);
    }
}
