//! The sequence-wise auxiliary balance loss's arithmetic (the definition is in
//! `model::moe::aux_loss`): per sequence and expert, the count of choices and the sum of the
//! normalised scores over the sequence's rows (`figures`); from those summed over the ranks
//! holding the sequence, each `f_e` and `L_b` (`balance`); and the gradient that `L_b`'s `P_e`
//! sends each row's normalised scores (`score_grads`). The CPU's `Backend::moe_aux_*` ops and
//! every other backend's host defaults (download, this math, upload); CUDA runs kernels of the
//! same definitions (`kernels/moe_aux.cu`), each figure summed in row order as here.

use super::routing::{ids_of_bits, normalised, RouterArgs};
use super::Backend;

/// Which sequence each of a forward's local token rows belongs to: row `t` is in sequence
/// `(first + t) / seq` of `sequences` (a rank's sequence-parallel rows start at `first`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceSpan {
    pub first: usize,
    pub seq: usize,
    pub sequences: usize,
}

impl SequenceSpan {
    /// The sequence of local row `t`.
    pub fn of(&self, t: usize) -> usize {
        (self.first + t) / self.seq.max(1)
    }

    /// Panics unless `tokens` local rows all fall within the span's sequences (a caller's bug).
    pub fn check(&self, tokens: usize) {
        assert!(
            tokens == 0 || self.of(tokens - 1) < self.sequences,
            "moe_aux: {tokens} rows from row {} of sequences of {} overrun {} sequences",
            self.first,
            self.seq,
            self.sequences
        );
    }
}

/// `[counts (n·E) | normalised score sums (n·E) | tokens (n)]` of this rank's rows, from the
/// chosen `experts` (`[tokens · top_k]`) and the router's `scores` (`[tokens, E]`).
pub fn figures(
    args: &RouterArgs,
    (experts, scores): (&[u32], &[f32]),
    span: SequenceSpan,
) -> Vec<f32> {
    let (e, k, n) = (args.num_experts, args.top_k, span.sequences);
    let tokens = scores.len() / e.max(1);
    span.check(tokens);
    let mut figures = vec![0.0f32; 2 * n * e + n];
    for t in 0..tokens {
        let b = span.of(t);
        for &x in &experts[t * k..(t + 1) * k] {
            figures[b * e + x as usize] += 1.0;
        }
        let (s, _) = normalised(args, &scores[t * e..(t + 1) * e]);
        let sums = &mut figures[n * e + b * e..n * e + (b + 1) * e];
        for (sum, s) in sums.iter_mut().zip(s) {
            *sum += s;
        }
        figures[2 * n * e + b] += 1.0;
    }
    figures
}

/// `[f (n·E) | L_b (n)]` from the figures summed over the ranks sharing the sequences:
/// `f_e = E / (k·T) · count_e`, `L_b = Σ_e f_e · (sum_e / T)`.
pub fn balance(args: &RouterArgs, figures: &[f32], sequences: usize) -> Vec<f32> {
    let (e, k, n) = (args.num_experts, args.top_k, sequences);
    let (counts, rest) = figures.split_at(n * e);
    let (score_sums, tokens) = rest.split_at(n * e);
    let mut out = vec![0.0f32; n * e + n];
    let (f, values) = out.split_at_mut(n * e);
    for b in 0..n {
        let t = tokens[b].max(1.0);
        for x in 0..e {
            f[b * e + x] = e as f32 / (k as f32 * t) * counts[b * e + x];
            values[b] += f[b * e + x] * score_sums[b * e + x] / t;
        }
    }
    out
}

/// The gradient of `scale · Σ_b L_b` with respect to each local row's normalised scores
/// (`[tokens, E]`): `scale · f_e / T_b`, from `balance`'s `f` and `figures`' token counts.
pub fn score_grads(
    args: &RouterArgs,
    (balance, figures): (&[f32], &[f32]),
    (span, tokens): (SequenceSpan, usize),
    scale: f32,
) -> Vec<f32> {
    let (e, n) = (args.num_experts, span.sequences);
    span.check(tokens);
    let counted = &figures[2 * n * e..];
    let mut g = vec![0.0f32; tokens * e];
    for (t, row) in g.chunks_mut(e.max(1)).enumerate() {
        let b = span.of(t);
        let per_token = scale / counted[b].max(1.0);
        for (g, f) in row.iter_mut().zip(&balance[b * e..(b + 1) * e]) {
            *g = per_token * f;
        }
    }
    g
}

pub(super) fn host_figures<B: Backend + ?Sized>(
    be: &B,
    (experts, scores): (&B::Buf, &B::Buf),
    args: &RouterArgs,
    span: SequenceSpan,
) -> B::Buf {
    let experts = ids_of_bits(&be.download(experts));
    be.upload_owned(figures(args, (&experts, &be.download(scores)), span))
}

pub(super) fn host_balance<B: Backend + ?Sized>(
    be: &B,
    figures: &B::Buf,
    args: &RouterArgs,
    sequences: usize,
) -> B::Buf {
    be.upload_owned(balance(args, &be.download(figures), sequences))
}

pub(super) fn host_score_grads<B: Backend + ?Sized>(
    be: &B,
    (bal, figs): (&B::Buf, &B::Buf),
    args: &RouterArgs,
    span_tokens: (SequenceSpan, usize),
    scale: f32,
) -> B::Buf {
    let (bal, figs) = (be.download(bal), be.download(figs));
    be.upload_owned(score_grads(args, (&bal, &figs), span_tokens, scale))
}
