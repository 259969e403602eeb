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
//! `router::route_backward`.
//!
//! A sequence whose tokens are spread over ranks (context parallel, sequence parallel under TP)
//! has its counts and score sums summed over those ranks first (`SequenceRows::sum`), so every rank
//! sees the whole sequence's `f` and `P`.

use anyhow::Result;

use super::router::{normalised, RouterArgs};

/// Which sequence each of a rank's token rows belongs to, and how to sum per-sequence figures over
/// the ranks holding the other rows of the same sequences.
pub struct SequenceRows<'a> {
    /// The sequence (of this forward's `sequences`) of each local token row.
    pub seq_of: Vec<u32>,
    pub sequences: usize,
    /// Sums a buffer elementwise over the ranks sharing these sequences (in place).
    pub sum: &'a (dyn Fn(&mut [f32]) -> Result<()> + 'a),
}

/// A block's per-sequence figures, from its forward to its backward.
pub struct AuxStats {
    /// `f[b·E + e]`.
    f: Vec<f32>,
    /// Tokens of each sequence.
    tokens: Vec<f32>,
    /// `L_b` of each sequence.
    pub values: Vec<f32>,
    seq_of: Vec<u32>,
}

/// `f`, `P` and `L_b` of every sequence of `rows` (collective over the ranks sharing them), from
/// the routing's chosen experts (`[tokens · top_k]`) and scores (`[tokens, experts]`).
pub fn forward(
    args: &RouterArgs,
    (experts, scores): (&[u32], &[f32]),
    rows: SequenceRows,
) -> Result<AuxStats> {
    let (e, k, n) = (args.num_experts, args.top_k, rows.sequences);
    // Counts, then score sums, then tokens: one sum over the ranks.
    let mut figures = vec![0.0f32; 2 * n * e + n];
    for (t, &b) in rows.seq_of.iter().enumerate() {
        let b = b as usize;
        for &x in &experts[t * k..(t + 1) * k] {
            figures[b * e + x as usize] += 1.0;
        }
        let (s, _) = normalised(args, &scores[t * e..(t + 1) * e]);
        for (sum, s) in figures[n * e + b * e..n * e + (b + 1) * e]
            .iter_mut()
            .zip(s)
        {
            *sum += s;
        }
        figures[2 * n * e + b] += 1.0;
    }
    (rows.sum)(&mut figures)?;
    let (counts, rest) = figures.split_at(n * e);
    let (score_sums, tokens) = rest.split_at(n * e);
    let mut f = vec![0.0f32; n * e];
    let mut values = vec![0.0f32; n];
    for b in 0..n {
        let t = tokens[b].max(1.0);
        for x in 0..e {
            f[b * e + x] = e as f32 / (k as f32 * t) * counts[b * e + x];
            values[b] += f[b * e + x] * score_sums[b * e + x] / t;
        }
    }
    Ok(AuxStats {
        f,
        tokens: tokens.to_vec(),
        values,
        seq_of: rows.seq_of,
    })
}

/// The gradient of `scale · Σ_b L_b` with respect to the normalised scores of each local token
/// (`[tokens, E]`).
pub fn score_grads(args: &RouterArgs, stats: &AuxStats, scale: f32) -> Vec<f32> {
    let e = args.num_experts;
    let mut g = vec![0.0f32; stats.seq_of.len() * e];
    for (t, &b) in stats.seq_of.iter().enumerate() {
        let b = b as usize;
        let per_token = scale / stats.tokens[b].max(1.0);
        for (g, f) in g[t * e..(t + 1) * e]
            .iter_mut()
            .zip(&stats.f[b * e..(b + 1) * e])
        {
            *g = per_token * f;
        }
    }
    g
}
