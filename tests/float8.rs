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

/// PyTorch's scales for `amaxes`: torchao's `amax_to_scale` (f64, then f32) and its power-of-two
/// rounding (`exp2(floor(log2(scale)))`), as little-endian f32 pairs.
fn torch_scales(py: &str, amaxes: &[f32]) -> Vec<(f32, f32)> {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.bin"), dir.path().join("out.bin"));
    let bytes: Vec<u8> = amaxes.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&input, bytes).unwrap();
    let script = "import torch, sys\n\
        a = torch.frombuffer(bytearray(open(sys.argv[1], 'rb').read()), dtype=torch.float32)\n\
        s = (448.0 / torch.clamp(a.to(torch.float64), min=1e-12)).to(torch.float32)\n\
        p = torch.exp2(torch.floor(torch.log2(s)))\n\
        open(sys.argv[2], 'wb').write(torch.stack([s, p], 1).numpy().tobytes())\n";
    let o = Command::new(py)
        .args(["-c", script])
        .arg(&input)
        .arg(&output)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f: Vec<f32> = std::fs::read(&output)
        .unwrap()
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    f.chunks(2).map(|p| (p[0], p[1])).collect()
}

#[test]
fn scales_match_torchao_formulas_in_pytorch() {
    let Some(py) = common::hf_python() else {
        return;
    };
    let mut amaxes = vec![0.0f32, 1e-20, 1e-12, 448.0, 1.0, 3.5, 7.0, 1e6];
    let mut a = 1e-9f32;
    while a < 1e9 {
        amaxes.push(a);
        // Around powers of two, where the power-of-two rounding is decided.
        amaxes.push(448.0 / 2f32.powi(a.log2() as i32));
        a *= 1.21;
    }
    let theirs = torch_scales(&py, &amaxes);
    for (&a, &(s, p)) in amaxes.iter().zip(&theirs) {
        let mine = titan::backend::float8::scale_from_amax(a, Fp8Format::E4M3);
        assert_eq!(
            mine.to_bits(),
            s.to_bits(),
            "amax {a:e}: titan {mine:e}, torch {s:e}"
        );
        let pow2 = titan::backend::float8::round_scale_down_to_power_of_two(mine);
        assert_eq!(
            pow2.to_bits(),
            p.to_bits(),
            "amax {a:e}: titan {pow2:e}, torch {p:e}"
        );
    }
}
