//! The model's head: the final RMSNorm, the output projection `logits = h · Wᵀ` and the
//! cross-entropy, without gradients (validation) and with them (training).
//!
//! In high precision the projection is fused with the loss over row chunks
//! (`TensorParallelOps::cross_entropy`), so the `[tokens, vocab]` logits never exist whole. A head
//! converted to float8 (`output` left out of `filter_fqns`) cannot be chunked that way: its casts
//! take amaxes over every token row (the logit gradient's columns for `dW`; the whole tensor for
//! tensorwise). It is then the column-parallel linear every block projection is
//! (`SequenceParallel::column_forward` and `column_backward`, with their casts and their amaxes
//! agreed over the tensor- and context-parallel groups), and the loss runs on its whole logits
//! (`TensorParallelOps::loss_of_logits`, over vocabulary shards with loss parallelism): the
//! memory of the full logits and their casts, as in TorchTitan, whose float8 head materialises
//! its logits too.

use anyhow::Result;

use super::run::frozen_or;
use super::{Decoder, Workspace};
use crate::backend::{Backend, LossSum};
use crate::model::linear::Linear;
use crate::model::parallel_linear::{Projection, ProjectionGrad};
use crate::model::params::ParamSet;

impl<B: Backend> Decoder<B> {
    /// The output projection in this rank's shapes (its vocabulary rows), in float8 where the
    /// conversion chose it.
    fn head_linear(&self) -> Linear {
        Linear::new(self.local.dim, self.local.vocab)
            .in_float8(self.float8.head())
            .weight_gathered_in_float8(self.float8.head_weight_gathered(&self.ids))
    }

    /// Final norm and cross-entropy without gradients (after the last block's forward): this
    /// rank's sum of token losses and their count.
    pub fn head_loss(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
    ) -> Result<LossSum> {
        let _span = crate::trace::span("model", "norm, output and loss");
        self.final_norm(be, params, ws);
        if self.head_linear().float8.is_some() {
            return self.float8_head(be, params, None, ws, 0.0);
        }
        let h = self.column_parallel_input(be, &ws.normed_final, &mut ws.normed_final_full)?;
        let w = &params.bufs[self.ids.output];
        self.tp
            .cross_entropy(be, h, w, &ws.targets, &self.local, 0.0, None)
    }

    fn final_norm(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>) {
        let a = &self.args;
        be.rmsnorm_forward(
            &mut ws.normed_final,
            &mut ws.rstd_final,
            ws.resid.read(be, a.n_layers),
            &params.bufs[self.ids.norm],
            a.dim,
            a.norm_eps,
        );
    }

    /// Final norm, output projection and cross-entropy, and their backward: leaves
    /// ∂L/∂(last block output) in the workspace for `block_backward`.
    pub fn head_forward_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        grad_scale: f32,
    ) -> Result<LossSum> {
        let _span = crate::trace::span("model", "norm, output and loss, forward and backward");
        self.final_norm(be, params, ws);
        let loss = match self.head_linear().float8 {
            Some(_) => self.float8_head(be, params, Some(grads), ws, grad_scale)?,
            None => self.fused_head(be, params, grads, ws, grad_scale)?,
        };
        let a = &self.args;
        be.fill(&mut ws.dx, 0.0);
        let mut spare = None;
        be.rmsnorm_backward(
            &mut ws.dx,
            frozen_or(be, &mut grads.bufs[self.ids.norm], &mut spare, a.dim),
            &ws.dnormed,
            ws.resid.read(be, a.n_layers),
            &params.bufs[self.ids.norm],
            &ws.rstd_final,
            a.dim,
        );
        Ok(loss)
    }

    /// The output projection fused with the cross-entropy, over row chunks, and its backward
    /// into `ws.dnormed` and the output weight's gradient.
    fn fused_head(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        grad_scale: f32,
    ) -> Result<LossSum> {
        let h = self.column_parallel_input(be, &ws.normed_final, &mut ws.normed_final_full)?;
        let dh = self.input_grad_target(&mut ws.dnormed, &mut ws.full);
        be.fill(dh, 0.0);
        let loss = self.tp.cross_entropy(
            be,
            h,
            &params.bufs[self.ids.output],
            &ws.targets,
            &self.local,
            grad_scale,
            Some((dh, &mut grads.bufs[self.ids.output])),
        )?;
        self.scatter_input_grad(be, &ws.full, &mut ws.dnormed)?;
        Ok(loss)
    }

    /// A float8 head: the whole logits through the column-parallel float8 linear, the loss over
    /// them, and with `grads` the linear's backward into `ws.dnormed` and the output weight's
    /// gradient.
    fn float8_head(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: Option<&mut ParamSet<B>>,
        ws: &mut Workspace<B>,
        grad_scale: f32,
    ) -> Result<LossSum> {
        let linear = self.head_linear();
        let tokens = ws.batch * ws.seq;
        let sp = self.sequence_parallel(tokens);
        let (id, dim) = (self.ids.output, self.local.dim);
        let w = &params.bufs[id];
        let mut logits = be.uninit(tokens * linear.d_out);
        let mut head = [Projection::new(linear, w, &mut logits)];
        sp.column_forward(
            be,
            &ws.normed_final,
            &mut ws.normed_final_full,
            dim,
            &mut head,
        )?;
        let grad = (grad_scale, grads.is_some());
        let loss = self
            .tp
            .loss_of_logits(be, &mut logits, &ws.targets, &self.local, grad)?;
        let Some(grads) = grads else {
            return Ok(loss);
        };
        let x = self.gathered(&ws.normed_final, &ws.normed_final_full);
        let mut head = [ProjectionGrad::new(
            linear,
            &logits,
            w,
            &mut grads.bufs[id],
            id,
        )];
        sp.column_backward(be, &mut head, x, &mut ws.full, &mut ws.dnormed)?;
        Ok(loss)
    }
}
