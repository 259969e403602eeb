//! The mixture-of-experts feed-forward (TorchTitan's `MoE`, Qwen3-MoE's and DeepSeek-V3's
//! structure), forward and backward: a token-choice top-k router (`router`; the backend's
//! `moe_route`), routed SwiGLU experts computed on the token rows sorted by expert (no capacity
//! limit: no token is dropped), and the expert bias of auxiliary-loss-free load balancing.
//! Optional shared experts, which every token goes through, are the block's SwiGLU
//! (`FeedForwardIds::swiglu`, column- and row-parallel under TP like a dense feed-forward), not
//! this layer's.
//!
//! `out += Σ_j w_tj · Expert_{e_tj}(x_t)` for every token `t`, where the router chose
//! experts `e_tj` with weights `w_tj`. The routing stays where the rows are: the choice, the
//! dispatch order (`Backend::moe_dispatch_order`: each row's token and routing slot, ids in
//! backend buffers) and each row's weight; the dispatch gathers each token's row once per choice
//! in expert order (`Backend::gather_rows`); each expert's rows are one block, and each of the
//! experts' three projections is one grouped GEMM over every block, sized by the dispatch order's
//! offsets where they are (`expert::LocalExperts`, `Backend::grouped_matmul`: no download; float8
//! experts one GEMM per expert on host blocks); the combine scales each row by its weight and
//! adds it back to its token (`Backend::moe_combine`, in dispatch order). The backward mirrors each step; the
//! weights' gradient is each row's output dotted with the token's output gradient
//! (`Backend::row_dots`), and the router's is `Backend::moe_route_backward`'s.
//!
//! Under expert parallelism a rank holds some of the experts: the dispatched rows go to their
//! experts' ranks and come back before the combine (`dispatch`, over `ExpertParallelOps`); with one
//! rank nothing moves. Qwen3-MoE's, DeepSeek-V3's and gpt-oss's blocks run this layer
//! (`model::decoder`, `FeedForwardIds::Moe`; gpt-oss's router and experts with biases and the
//! clamped SwiGLU, `activation`). The sequence-wise auxiliary balance loss is `aux_loss` (host
//! math over the downloaded scores). Not built yet (issue 45): grouped GEMMs reading the row
//! counts on the device, which would leave the block no copy.

pub mod activation;
pub mod aux_loss;
pub mod dispatch;
mod expert;
pub mod router;
pub mod stats;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::backend::float8::Float8Recipe;
use crate::backend::grouped_gemm::rows_of;
use crate::backend::routing::{DispatchOrder, RoutedTokens};
use crate::backend::Backend;
use crate::model::bias;
use crate::model::crossings::expert::ExpertParallelOps;
use crate::model::linear::Linear;
use activation::ExpertActivation;
use aux_loss::{AuxStats, SequenceRows};
use dispatch::ExpertRows;
use expert::{swiglu_ffn, swiglu_ffn_backward, ExpertBlocks, ExpertParams, LocalExperts};
use router::RouterArgs;

/// A model's mixture-of-experts feed-forward (part of `ModelArgs`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MoeArgs {
    /// Each routed expert's hidden width.
    pub hidden: usize,
    /// The shared experts' hidden width (None: none).
    pub shared_hidden: Option<usize>,
    pub router: RouterArgs,
    /// Auxiliary-loss-free load balancing: after each step every expert's routing bias moves this
    /// much toward the mean load (TorchTitan's `load_balance_coeff`); None: no bias.
    #[serde(default)]
    pub load_balance_coeff: Option<f32>,
    /// The sequence-wise auxiliary balance loss's coefficient (`aux_loss`; Hugging Face's
    /// `router_aux_loss_coef`); None: no auxiliary loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss_coef: Option<f32>,
    /// Leading blocks whose feed-forward stays dense (`ModelArgs::ffn_hidden` wide) instead of
    /// the experts (DeepSeek-V3's `first_k_dense_replace`, Qwen3-MoE's `mlp_only_layers` 0..k).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_dense_layers: usize,
    /// The experts are in every `sparse_step`-th block only, block `l` when `l + 1` is a
    /// multiple of it, the others dense (Qwen3-MoE's `decoder_sparse_step`).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub sparse_step: usize,
    /// Biases on the router's logits and on every routed expert's three projections (gpt-oss).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub linear_biases: bool,
    /// The routed experts' gated activation (gpt-oss's clamped SwiGLU; else SwiGLU).
    #[serde(default, skip_serializing_if = "ExpertActivation::is_default")]
    pub activation: ExpertActivation,
    /// Each routing weight scales its expert's input row instead of its output (TorchTitan's
    /// `score_before_experts`, Llama 4's routing): `Σ_j Expert_j(w_j·x)`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub score_before_experts: bool,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl MoeArgs {
    /// Whether block `layer`'s feed-forward is this mixture of experts (else it is dense).
    pub fn in_layer(&self, layer: usize) -> bool {
        layer >= self.first_dense_layers && (layer + 1).is_multiple_of(self.sparse_step.max(1))
    }

    pub fn validate(&self) -> Result<()> {
        if self.hidden == 0 || self.shared_hidden == Some(0) {
            anyhow::bail!("[model] moe hidden widths must be positive: {self:?}");
        }
        if self.sparse_step == 0 {
            anyhow::bail!("[model] moe sparse_step (decoder_sparse_step) must be at least 1");
        }
        if let Some(c) = self.load_balance_coeff {
            if !(c.is_finite() && c > 0.0) {
                anyhow::bail!(
                    "[model] load_balance_coeff = {c} must be positive (or absent: no expert bias)"
                );
            }
        }
        if let Some(c) = self.aux_loss_coef {
            if !(c.is_finite() && c > 0.0) {
                anyhow::bail!(
                    "[model] router_aux_loss_coef = {c} must be positive (or absent: no auxiliary loss)"
                );
            }
        }
        self.router.validate()
    }

    /// Parameters of one layer: the router, every expert, the shared experts.
    pub fn params(&self, dim: usize) -> usize {
        self.router_params(dim)
            + self.routed_params(dim)
            + 3 * dim * self.shared_hidden.unwrap_or(0)
    }

    /// Parameters of the router: its gate and (gpt-oss) its bias.
    fn router_params(&self, dim: usize) -> usize {
        let e = self.router.num_experts;
        e * dim + if self.linear_biases { e } else { 0 }
    }

    /// Parameters of one routed expert: three projections and (gpt-oss) their biases.
    fn expert_params(&self, dim: usize) -> usize {
        let biases = if self.linear_biases {
            2 * self.hidden + dim
        } else {
            0
        };
        3 * dim * self.hidden + biases
    }

    /// Parameters of one layer's routed experts (what expert parallelism splits).
    pub fn routed_params(&self, dim: usize) -> usize {
        self.router.num_experts * self.expert_params(dim)
    }

    /// Parameters one token goes through: the router, its `top_k` experts, the shared ones.
    pub fn active_params(&self, dim: usize) -> usize {
        self.router_params(dim)
            + self.router.top_k * self.expert_params(dim)
            + 3 * dim * self.shared_hidden.unwrap_or(0)
    }

    /// Activation values one layer keeps per token for its routed experts (`MoeActs`): each
    /// choice's dispatched input and output, gate, up and SwiGLU output (a block keeps its
    /// shared experts' as its SwiGLU's).
    pub fn activation_floats_per_token(&self, dim: usize) -> usize {
        self.router.top_k * (2 * dim + 3 * self.hidden)
    }
}

/// A mixture-of-experts layer's shapes (its routed experts).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShapes {
    pub dim: usize,
    /// Each routed expert's hidden width.
    pub hidden: usize,
    pub router: RouterArgs,
    /// The recipe the routed experts' GEMMs cast their operands with (`quantize.grouped_mm.
    /// float8`: rowwise; `quantize.grouped_mm.mx`: MXFP8; each expert's GEMMs over the rows
    /// routed to it); None: high precision.
    pub experts_float8: Option<Float8Recipe>,
    /// bf16 mixed precision: the experts' activations rounded to bf16 where they are produced and
    /// kept as bf16 pairs (`MoeActs`), as the block keeps its own.
    pub bf16_activations: bool,
    pub activation: ExpertActivation,
    /// The routing weights scale the experts' input rows (`MoeArgs::score_before_experts`).
    pub score_before_experts: bool,
}

impl MoeShapes {
    pub fn new(dim: usize, moe: &MoeArgs) -> Self {
        MoeShapes {
            dim,
            hidden: moe.hidden,
            router: moe.router,
            experts_float8: None,
            bf16_activations: false,
            activation: moe.activation,
            score_before_experts: moe.score_before_experts,
        }
    }

    /// Under bf16 mixed precision, `buf` rounded to bf16 in place.
    fn round<B: Backend>(&self, be: &B, buf: &mut B::Buf) {
        if self.bf16_activations {
            be.round_to_bf16(buf);
        }
    }

    /// An expert's two linears: `dim → hidden` (w1, w3) and `hidden → dim` (w2).
    fn expert_linears(&self) -> (Linear, Linear) {
        let recipe = self.experts_float8;
        (
            Linear::new(self.dim, self.hidden).in_float8(recipe),
            Linear::new(self.hidden, self.dim).in_float8(recipe),
        )
    }
}

/// Where a block's mixture-of-experts parameters are in a parameter list: the router's
/// `[experts, dim]` gate, each expert's `[w1, w2, w3]` (`[hidden, dim]`, `[dim, hidden]`,
/// `[hidden, dim]`), and the shared experts' likewise (computed by the block as its SwiGLU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeIds {
    pub router: usize,
    pub experts: Vec<[usize; 3]>,
    pub shared: Option<[usize; 3]>,
    /// The router's and the routed experts' biases (gpt-oss; None without).
    pub biases: Option<MoeBiasIds>,
}

/// The router's bias `[experts]` and each routed expert's `[b1, b2, b3]` (`[hidden]`, `[dim]`,
/// `[hidden]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeBiasIds {
    pub router: usize,
    pub experts: Vec<[usize; 3]>,
}

impl MoeIds {
    /// Routed expert `e`'s parameter ids: its weights, and its biases when it has them.
    fn expert(&self, e: usize) -> (&[usize; 3], Option<&[usize; 3]>) {
        let biases = self.biases.as_ref().map(|b| &b.experts[e]);
        (&self.experts[e], biases)
    }
}

/// What the forward keeps for the backward.
pub struct MoeActs<B: Backend> {
    /// Every token's choice, where the backend keeps it.
    routed: RoutedTokens<B::Buf>,
    /// The chosen rows grouped by expert, and each one's routing weight (`[rows]`).
    order: DispatchOrder<B::Buf>,
    row_weights: B::Buf,
    /// Where the rows went to their experts and came back from (expert parallelism).
    rows_go: ExpertRows<B>,
    /// The local experts' blocks of rows on the host where they run one at a time
    /// (`LocalExperts::blocks`).
    blocks: Option<ExpertBlocks>,
    /// This rank's experts' input rows `[local rows, dim]` (in local expert order), their gate
    /// and up projections and SwiGLU outputs `[local rows, hidden]`.
    x_local: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
    /// The unweighted outputs of this rank's dispatched rows `[rows, dim]`, back from their experts.
    y: B::Buf,
    /// Under bf16 mixed precision the five buffers above hold bf16 pairs of these many values
    /// (`MoeActs::unpacked` widens them for the backward); None: f32 values.
    packed_lens: Option<[usize; 5]>,
    /// The auxiliary loss's per-sequence figures (with `aux_loss_coef`).
    pub aux: Option<AuxStats<B>>,
}

/// This rank's experts with their parameters, their rows' offsets and, where they run one at a
/// time, their blocks on the host.
fn local_experts<'a, B: Backend>(
    ids: &MoeIds,
    params: &'a [B::Buf],
    rows_go: &'a ExpertRows<B>,
    (order_offsets, blocks): (&'a B::Buf, Option<ExpertBlocks>),
) -> LocalExperts<'a, B> {
    let first = rows_go.first_expert();
    let count = rows_go.local_experts(ids.experts.len());
    LocalExperts {
        params: (first..first + count)
            .map(|e| expert_params(ids, e, |i| &params[i]))
            .collect(),
        offsets: rows_go.offsets(order_offsets),
        blocks,
    }
}

/// Expert `e`'s parameters (or gradients), each id mapped by `at`.
fn expert_params<T>(ids: &MoeIds, e: usize, mut at: impl FnMut(usize) -> T) -> ExpertParams<T> {
    let (w, b) = ids.expert(e);
    ExpertParams {
        w: w.map(&mut at),
        b: b.map(|b| b.map(&mut at)),
    }
}

/// The layer's forward over `x` (`[tokens, dim]`): adds its output into `out`; `bias` is the
/// expert bias that shifts the router's choice. This rank computes its experts (`ep`) on every
/// rank's rows routed to them. With `sequences` (the auxiliary loss), the per-sequence figures of
/// the auxiliary loss are kept for the backward.
#[allow(clippy::too_many_arguments)]
pub fn forward<B: Backend>(
    be: &B,
    m: &MoeShapes,
    ids: &MoeIds,
    params: &[B::Buf],
    x: &B::Buf,
    out: &mut B::Buf,
    bias: Option<&B::Buf>,
    ep: &dyn ExpertParallelOps<B>,
    sequences: Option<SequenceRows<B>>,
) -> Result<MoeActs<B>> {
    let (d, e) = (m.dim, m.router.num_experts);
    let tokens = be.len(x) / d;
    let mut logits = be.uninit(tokens * e);
    Linear::new(d, e).forward(be, &mut logits, x, &params[ids.router], tokens);
    if let Some(b) = &ids.biases {
        bias::add(be, &mut logits, &params[b.router]);
    }
    let (k, n) = (m.router.top_k, tokens * m.router.top_k);
    let routed = be.moe_route(&logits, bias, &m.router);
    let aux = match sequences {
        Some(rows) => Some(aux_loss::forward(be, &m.router, &routed, rows)?),
        None => None,
    };
    let order = be.moe_dispatch_order(&routed.experts, (e, k));
    let rows_go = ExpertRows::plan(be, ep, &order.offsets)?;
    let mut row_weights = be.uninit(n);
    be.gather_rows(&mut row_weights, &routed.weights, &order.slots, 1);
    let mut x_sorted = be.uninit(n * d);
    be.gather_rows(&mut x_sorted, x, &order.rows, d);
    if m.score_before_experts {
        be.scale_rows_by(&mut x_sorted, &row_weights, d);
    }
    let x_local = rows_go.to_experts(be, ep, x_sorted, d)?;
    let blocks =
        LocalExperts::<B>::one_at_a_time(m).then(|| rows_go.host_blocks(be, &order.offsets));
    let experts = local_experts(ids, params, &rows_go, (&order.offsets, blocks.clone()));
    let mut y_local = be.uninit(rows_go.local_rows(n) * d);
    let [gate, up, act] = swiglu_ffn(be, m, &experts, &x_local, &mut y_local)?;
    let y = rows_go.from_experts(be, ep, y_local, d)?;
    // Combine: each row weighted (unless its input was), added back to its token.
    let mut weighted = rows_of(be, &y, (0, n), d);
    if !m.score_before_experts {
        be.scale_rows_by(&mut weighted, &row_weights, d);
    }
    be.moe_combine(out, &weighted, &order.row_of_slot, (k, d));
    let acts = MoeActs {
        routed,
        order,
        row_weights,
        rows_go,
        blocks,
        x_local,
        gate,
        up,
        act,
        y,
        packed_lens: None,
        aux,
    };
    Ok(match m.bf16_activations {
        true => acts.packed(be),
        false => acts,
    })
}

impl<B: Backend> MoeActs<B> {
    /// The dispatch order's offsets (`[experts + 1]`, u32 bits): the rows this rank routed to
    /// each expert (the step's load statistics).
    pub fn load_offsets(&self) -> &B::Buf {
        &self.order.offsets
    }

    /// These activations (bf16-rounded where they were produced; the input rows are the normed
    /// block input, bf16 already) kept as bf16 pairs: half the memory.
    fn packed(mut self, be: &B) -> Self {
        let mut lens = [0; 5];
        for (len, buf) in lens.iter_mut().zip(self.buffers()) {
            *len = be.len(buf);
            let mut pairs = be.uninit(len.div_ceil(2));
            be.pack_bf16_pairs(&mut pairs, buf);
            *buf = pairs;
        }
        self.packed_lens = Some(lens);
        self
    }

    /// The kept buffers: input rows, gate, up, SwiGLU output, expert outputs.
    fn buffers(&mut self) -> [&mut B::Buf; 5] {
        [
            &mut self.x_local,
            &mut self.gate,
            &mut self.up,
            &mut self.act,
            &mut self.y,
        ]
    }

    /// The kept activations in f32 for the backward: unpacked when they are kept as bf16 pairs
    /// (transient, freed after the backward), else None (read in place).
    fn unpacked(&self, be: &B) -> Option<[B::Buf; 5]> {
        let lens = self.packed_lens?;
        let kept = [&self.x_local, &self.gate, &self.up, &self.act, &self.y];
        Some(std::array::from_fn(|k| {
            let mut values = be.uninit(lens[k]);
            be.unpack_bf16_pairs(&mut values, kept[k]);
            values
        }))
    }
}

/// The layer's backward: adds the parameters' gradients into `grads` (this rank's experts' from
/// every rank's rows routed to them) and `dx += ∂L/∂x` for the output gradient `dout`
/// (`[tokens, dim]`), plus, when the forward kept its figures, the gradient of `aux_scale ·
/// Σ_sequences L_b` (the auxiliary loss's share of this block).
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    be: &B,
    m: &MoeShapes,
    ids: &MoeIds,
    params: &[B::Buf],
    grads: &mut [B::Buf],
    acts: &MoeActs<B>,
    x: &B::Buf,
    dout: &B::Buf,
    dx: &mut B::Buf,
    ep: &dyn ExpertParallelOps<B>,
    aux_scale: f32,
) -> Result<()> {
    let (d, e, k) = (m.dim, m.router.num_experts, m.router.top_k);
    let tokens = be.len(x) / d;
    let n = tokens * k;
    let unpacked = acts.unpacked(be);
    let [x_local, gate, up, act, y] = match &unpacked {
        Some([x_local, gate, up, act, y]) => [x_local, gate, up, act, y],
        None => [&acts.x_local, &acts.gate, &acts.up, &acts.act, &acts.y],
    };
    // Each row's output gradient: its token's, times its weight; the weight's own gradient is
    // that token's output gradient dotted with the row's unweighted output (or, when the weight
    // scaled the input, the input row's gradient dotted with the unweighted input row).
    let order = &acts.order;
    let mut dy = be.uninit(n * d);
    be.gather_rows(&mut dy, dout, &order.rows, d);
    let output_dots = (!m.score_before_experts).then(|| {
        let dots = be.row_dots(&dy, y, d);
        be.scale_rows_by(&mut dy, &acts.row_weights, d);
        dots
    });
    let rows_go = &acts.rows_go;
    let dy_local = rows_go.to_experts(be, ep, dy, d)?;
    let experts = local_experts(ids, params, rows_go, (&order.offsets, acts.blocks.clone()));
    let first = rows_go.first_expert();
    let mut slots: Vec<Option<&mut B::Buf>> = grads.iter_mut().map(Some).collect();
    let mut take = |i: usize| slots[i].take().expect("an expert's gradients are its own");
    let mut expert_grads: Vec<_> = (first..first + experts.params.len())
        .map(|e| expert_params(ids, e, &mut take))
        .collect();
    let saved = [x_local, gate, up, act];
    let dx_local = swiglu_ffn_backward(be, m, &experts, saved, &mut expert_grads, &dy_local)?;
    drop(expert_grads);
    let mut dx_sorted = rows_go.from_experts(be, ep, dx_local, d)?;
    let row_dots = output_dots.unwrap_or_else(|| {
        let mut x_sorted = be.uninit(n * d);
        be.gather_rows(&mut x_sorted, x, &order.rows, d);
        let dots = be.row_dots(&dx_sorted, &x_sorted, d);
        be.scale_rows_by(&mut dx_sorted, &acts.row_weights, d);
        dots
    });
    be.moe_combine(dx, &dx_sorted, &order.row_of_slot, (k, d));
    // Each choice's weight gradient, back in routing order.
    let mut dweights = be.uninit(n);
    be.gather_rows(&mut dweights, &row_dots, &order.row_of_slot, 1);
    // The router: from the weights' gradient to the logits', then to its gate and the input.
    let aux_grads = acts
        .aux
        .as_ref()
        .map(|a| a.score_grads(be, &m.router, aux_scale));
    let routed = (&acts.routed.scores, &acts.routed.experts);
    let dlogits = be.moe_route_backward(&m.router, routed, &dweights, aux_grads.as_ref());
    if let Some(b) = &ids.biases {
        bias::add_grad(be, &mut grads[b.router], &dlogits);
    }
    let gate = Linear::new(d, e);
    gate.add_weight_grad(be, &mut grads[ids.router], &dlogits, x, tokens);
    gate.add_input_grad(be, dx, &dlogits, &params[ids.router], tokens);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::router::ScoreFunc;
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::model::crossings::single_rank::SingleRank;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Parameters of a layer of `m` at `ids`: router, experts, and with `biases` theirs.
    fn layer(m: &MoeShapes, seed: u64, biases: bool) -> (MoeIds, Vec<Vec<f32>>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut params = vec![];
        let mut add = |n: usize, scale: f32| {
            params.push((0..n).map(|_| (rng.gen::<f32>() - 0.5) * scale).collect());
            params.len() - 1
        };
        let (d, h, e) = (m.dim, m.hidden, m.router.num_experts);
        let router = add(e * d, 2.0);
        let experts = (0..e)
            .map(|_| [add(h * d, 0.8), add(d * h, 0.8), add(h * d, 0.8)])
            .collect();
        let biases = biases.then(|| MoeBiasIds {
            router: add(e, 1.0),
            experts: (0..e)
                .map(|_| [add(h, 0.5), add(d, 0.5), add(h, 0.5)])
                .collect(),
        });
        (
            MoeIds {
                router,
                experts,
                shared: None,
                biases,
            },
            params,
        )
    }

    fn shapes(score_func: ScoreFunc, groups: Option<(usize, usize)>) -> MoeShapes {
        MoeShapes {
            dim: 6,
            hidden: 5,
            router: RouterArgs {
                num_experts: 4,
                top_k: 2,
                score_func,
                norm_topk_prob: score_func == ScoreFunc::Softmax,
                route_scale: 1.3,
                groups,
            },
            experts_float8: None,
            bf16_activations: false,
            activation: ExpertActivation::Swiglu,
            score_before_experts: false,
        }
    }

    /// The auxiliary loss's weight in the objective of the gradient check.
    const AUX_SCALE: f32 = 0.7;

    /// Three sequences of three tokens, on one rank.
    fn three_sequences<'a>(
        sum: &'a (dyn Fn(&mut Vec<f32>) -> Result<()> + 'a),
    ) -> SequenceRows<'a, CpuBackend> {
        SequenceRows {
            span: aux_loss::SequenceSpan {
                first: 0,
                seq: 3,
                sequences: 3,
            },
            sum,
        }
    }

    /// Σ out ⊙ r + AUX_SCALE · Σ_b L_b for the layer at `params` on `x`.
    fn objective(m: &MoeShapes, ids: &MoeIds, params: &[Vec<f32>], x: &[f32], r: &[f32]) -> f64 {
        let be = CpuBackend::new();
        let mut out = vec![0.0; x.len()];
        let nothing = |_: &mut Vec<f32>| Ok(());
        let acts = forward(
            &be,
            m,
            ids,
            params,
            &x.to_vec(),
            &mut out,
            None,
            &SingleRank,
            Some(three_sequences(&nothing)),
        )
        .unwrap();
        let (values, at, n) = acts.aux.as_ref().unwrap().values();
        let aux: f64 = values[at..at + n].iter().map(|&v| v as f64).sum();
        out.iter()
            .zip(r)
            .map(|(o, r)| *o as f64 * *r as f64)
            .sum::<f64>()
            + AUX_SCALE as f64 * aux
    }

    #[test]
    fn moe_gradients_match_finite_differences() {
        // gpt-oss's experts: biases, and the clamped SwiGLU with a limit the values cross.
        let clamped = ExpertActivation::ClampedSwiglu {
            alpha: 1.702,
            limit: 0.4,
        };
        // Llama 4's: each sigmoid score scales its expert's input, not its output.
        let plain = ExpertActivation::Swiglu;
        for (f, groups, biases, activation, score_before_experts) in [
            (ScoreFunc::Softmax, None, false, plain, false),
            (ScoreFunc::Sigmoid, Some((2, 1)), false, plain, false),
            (ScoreFunc::Softmax, None, true, clamped, false),
            (ScoreFunc::Sigmoid, None, false, plain, true),
        ] {
            let m = MoeShapes {
                activation,
                score_before_experts,
                ..shapes(f, groups)
            };
            let be = CpuBackend::new();
            let (ids, params) = layer(&m, 7, biases);
            let tokens = 9;
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let x: Vec<f32> = (0..tokens * m.dim)
                .map(|_| rng.gen::<f32>() - 0.5)
                .collect();
            let r: Vec<f32> = (0..tokens * m.dim)
                .map(|_| rng.gen::<f32>() - 0.5)
                .collect();
            let mut out = vec![0.0; x.len()];
            let nothing = |_: &mut Vec<f32>| Ok(());
            let acts = forward(
                &be,
                &m,
                &ids,
                &params,
                &x,
                &mut out,
                None,
                &SingleRank,
                Some(three_sequences(&nothing)),
            )
            .unwrap();
            // Every expert gets tokens, so every expert's gradient is checked.
            let offsets = crate::backend::routing::ids_of_bits(acts.load_offsets());
            assert!(offsets.windows(2).all(|w| w[1] > w[0]), "{offsets:?}");
            let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
            let mut dx = vec![0.0; x.len()];
            backward(
                &be,
                &m,
                &ids,
                &params,
                &mut grads,
                &acts,
                &x,
                &r,
                &mut dx,
                &SingleRank,
                AUX_SCALE,
            )
            .unwrap();
            let eps = 1e-3f32;
            let check = |name: &str, analytic: &[f32], perturb: &dyn Fn(usize, f32) -> f64| {
                for i in (0..analytic.len()).step_by(3) {
                    let numeric = (perturb(i, eps) - perturb(i, -eps)) / (2.0 * eps as f64);
                    assert!(
                        (numeric - analytic[i] as f64).abs() < 3e-3 * (1.0 + numeric.abs()),
                        "{f:?} {name}[{i}]: analytic {} numeric {numeric}",
                        analytic[i]
                    );
                }
            };
            check("x", &dx, &|i, delta| {
                let mut x2 = x.clone();
                x2[i] += delta;
                objective(&m, &ids, &params, &x2, &r)
            });
            for (p, g) in grads.iter().enumerate() {
                check(&format!("param {p}"), g, &|i, delta| {
                    let mut p2 = params.clone();
                    p2[p][i] += delta;
                    objective(&m, &ids, &p2, &x, &r)
                });
            }
        }
    }
}
