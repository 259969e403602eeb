//! The float8 formats against PyTorch's own casts (`torch.float8_e4m3fn`, `torch.float8_e5m2`,
//! which torchao's scaling saturates into): every code's value, and the rounding of values all
//! over each format's range (ties, subnormals, saturation), bit for bit.

mod common;

use std::process::Command;

use titan::backend::float8::Fp8Format;

/// Values spread over `format`'s range with both signs: a geometric sweep, every midpoint
/// between neighbouring codes and a hair either side of it, and values beyond ±max.
fn probes(format: Fp8Format) -> Vec<f32> {
    let mut values: Vec<f32> = (0u8..0x7f)
        .map(|c| format.decode(c))
        .filter(|v| v.is_finite())
        .collect();
    values.sort_by(f32::total_cmp);
    let mut out = Vec::new();
    for w in values.windows(2) {
        let mid = (f64::from(w[0]) + f64::from(w[1])) / 2.0;
        out.extend([
            mid as f32,
            (mid * (1.0 - 1e-5)) as f32,
            (mid * (1.0 + 1e-5)) as f32,
        ]);
    }
    let mut x = 1e-8f32;
    while x < 1e6 {
        out.push(x);
        x *= 1.037;
    }
    out.extend([0.0, 1e9]);
    let negatives: Vec<f32> = out.iter().map(|v| -v).collect();
    out.extend(negatives);
    out
}

/// PyTorch's codes for `values` saturated into `dtype` (as torchao's `to_fp8_saturated` does).
fn torch_codes(py: &str, dtype: &str, max: f32, values: &[f32]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.bin");
    let output = dir.path().join("out.bin");
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&input, bytes).unwrap();
    let script = format!(
        "import torch, sys\n\
         x = torch.frombuffer(bytearray(open(sys.argv[1], 'rb').read()), dtype=torch.float32)\n\
         q = x.clamp(min=-{max}, max={max}).to(torch.{dtype})\n\
         open(sys.argv[2], 'wb').write(q.view(torch.uint8).numpy().tobytes())\n"
    );
    let o = Command::new(py)
        .args(["-c", &script])
        .arg(&input)
        .arg(&output)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read(&output).unwrap()
}

#[test]
fn casts_match_pytorch_bit_for_bit() {
    let Some(py) = common::hf_python() else {
        return;
    };
    for (format, dtype) in [
        (Fp8Format::E4M3, "float8_e4m3fn"),
        (Fp8Format::E5M2, "float8_e5m2"),
    ] {
        let values = probes(format);
        let theirs = torch_codes(&py, dtype, format.max(), &values);
        assert_eq!(theirs.len(), values.len());
        for (v, &t) in values.iter().zip(&theirs) {
            let mine = format.encode(format.quantize(*v, 1.0));
            // PyTorch keeps the sign of a zero; so does titan.
            assert_eq!(
                mine, t,
                "{format:?}: {v:e} -> titan {mine:#04x}, torch {t:#04x}"
            );
            assert_eq!(format.decode(mine), format.decode(t));
        }
    }
}
