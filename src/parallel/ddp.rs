//! DDP: every data-parallel rank holds the whole model; after the backward the gradients are summed
//! across ranks (the loss is already normalised by the global number of targets, so the sum is the
//! gradient of the global mean loss), after which every rank takes the same optimizer step.
//!
//! Not yet: bucketing and overlapping the all-reduce with the backward (today it runs after it).

use anyhow::Result;

use crate::backend::Backend;
use crate::comm::group::{ProcessGroup, ReduceOp};
use crate::model::ParamSet;

pub fn all_reduce_gradients<B: Backend>(
    be: &B,
    group: &dyn ProcessGroup,
    grads: &mut ParamSet<B>,
) -> Result<()> {
    for g in &mut grads.bufs {
        let mut host = be.download(g);
        group.all_reduce(&mut host, ReduceOp::Sum)?;
        *g = be.upload(&host);
    }
    Ok(())
}
