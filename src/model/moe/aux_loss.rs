//! The sequence-wise auxiliary load-balancing loss of a mixture-of-experts block (DeepSeek-V3's
//! complementary balance loss; `[model] router_aux_loss_coef`, the name Hugging Face configs use).
//!
//! For each sequence `b` of `T` tokens and each block:
//!
//! `L_b = Σ_e f_e · P_e`, with `f_e = E / (k·T) · #{t : e ∈ top_k(t)}` and `P_e = (1/T) Σ_t s'_te`,
//!
//! `s'` being the router's scores normalised to sum to one per token (softmax scores already do;
//! sigmoid scores are divided by their sum). A perfectly balanced router has `L_b = 1`. The
//! step's auxiliary loss is `coef · Σ_blocks Σ_b L_b / (sequences in the step)`: per sequence and
//! per step, so it does not depend on how the batch is split over ranks, micro-batches or
//! pipeline stages. `f` is a count (no gradient); the gradient reaches the logits through `P`:
//! `∂/∂s'_te = coef · f_e / (T · sequences)`, added to the scores' gradient in
//! `router::route_backward`. The arithmetic is the backend's (`backend::moe_aux`,
//! `Backend::moe_aux_figures`, `moe_aux_balance`, `moe_aux_score_grads`), so the figures stay where
//! the routing is: a block's forward and backward copy nothing for them.
//!
//! A sequence whose tokens are spread over ranks (context parallel, sequence parallel under TP)
//! has its counts and score sums summed over those ranks first (`SequenceRows::sum`), so every rank
//! sees the whole sequence's `f` and `P` (over TP on the backend's buffers; over CP through the
//! host).

use anyhow::Result;

pub use crate::backend::moe_aux::SequenceSpan;
use crate::backend::routing::{RoutedTokens, RouterArgs};
use crate::backend::Backend;

/// Which sequence each of a rank's token rows belongs to, and how to sum per-sequence figures over
/// the ranks holding the other rows of the same sequences.
pub struct SequenceRows<'a, B: Backend> {
    pub span: SequenceSpan,
    /// Sums a buffer elementwise over the ranks sharing these sequences (in place).
    pub sum: &'a (dyn Fn(&mut B::Buf) -> Result<()> + 'a),
}

/// A block's per-sequence figures, from its forward to its backward, on the backend.
pub struct AuxStats<B: Backend> {
    /// `[counts | normalised score sums | tokens]`, summed over the ranks sharing the sequences.
    figures: B::Buf,
    /// `[f | L_b]`.
    balance: B::Buf,
    span: SequenceSpan,
    /// This rank's rows.
    tokens: usize,
    experts: usize,
}

/// `f`, `P` and `L_b` of every sequence of `rows` (collective over the ranks sharing them), from
/// the routing's chosen experts and scores.
pub fn forward<B: Backend>(
    be: &B,
    args: &RouterArgs,
    routed: &RoutedTokens<B::Buf>,
    rows: SequenceRows<B>,
) -> Result<AuxStats<B>> {
    let span = rows.span;
    let mut figures = be.moe_aux_figures((&routed.experts, &routed.scores), args, span);
    (rows.sum)(&mut figures)?;
    let balance = be.moe_aux_balance(&figures, args, span.sequences);
    Ok(AuxStats {
        figures,
        balance,
        span,
        tokens: be.len(&routed.scores) / args.num_experts.max(1),
        experts: args.num_experts,
    })
}

impl<B: Backend> AuxStats<B> {
    /// The gradient of `scale · Σ_b L_b` with respect to the normalised scores of each local
    /// token (`[tokens, E]`).
    pub fn score_grads(&self, be: &B, args: &RouterArgs, scale: f32) -> B::Buf {
        let span_tokens = (self.span, self.tokens);
        be.moe_aux_score_grads((&self.balance, &self.figures), args, span_tokens, scale)
    }

    /// Where each sequence's `L_b` lies: `(buffer, offset, sequences)`.
    pub fn values(&self) -> (&B::Buf, usize, usize) {
        let n = self.span.sequences;
        (&self.balance, n * self.experts, n)
    }

    /// `values`, owning the buffer (the figures go).
    pub fn into_values(self) -> (B::Buf, usize, usize) {
        let n = self.span.sequences;
        (self.balance, n * self.experts, n)
    }
}
