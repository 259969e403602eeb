//! Fused AdamW (decoupled weight decay, bias-corrected moments), one pass over each parameter;
//! with `WeightDecay::L2`, Adam (the decay added to the gradient instead).

use rayon::prelude::*;

use super::rows::adamw_chunk;
use crate::backend::AdamWStep;

const CHUNK: usize = 1 << 14;

pub fn adamw_step(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    hp: AdamWStep,
) {
    let (step_size, bias2_sqrt, decay, l2) = hp.host_constants();
    let (b1, b2, eps) = (hp.beta1, hp.beta2, hp.eps);
    param
        .par_chunks_mut(CHUNK)
        .zip(exp_avg.par_chunks_mut(CHUNK))
        .zip(exp_avg_sq.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, ((p, m), v))| {
            let g = &grad[c * CHUNK..c * CHUNK + p.len()];
            adamw_chunk(
                p,
                g,
                m,
                v,
                b1,
                b2,
                eps,
                step_size,
                bias2_sqrt,
                (decay, l2),
                hp.grad_scale,
            );
        });
}
