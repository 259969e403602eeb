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

/// Every operand of every GEMM of every recipe, fake-quantised as torchao's emulated float8 GEMM
/// reads it (`(x·s).clamp(±max).to(fp8).float() · s⁻¹`, scales along the recipe's axes), against
/// the same formulas run in PyTorch, bit for bit.
#[test]
fn recipe_operands_match_torchao_formulas_in_pytorch() {
    use titan::backend::float8::{fake_quantize, Float8Recipe, LinearGemm, ScaleAxis};
    let Some(py) = common::hf_python() else {
        return;
    };
    let (m, k, n) = (6, 8, 5);
    let values = |len: usize, seed: u32| -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2654435761) >> 8;
                ((h % 20001) as f32 - 10000.0) * 1e-3 * (1 + i % 7) as f32
            })
            .collect()
    };
    let (x, w, g) = (values(m * k, 1), values(n * k, 2), values(m * n, 3));
    let operand = |name: char| match name {
        'X' => (&x, m, k),
        'W' => (&w, n, k),
        _ => (&g, m, n),
    };
    let mut jobs = Vec::new();
    for recipe in ["tensorwise", "rowwise", "rowwise_with_gw_hp"] {
        let r = Float8Recipe::parse(recipe).unwrap();
        for (gemm, names) in [
            (LinearGemm::Output, ['X', 'W']),
            (LinearGemm::InputGrad, ['G', 'W']),
            (LinearGemm::WeightGrad, ['G', 'X']),
        ] {
            for (q, name) in r.operands(gemm).into_iter().zip(names) {
                if let Some(q) = q {
                    jobs.push((name, q));
                }
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let write = |file: &str, v: &[f32]| {
        let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        std::fs::write(dir.path().join(file), bytes).unwrap();
    };
    write("X", &x);
    write("W", &w);
    write("G", &g);
    let spec: Vec<String> = jobs
        .iter()
        .map(|(name, q)| {
            let (_, rows, cols) = operand(*name);
            let axis = match q.axis {
                ScaleAxis::Tensor => "tensor",
                ScaleAxis::Rows => "rows",
                ScaleAxis::Columns => "cols",
            };
            let (dtype, max) = match q.format {
                Fp8Format::E4M3 => ("float8_e4m3fn", 448.0),
                Fp8Format::E5M2 => ("float8_e5m2", 57344.0),
            };
            format!(
                "{name} {rows} {cols} {axis} {dtype} {max} {}",
                q.power_of_two_scales as u8
            )
        })
        .collect();
    std::fs::write(dir.path().join("jobs"), spec.join("\n")).unwrap();
    let script = r#"
import torch, sys, os
d = sys.argv[1]
out = []
for line in open(os.path.join(d, 'jobs')).read().splitlines():
    name, rows, cols, axis, dtype, mx, pow2 = line.split()
    x = torch.frombuffer(bytearray(open(os.path.join(d, name), 'rb').read()), dtype=torch.float32)
    x = x.reshape(int(rows), int(cols))
    a = x.abs()
    amax = a.amax() if axis == 'tensor' else a.amax(dim=1, keepdim=True) if axis == 'rows' else a.amax(dim=0, keepdim=True)
    s = (float(mx) / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    if pow2 == '1':
        s = torch.exp2(torch.floor(torch.log2(s)))
    q = (x * s).clamp(min=-float(mx), max=float(mx)).to(getattr(torch, dtype)).float()
    out.append((q * s.reciprocal()).reshape(-1))
open(os.path.join(d, 'out'), 'wb').write(torch.cat(out).numpy().tobytes())
"#;
    let o = Command::new(&py)
        .args(["-c", script])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<f32> = std::fs::read(dir.path().join("out"))
        .unwrap()
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let mut at = 0;
    for (name, q) in &jobs {
        let (v, rows, cols) = operand(*name);
        let mine = fake_quantize(v, rows, cols, *q);
        let t = &theirs[at..at + mine.len()];
        at += mine.len();
        for (i, (a, b)) in mine.iter().zip(t).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{name} {q:?} [{i}]: titan {a:e}, torch {b:e}"
            );
        }
    }
    assert_eq!(at, theirs.len());
}

/// MXFP8 with RCEIL scales against torchao's `to_mx` RCEIL formulas run in PyTorch: the E8M0
/// scale bytes and the e4m3 element codes of blocks of every magnitude (zero blocks, one outlier,
/// tiny and huge values), bit for bit.
#[test]
fn mxfp8_rceil_matches_torchao_formulas_in_pytorch() {
    use titan::backend::float8::mx_quantize;
    let Some(py) = common::hf_python() else {
        return;
    };
    let (rows, cols) = (16, 64);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2654435761) >> 8;
            let magnitude = 10f32.powi((i / 32 % 16) as i32 - 8);
            match i / 32 {
                3 => 0.0,
                5 if i % 32 == 7 => 3.0e4,
                _ => ((h % 20001) as f32 - 10000.0) * 1e-4 * magnitude,
            }
        })
        .collect();
    let mine = mx_quantize(&x, cols).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.path().join("x"), bytes).unwrap();
    let script = format!(
        r#"
import torch, sys, os
d = sys.argv[1]
x = torch.frombuffer(bytearray(open(os.path.join(d, 'x'), 'rb').read()), dtype=torch.float32)
b = x.reshape({rows}, {cols} // 32, 32)
descale = b.abs().amax(-1, keepdim=True) / 448.0
e = torch.where(torch.isnan(descale), 255, (torch.clamp(torch.ceil(torch.log2(descale)), min=-127, max=127) + 127).to(torch.uint8))
m = torch.where(e == 0, 1.0, torch.exp2(127 - e.to(torch.float32)))
q = torch.clamp(b * m, min=-448.0, max=448.0).to(torch.float8_e4m3fn)
open(os.path.join(d, 'e'), 'wb').write(e.to(torch.uint8).reshape(-1).numpy().tobytes())
open(os.path.join(d, 'q'), 'wb').write(q.view(torch.uint8).reshape(-1).numpy().tobytes())
"#
    );
    let o = Command::new(&py)
        .args(["-c", &script])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let scales = std::fs::read(dir.path().join("e")).unwrap();
    let codes = std::fs::read(dir.path().join("q")).unwrap();
    assert_eq!(mine.scales, scales, "E8M0 scale bytes");
    for (i, (v, &c)) in mine.values.iter().zip(&codes).enumerate() {
        let m = Fp8Format::E4M3.encode(*v);
        assert_eq!(
            m, c,
            "element {i} ({:e}): titan {m:#04x}, torch {c:#04x}",
            x[i]
        );
    }
}
