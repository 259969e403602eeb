//! One optimizer step, the same for every layout: the step's targets counted over the ranks that
//! split the batch, every micro-batch's forward and backward (the layout runs its collectives),
//! the global gradient norm, clipping folded into the optimizer.

use anyhow::Result;

use super::optimizer::{clip_factor, Optimizer};
use super::replicas::ReplicaSync;
use crate::backend::Backend;
use crate::memory_timeline;
use crate::parallel::layout::RankLayout;

/// One step's outcome: its loss and gradient norm before clipping, and whether the update was
/// applied (not when either is not finite, nor when a replica group was lost while averaging).
pub struct StepOutcome {
    pub loss: f64,
    pub norm: f64,
    pub committed: bool,
    /// Seconds the optimizer step took (0 when no update was applied).
    pub optimizer_s: f64,
}

/// One step over `micro` batches (`[batch, seq+1]` each): gradients accumulate with the loss
/// normalised by the step's global number of targets, so micro-batches and data-parallel ranks
/// add up to one big batch; with replica groups (`replicas`) they are then averaged over the live
/// ones. When the loss or the norm is not finite the weights are left untouched.
#[allow(clippy::too_many_arguments)]
pub fn train_step<B: Backend>(
    be: &B,
    layout: &mut RankLayout<B>,
    opt: &mut Optimizer<B>,
    micro: &[Vec<u32>],
    lr: f64,
    step: u64,
    max_norm: f64,
    replicas: Option<&mut ReplicaSync>,
) -> Result<StepOutcome> {
    let _span = crate::trace::span_named("step", || format!("step {step}"));
    let seq = layout.seq();
    let counted: usize = micro
        .iter()
        .map(|m| layout.model.count_targets(m, seq))
        .sum();
    let targets = layout.sum_over_batch(counted as f64)?.round() as usize;
    let scale = 1.0 / targets.max(1) as f32;
    memory_timeline::mark(|| format!("step {step}: forward and backward start"));
    let loss_sum = layout.forward_backward(be, micro, scale)?;
    memory_timeline::mark(|| format!("step {step}: forward and backward done"));
    let loss = layout.sum_over_batch(loss_sum)? / targets.max(1) as f64;
    if let Some(r) = replicas {
        if !r.average(be, layout.state.grads_mut())? {
            return Ok(StepOutcome {
                loss,
                norm: f64::NAN,
                committed: false,
                optimizer_s: 0.0,
            });
        }
    }
    let norm = layout.grad_norm(be)?;
    let committed = loss.is_finite() && norm.is_finite();
    let mut optimizer_s = 0.0;
    if committed {
        let _span = crate::trace::span("optimizer", "optimizer step");
        let t0 = std::time::Instant::now();
        let (weights, grads) = layout.weights_and_grads();
        opt.step(be, weights, grads, lr, step, clip_factor(norm, max_norm))?;
        be.synchronize();
        optimizer_s = t0.elapsed().as_secs_f64();
        memory_timeline::mark(|| format!("step {step}: optimizer done"));
    }
    Ok(StepOutcome {
        loss,
        norm,
        committed,
        optimizer_s,
    })
}
