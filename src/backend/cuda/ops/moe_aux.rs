//! The sequence-wise auxiliary balance loss on the GPU (`Backend::moe_aux_figures`,
//! `moe_aux_balance`, `moe_aux_score_grads`; kernels in `kernels/moe_aux.cu`, definitions in
//! `backend::moe_aux`): the per-sequence figures, the balance and the scores' gradient stay on
//! the device with the routing they are taken from.

use cudarc::driver::PushKernelArg;

use super::routing::token_config;
use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::CudaBackend;
use crate::backend::moe_aux::SequenceSpan;
use crate::backend::routing::{RouterArgs, ScoreFunc};
use crate::backend::Backend;

/// `(tokens, first, seq)` as the kernels take them, after checking that the rows fall within
/// the span's sequences.
fn span_args(span: SequenceSpan, tokens: usize) -> (i64, i64, i64) {
    span.check(tokens);
    (tokens as i64, span.first as i64, span.seq.max(1) as i64)
}

impl CudaBackend {
    pub(super) fn moe_aux_figures_untimed(
        &self,
        (experts, scores): (&Buf, &Buf),
        args: &RouterArgs,
        span: SequenceSpan,
    ) -> Buf {
        let (e, k, n) = (args.num_experts, args.top_k, span.sequences);
        let tokens = scores.len() / e.max(1);
        check_len("moe_aux_figures", "experts", experts.len(), tokens * k);
        let (t, first, seq) = span_args(span, tokens);
        let mut figures = self.zeros(2 * n * e + n);
        if n * e > 0 {
            let sigmoid = (args.score_func == ScoreFunc::Sigmoid) as i32;
            let (n_arg, e_arg, k_arg) = (n as i32, e as i32, k as i32);
            launch!(
                self,
                "moe_aux_figures",
                token_config(n * e),
                &mut figures,
                experts,
                scores,
                &t,
                &first,
                &seq,
                &n_arg,
                &e_arg,
                &k_arg,
                &sigmoid
            );
        }
        figures
    }

    pub(super) fn moe_aux_balance_untimed(
        &self,
        figures: &Buf,
        args: &RouterArgs,
        sequences: usize,
    ) -> Buf {
        let (e, k, n) = (args.num_experts, args.top_k, sequences);
        check_len("moe_aux_balance", "figures", figures.len(), 2 * n * e + n);
        let mut balance = self.uninit(n * e + n);
        if n > 0 {
            let (n_arg, e_arg, k_arg) = (n as i32, e as i32, k as i32);
            launch!(
                self,
                "moe_aux_balance",
                token_config(n),
                &mut balance,
                figures,
                &n_arg,
                &e_arg,
                &k_arg
            );
        }
        balance
    }

    pub(super) fn moe_aux_score_grads_untimed(
        &self,
        (balance, figures): (&Buf, &Buf),
        args: &RouterArgs,
        (span, tokens): (SequenceSpan, usize),
        scale: f32,
    ) -> Buf {
        let (e, n) = (args.num_experts, span.sequences);
        check_len("moe_aux_score_grads", "balance", balance.len(), n * e + n);
        check_len(
            "moe_aux_score_grads",
            "figures",
            figures.len(),
            2 * n * e + n,
        );
        let (t, first, seq) = span_args(span, tokens);
        let mut grads = self.uninit(tokens * e);
        if tokens * e > 0 {
            let (n_arg, e_arg) = (n as i32, e as i32);
            launch!(
                self,
                "moe_aux_score_grads",
                token_config(tokens * e),
                &mut grads,
                balance,
                figures,
                &t,
                &first,
                &seq,
                &n_arg,
                &e_arg,
                &scale
            );
        }
        grads
    }
}
