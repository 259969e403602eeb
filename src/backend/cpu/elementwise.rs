//! SwiGLU, residual adds and scaling: memory-bound loops split into fixed chunks across threads.

use rayon::prelude::*;

use super::rows::{swiglu_backward_chunk, swiglu_forward_chunk};

const CHUNK: usize = 1 << 14;

pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK))
        .for_each(|((o, g), u)| swiglu_forward_chunk(o, g, u));
}

pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let r = c * CHUNK..c * CHUNK + dg.len();
            swiglu_backward_chunk(dg, du, &dout[r.clone()], &gate[r.clone()], &up[r]);
        });
}

pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .zip(b.par_chunks(CHUNK))
        .for_each(|((o, a), b)| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
}

pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    acc.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(a, x)| {
            for (a, x) in a.iter_mut().zip(x) {
                *a += x;
            }
        });
}

/// The bf16 bits of `v` rounded to nearest even (NaN stays a quiet NaN), as `half`'s conversion,
/// the CUDA kernel and PyTorch's `.to(bfloat16)` round: written without branches on the value so
/// the loops below vectorise (`half::bf16::from_f32` does not).
#[inline(always)]
fn bf16_bits(v: f32) -> u32 {
    let b = v.to_bits();
    let rounded = (b + 0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    if v.is_nan() {
        quiet_nan
    } else {
        rounded
    }
}

pub fn round_to_bf16(buf: &mut [f32]) {
    buf.par_chunks_mut(CHUNK).for_each(|b| {
        b.iter_mut()
            .for_each(|v| *v = f32::from_bits(bf16_bits(*v) << 16))
    });
}

/// `words[i]` = `src[2i]` and `src[2i + 1]` (0 past the end) rounded to bf16, low half first: the
/// layout of `tensor::pack_bf16_pairs`, written in place by the pool's threads.
pub fn pack_bf16_pairs(words: &mut [f32], src: &[f32]) {
    assert_eq!(
        words.len(),
        src.len().div_ceil(2),
        "pack_bf16_pairs: lengths"
    );
    let word = |lo: f32, hi: u32| f32::from_bits(bf16_bits(lo) | (hi << 16));
    words
        .par_chunks_mut(CHUNK / 2)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(w, s)| {
            let pairs = s.chunks_exact(2);
            let odd = pairs.remainder().first().copied();
            for (out, pair) in w.iter_mut().zip(pairs) {
                *out = word(pair[0], bf16_bits(pair[1]));
            }
            if let Some(last) = odd {
                w[s.len() / 2] = word(last, 0);
            }
        });
}

/// The values `pack_bf16_pairs` packed into `words`, widened to f32 (`out`'s length of them).
pub fn unpack_bf16_pairs(out: &mut [f32], words: &[f32]) {
    assert!(words.len() * 2 >= out.len(), "unpack_bf16_pairs: lengths");
    out.par_chunks_mut(CHUNK)
        .zip(words.par_chunks(CHUNK / 2))
        .for_each(|(o, w)| {
            let half = o.len() / 2;
            let mut pairs = o.chunks_exact_mut(2);
            for (pair, word) in (&mut pairs).zip(w) {
                let bits = word.to_bits();
                pair[0] = f32::from_bits(bits << 16);
                pair[1] = f32::from_bits(bits & 0xffff_0000);
            }
            if let [last] = pairs.into_remainder() {
                *last = f32::from_bits(w[half].to_bits() << 16);
            }
        });
}

pub fn scale(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(CHUNK)
        .for_each(|b| b.iter_mut().for_each(|v| *v *= factor));
}

/// Sum of squares in f64. The buffer is cut into `SUM_BLOCKS` fixed blocks whose partial sums land in a stack array, so
/// the order of additions never depends on the threads and nothing is allocated.
pub fn sum_squares(buf: &[f32]) -> f64 {
    const SUM_BLOCKS: usize = 64;
    let block = buf.len().div_ceil(SUM_BLOCKS).max(1);
    let mut partials = [0.0f64; SUM_BLOCKS];
    partials.par_iter_mut().enumerate().for_each(|(i, p)| {
        let lo = (i * block).min(buf.len());
        let hi = ((i + 1) * block).min(buf.len());
        *p = buf[lo..hi]
            .iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>();
    });
    partials.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threaded packing writes `tensor::pack_bf16_pairs`'s words bit for bit (odd lengths and
    /// lengths across chunk boundaries), and unpacking gives back each value rounded to bf16.
    #[test]
    fn bf16_pairs_pack_as_the_tensor_layout_and_unpack_to_the_rounded_values() {
        for n in [1, 7, CHUNK - 1, CHUNK, 3 * CHUNK + 5] {
            let src: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.37).sin() * 1e3 + 0.1)
                .collect();
            let mut words = vec![0.0; n.div_ceil(2)];
            pack_bf16_pairs(&mut words, &src);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&words),
                bits(&crate::tensor::pack_bf16_pairs(&src)),
                "{n}"
            );
            let mut back = vec![0.0; n];
            unpack_bf16_pairs(&mut back, &words);
            let mut rounded = src.clone();
            round_to_bf16(&mut rounded);
            assert_eq!(bits(&back), bits(&rounded), "{n}");
        }
    }

    /// The branch-free rounding gives `half`'s bits for every kind of value: ties (to even),
    /// values rounding up into the next binade and to infinity, infinities, NaNs (quieted),
    /// subnormals, zeros, and a sweep of bit patterns.
    #[test]
    fn bf16_rounding_matches_half_bit_for_bit() {
        let mut values = vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0x0000_0001),
            f32::from_bits(0x7fa0_0001), // a signalling NaN
        ];
        values.extend((0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))));
        let mut rounded = values.clone();
        round_to_bf16(&mut rounded);
        for (v, r) in values.iter().zip(&rounded) {
            let want = half::bf16::from_f32(*v).to_f32();
            assert_eq!(r.to_bits(), want.to_bits(), "{:#010x}", v.to_bits());
        }
    }
}
