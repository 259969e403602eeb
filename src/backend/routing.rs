//! The token-choice top-k router of a mixture-of-experts layer (TorchTitan's `TokenChoiceTopKRouter`,
//! DeepSeek-V3's and Qwen3-MoE's routing), as host math: every token's `top_k` experts and their
//! weights from the router's logits, the backward of those weights to the logits, and the order
//! that groups the chosen rows by expert (`dispatch_order`) with its inverse's combine. These are
//! the CPU backend's `Backend::moe_route`, `moe_route_backward`, `moe_dispatch_order` and
//! `moe_combine`, and every other backend's host default; a device runs its own kernels of the
//! same definitions (CUDA's in `kernels/routing.cu`).
//!
//! - Scores: `softmax` over the experts (Qwen3-MoE, Mixtral) or `sigmoid` of each (DeepSeek-V3).
//! - Selection: by score plus the expert bias of auxiliary-loss-free load balancing (the bias moves
//!   the choice only, never the weights); with group-limited routing only the experts of the
//!   `num_limited_groups` best of `num_expert_groups` groups compete (a group's score is its best
//!   expert's under softmax, the sum of its best two under sigmoid, as DeepSeek-V3). Ties go to
//!   the lower index (`total_cmp`, descending).
//! - Weights: the chosen experts' scores, renormalised to sum to one with `norm_topk_prob`, times
//!   `route_scale`.
//! - Normalised scores: each token's scores divided by their sum (`normalised`; the auxiliary loss
//!   of `model::moe::aux_loss` is taken over them), and the backward through that division
//!   (`unnormalise_grad`), which `route_backward` applies to the auxiliary loss's gradient.
//!
//! Ids (chosen experts, row orders) travel in backend buffers as `u32` bit patterns
//! (`ids_to_bits`, `ids_of_bits`), so they can stay where the rows are.

use anyhow::{bail, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How the router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoreFunc {
    Softmax,
    Sigmoid,
}

/// A router's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterArgs {
    pub num_experts: usize,
    pub top_k: usize,
    pub score_func: ScoreFunc,
    pub norm_topk_prob: bool,
    pub route_scale: f32,
    /// Group-limited routing: `(num_expert_groups, num_limited_groups)`.
    pub groups: Option<(usize, usize)>,
}

impl RouterArgs {
    pub fn validate(&self) -> Result<()> {
        if self.num_experts == 0 || self.top_k == 0 || self.top_k > self.num_experts {
            bail!(
                "[model] moe top_k {} must be between 1 and the number of experts {}",
                self.top_k,
                self.num_experts
            );
        }
        if let Some((groups, limited)) = self.groups {
            if groups == 0 || !self.num_experts.is_multiple_of(groups) {
                bail!(
                    "[model] num_expert_groups {groups} must divide the number of experts {}",
                    self.num_experts
                );
            }
            if limited == 0 || limited > groups {
                bail!("[model] num_limited_groups {limited} must be between 1 and num_expert_groups {groups}");
            }
            if limited * (self.num_experts / groups) < self.top_k {
                bail!(
                    "[model] num_limited_groups {limited} of {groups} groups leave fewer than top_k {} experts to choose from",
                    self.top_k
                );
            }
        }
        Ok(())
    }
}

/// Every token's choice: `experts[t·k + j]` its j-th expert and `weights[t·k + j]` that expert's
/// weight; `scores` `[tokens, experts]` kept for the backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
    pub scores: Vec<f32>,
}

/// Added to the chosen scores' sum before renormalising (TorchTitan's).
const RENORM_EPS: f32 = 1e-20;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Routes every token of `logits` (`[tokens, experts]`); `bias` (`[experts]`) shifts the choice.
pub fn route(args: &RouterArgs, logits: &[f32], bias: Option<&[f32]>) -> Routing {
    let (e, k) = (args.num_experts, args.top_k);
    let tokens = logits.len() / e;
    let mut scores = vec![0.0f32; logits.len()];
    let mut experts = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let (l, s) = (&logits[t * e..(t + 1) * e], &mut scores[t * e..(t + 1) * e]);
        match args.score_func {
            ScoreFunc::Softmax => {
                let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for (s, &x) in s.iter_mut().zip(l) {
                    *s = (x - max).exp();
                    sum += *s;
                }
                s.iter_mut().for_each(|s| *s /= sum);
            }
            ScoreFunc::Sigmoid => {
                for (s, &x) in s.iter_mut().zip(l) {
                    *s = sigmoid(x);
                }
            }
        }
        let mut select: Vec<f32> = match bias {
            Some(b) => s.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => s.to_vec(),
        };
        if let Some((groups, limited)) = args.groups {
            let per = e / groups;
            let group_score = |g: usize| {
                let mut v: Vec<f32> = select[g * per..(g + 1) * per].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                match args.score_func {
                    ScoreFunc::Softmax => v[0],
                    ScoreFunc::Sigmoid => v.iter().take(2).sum(),
                }
            };
            let mut order: Vec<usize> = (0..groups).collect();
            let group_scores: Vec<f32> = order.iter().map(|&g| group_score(g)).collect();
            order.sort_by(|&a, &b| group_scores[b].total_cmp(&group_scores[a]).then(a.cmp(&b)));
            for &g in &order[limited..] {
                select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        // The epsilon keeps sigmoid scores that all underflow from dividing by zero.
        let total: f32 = chosen.iter().map(|&x| s[x]).sum::<f32>() + RENORM_EPS;
        for &x in chosen {
            let w = if args.norm_topk_prob {
                s[x] / total
            } else {
                s[x]
            };
            experts.push(x as u32);
            weights.push(w * args.route_scale);
        }
    }
    Routing {
        experts,
        weights,
        scores,
    }
}

/// One token's scores `s` normalised to sum to one, and the sum they were divided by (softmax
/// scores already sum to one: 1). The auxiliary loss (`aux_loss`) is taken over these.
pub fn normalised(args: &RouterArgs, s: &[f32]) -> (Vec<f32>, f32) {
    match args.score_func {
        ScoreFunc::Softmax => (s.to_vec(), 1.0),
        ScoreFunc::Sigmoid => {
            let total: f32 = s.iter().sum();
            (s.iter().map(|x| x / total).collect(), total)
        }
    }
}

/// The gradient of the raw scores `s` of one token given that of its normalised ones `g`.
pub fn unnormalise_grad(args: &RouterArgs, s: &[f32], g: &[f32], out: &mut [f32]) {
    match args.score_func {
        ScoreFunc::Softmax => {
            for (o, g) in out.iter_mut().zip(g) {
                *o += g;
            }
        }
        ScoreFunc::Sigmoid => {
            // s'_j = s_j / S: ∂/∂s_i = (g_i − Σ_j g_j s'_j) / S.
            let (norm, total) = normalised(args, s);
            let dot: f32 = g.iter().zip(&norm).map(|(g, n)| g * n).sum();
            for (o, g) in out.iter_mut().zip(g) {
                *o += (g - dot) / total;
            }
        }
    }
}

/// The gradient of the logits from the gradient of the routing weights (`dweights`, one per
/// token and choice) and, with the auxiliary loss, of the normalised scores (`aux_grads`,
/// `[tokens, experts]`): through the renormalisation, the scale and the score function. The
/// choice itself is piecewise constant and has none.
pub fn route_backward(
    args: &RouterArgs,
    (scores, experts): (&[f32], &[u32]),
    dweights: &[f32],
    aux_grads: Option<&[f32]>,
) -> Vec<f32> {
    let (e, k) = (args.num_experts, args.top_k);
    let tokens = scores.len() / e;
    let mut dlogits = vec![0.0f32; tokens * e];
    let mut dscores = vec![0.0f32; e];
    for t in 0..tokens {
        let s = &scores[t * e..(t + 1) * e];
        let chosen = &experts[t * k..(t + 1) * k];
        let dw = &dweights[t * k..(t + 1) * k];
        let dl = &mut dlogits[t * e..(t + 1) * e];
        if args.score_func == ScoreFunc::Softmax && args.norm_topk_prob && aux_grads.is_none() {
            softmax_over_chosen_backward(args.route_scale, s, chosen, dw, dl);
            continue;
        }
        dscores.fill(0.0);
        if args.norm_topk_prob {
            // w_j = scale · s_j / Z with Z = Σ s_chosen.
            let z: f32 = chosen.iter().map(|&x| s[x as usize]).sum::<f32>() + RENORM_EPS;
            let dot: f32 = chosen
                .iter()
                .zip(dw)
                .map(|(&x, &d)| d * s[x as usize])
                .sum();
            for (&x, &d) in chosen.iter().zip(dw) {
                dscores[x as usize] += args.route_scale * (d / z - dot / (z * z));
            }
        } else {
            for (&x, &d) in chosen.iter().zip(dw) {
                dscores[x as usize] += args.route_scale * d;
            }
        }
        if let Some(g) = aux_grads {
            unnormalise_grad(args, s, &g[t * e..(t + 1) * e], &mut dscores);
        }
        match args.score_func {
            ScoreFunc::Softmax => {
                let dot: f32 = dscores.iter().zip(s).map(|(d, s)| d * s).sum();
                for ((dl, d), s) in dl.iter_mut().zip(&dscores).zip(s) {
                    *dl = s * (d - dot);
                }
            }
            ScoreFunc::Sigmoid => {
                for ((dl, d), s) in dl.iter_mut().zip(&dscores).zip(s) {
                    *dl = d * s * (1.0 - s);
                }
            }
        }
    }
    dlogits
}

/// The logits' gradient of softmax scores renormalised over the chosen experts, which are the
/// softmax of the chosen logits alone (`w_j = scale · p_j`, `p_j = e^{l_j} / Σ_chosen e^{l_c}`):
/// `dl_j = scale · p_j · (dw_j − Σ_i p_i·dw_i)` for a chosen expert, exactly 0 for the others
/// (as transformers' gpt-oss and Mixtral compute it; through the whole softmax the others' would
/// be rounding noise).
fn softmax_over_chosen_backward(scale: f32, s: &[f32], chosen: &[u32], dw: &[f32], dl: &mut [f32]) {
    let z: f32 = chosen.iter().map(|&x| s[x as usize]).sum::<f32>() + RENORM_EPS;
    let dot: f32 = chosen
        .iter()
        .zip(dw)
        .map(|(&x, &d)| d * s[x as usize] / z)
        .sum();
    dl.fill(0.0);
    for (&x, &d) in chosen.iter().zip(dw) {
        dl[x as usize] = scale * s[x as usize] / z * (d - dot);
    }
}

/// `ids` as the `u32` bit patterns a backend buffer carries them in.
pub fn ids_to_bits(ids: &[u32]) -> Vec<f32> {
    ids.iter().map(|&id| f32::from_bits(id)).collect()
}

/// The ids a buffer carries as bit patterns (`ids_to_bits`).
pub fn ids_of_bits(bits: &[f32]) -> Vec<u32> {
    bits.iter().map(|b| b.to_bits()).collect()
}

/// A routing where its backend keeps it: `experts[t·k + j]` token `t`'s j-th expert (ids as bits),
/// `weights` likewise, `scores` `[tokens, experts]` for the backward.
pub struct RoutedTokens<Buf> {
    pub experts: Buf,
    pub weights: Buf,
    pub scores: Buf,
}

/// The chosen rows grouped by expert, where its backend keeps them (ids as bits): dispatched row
/// `r` is token `rows[r]`'s choice `slots[r]` (its place `t·k + j` in the routing), choice `s` is
/// row `row_of_slot[s]`, and expert `e`'s rows are `offsets[e]..offsets[e + 1]`. Within an expert
/// the rows keep token order (a stable counting sort).
pub struct DispatchOrder<Buf> {
    pub rows: Buf,
    pub slots: Buf,
    pub row_of_slot: Buf,
    pub offsets: Buf,
}

impl<T> DispatchOrder<T> {
    /// Each of the four through `f`.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> DispatchOrder<U> {
        DispatchOrder {
            rows: f(self.rows),
            slots: f(self.slots),
            row_of_slot: f(self.row_of_slot),
            offsets: f(self.offsets),
        }
    }
}

/// The dispatch order of a routing's chosen `experts` (`[tokens · top_k]`) over `num_experts`.
pub fn dispatch_order(
    experts: &[u32],
    num_experts: usize,
    top_k: usize,
) -> DispatchOrder<Vec<u32>> {
    let mut offsets = vec![0u32; num_experts + 1];
    for &e in experts {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        offsets[e + 1] += offsets[e];
    }
    let mut next = offsets.clone();
    let n = experts.len();
    let (mut rows, mut slots, mut row_of_slot) = (vec![0u32; n], vec![0u32; n], vec![0u32; n]);
    for (slot, &e) in experts.iter().enumerate() {
        let r = next[e as usize] as usize;
        next[e as usize] += 1;
        rows[r] = (slot / top_k) as u32;
        slots[r] = slot as u32;
        row_of_slot[slot] = r as u32;
    }
    DispatchOrder {
        rows,
        slots,
        row_of_slot,
        offsets,
    }
}

/// The combine: `out[t] += rows[r]` for each of token `t`'s `top_k` dispatched rows `r`
/// (`row_of_slot`), in increasing `r` (the order the rows were dispatched in, whatever the
/// thread count).
pub fn combine(out: &mut [f32], rows: &[f32], row_of_slot: &[u32], top_k: usize, width: usize) {
    assert_eq!(
        out.len() / width.max(1) * top_k,
        row_of_slot.len(),
        "moe_combine: {} tokens of width {width} for {} choices of top {top_k}",
        out.len() / width.max(1),
        row_of_slot.len()
    );
    let n = rows.len() / width.max(1);
    if let Some(&bad) = row_of_slot.iter().find(|&&r| r as usize >= n) {
        panic!("moe_combine: row {bad} outside the {n} dispatched rows");
    }
    out.par_chunks_mut(width)
        .zip(row_of_slot.par_chunks(top_k))
        .for_each(|(token, choices)| {
            // The token's rows smallest first (a token's rows are distinct; top_k is small).
            let mut after = None;
            for _ in choices {
                let next = choices
                    .iter()
                    .copied()
                    .filter(|&r| after.is_none_or(|a| r > a))
                    .min();
                let Some(r) = next else { break };
                let row = &rows[r as usize * width..(r as usize + 1) * width];
                token.iter_mut().zip(row).for_each(|(o, x)| *o += x);
                after = Some(r);
            }
        });
}

/// `counts[at + e] += offsets[e + 1] - offsets[e]`: each expert's rows added to a load count.
pub fn count_load(counts: &mut [f32], offsets: &[u32], at: usize) {
    for (c, w) in counts[at..].iter_mut().zip(offsets.windows(2)) {
        *c += (w[1] - w[0]) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(score_func: ScoreFunc, norm: bool) -> RouterArgs {
        RouterArgs {
            num_experts: 6,
            top_k: 2,
            score_func,
            norm_topk_prob: norm,
            route_scale: 1.5,
            groups: None,
        }
    }

    #[test]
    fn chooses_the_best_scores_and_the_bias_moves_only_the_choice() {
        let logits = [0.1, 2.0, -1.0, 1.5, 0.0, 0.3];
        let a = args(ScoreFunc::Softmax, true);
        let r = route(&a, &logits, None);
        assert_eq!(r.experts, [1, 3]);
        let (s1, s3) = (r.scores[1], r.scores[3]);
        assert!((r.weights[0] - 1.5 * s1 / (s1 + s3)).abs() < 1e-6);
        // A bias large enough for expert 5 to win a place, with the weight of its own score.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let b = route(&a, &logits, Some(&bias));
        assert_eq!(b.experts, [5, 1]);
        let (s5, s1) = (b.scores[5], b.scores[1]);
        assert!((b.weights[0] - 1.5 * s5 / (s5 + s1)).abs() < 1e-6);
    }

    #[test]
    fn group_limited_routing_keeps_to_the_best_groups() {
        // Three groups of two; sigmoid group score = its two scores' sum.
        let a = RouterArgs {
            groups: Some((3, 1)),
            ..args(ScoreFunc::Sigmoid, false)
        };
        // Expert 1 alone is best, but group 2 (experts 4, 5) has the best pair.
        let logits = [-3.0, 4.0, 0.0, 0.0, 2.0, 2.0];
        let r = route(&a, &logits, None);
        assert_eq!(r.experts, [4, 5]);
        let bad = RouterArgs {
            groups: Some((4, 1)),
            ..a
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn backward_matches_finite_differences() {
        let logits: Vec<f32> = (0..4 * 6)
            .map(|i| ((i * 7919) % 23) as f32 / 7.0 - 1.5)
            .collect();
        let dw: Vec<f32> = (0..4 * 2).map(|i| (i as f32 * 0.37).sin()).collect();
        for (f, norm) in [
            (ScoreFunc::Softmax, true),
            (ScoreFunc::Softmax, false),
            (ScoreFunc::Sigmoid, true),
            (ScoreFunc::Sigmoid, false),
        ] {
            let a = args(f, norm);
            let r = route(&a, &logits, None);
            let dl = route_backward(&a, (&r.scores, &r.experts), &dw, None);
            let objective = |l: &[f32]| -> f64 {
                let r2 = route(&a, l, None);
                assert_eq!(r2.experts, r.experts, "the choice must not move");
                r2.weights
                    .iter()
                    .zip(&dw)
                    .map(|(w, d)| *w as f64 * *d as f64)
                    .sum()
            };
            for i in 0..logits.len() {
                let eps = 1e-3;
                let (mut up, mut down) = (logits.clone(), logits.clone());
                up[i] += eps;
                down[i] -= eps;
                let numeric = (objective(&up) - objective(&down)) / (2.0 * eps as f64);
                assert!(
                    (numeric - dl[i] as f64).abs() < 2e-3,
                    "{f:?} norm {norm} logit {i}: analytic {} numeric {numeric}",
                    dl[i]
                );
            }
        }
    }

    #[test]
    fn dispatch_orders_rows_by_expert_and_keeps_every_choice() {
        let order = dispatch_order(&[2, 0, 0, 1, 2, 1], 3, 2);
        assert_eq!(order.offsets, [0, 2, 4, 6]);
        assert_eq!(order.rows, [0, 1, 1, 2, 0, 2]);
        assert_eq!(order.slots, [1, 2, 3, 5, 0, 4]);
        assert_eq!(order.row_of_slot, [4, 0, 1, 2, 5, 3]);
    }

    #[test]
    fn combine_adds_each_tokens_rows_in_dispatch_order() {
        // Two tokens, top 2, width 1: token 0's rows 2 and 0, token 1's rows 1 and 3.
        let rows = [-1e8, 1.0, 0.5, 3.0];
        let mut out = [1e8, 0.0];
        combine(&mut out, &rows, &[2, 0, 1, 3], 2, 1);
        // Row 0 first: (1e8 − 1e8) + 0.5, where (1e8 + 0.5) − 1e8 would be 0.
        assert_eq!(out, [0.5, 4.0]);
        let bits = ids_to_bits(&[0, 7, u32::MAX]);
        assert_eq!(ids_of_bits(&bits), [0, 7, u32::MAX]);
    }
}
