//! titan's float8 linears against torchao's own `Float8Linear` (`emulate=True`, on the CPU), and
//! its MXFP8 linears against torchao's MXFP8 training linear (`KernelPreference.EMULATED`, FLOOR
//! and RCEIL scales): for each recipe, the forward `Y = X·Wᵀ` and both backward products `dX`, `dW` of one linear on the
//! same inputs. The casts are exact arithmetic on both sides, so the products differ only by the
//! order of the f32 sums; a scale or rounding off anywhere would move whole rows by far more.

mod common;

use std::process::Command;

use titan::backend::cpu::CpuBackend;
use titan::backend::float8::{Float8Recipe, LinearGemm};
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
    Dims { m, k, n }: Dims,
    (x, w, g): (&[f32], &[f32], &[f32]),
) -> [Vec<f32>; 3] {
    let be = CpuBackend::default();
    let linear = Linear::new(k, n).in_float8(Some(recipe));
    let casts = Float8Casts {
        groups: &OnOneRank,
        partial_row_blocks: false,
    };
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
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, v: &[f32]| {
        let p = dir.path().join(name);
        std::fs::write(
            &p,
            v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>(),
        )
        .unwrap();
        p
    };
    let (xp, wp, gp) = (write("x", x), write("w", w), write("g", g));
    let out = dir.path().join("out");
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
    let o = Command::new(py)
        .args(["-c", &script])
        .args([&xp, &wp, &gp, &out])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let all: Vec<f32> = std::fs::read(&out)
        .unwrap()
        .chunks(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let (y, rest) = all.split_at(m * n);
    let (dx, dw) = rest.split_at(m * k);
    [y.to_vec(), dx.to_vec(), dw.to_vec()]
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
    for ((product, a), b) in ["Y", "dX", "dW"].iter().zip(mine).zip(theirs) {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-6 * scale,
            "{what} {product}: titan and torchao differ by {worst:e} (largest value {scale:e})"
        );
    }
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
