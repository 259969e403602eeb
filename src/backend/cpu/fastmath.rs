//! A branch-free `exp` that the compiler vectorises: attention and the softmax call it billions of
//! times per step, and libm's scalar `expf` would dominate their cost.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` with relative error below 2e-7 for `x` in [-87, 88]; smaller inputs give ~0, larger +inf-ish.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor polynomial of e^r on |r| <= ln2/2 (Horner form).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n built from bits: adding 1.5·2^23 puts the integer n in the low mantissa bits (no
    // float→int conversion, which would keep the loop from vectorising).
    let n_bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// Lanes of the explicit accumulators below: wide enough for one AVX-512 register (two AVX2 ones),
/// so that reductions vectorise without relying on floating-point reassociation.
const LANES: usize = 16;

#[inline(always)]
fn fold_lanes(acc: [f32; LANES]) -> f32 {
    let mut s = 0.0;
    for a in acc {
        s += a;
    }
    s
}

/// `Σ a[i]·b[i]` with a fixed summation order (independent of threads and call site).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    fold_lanes(acc)
}

/// `Σ a[i]·b[i]·c[i]` with a fixed summation order.
#[inline(always)]
pub fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let mut acc = [0.0f32; LANES];
    let full = n / LANES * LANES;
    for i in (0..full).step_by(LANES) {
        let (x, y, z) = (&a[i..i + LANES], &b[i..i + LANES], &c[i..i + LANES]);
        for l in 0..LANES {
            acc[l] += x[l] * y[l] * z[l];
        }
    }
    for i in full..n {
        acc[i - full] += a[i] * b[i] * c[i];
    }
    fold_lanes(acc)
}

#[inline(always)]
pub fn sum(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut c = a.chunks_exact(LANES);
    for x in &mut c {
        for l in 0..LANES {
            acc[l] += x[l];
        }
    }
    for (l, x) in c.remainder().iter().enumerate() {
        acc[l] += x;
    }
    fold_lanes(acc)
}

#[inline(always)]
pub fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut c = a.chunks_exact(LANES);
    for x in &mut c {
        for l in 0..LANES {
            acc[l] = acc[l].max(x[l]);
        }
    }
    for (l, x) in c.remainder().iter().enumerate() {
        acc[l] = acc[l].max(*x);
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `y += alpha · x`.
#[inline(always)]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_std_exp() {
        let mut worst = 0.0f64;
        let mut x = -80.0f32;
        while x < 80.0 {
            let got = super::exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
    }
}
