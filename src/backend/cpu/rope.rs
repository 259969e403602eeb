//! Rotary position embedding on interleaved pairs `(x[2i], x[2i+1])` (Meta/TorchTitan layout),
//! with a frequency scaling when configured (`rope_scaling`: Llama 3.1's, YaRN's).

use rayon::prelude::*;

pub use super::rope_scaling::{inverse_frequencies, Llama3Scaling, RopeScaling, YarnScaling};
use crate::backend::RopeShape;

/// `(cos, sin)` tables of shape `[max_seq, head_dim/2]`, times the scaling's attention factor
/// (YaRN's; transformers multiplies its cos and sin by it too).
pub fn rope_tables(
    head_dim: usize,
    max_seq: usize,
    theta: f64,
    scaling: Option<RopeScaling>,
) -> (Vec<f32>, Vec<f32>) {
    let inv = inverse_frequencies(head_dim, theta, scaling);
    let magnitude = scaling.map_or(1.0, |s| s.attention_factor());
    let half = head_dim / 2;
    let mut cos = vec![0.0f32; max_seq * half];
    let mut sin = vec![0.0f32; max_seq * half];
    for p in 0..max_seq {
        for (i, f) in inv.iter().enumerate() {
            let angle = p as f64 * f;
            cos[p * half + i] = (angle.cos() * magnitude) as f32;
            sin[p * half + i] = (angle.sin() * magnitude) as f32;
        }
    }
    (cos, sin)
}

/// Rotates every pair of `x` (`shape`) by its position's angle times `direction` (1: forward,
/// -1: backward).
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], shape: RopeShape, direction: f32) {
    let RopeShape {
        seq,
        heads,
        head_dim,
        pos_offset,
        per_token,
        ..
    } = shape;
    assert!(
        shape.table_rows() * head_dim / 2 <= cos.len().min(sin.len()),
        "rope: table row {} beyond the table",
        shape.table_rows()
    );
    let half = head_dim / 2;
    let row = heads * head_dim;
    x[..shape.values()]
        .par_chunks_mut(row)
        .enumerate()
        .for_each(|(t, xr)| {
            let p = if per_token { t } else { pos_offset + t % seq };
            let c = &cos[p * half..(p + 1) * half];
            let s = &sin[p * half..(p + 1) * half];
            for head in xr.chunks_exact_mut(head_dim) {
                for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                    let (x0, x1) = (pair[0], pair[1]);
                    let si = direction * s[i];
                    pair[0] = x0 * c[i] - x1 * si;
                    pair[1] = x0 * si + x1 * c[i];
                }
            }
        });
}

pub fn rope_forward(x: &mut [f32], cos: &[f32], sin: &[f32], shape: RopeShape) {
    rotate(x, cos, sin, shape, 1.0);
}

/// The rotation is orthogonal, so its backward is the rotation by the opposite angle.
pub fn rope_backward(dx: &mut [f32], cos: &[f32], sin: &[f32], shape: RopeShape) {
    rotate(dx, cos, sin, shape, -1.0);
}
