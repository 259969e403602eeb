//! Float8 values as their 8-bit codes, four to a 32-bit word (the first value in the word's low
//! byte): what FSDP's float8 all-gather sends, a quarter of an fp32 shard's bytes. Words travel
//! as f32 bit patterns in the backends' buffers, as the bf16 pairs do; a last partial word is
//! padded with zero codes.

use super::kernels::quantize_with_scale;
use super::Fp8Format;

/// Values per word.
pub const CODES_PER_WORD: usize = 4;

/// `x` quantised to `format` with one `scale` (`kernels::quantize_with_scale`) as codes, four to
/// a word: `x.len().div_ceil(4)` words.
pub fn encode_words(x: &[f32], scale: f32, format: Fp8Format) -> Vec<f32> {
    let mut values = vec![0f32; x.len()];
    quantize_with_scale(&mut values, x, scale, format);
    values
        .chunks(CODES_PER_WORD)
        .map(|four| {
            let word = four.iter().enumerate().fold(0u32, |w, (k, &q)| {
                w | u32::from(code_of(format, q)) << (8 * k)
            });
            f32::from_bits(word)
        })
        .collect()
}

/// The fp8 values (held as f32) of the codes in `words`, four per word.
pub fn decode_words(words: &[f32], format: Fp8Format) -> Vec<f32> {
    decode_codes(words.iter().flat_map(|w| w.to_bits().to_le_bytes()), format)
}

/// The fp8 values (held as f32) of 8-bit `codes` (a safetensors E4M3 tensor's bytes, or the
/// all-gather's words'), through one 256-entry table.
pub fn decode_codes(codes: impl Iterator<Item = u8>, format: Fp8Format) -> Vec<f32> {
    let table: Vec<f32> = (0..=255u8).map(|c| format.decode(c)).collect();
    codes.map(|c| table[usize::from(c)]).collect()
}

/// The code of `q`, a value of `format` (or NaN): `Fp8Format::encode` in bit operations, for a
/// value already rounded.
fn code_of(format: Fp8Format, q: f32) -> u8 {
    let bits = q.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    if q.is_nan() {
        return sign | 0x7f;
    }
    let m = format.mantissa_bits();
    let min_exponent = format.min_normal_exponent();
    let a = q.abs();
    let magnitude = if a < (min_exponent as f32).exp2() {
        // A subnormal: a whole number of the smallest spacing, 2^(min_exponent − m).
        (a * ((m - min_exponent) as f32).exp2()) as u32
    } else {
        let exponent_field = ((bits >> 23) & 0xff) as i32 - 127 + format.bias();
        (exponent_field as u32) << m | (bits >> (23 - m)) & ((1 << m) - 1)
    };
    sign | magnitude as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    #[test]
    fn every_code_of_a_value_is_the_reference_encoding() {
        for format in FORMATS {
            for code in 0..=255u8 {
                let v = format.decode(code);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                assert_eq!(code_of(format, v), format.encode(v), "{format:?} {v}");
            }
        }
    }

    /// A weight FSDP gathered in float8 (codes times 1/scale), cast again tensorwise from its
    /// own amax (what a backend with float8 GEMMs does to get its codes): every code comes back,
    /// and every value within two f32 ulps of the gathered one (the scale may differ by one).
    #[test]
    fn a_weight_gathered_in_float8_cast_again_gives_back_its_codes() {
        use crate::backend::float8::{amax, scale_from_amax};
        let mut state = 12345u64;
        for trial in 0..200 {
            let n = 257;
            let w: Vec<f32> = (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    u * (trial as f32 * 0.37).exp2() * 1e-3
                })
                .collect();
            let format = Fp8Format::E4M3;
            let scale = scale_from_amax(amax(&w), format);
            let codes = encode_words(&w, scale, format);
            let gathered: Vec<f32> = decode_words(&codes, format)[..n]
                .iter()
                .map(|c| c * scale.recip())
                .collect();
            let again = scale_from_amax(amax(&gathered), format);
            assert_eq!(
                encode_words(&gathered, again, format),
                codes,
                "trial {trial}"
            );
            for (g, c) in gathered.iter().zip(decode_words(&codes, format)) {
                let recast = c * again.recip();
                assert!(
                    (recast - g).abs() <= 2.0 * g.abs() * f32::EPSILON,
                    "{recast} vs {g}"
                );
            }
        }
    }

    #[test]
    fn words_decode_to_the_quantised_values() {
        let x: Vec<f32> = (0..23)
            .map(|i| ((i as f32) * 0.37 - 4.0).powi(3) * 1e-2)
            .chain([f32::NAN, -0.0, 1e-9, -600.0, 600.0])
            .collect();
        for format in FORMATS {
            let scale = 7.3;
            let words = encode_words(&x, scale, format);
            assert_eq!(words.len(), x.len().div_ceil(CODES_PER_WORD));
            let values = decode_words(&words, format);
            for (i, &v) in x.iter().enumerate() {
                let want = format.quantize(v, scale);
                let got = values[i];
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{format:?} value {i} ({v}): {got} != {want}"
                );
            }
            // The padding of the last word is zeros.
            assert!(values[x.len()..].iter().all(|&v| v == 0.0));
        }
    }
}
