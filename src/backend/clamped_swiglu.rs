//! gpt-oss's clamped SwiGLU, `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with `g = min(gate,
//! limit)` (transformers' `GptOssExperts._apply_gate`), forward and backward: the math of one pair
//! (`clamped`), the CPU's threaded passes over slices, and the host defaults of
//! `Backend::clamped_swiglu_forward` / `clamped_swiglu_backward` (CUDA's kernels in
//! `kernels/elementwise.cu`).

use rayon::prelude::*;

use super::Backend;

/// The clamp's two constants: `(alpha, limit)`.
pub type Clamp = (f32, f32);

/// The clamped SwiGLU of one pair and its two partial derivatives. A clamp passes the gradient
/// where its input is within the bounds, bounds included (PyTorch's `clamp`).
pub fn clamped(alpha: f32, limit: f32, gate: f32, up: f32) -> (f32, f32, f32) {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    let s = 1.0 / (1.0 + (-alpha * g).exp());
    let glu = g * s;
    let out = (u + 1.0) * glu;
    let dg = match gate <= limit {
        true => (u + 1.0) * (s + g * alpha * s * (1.0 - s)),
        false => 0.0,
    };
    let du = match (-limit..=limit).contains(&up) {
        true => glu,
        false => 0.0,
    };
    (out, dg, du)
}

/// `act = f(gate, up)` elementwise.
pub fn forward(act: &mut [f32], gate: &[f32], up: &[f32], (alpha, limit): Clamp) {
    act.par_iter_mut()
        .zip(gate.par_iter().zip(up))
        .for_each(|(a, (&g, &u))| *a = clamped(alpha, limit, g, u).0);
}

/// `dgate`, `dup` from `dact` and the forward's `gate`, `up`.
pub fn backward(
    (dgate, dup): (&mut [f32], &mut [f32]),
    dact: &[f32],
    (gate, up): (&[f32], &[f32]),
    (alpha, limit): Clamp,
) {
    dgate
        .par_iter_mut()
        .zip(dup.par_iter_mut())
        .zip(dact.par_iter().zip(gate.par_iter().zip(up)))
        .for_each(|((dg, du), (&d, (&g, &u)))| {
            let (_, pg, pu) = clamped(alpha, limit, g, u);
            (*dg, *du) = (d * pg, d * pu);
        });
}

pub(super) fn host_forward<B: Backend + ?Sized>(
    be: &B,
    act: &mut B::Buf,
    (gate, up): (&B::Buf, &B::Buf),
    clamp: Clamp,
) {
    let (g, u) = (be.download(gate), be.download(up));
    let mut out = vec![0.0; g.len()];
    forward(&mut out, &g, &u, clamp);
    *act = be.upload_owned(out);
}

pub(super) fn host_backward<B: Backend + ?Sized>(
    be: &B,
    (dgate, dup): (&mut B::Buf, &mut B::Buf),
    dact: &B::Buf,
    (gate, up): (&B::Buf, &B::Buf),
    clamp: Clamp,
) {
    let (g, u, d) = (be.download(gate), be.download(up), be.download(dact));
    let (mut dg, mut du) = (vec![0.0; g.len()], vec![0.0; g.len()]);
    backward((&mut dg, &mut du), &d, (&g, &u), clamp);
    *dgate = be.upload_owned(dg);
    *dup = be.upload_owned(du);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clamped_swiglu_matches_its_definition_and_finite_differences() {
        let (alpha, limit) = (1.702f32, 7.0f32);
        let f = |g: f64, u: f64| {
            let g = g.min(limit as f64);
            let u = u.clamp(-(limit as f64), limit as f64);
            (u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp())
        };
        for (g, u) in [
            (0.3, -0.7),
            (-2.5, 1.2),
            (8.0, 0.5),
            (1.0, 9.0),
            (-3.0, -8.0),
        ] {
            let (out, dg, du) = clamped(alpha, limit, g as f32, u as f32);
            assert!((out as f64 - f(g, u)).abs() < 1e-5, "{g} {u}");
            let eps = 1e-4;
            let ng = (f(g + eps, u) - f(g - eps, u)) / (2.0 * eps);
            let nu = (f(g, u + eps) - f(g, u - eps)) / (2.0 * eps);
            assert!(
                (dg as f64 - ng).abs() < 1e-3,
                "dgate at {g} {u}: {dg} vs {ng}"
            );
            assert!(
                (du as f64 - nu).abs() < 1e-3,
                "dup at {g} {u}: {du} vs {nu}"
            );
        }
    }
}
