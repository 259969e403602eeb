//! titan's float8 linears against torchao's own `Float8Linear` (`emulate=True`, on the CPU), and
//! its MXFP8 linears against torchao's MXFP8 training linear (`KernelPreference.EMULATED`, FLOOR
//! and RCEIL scales): for each recipe, the forward `Y = X·Wᵀ` and both backward products `dX`, `dW` of one linear on the
//! same inputs. The casts are exact arithmetic on both sides, so the products differ only by the
//! order of the f32 sums; a scale or rounding off anywhere would move whole rows by far more. And
//! MXFP8 experts against torchao's emulated MXFP8 grouped GEMM, compared in bf16 (its output).
//! And a float8 output head (`filter_fqns` without `output`): torchao's `Float8Linear` followed
//! by PyTorch's cross-entropy, its loss and both gradients.

mod common;

use std::process::Command;

use titan::backend::cpu::CpuBackend;
use titan::backend::float8::{Float8Recipe, LinearGemm};
use titan::backend::{Backend, IGNORE_INDEX};
use titan::model::float8_linear::{Float8Casts, OnOneRank};
use titan::model::linear::Linear;

/// A linear's GEMM sizes: `M` token rows, `K` input and `N` output features.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    k: usize,
    n: usize,
}

/// Float8's sizes (not multiples of 32: float8 has no blocks).
const FLOAT8_DIMS: Dims = Dims {
    m: 32,
    k: 48,
    n: 64,
};
/// MXFP8's sizes: each a multiple of its blocks of 32.
const MX_DIMS: Dims = Dims {
    m: 64,
    k: 96,
    n: 128,
};

/// Values of many magnitudes (so the rows' and columns' amaxes differ, and some values fall
/// below e4m3's normals after scaling), from a fixed pseudo-random sequence.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            u * 10f32.powi((i % 7) as i32 - 3)
        })
        .collect()
}

/// titan's `Y`, `dX`, `dW` for `recipe` on the CPU backend.
fn titan_products(
    recipe: Float8Recipe,
    dims: Dims,
    operands: (&[f32], &[f32], &[f32]),
) -> [Vec<f32>; 3] {
    let casts = Float8Casts {
        groups: &OnOneRank,
        partial_row_blocks: false,
    };
    products_cast(&casts, recipe, dims, operands)
}

/// `Y`, `dX`, `dW` of one linear (or one expert's GEMMs over its rows) cast by `casts`.
fn products_cast(
    casts: &Float8Casts<'_>,
    recipe: Float8Recipe,
    Dims { m, k, n }: Dims,
    (x, w, g): (&[f32], &[f32], &[f32]),
) -> [Vec<f32>; 3] {
    let be = CpuBackend::default();
    let linear = Linear::new(k, n).in_float8(Some(recipe));
    let (x, w, g) = (x.to_vec(), w.to_vec(), g.to_vec());
    let [xq, wq] = casts
        .operands(&be, linear, LinearGemm::Output, (&x, &w), m)
        .unwrap();
    let mut y = vec![0f32; m * n];
    linear.forward(&be, &mut y, xq.buf(), wq.buf(), m);
    let [gq, wq] = casts
        .operands(&be, linear, LinearGemm::InputGrad, (&g, &w), m)
        .unwrap();
    let mut dx = vec![0f32; m * k];
    linear.input_grad(&be, &mut dx, gq.buf(), wq.buf(), m);
    let [gq, xq] = casts
        .operands(&be, linear, LinearGemm::WeightGrad, (&g, &x), m)
        .unwrap();
    let mut dw = vec![0f32; n * k];
    linear.add_weight_grad(&be, &mut dw, gq.buf(), xq.buf(), m);
    [y, dx, dw]
}

/// torchao's `Y`, `dX`, `dW` from a linear `convert` (Python lines converting the
/// `nn.Sequential` `m`, emulated) makes.
fn torchao_products(
    py: &str,
    convert: &str,
    Dims { m, k, n }: Dims,
    (x, w, g): (&[f32], &[f32], &[f32]),
) -> [Vec<f32>; 3] {
    let script = format!(
        "import sys, dataclasses, torch\n\
         def load(p, *shape):\n    return torch.frombuffer(bytearray(open(p, 'rb').read()), dtype=torch.float32).reshape(*shape).clone()\n\
         x, w, g = load(sys.argv[1], {m}, {k}), load(sys.argv[2], {n}, {k}), load(sys.argv[3], {m}, {n})\n\
         m = torch.nn.Sequential(torch.nn.Linear({k}, {n}, bias=False))\n\
         with torch.no_grad():\n    m[0].weight.copy_(w)\n\
         {convert}\n\
         x.requires_grad_(True)\n\
         y = m(x)\n\
         y.backward(g)\n\
         out = torch.cat([y.detach().flatten(), x.grad.flatten(), m[0].weight.grad.flatten()])\n\
         open(sys.argv[4], 'wb').write(out.numpy().tobytes())\n"
    );
    let all = run_torch(py, &script, [x, w, g]);
    let (y, rest) = all.split_at(m * n);
    let (dx, dw) = rest.split_at(m * k);
    [y.to_vec(), dx.to_vec(), dw.to_vec()]
}

/// Runs `script` with `py`: its arguments are files holding `inputs` (f32, little-endian) and
/// the file it writes its f32 outputs to, which are returned.
fn run_torch(py: &str, script: &str, inputs: [&[f32]; 3]) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let mut paths: Vec<std::path::PathBuf> = inputs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let p = dir.path().join(format!("in{i}"));
            let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
            std::fs::write(&p, bytes).unwrap();
            p
        })
        .collect();
    paths.push(dir.path().join("out"));
    let o = Command::new(py)
        .args(["-c", script])
        .args(&paths)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read(&paths[3])
        .unwrap()
        .chunks(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Checks each of titan's three results (named `names`) against torchao's: within `tolerance`
/// times torchao's largest value.
fn assert_each_close(
    what: &str,
    names: [&str; 3],
    mine: &[Vec<f32>; 3],
    theirs: &[Vec<f32>; 3],
    tolerance: f32,
) {
    for ((product, a), b) in names.iter().zip(mine).zip(theirs) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= tolerance * scale,
            "{what} {product}: titan and torchao differ by {worst:e} (largest value {scale:e})"
        );
    }
}

/// Checks titan's three products against torchao's: within 1e-6 of the largest value, and not the
/// high-precision forward.
fn assert_matches(
    what: &str,
    dims: Dims,
    mine: &[Vec<f32>; 3],
    theirs: &[Vec<f32>; 3],
    x: &[f32],
    w: &[f32],
) {
    assert_each_close(what, ["Y", "dX", "dW"], mine, theirs, 1e-6);
    // Not the high-precision products: the casts changed the numbers.
    let Dims { m: _, k, n } = dims;
    let plain: Vec<f32> = (0..mine[0].len())
        .map(|i| (0..k).map(|j| x[i / n * k + j] * w[i % n * k + j]).sum())
        .collect();
    let moved = mine[0]
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-4,
        "{what}: the low-precision forward equals the fp32 one"
    );
}

#[test]
fn float8_linears_match_torchao_for_every_recipe() {
    let Some(py) = common::torchao_python() else {
        return;
    };
    let d = FLOAT8_DIMS;
    let (x, w, g) = (
        values(d.m * d.k, 1),
        values(d.n * d.k, 2),
        values(d.m * d.n, 3),
    );
    for (recipe, name) in [
        (Float8Recipe::Tensorwise, "tensorwise"),
        (Float8Recipe::Rowwise, "rowwise"),
        (Float8Recipe::RowwiseWithGwHp, "rowwise_with_gw_hp"),
    ] {
        let convert = format!(
            "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\
             config = dataclasses.replace(Float8LinearConfig.from_recipe_name('{name}'), emulate=True)\n\
             convert_to_float8_training(m, config=config)"
        );
        let mine = titan_products(recipe, d, (&x, &w, &g));
        let theirs = torchao_products(&py, &convert, d, (&x, &w, &g));
        assert_matches(name, d, &mine, &theirs, &x, &w);
    }
}

#[test]
fn mxfp8_linears_match_torchao_with_floor_and_rceil_scales() {
    let Some(py) = common::torchao_python() else {
        return;
    };
    let d = MX_DIMS;
    let (x, w, g) = (
        values(d.m * d.k, 4),
        values(d.n * d.k, 5),
        values(d.m * d.n, 6),
    );
    for (name, mode) in [("mxfp8_cublas", "FLOOR"), ("mxfp8_cublas_rceil", "RCEIL")] {
        let convert = format!(
            "from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig\n\
             from torchao.prototype.mx_formats.config import ScaleCalculationMode\n\
             from torchao.quantization import quantize_\n\
             from torchao.quantization.quantize_.common.kernel_preference import KernelPreference\n\
             config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED, out_dtype=torch.float32, wgrad_with_hp=False, scale_calculation_mode=ScaleCalculationMode.{mode})\n\
             quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))"
        );
        let recipe = Float8Recipe::parse_mx(name).unwrap();
        let mine = titan_products(recipe, d, (&x, &w, &g));
        let theirs = torchao_products(&py, &convert, d, (&x, &w, &g));
        assert_matches(name, d, &mine, &theirs, &x, &w);
    }
}

/// A float8 output head's sizes: 32 token rows, dim 48, vocabulary 64.
const HEAD_DIMS: Dims = Dims {
    m: 32,
    k: 48,
    n: 64,
};

/// titan's loss, `dH`, `dW` of a float8 head on the CPU backend, as `Llama`'s float8 head
/// computes them: the logits through the float8 linear, the loss of the whole logits with their
/// gradient in place, and the linear's two backward GEMMs on that gradient.
fn titan_head(
    recipe: Float8Recipe,
    (h, w, targets): (&[f32], &[f32], &[u32]),
    grad_scale: f32,
) -> [Vec<f32>; 3] {
    let Dims { m, k, n } = HEAD_DIMS;
    let be = CpuBackend::default();
    let linear = Linear::new(k, n).in_float8(Some(recipe));
    let casts = Float8Casts {
        groups: &OnOneRank,
        partial_row_blocks: false,
    };
    let (h, w) = (h.to_vec(), w.to_vec());
    let [hq, wq] = casts
        .operands(&be, linear, LinearGemm::Output, (&h, &w), m)
        .unwrap();
    let mut logits = vec![0f32; m * n];
    linear.forward(&be, &mut logits, hq.buf(), wq.buf(), m);
    let loss = be.cross_entropy_of_logits(&mut logits, targets, n, grad_scale, true);
    let [_, dh, dw] = products_cast(&casts, recipe, HEAD_DIMS, (&h, &w, &logits));
    [vec![loss.sum as f32], dh, dw]
}

/// torchao's: `Float8Linear` (emulated) and `F.cross_entropy` summed over the rows (ignore index
/// -100), times `grad_scale`, backward.
fn torchao_head(
    py: &str,
    name: &str,
    (h, w, targets): (&[f32], &[f32], &[f32]),
    grad_scale: f32,
) -> [Vec<f32>; 3] {
    let Dims { m, k, n } = HEAD_DIMS;
    let script = format!(
        "import sys, dataclasses, torch\n\
         from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n\
         def load(p, *shape):\n    return torch.frombuffer(bytearray(open(p, 'rb').read()), dtype=torch.float32).reshape(*shape).clone()\n\
         h, w, t = load(sys.argv[1], {m}, {k}), load(sys.argv[2], {n}, {k}), load(sys.argv[3], {m}).long()\n\
         m = torch.nn.Sequential(torch.nn.Linear({k}, {n}, bias=False))\n\
         with torch.no_grad():\n    m[0].weight.copy_(w)\n\
         config = dataclasses.replace(Float8LinearConfig.from_recipe_name('{name}'), emulate=True)\n\
         convert_to_float8_training(m, config=config)\n\
         h.requires_grad_(True)\n\
         loss = torch.nn.functional.cross_entropy(m(h), t, ignore_index=-100, reduction='sum')\n\
         (loss * {grad_scale:?}).backward()\n\
         out = torch.cat([loss.detach().reshape(1), h.grad.flatten(), m[0].weight.grad.flatten()])\n\
         open(sys.argv[4], 'wb').write(out.numpy().tobytes())\n"
    );
    let all = run_torch(py, &script, [h, w, targets]);
    let (loss, rest) = all.split_at(1);
    let (dh, dw) = rest.split_at(m * k);
    [loss.to_vec(), dh.to_vec(), dw.to_vec()]
}

#[test]
fn a_float8_output_head_matches_torchao_and_pytorchs_cross_entropy() {
    let Some(py) = common::torchao_python() else {
        return;
    };
    let Dims { m, k, n } = HEAD_DIMS;
    // Logits of a few units, so the softmax is neither flat nor one-hot.
    let h: Vec<f32> = values(m * k, 7).iter().map(|v| v * 0.004).collect();
    let w: Vec<f32> = values(n * k, 8).iter().map(|v| v * 0.004).collect();
    let targets: Vec<u32> = (0..m)
        .map(|r| match r % 5 {
            4 => IGNORE_INDEX,
            _ => (r * 37 % n) as u32,
        })
        .collect();
    let as_torch: Vec<f32> = targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { -100.0 } else { t as f32 })
        .collect();
    let grad_scale = 1.0 / 26.0;
    for (recipe, name) in [
        (Float8Recipe::Tensorwise, "tensorwise"),
        (Float8Recipe::Rowwise, "rowwise"),
        (Float8Recipe::RowwiseWithGwHp, "rowwise_with_gw_hp"),
    ] {
        let mine = titan_head(recipe, (&h, &w, &targets), grad_scale);
        let theirs = torchao_head(&py, name, (&h, &w, &as_torch), grad_scale);
        assert_each_close(name, ["loss", "dH", "dW"], &mine, &theirs, 2e-6);
    }
    // The casts are in the numbers: the high-precision head's loss is another.
    let be = CpuBackend::default();
    let mut logits = vec![0f32; m * n];
    Linear::new(k, n).forward(&be, &mut logits, &h, &w, m);
    let plain = be.cross_entropy_of_logits(&mut logits, &targets, n, 1.0, false);
    let float8 = titan_head(Float8Recipe::Rowwise, (&h, &w, &targets), grad_scale)[0][0];
    assert!(
        (plain.sum as f32 - float8).abs() > 1e-4,
        "{} / {float8}",
        plain.sum
    );
}

/// x rounded to bf16 (nearest even): what torchao's bf16 outputs and output gradients hold.
fn bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

#[test]
fn mxfp8_experts_match_torchaos_emulated_grouped_gemm() {
    // Two experts of 40 and 50 routed rows (each ends in a partial block of rows, which torchao
    // pads with zero rows to 32, as TorchTitan does), RCEIL scales. torchao's emulated grouped
    // GEMM dequantises into bf16 (exactly: e4m3 values times powers of two) and writes bf16, so
    // titan's f32 products rounded to bf16 must be torchao's, but for the rare element whose f32
    // sums (in another order) straddle a bf16 rounding boundary: one bf16 ulp.
    let Some(py) = common::torchao_python() else {
        return;
    };
    let (k, n, groups) = (64, 96, [40usize, 50]);
    let m: usize = groups.iter().sum();
    let (x, w) = (values(m * k, 7), values(groups.len() * n * k, 8));
    // The output gradient reaches torchao in bf16 (its output's dtype): both sides get those.
    let g: Vec<f32> = values(m * n, 9).into_iter().map(bf16).collect();
    let recipe = Float8Recipe::Mxfp8(titan::backend::float8::MxScaling::Rceil);
    let casts = Float8Casts {
        groups: &OnOneRank,
        partial_row_blocks: true,
    };
    let mut mine = [Vec::new(), Vec::new(), Vec::new()];
    let mut start = 0;
    for (e, &rows) in groups.iter().enumerate() {
        let (xe, ge) = (
            &x[start * k..(start + rows) * k],
            &g[start * n..(start + rows) * n],
        );
        let we = &w[e * n * k..(e + 1) * n * k];
        let dims = Dims { m: rows, k, n };
        let [y, dx, dw] = products_cast(&casts, recipe, dims, (xe, we, ge));
        mine[0].extend(y);
        mine[1].extend(dx);
        mine[2].extend(dw);
        start += rows;
    }
    let theirs = torchao_grouped(&py, (m, k, n), &groups, (&x, &w, &g));
    for ((product, a), b) in ["Y", "dX", "dW"].iter().zip(&mine).zip(&theirs) {
        assert_eq!(a.len(), b.len(), "{product}");
        let ulps: Vec<u32> = a
            .iter()
            .zip(b)
            // In bf16 ulps: the top 16 bits of an f32 holding a bf16 value.
            .map(|(a, b)| {
                ((bf16(*a).to_bits() >> 16) as i64 - (b.to_bits() >> 16) as i64).unsigned_abs()
                    as u32
            })
            .collect();
        let exact = ulps.iter().filter(|&&u| u == 0).count();
        let worst = ulps.iter().max().copied().unwrap_or(0);
        assert!(
            worst <= 1 && exact * 100 >= 95 * a.len(),
            "{product}: {exact} of {} equal in bf16, worst {worst} bf16 ulps",
            a.len()
        );
    }
}

/// torchao's emulated MXFP8 grouped GEMM (`_to_mxfp8_then_scaled_grouped_mm`, RCEIL, token groups
/// padded to 32) on `x` `[m, k]`, experts `w` `[E, n, k]` and output gradient `g` `[m, n]`: `Y`,
/// `dX` and each expert's `dW` `[n, k]`, as f32 (holding bf16 values).
fn torchao_grouped(
    py: &str,
    (m, k, n): (usize, usize, usize),
    groups: &[usize],
    (x, w, g): (&[f32], &[f32], &[f32]),
) -> [Vec<f32>; 3] {
    let ends: Vec<String> = groups
        .iter()
        .scan(0, |end, r| {
            *end += r;
            Some(end.to_string())
        })
        .collect();
    let e = groups.len();
    let script = format!(
        "import sys, warnings, torch\n\
         warnings.filterwarnings('ignore')\n\
         from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm\n\
         from torchao.prototype.mx_formats.config import ScaleCalculationMode\n\
         from torchao.quantization.quantize_.common import KernelPreference\n\
         def load(p, *shape):\n    return torch.frombuffer(bytearray(open(p, 'rb').read()), dtype=torch.float32).reshape(*shape).clone()\n\
         x, w, g = load(sys.argv[1], {m}, {k}), load(sys.argv[2], {e}, {n}, {k}), load(sys.argv[3], {m}, {n})\n\
         x.requires_grad_(True)\n\
         b_t = w.transpose(-2, -1).detach().requires_grad_(True)\n\
         offs = torch.tensor([{ends}], dtype=torch.int32)\n\
         y = _to_mxfp8_then_scaled_grouped_mm(x, b_t, offs, out_dtype=torch.bfloat16, kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=ScaleCalculationMode.RCEIL, pad_token_groups_for_grouped_mm=True)\n\
         y.backward(g.to(torch.bfloat16))\n\
         dw = b_t.grad.transpose(-2, -1)\n\
         out = torch.cat([y.detach().float().flatten(), x.grad.float().flatten(), dw.float().flatten()])\n\
         open(sys.argv[4], 'wb').write(out.numpy().tobytes())\n",
        ends = ends.join(", ")
    );
    let all = run_torch(py, &script, [x, w, g]);
    let (y, rest) = all.split_at(m * n);
    let (dx, dw) = rest.split_at(m * k);
    [y.to_vec(), dx.to_vec(), dw.to_vec()]
}
