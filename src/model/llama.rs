//! The Llama 3 decoder with an explicit forward (saving what the backward needs) and backward,
//! written once in one tensor-parallel rank's shapes (`LocalShapes`; with one rank, the model's).
//!
//! Per block: `h = x + Attention(RMSNorm(x))`, `out = h + W2·(silu(W1·n) ∘ W3·n)` with `n = RMSNorm(h)`.
//!
//! Tensor parallelism is Megatron's picture with sequence parallelism: between blocks a rank holds
//! its `1/tp` of the token rows of the residual stream, and the RMSNorms run on those rows. Before
//! the column-parallel projections (wq, wk, wv; w1, w3) the normed rows are all-gathered
//! (`column_parallel_input`), each rank computing its heads and its slice of the hidden layer on
//! every token; the row-parallel projections (wo, w2) give partial sums over the group, which are
//! reduce-scattered back to row shards (`row_parallel_residual`). The backward mirrors each: the
//! output gradient is gathered before a row-parallel backward and the input gradient of the
//! column-parallel ones is reduce-scattered. The embedding is vocabulary-parallel and the loss
//! runs over vocabulary shards (`TensorParallelOps::cross_entropy`). With one rank every one of
//! these crossings is the identity and costs nothing.
//!
//! Context parallelism splits each sequence over a group (`model::context_parallel`): a rank's
//! workspace holds its shard of every sequence, RoPE rotates its rows by their global positions,
//! and attention crosses the group (`ContextParallelOps`); nothing else in the block changes.
//!
//! Activations live in a `Workspace` sized once for a (batch, seq) shape and reused every step.

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::backend::{cpu::rope::rope_tables, AttnShape, Backend, LossSum, IGNORE_INDEX};

use super::activation_checkpoint::{Act, ActivationPlan, BlockSave};
use super::args::{LocalShapes, ModelArgs};
use super::context_parallel::{ContextParallelOps, SequenceShard};
use super::expert_parallel::ExpertParallelOps;
use super::linear::Linear;
use super::moe::{self, MoeActs, MoeShapes};
use super::parallel_linear::{DeferredWeightGrad, Projection, ProjectionGrad, SequenceParallel};
use super::params::{local_param_specs, FeedForwardIds, LayerIds, ParamIds, ParamSet};
use super::tensor_parallel::{SingleRank, TensorParallelOps};

/// What one block keeps from its forward for its backward.
pub struct LayerActs<B: Backend> {
    /// The attention norm's output on this rank's rows, and (tensor parallel) gathered over the
    /// group: the input of the column-parallel projections.
    pub normed_attn: B::Buf,
    pub normed_attn_full: B::Buf,
    pub rstd_attn: B::Buf,
    pub q: B::Buf,
    pub k: B::Buf,
    pub v: B::Buf,
    /// QK-norm's inputs and statistics (Qwen3; empty without QK-norm).
    pub q_raw: B::Buf,
    pub k_raw: B::Buf,
    pub rstd_q: B::Buf,
    pub rstd_k: B::Buf,
    pub attn_out: B::Buf,
    pub lse: B::Buf,
    pub h: B::Buf,
    pub normed_ffn: B::Buf,
    pub normed_ffn_full: B::Buf,
    pub rstd_ffn: B::Buf,
    pub gate: B::Buf,
    pub up: B::Buf,
    pub act: B::Buf,
}

/// Every activation and gradient buffer of one training step, allocated once per shape.
pub struct Workspace<B: Backend> {
    pub batch: usize,
    /// Positions of each sequence this rank holds (with context parallelism, its shard).
    pub seq: usize,
    /// With context parallelism, the RoPE tables of the shard's rows (their global positions),
    /// made by `Llama::load_tokens` the first time.
    rope: Option<(B::Buf, B::Buf)>,
    /// Input of block `l` at `resid[l]`; the last entry is the final block's output.
    resid: Vec<B::Buf>,
    /// Each block's own activations (empty buffers for what it does not keep) and the shared set
    /// the blocks that keep less write and recompute theirs in; what each block keeps.
    layers: Vec<LayerActs<B>>,
    recomputed: LayerActs<B>,
    plan: ActivationPlan,
    normed_final: B::Buf,
    normed_final_full: B::Buf,
    rstd_final: B::Buf,
    // backward scratch
    dx: B::Buf,
    dnormed: B::Buf,
    /// Tensor parallel only: `[tokens, dim]` for a row-parallel projection's partial sums, a
    /// gathered output gradient, or a column-parallel input gradient's partial sums.
    full: B::Buf,
    dq: B::Buf,
    dk: B::Buf,
    dv: B::Buf,
    /// With QK-norm: the gradients of the projections before it.
    dq_raw: B::Buf,
    dk_raw: B::Buf,
    dattn: B::Buf,
    dgate: B::Buf,
    dup: B::Buf,
    dact: B::Buf,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// The inputs as rows of this rank's vocabulary shard (`IGNORE_INDEX` for the others').
    local_ids: Vec<u32>,
    /// Each mixture-of-experts block's routing and expert activations, from its forward to its
    /// backward (their sizes depend on nothing but the shape; the routing is per step).
    moe: Vec<Option<MoeActs<B>>>,
}

/// How a device may store an activation (`Backend::zeros_bf16_activation`, `activation_copy_bytes`).
#[derive(Debug, Clone, Copy)]
struct ActStorage {
    floats: usize,
    /// Read only by GEMMs, SwiGLU or a gather feeding GEMMs: a device may keep it in bf16 alone.
    bf16_alone: bool,
    /// Its producer may keep a bf16 copy beside it for the kernels that read it.
    bf16_copy: bool,
}

/// The size and storage of each block activation for one rank's shapes: the single source for
/// allocation and memory estimates.
fn act_storage(m: &LocalShapes, batch: usize, seq: usize, act: Act) -> ActStorage {
    let n = batch * seq;
    let r = m.rows(n);
    let (d, f, qd, kvd) = (m.dim, m.ffn, m.q_dim(), m.kv_dim());
    let tp = m.tp > 1;
    let plain = |floats| ActStorage {
        floats,
        bf16_alone: false,
        bf16_copy: false,
    };
    let copied = |floats| ActStorage {
        bf16_copy: true,
        ..plain(floats)
    };
    let gemm_input = |floats| ActStorage {
        floats,
        bf16_alone: true,
        bf16_copy: true,
    };
    match act {
        // A norm's output feeds the column-parallel GEMMs directly, or (tensor parallel) through
        // the gather, whose result is then the GEMMs' input.
        Act::NormedAttn | Act::NormedFfn if tp => plain(r * d),
        // A mixture of experts gathers the normed rows (not a GEMM reading them): f32 kept.
        Act::NormedFfn if m.moe.is_some() => copied(n * d),
        Act::NormedAttn | Act::NormedFfn => gemm_input(n * d),
        Act::NormedAttnFull | Act::NormedFfnFull if tp => gemm_input(n * d),
        Act::NormedAttnFull | Act::NormedFfnFull => plain(0),
        Act::RstdAttn | Act::RstdFfn => plain(r),
        Act::Q | Act::AttnOut => copied(n * qd),
        Act::K => copied(n * kvd),
        Act::V => plain(n * kvd),
        Act::QRaw if m.qk_norm => plain(n * qd),
        Act::KRaw if m.qk_norm => plain(n * kvd),
        Act::RstdQ if m.qk_norm => plain(n * m.heads),
        Act::RstdK if m.qk_norm => plain(n * m.kv_heads),
        Act::QRaw | Act::KRaw | Act::RstdQ | Act::RstdK => plain(0),
        Act::Lse => plain(batch * m.heads * seq),
        Act::H => plain(r * d),
        Act::Gate | Act::Up | Act::Act => gemm_input(n * f),
    }
}

/// The block activations' values over the workspace, counting each buffer `plan` allocates, of
/// those selected by `which`.
fn block_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
    which: impl Fn(ActStorage) -> bool,
) -> usize {
    Act::ALL
        .iter()
        .map(|&act| (act_storage(m, batch, seq, act), plan.copies(act)))
        .filter(|(st, _)| which(*st))
        .map(|(st, copies)| st.floats * copies)
        .sum()
}

/// Float counts of the workspace for a shape and activation plan: the single source for
/// allocation and memory estimates.
pub fn workspace_floats(m: &LocalShapes, batch: usize, seq: usize, plan: &ActivationPlan) -> usize {
    let seq = m.local_seq(seq);
    let n = batch * seq;
    let r = m.rows(n);
    let (d, f, qd, kvd) = (m.dim, m.ffn, m.q_dim(), m.kv_dim());
    let gathered = if m.tp > 1 { n * d } else { 0 };
    let resid = (m.n_layers + 1) * r * d;
    let final_norm = r * (d + 1) + gathered;
    let qk_norm = if m.qk_norm { n * (qd + kvd) } else { 0 };
    let backward = r * 2 * d + gathered + n * (2 * qd + 2 * kvd + 3 * f) + qk_norm;
    // Every mixture-of-experts block keeps its routed rows' activations (`Workspace::moe`), and its
    // backward needs about as much again for their gradients.
    let moe = m.moe.map_or(0, |moe| {
        let per_block = n * moe.activation_floats_per_token(d);
        let held = plan
            .blocks
            .iter()
            .filter(|&&b| b != BlockSave::Elsewhere && b != BlockSave::Input)
            .count();
        held * per_block + per_block
    });
    block_floats(m, batch, seq, plan, |_| true) + resid + final_norm + backward + moe
}

/// Values of the workspace allocated by `Backend::zeros_bf16_activation` (the blocks'
/// column-parallel inputs, gate and up projections and SwiGLU outputs, and the backward's SwiGLU
/// input and output gradients), whose f32 storage a device may leave out.
pub fn workspace_bf16_activation_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
) -> usize {
    let seq = m.local_seq(seq);
    block_floats(m, batch, seq, plan, |st| st.bf16_alone) + 3 * batch * seq * m.ffn
}

/// Values of the workspace whose producers may keep a bf16 copy beside them (or their values in
/// bf16 alone) for the GEMMs, attention and SwiGLU kernels that read them
/// (`Backend::activation_copy_bytes`): the blocks' normed inputs, rotated q and k, attention
/// outputs, gate and up projections and SwiGLU outputs, the final norm's output, and the
/// backward's SwiGLU input and output gradients, rotated dq and dk, and block-input gradient.
pub fn workspace_copied_floats(
    m: &LocalShapes,
    batch: usize,
    seq: usize,
    plan: &ActivationPlan,
) -> usize {
    let seq = m.local_seq(seq);
    let n = batch * seq;
    let (d, f, qd, kvd) = (m.dim, m.ffn, m.q_dim(), m.kv_dim());
    block_floats(m, batch, seq, plan, |st| st.bf16_copy) + n * d + n * (3 * f + d + qd + kvd)
}

impl<B: Backend> LayerActs<B> {
    /// A block's buffers: those `keep` selects sized for the shapes, the others empty.
    fn allocate(
        be: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        keep: impl Fn(Act) -> bool,
    ) -> Self {
        let buf = |act: Act| {
            let st = act_storage(m, batch, seq, act);
            match (keep(act), st.bf16_alone) {
                (false, _) => be.zeros(0),
                (true, true) => be.zeros_bf16_activation(st.floats),
                (true, false) => be.zeros(st.floats),
            }
        };
        LayerActs {
            normed_attn: buf(Act::NormedAttn),
            normed_attn_full: buf(Act::NormedAttnFull),
            rstd_attn: buf(Act::RstdAttn),
            q: buf(Act::Q),
            k: buf(Act::K),
            v: buf(Act::V),
            q_raw: buf(Act::QRaw),
            k_raw: buf(Act::KRaw),
            rstd_q: buf(Act::RstdQ),
            rstd_k: buf(Act::RstdK),
            attn_out: buf(Act::AttnOut),
            lse: buf(Act::Lse),
            h: buf(Act::H),
            normed_ffn: buf(Act::NormedFfn),
            normed_ffn_full: buf(Act::NormedFfnFull),
            rstd_ffn: buf(Act::RstdFfn),
            gate: buf(Act::Gate),
            up: buf(Act::Up),
            act: buf(Act::Act),
        }
    }
}

/// A block's projections in one rank's shapes: attention's (wq, wk, wv column-parallel, wo
/// row-parallel) and the feed-forward's (w1, w3 column-parallel, w2 row-parallel).
struct BlockLinears {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl BlockLinears {
    fn of(m: &LocalShapes) -> Self {
        let (d, f) = (m.dim, m.ffn);
        BlockLinears {
            wq: Linear::new(d, m.q_dim()),
            wk: Linear::new(d, m.kv_dim()),
            wv: Linear::new(d, m.kv_dim()),
            wo: Linear::new(m.q_dim(), d),
            w1: Linear::new(d, f),
            w2: Linear::new(f, d),
            w3: Linear::new(d, f),
        }
    }
}

/// One block's activations as its forward writes them and its backward reads them: each from the
/// block's own buffers when it keeps it, else from the shared scratch set.
pub struct BlockActs<'a, B: Backend> {
    pub normed_attn: &'a mut B::Buf,
    pub normed_attn_full: &'a mut B::Buf,
    pub rstd_attn: &'a mut B::Buf,
    pub q: &'a mut B::Buf,
    pub k: &'a mut B::Buf,
    pub v: &'a mut B::Buf,
    pub q_raw: &'a mut B::Buf,
    pub k_raw: &'a mut B::Buf,
    pub rstd_q: &'a mut B::Buf,
    pub rstd_k: &'a mut B::Buf,
    pub attn_out: &'a mut B::Buf,
    pub lse: &'a mut B::Buf,
    pub h: &'a mut B::Buf,
    pub normed_ffn: &'a mut B::Buf,
    pub normed_ffn_full: &'a mut B::Buf,
    pub rstd_ffn: &'a mut B::Buf,
    pub gate: &'a mut B::Buf,
    pub up: &'a mut B::Buf,
    pub act: &'a mut B::Buf,
}

impl<'a, B: Backend> BlockActs<'a, B> {
    fn pick(own: &'a mut LayerActs<B>, scratch: &'a mut LayerActs<B>, save: BlockSave) -> Self {
        macro_rules! from {
            ($field:ident, $act:expr) => {
                if save.keeps($act) {
                    &mut own.$field
                } else {
                    &mut scratch.$field
                }
            };
        }
        BlockActs {
            normed_attn: from!(normed_attn, Act::NormedAttn),
            normed_attn_full: from!(normed_attn_full, Act::NormedAttnFull),
            rstd_attn: from!(rstd_attn, Act::RstdAttn),
            q: from!(q, Act::Q),
            k: from!(k, Act::K),
            v: from!(v, Act::V),
            q_raw: from!(q_raw, Act::QRaw),
            k_raw: from!(k_raw, Act::KRaw),
            rstd_q: from!(rstd_q, Act::RstdQ),
            rstd_k: from!(rstd_k, Act::RstdK),
            attn_out: from!(attn_out, Act::AttnOut),
            lse: from!(lse, Act::Lse),
            h: from!(h, Act::H),
            normed_ffn: from!(normed_ffn, Act::NormedFfn),
            normed_ffn_full: from!(normed_ffn_full, Act::NormedFfnFull),
            rstd_ffn: from!(rstd_ffn, Act::RstdFfn),
            gate: from!(gate, Act::Gate),
            up: from!(up, Act::Up),
            act: from!(act, Act::Act),
        }
    }
}

impl<B: Backend> Workspace<B> {
    /// The workspace of a single-process model, keeping every activation.
    pub fn new(backend: &B, args: &ModelArgs, batch: usize, seq: usize) -> Self {
        let plan = ActivationPlan::keep_everything(args.n_layers);
        Self::planned(backend, &LocalShapes::whole(args), batch, seq, plan)
    }

    /// The workspace of one rank for `batch` sequences of `seq` positions (context parallel: it
    /// holds `seq / cp` of each; tensor parallel: `batch × seq / cp` must divide by its degree)
    /// whose blocks keep what `plan` says (activation checkpointing):
    /// a buffer per block for each kept activation, one shared for each recomputed one.
    pub fn planned(
        backend: &B,
        m: &LocalShapes,
        batch: usize,
        seq: usize,
        plan: ActivationPlan,
    ) -> Self {
        assert_eq!(plan.blocks.len(), m.n_layers, "a plan per block");
        let seq = m.local_seq(seq);
        let n = batch * seq;
        let r = m.rows(n);
        let (d, f, qd, kvd) = (m.dim, m.ffn, m.q_dim(), m.kv_dim());
        let z = |len: usize| backend.zeros(len);
        let tp = m.tp > 1;
        // Read only by GEMMs (dgate, dup) or SwiGLU's backward (dact).
        let gemm_input = |len: usize| backend.zeros_bf16_activation(len);
        Workspace {
            batch,
            seq,
            rope: None,
            resid: (0..=m.n_layers).map(|_| z(r * d)).collect(),
            layers: plan
                .blocks
                .iter()
                .map(|&save| LayerActs::allocate(backend, m, batch, seq, |a| save.keeps(a)))
                .collect(),
            recomputed: LayerActs::allocate(backend, m, batch, seq, |a| plan.needs_scratch(a)),
            plan,
            normed_final: z(r * d),
            normed_final_full: if tp { z(n * d) } else { z(0) },
            rstd_final: z(r),
            dx: z(r * d),
            dnormed: z(r * d),
            full: if tp { z(n * d) } else { z(0) },
            dq: z(n * qd),
            dk: z(n * kvd),
            dv: z(n * kvd),
            dq_raw: z(if m.qk_norm { n * qd } else { 0 }),
            dk_raw: z(if m.qk_norm { n * kvd } else { 0 }),
            dattn: z(n * qd),
            dgate: gemm_input(n * f),
            dup: gemm_input(n * f),
            dact: gemm_input(n * f),
            inputs: vec![0; n],
            targets: vec![0; n],
            local_ids: vec![0; n],
            moe: (0..m.n_layers).map(|_| None).collect(),
        }
    }

    /// What the workspace's blocks keep.
    pub fn plan(&self) -> &ActivationPlan {
        &self.plan
    }

    /// The input of block `l` on this rank's rows: the embedding's output for `l = 0`, the final
    /// norm's input for `l = n_layers` (a pipeline stage receives its input here and sends its
    /// output from here).
    pub fn block_input(&self, l: usize) -> &B::Buf {
        &self.resid[l]
    }

    pub fn block_input_mut(&mut self, l: usize) -> &mut B::Buf {
        &mut self.resid[l]
    }

    /// The gradient the backward carries from block to block: ∂L/∂(output) of the next block to
    /// run backward, ∂L/∂(input) of the last one run (a pipeline stage receives the first and
    /// sends the second).
    pub fn carried_grad(&self) -> &B::Buf {
        &self.dx
    }

    pub fn carried_grad_mut(&mut self) -> &mut B::Buf {
        &mut self.dx
    }
}

/// Whether a block's forward keeps its mixture of experts' activations: as its save policy says
/// (not for a block that keeps only its input), or always (the recompute before its backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExpertActs {
    AsPlanned,
    ForBackward,
}

/// Called by `forward_backward_with` when a block's gradients are final.
pub trait BlockGradHook<B: Backend> {
    fn block_done(&mut self, be: &B, layer: &LayerIds, grads: &mut ParamSet<B>) -> Result<()>;
}

/// A Llama model bound to a backend: shapes, parameter indices, RoPE tables and the
/// tensor- and context-parallel groups its blocks cross.
pub struct Llama<B: Backend> {
    pub args: ModelArgs,
    /// The shapes this rank computes with.
    pub local: LocalShapes,
    pub ids: ParamIds,
    tp: Arc<dyn TensorParallelOps<B>>,
    cp: Arc<dyn ContextParallelOps<B>>,
    /// The expert-parallel group a mixture of experts' rows travel over (one rank: `SingleRank`).
    ep: Arc<dyn ExpertParallelOps<B>>,
    /// Tokens each mixture-of-experts block sent to each expert since `take_expert_load`: counted
    /// in the backward, so once per trained microbatch (not again for a recomputed forward, not for
    /// validation).
    expert_load: std::sync::Mutex<Vec<Vec<u64>>>,
    /// Each mixture-of-experts block's routing bias (`load_balance_coeff`; empty without), moved
    /// after every step by `update_expert_bias`.
    expert_bias: std::sync::Mutex<Vec<Vec<f32>>>,
    /// The auxiliary loss (`aux_loss_coef`) since `take_aux_loss`: this rank's share of
    /// `coef · Σ_blocks Σ_sequences L_b`, counted in the backward like the expert load (a sequence
    /// spread over TP and CP ranks adds `1 / (tp · cp)` on each).
    aux_loss: std::sync::Mutex<f64>,
    /// Sequences in an optimizer step over the whole job (the global batch): the auxiliary loss is
    /// a mean over them.
    sequences_per_step: usize,
    rope_cos: B::Buf,
    rope_sin: B::Buf,
    rope_len: usize,
}

impl<B: Backend> Llama<B> {
    /// `max_seq` bounds the positions the RoPE tables cover (training seq_len or generation length).
    pub fn new(backend: &B, args: ModelArgs, max_seq: usize) -> Result<Self> {
        let local = LocalShapes::whole(&args);
        Self::tensor_parallel(backend, args, max_seq, local, Arc::new(SingleRank))
    }

    /// One rank of a tensor-parallel model: `local` its shapes, `tp` its group.
    pub fn tensor_parallel(
        backend: &B,
        args: ModelArgs,
        max_seq: usize,
        local: LocalShapes,
        tp: Arc<dyn TensorParallelOps<B>>,
    ) -> Result<Self> {
        args.validate()?;
        assert_eq!(
            local.tp,
            tp.degree(),
            "Llama: shapes and group disagree on the TP degree"
        );
        let (cos, sin) = rope_tables(args.head_dim(), max_seq, args.rope_theta, args.rope_scaling);
        let expert_load = match &args.moe {
            Some(moe) => vec![vec![0; moe.router.num_experts]; args.n_layers],
            None => Vec::new(),
        };
        let expert_bias = match &args.moe {
            Some(moe) if moe.load_balance_coeff.is_some() => {
                vec![vec![0.0; moe.router.num_experts]; args.n_layers]
            }
            _ => Vec::new(),
        };
        Ok(Llama {
            ids: ParamIds::new(&args),
            args,
            local,
            tp,
            cp: Arc::new(SingleRank),
            ep: Arc::new(SingleRank),
            expert_load: std::sync::Mutex::new(expert_load),
            expert_bias: std::sync::Mutex::new(expert_bias),
            aux_loss: std::sync::Mutex::new(0.0),
            sequences_per_step: 1,
            rope_cos: backend.upload(&cos),
            rope_sin: backend.upload(&sin),
            rope_len: max_seq,
        })
    }

    /// This model with its attention spread over a context-parallel group (`self.local` says
    /// which shard of each sequence this rank holds).
    pub fn with_context_parallel(mut self, cp: Arc<dyn ContextParallelOps<B>>) -> Self {
        assert_eq!(
            self.local.cp,
            cp.degree(),
            "Llama: shapes and group disagree on the CP degree"
        );
        self.cp = cp;
        self
    }

    /// This model with its experts split over an expert-parallel group (`self.local` says which
    /// experts this rank holds).
    pub fn with_expert_parallel(mut self, ep: Arc<dyn ExpertParallelOps<B>>) -> Self {
        assert_eq!(
            (self.local.ep, self.local.ep_rank),
            (ep.degree(), ep.rank()),
            "Llama: shapes and group disagree on the EP degree or rank"
        );
        self.ep = ep;
        self
    }

    /// This model in a job whose optimizer steps take `sequences` sequences (the global batch):
    /// the MoE auxiliary loss is their mean.
    pub fn with_sequences_per_step(mut self, sequences: usize) -> Self {
        self.sequences_per_step = sequences.max(1);
        self
    }

    /// The MoE auxiliary loss's share this rank has added since the last call (`Σ` over the
    /// job's ranks, divided by nothing more: it is already a mean over the step's sequences), and
    /// zeroes it. None without an auxiliary loss.
    pub fn take_aux_loss(&self) -> Option<f64> {
        self.args.moe.as_ref()?.aux_loss_coef?;
        let mut aux = self.aux_loss.lock().unwrap_or_else(|e| e.into_inner());
        Some(std::mem::take(&mut *aux))
    }

    /// With the auxiliary loss: which sequence each of this rank's rows of a block's forward
    /// belongs to (its sequence-parallel rows under TP; its shard of each under CP), and the sum
    /// of per-sequence figures over the TP and CP ranks sharing them.
    fn sequence_rows<'a>(
        &self,
        batch: usize,
        seq: usize,
        sum: &'a (dyn Fn(&mut [f32]) -> Result<()> + 'a),
    ) -> Option<moe::aux_loss::SequenceRows<'a>> {
        self.args.moe.as_ref()?.aux_loss_coef?;
        let rows = self.local.rows(batch * seq);
        let first = self.local.tp_rank * rows;
        Some(moe::aux_loss::SequenceRows {
            seq_of: (first..first + rows).map(|r| (r / seq) as u32).collect(),
            sequences: batch,
            sum,
        })
    }

    /// Sums host figures over the TP and CP ranks (every one of them calls this together).
    fn sum_over_sequence_ranks(&self, be: &B, values: &mut [f32]) -> Result<()> {
        if self.local.tp > 1 {
            let mut buf = be.upload(values);
            self.tp.all_reduce_sum(be, &mut buf)?;
            values.copy_from_slice(&be.download(&buf));
        }
        self.cp.sum_over_group(values)
    }

    /// The expert-parallel group (degree 1 without expert parallelism).
    pub fn ep(&self) -> &dyn ExpertParallelOps<B> {
        self.ep.as_ref()
    }

    /// The context-parallel group (degree 1 without context parallelism).
    pub fn cp(&self) -> &dyn ContextParallelOps<B> {
        self.cp.as_ref()
    }

    /// Tokens each mixture-of-experts block sent to each expert since the last call (`[layer]
    /// [expert]`; this rank's microbatches only), and zeroes the counts. None for a dense model.
    pub fn take_expert_load(&self) -> Option<Vec<Vec<u64>>> {
        self.args.moe.as_ref()?;
        let mut load = self.expert_load.lock().unwrap_or_else(|e| e.into_inner());
        let taken = load.clone();
        load.iter_mut().for_each(|l| l.fill(0));
        Some(taken)
    }

    /// Every MoE block's expert bias (None without load balancing).
    pub fn expert_bias(&self) -> Option<Vec<Vec<f32>>> {
        let bias = self.expert_bias.lock().unwrap_or_else(|e| e.into_inner());
        (!bias.is_empty()).then(|| bias.clone())
    }

    /// Restores the expert bias of a checkpoint (it must be this model's shape).
    pub fn set_expert_bias(&self, saved: &[Vec<f32>]) -> Result<()> {
        let mut bias = self.expert_bias.lock().unwrap_or_else(|e| e.into_inner());
        let shape = |b: &[Vec<f32>]| b.iter().map(Vec::len).collect::<Vec<_>>();
        if shape(&bias) != shape(saved) {
            bail!(
                "the checkpoint's expert bias has {} blocks of {:?} experts; this model's has {} blocks of {:?} (is load_balance_coeff set alike?)",
                saved.len(),
                saved.first().map(Vec::len),
                bias.len(),
                bias.first().map(Vec::len)
            );
        }
        *bias = saved.to_vec();
        Ok(())
    }

    /// After a step: each block's bias moves `load_balance_coeff` toward the mean of `load`, the
    /// step's tokens per expert summed over the job (so every rank moves it alike).
    pub fn update_expert_bias(&self, load: &[Vec<u64>]) {
        let Some(coeff) = self.args.moe.and_then(|m| m.load_balance_coeff) else {
            return;
        };
        let mut bias = self.expert_bias.lock().unwrap_or_else(|e| e.into_inner());
        for (b, l) in bias.iter_mut().zip(load) {
            moe::router::update_expert_bias(b, l, coeff);
        }
    }

    /// Block `l`'s routing bias, when load balancing is on.
    fn block_expert_bias(&self, l: usize) -> Option<Vec<f32>> {
        let bias = self.expert_bias.lock().unwrap_or_else(|e| e.into_inner());
        bias.get(l).cloned()
    }

    /// The positions of each sequence this rank holds.
    pub fn sequence_shard(&self) -> SequenceShard {
        SequenceShard {
            degree: self.local.cp,
            rank: self.local.cp_rank,
        }
    }

    /// The targets of `[rows, seq+1]` token rows that count toward this rank's loss: those at its
    /// positions, ignored ids left out.
    pub fn count_targets(&self, tokens: &[u32], seq: usize) -> usize {
        let chunks = self.sequence_shard().chunks(seq);
        tokens
            .chunks(seq + 1)
            .map(|row| {
                chunks
                    .iter()
                    .map(|c| {
                        row[c.start + 1..c.end + 1]
                            .iter()
                            .filter(|&&t| t != IGNORE_INDEX)
                            .count()
                    })
                    .sum::<usize>()
            })
            .sum()
    }

    /// The RoPE tables of a workspace's rows: the model's, or the shard's own.
    fn rope_tables<'a>(&'a self, shard: &'a Option<(B::Buf, B::Buf)>) -> (&'a B::Buf, &'a B::Buf) {
        debug_assert!(
            self.local.cp == 1 || shard.is_some(),
            "a context-parallel workspace gets its RoPE tables from load_tokens"
        );
        match shard {
            Some((cos, sin)) => (cos, sin),
            None => (&self.rope_cos, &self.rope_sin),
        }
    }

    /// Names and shapes of this rank's parameters (its tensor-parallel parts).
    pub fn param_specs(&self) -> Vec<(String, Vec<usize>)> {
        local_param_specs(&self.args, self.local.tp)
    }

    /// The tensor-parallel group (degree 1 without tensor parallelism).
    pub fn tp(&self) -> &dyn TensorParallelOps<B> {
        self.tp.as_ref()
    }

    /// One forward and backward over `tokens` (`[batch, seq+1]`, inputs are the first `seq` of each
    /// row, targets the last `seq`). Gradients are *added* into `grads`, scaled by `grad_scale`
    /// (1 / global number of targets), so micro-batches accumulate into one big batch.
    pub fn forward_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        grad_scale: f32,
    ) -> Result<LossSum> {
        self.forward_backward_with(be, params, grads, ws, tokens, grad_scale, None)
    }

    /// `forward_backward`, calling `hook` as soon as each block's gradients are complete (last block
    /// first), so that data parallelism can start reducing them while earlier blocks still compute.
    /// The stages it runs are public, so that FSDP can run them with its gathers in between.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_with(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
        grad_scale: f32,
        mut hook: Option<&mut dyn BlockGradHook<B>>,
    ) -> Result<LossSum> {
        self.load_tokens(be, ws, tokens)?;
        self.embed_forward(be, params, ws)?;
        for l in 0..self.args.n_layers {
            self.block_forward(be, params, ws, l)?;
        }
        let loss = self.head_forward_backward(be, params, grads, ws, grad_scale)?;
        for l in (0..self.args.n_layers).rev() {
            self.block_backward(be, params, grads, ws, l)?;
            if let Some(h) = hook.as_deref_mut() {
                h.block_done(be, &self.ids.layers[l], grads)?;
            }
        }
        self.embed_backward(be, grads, ws)?;
        Ok(loss)
    }

    /// Loss without gradients (validation, tests).
    pub fn loss(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
    ) -> Result<LossSum> {
        self.load_tokens(be, ws, tokens)?;
        self.embed_forward(be, params, ws)?;
        for l in 0..self.args.n_layers {
            self.block_forward(be, params, ws, l)?;
        }
        // No backward follows: a mixture of experts' activations are not needed.
        ws.moe.iter_mut().for_each(|m| *m = None);
        self.head_loss(be, params, ws)
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
        let h = self.column_parallel_input(be, &ws.normed_final, &mut ws.normed_final_full)?;
        let w = &params.bufs[self.ids.output];
        self.tp
            .cross_entropy(be, h, w, &ws.targets, &self.local, 0.0, None)
    }

    /// Checks `tokens` (`[batch, seq+1]`, whole sequences) and splits them into the workspace's
    /// inputs and targets: with context parallelism, those at this rank's positions.
    pub fn load_tokens(&self, be: &B, ws: &mut Workspace<B>, tokens: &[u32]) -> Result<()> {
        let (b, s) = (ws.batch, ws.seq * self.local.cp);
        if tokens.len() != b * (s + 1) {
            bail!(
                "expected {} tokens ({b} rows of seq_len+1 = {}), got {}",
                b * (s + 1),
                s + 1,
                tokens.len()
            );
        }
        if s > self.rope_len {
            bail!(
                "sequence length {s} exceeds the {} positions this model was built for",
                self.rope_len
            );
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.args.vocab_size) {
            bail!(
                "token id {bad} is outside the model's vocabulary of {}",
                self.args.vocab_size
            );
        }
        let chunks = self.sequence_shard().chunks(s);
        for (r, row) in tokens.chunks(s + 1).enumerate() {
            let mut at = r * ws.seq;
            for c in &chunks {
                let n = c.len();
                ws.inputs[at..at + n].copy_from_slice(&row[c.clone()]);
                ws.targets[at..at + n].copy_from_slice(&row[c.start + 1..c.end + 1]);
                at += n;
            }
        }
        if self.local.cp > 1 && ws.rope.is_none() {
            let a = &self.args;
            let half = a.head_dim() / 2;
            let (cos, sin) = rope_tables(a.head_dim(), s, a.rope_theta, a.rope_scaling);
            let rows = |table: &[f32]| -> Vec<f32> {
                self.sequence_shard()
                    .positions(s)
                    .into_iter()
                    .flat_map(|p| table[p * half..(p + 1) * half].to_vec())
                    .collect()
            };
            ws.rope = Some((be.upload(&rows(&cos)), be.upload(&rows(&sin))));
        }
        let (lo, n) = (self.local.vocab_offset as u32, self.local.vocab as u32);
        for (local, &id) in ws.local_ids.iter_mut().zip(&ws.inputs) {
            *local = if id >= lo && id - lo < n {
                id - lo
            } else {
                IGNORE_INDEX
            };
        }
        Ok(())
    }

    // ---------------------------------------------------- the tensor-parallel crossings

    /// The input of column-parallel projections: this rank's `local` rows, or with tensor
    /// parallelism every rank's rows gathered into `full`.
    fn column_parallel_input<'a>(
        &self,
        be: &B,
        local: &'a B::Buf,
        full: &'a mut B::Buf,
    ) -> Result<&'a B::Buf> {
        if self.local.tp == 1 {
            return Ok(local);
        }
        self.tp.gather_rows(be, local, full)?;
        Ok(full)
    }

    /// Where a column-parallel layer's input gradient is summed: straight into this rank's rows
    /// (`local`), or with tensor parallelism into the partial sums over every row (`full`), which
    /// `scatter_input_grad` then reduces.
    fn input_grad_target<'a>(&self, local: &'a mut B::Buf, full: &'a mut B::Buf) -> &'a mut B::Buf {
        if self.local.tp == 1 {
            local
        } else {
            full
        }
    }

    /// With tensor parallelism, this rank's rows of the input gradient summed over the group.
    fn scatter_input_grad(&self, be: &B, full: &B::Buf, local: &mut B::Buf) -> Result<()> {
        if self.local.tp > 1 {
            self.tp.reduce_scatter_rows(be, full, local)?;
        }
        Ok(())
    }

    // ---------------------------------------------------- stages

    /// The embedding of the inputs into `resid[0]`: vocabulary-parallel with tensor parallelism
    /// (each rank looks up the tokens of its vocabulary rows, zero for the others, and the sums
    /// are reduce-scattered to row shards).
    pub fn embed_forward(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>) -> Result<()> {
        let _span = crate::trace::span("model", "embedding forward");
        let table = &params.bufs[self.ids.tok_embeddings];
        let d = self.args.dim;
        if self.local.tp == 1 {
            be.embedding_forward(&mut ws.resid[0], table, &ws.inputs, d);
            return Ok(());
        }
        be.embedding_forward(&mut ws.full, table, &ws.local_ids, d);
        self.tp.reduce_scatter_rows(be, &ws.full, &mut ws.resid[0])
    }

    fn final_norm(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>) {
        let a = &self.args;
        be.rmsnorm_forward(
            &mut ws.normed_final,
            &mut ws.rstd_final,
            &ws.resid[a.n_layers],
            &params.bufs[self.ids.norm],
            a.dim,
            a.norm_eps,
        );
    }

    /// Final norm, cross-entropy fused with the output projection, and their backward: leaves
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
        let a = &self.args;
        let p = &params.bufs;
        let h = self.column_parallel_input(be, &ws.normed_final, &mut ws.normed_final_full)?;
        let dh = self.input_grad_target(&mut ws.dnormed, &mut ws.full);
        be.fill(dh, 0.0);
        let loss = self.tp.cross_entropy(
            be,
            h,
            &p[self.ids.output],
            &ws.targets,
            &self.local,
            grad_scale,
            Some((dh, &mut grads.bufs[self.ids.output])),
        )?;
        self.scatter_input_grad(be, &ws.full, &mut ws.dnormed)?;
        be.fill(&mut ws.dx, 0.0);
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut grads.bufs[self.ids.norm],
            &ws.dnormed,
            &ws.resid[a.n_layers],
            &p[self.ids.norm],
            &ws.rstd_final,
            a.dim,
        );
        Ok(loss)
    }

    /// Adds the embedding gradient (after the first block's backward).
    pub fn embed_backward(
        &self,
        be: &B,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
    ) -> Result<()> {
        let _span = crate::trace::span("model", "embedding backward");
        let dtable = &mut grads.bufs[self.ids.tok_embeddings];
        let d = self.args.dim;
        if self.local.tp == 1 {
            be.embedding_backward(dtable, &ws.dx, &ws.inputs, d);
            return Ok(());
        }
        self.tp.gather_rows(be, &ws.dx, &mut ws.full)?;
        be.embedding_backward(dtable, &ws.full, &ws.local_ids, d);
        Ok(())
    }

    /// The linear layers of this rank's tensor-parallel group over `tokens` rows.
    fn sequence_parallel(&self, tokens: usize) -> SequenceParallel<'_, B> {
        SequenceParallel {
            tp: self.tp.as_ref(),
            tokens,
            deferred: None,
        }
    }

    pub fn block_forward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        self.block_forward_keeping(be, params, ws, l, ExpertActs::AsPlanned)
    }

    /// `block_forward`, keeping a mixture of experts' activations as `experts` says.
    fn block_forward_keeping(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        experts_kept: ExpertActs,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} forward"));
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let sp = self.sequence_parallel(b * s);
        let BlockLinears {
            wq,
            wk,
            wv,
            wo,
            w1,
            w2,
            w3,
        } = BlockLinears::of(m);
        let (before, after) = ws.resid.split_at_mut(l + 1);
        let x = &before[l];
        let out = &mut after[0];
        let save = ws.plan.blocks[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        // Attention: h = x + wo · Attention(RoPE(wq·n), RoPE(wk·n), wv·n), n = RMSNorm(x).
        be.rmsnorm_forward(
            acts.normed_attn,
            acts.rstd_attn,
            x,
            &p[id.attention_norm],
            d,
            a.norm_eps,
        );
        // With QK-norm the projections go to q_raw and k_raw, normed per head into q and k.
        let (q_proj, k_proj) = match m.qk_norm {
            true => (&mut *acts.q_raw, &mut *acts.k_raw),
            false => (&mut *acts.q, &mut *acts.k),
        };
        sp.column_forward(
            be,
            acts.normed_attn,
            acts.normed_attn_full,
            d,
            &mut [
                Projection::new(wq, &p[id.wq], q_proj),
                Projection::new(wk, &p[id.wk], k_proj),
                Projection::new(wv, &p[id.wv], acts.v),
            ],
        )?;
        if let (Some(qn), Some(kn)) = (id.q_norm, id.k_norm) {
            be.rmsnorm_forward(acts.q, acts.rstd_q, acts.q_raw, &p[qn], hd, a.norm_eps);
            be.rmsnorm_forward(acts.k, acts.rstd_k, acts.k_raw, &p[kn], hd, a.norm_eps);
        }
        let (cos, sin) = self.rope_tables(&ws.rope);
        be.rope_forward(acts.q, cos, sin, b, s, m.heads, hd, 0);
        be.rope_forward(acts.k, cos, sin, b, s, m.kv_heads, hd, 0);
        let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
        self.cp
            .attention_forward(be, acts.attn_out, acts.lse, acts.q, acts.k, acts.v, shape)?;
        sp.row_forward_residual(be, wo, acts.attn_out, &p[id.wo], x, acts.h, &mut ws.full)?;
        // Feed-forward: out = h + w2 · (silu(w1·n) ∘ w3·n), n = RMSNorm(h), or with a mixture
        // of experts out = h + MoE(n).
        be.rmsnorm_forward(
            acts.normed_ffn,
            acts.rstd_ffn,
            acts.h,
            &p[id.ffn_norm],
            d,
            a.norm_eps,
        );
        // The SwiGLU (the dense feed-forward, or a mixture of experts' shared experts), column-
        // then row-parallel under TP: out = h + w2 · (silu(w1·n) ∘ w3·n).
        match id.ffn.swiglu() {
            Some([i1, i2, i3]) => {
                sp.column_forward(
                    be,
                    acts.normed_ffn,
                    acts.normed_ffn_full,
                    d,
                    &mut [
                        Projection::new(w1, &p[i1], acts.gate),
                        Projection::new(w3, &p[i3], acts.up),
                    ],
                )?;
                be.swiglu_forward(acts.act, acts.gate, acts.up);
                sp.row_forward_residual(be, w2, acts.act, &p[i2], acts.h, out, &mut ws.full)?;
            }
            None => be.copy_from(out, acts.h),
        }
        // The routed experts: out += Σ_j w_j · Expert_j(n), on this rank's rows.
        match &id.ffn {
            FeedForwardIds::Dense { .. } => Ok(()),
            FeedForwardIds::Moe(experts) => {
                let shapes = self.moe_shapes()?;
                let bias = self.block_expert_bias(l);
                let sum = |v: &mut [f32]| self.sum_over_sequence_ranks(be, v);
                let moe_acts = moe::forward(
                    be,
                    &shapes,
                    experts,
                    p,
                    acts.normed_ffn,
                    out,
                    bias.as_deref(),
                    self.ep.as_ref(),
                    self.sequence_rows(b, s, &sum),
                )?;
                // A block that keeps only its input recomputes its experts before its backward.
                let keep = experts_kept == ExpertActs::ForBackward || save != BlockSave::Input;
                ws.moe[l] = keep.then_some(moe_acts);
                Ok(())
            }
        }
    }

    /// The mixture-of-experts layer's shapes (a MoE model's): its routed experts (the block
    /// computes the shared experts as its SwiGLU, `FeedForwardIds::swiglu`).
    fn moe_shapes(&self) -> Result<MoeShapes> {
        match &self.args.moe {
            Some(moe) => Ok(MoeShapes::new(self.args.dim, moe)),
            None => {
                bail!("a mixture-of-experts block in a model without MoE arguments (a titan bug)")
            }
        }
    }

    /// Before block `l`'s backward, what its forward did not keep (activation checkpointing):
    /// with the same kernels on the same inputs, so the values are the forward's, bit for bit.
    fn recompute(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} recompute"));
        match ws.plan.blocks[l] {
            BlockSave::Everything => Ok(()),
            // The whole forward again, from the block's input (its output, the next block's
            // input, is written again with the same values).
            BlockSave::Input => {
                self.block_forward_keeping(be, params, ws, l, ExpertActs::ForBackward)
            }
            BlockSave::ExpensiveOps => self.recompute_missing(be, params, ws, l),
            BlockSave::Elsewhere => {
                anyhow::bail!("block {l} runs on another pipeline rank, not this one")
            }
        }
    }

    /// Selective checkpointing: every activation the block did not keep, op by op in the
    /// forward's order, from the block's input and what it kept (an op whose output was kept is
    /// skipped; the block's output is not needed again).
    fn recompute_missing(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let n = b * s;
        let save = ws.plan.blocks[l];
        let redo = |act: Act| !save.keeps(act);
        let x = &ws.resid[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        let (cos, sin) = self.rope_tables(&ws.rope);
        let tp = m.tp > 1;
        let sp = self.sequence_parallel(n);
        if redo(Act::NormedAttn) || redo(Act::RstdAttn) {
            let w = &p[id.attention_norm];
            be.rmsnorm_forward(acts.normed_attn, acts.rstd_attn, x, w, d, a.norm_eps);
        }
        // The projections go through the forward's own column-parallel layer (gather and GEMMs,
        // chunked alike under async TP), so their values are the forward's to the bit.
        let (redo_q, redo_k) = (redo(Act::Q), redo(Act::K));
        {
            let BlockLinears { wq, wk, wv, .. } = BlockLinears::of(m);
            let mut qkv = Vec::new();
            // With QK-norm the projections are q_raw and k_raw (then normed into q and k).
            let (q_proj, k_proj, redo_q_proj, redo_k_proj) = match m.qk_norm {
                true => (
                    &mut *acts.q_raw,
                    &mut *acts.k_raw,
                    redo(Act::QRaw),
                    redo(Act::KRaw),
                ),
                false => (&mut *acts.q, &mut *acts.k, redo_q, redo_k),
            };
            if redo_q_proj {
                qkv.push(Projection::new(wq, &p[id.wq], q_proj));
            }
            if redo_k_proj {
                qkv.push(Projection::new(wk, &p[id.wk], k_proj));
            }
            if redo(Act::V) {
                qkv.push(Projection::new(wv, &p[id.wv], &mut *acts.v));
            }
            if !qkv.is_empty() {
                sp.column_forward(be, acts.normed_attn, acts.normed_attn_full, d, &mut qkv)?;
            } else if tp && redo(Act::NormedAttnFull) {
                self.tp
                    .gather_rows(be, acts.normed_attn, acts.normed_attn_full)?;
            }
        }
        if let (Some(qn), Some(kn)) = (id.q_norm, id.k_norm) {
            if redo_q || redo(Act::RstdQ) {
                be.rmsnorm_forward(acts.q, acts.rstd_q, acts.q_raw, &p[qn], hd, a.norm_eps);
            }
            if redo_k || redo(Act::RstdK) {
                be.rmsnorm_forward(acts.k, acts.rstd_k, acts.k_raw, &p[kn], hd, a.norm_eps);
            }
        }
        if redo_q {
            be.rope_forward(acts.q, cos, sin, b, s, m.heads, hd, 0);
        }
        if redo_k {
            be.rope_forward(acts.k, cos, sin, b, s, m.kv_heads, hd, 0);
        }
        if redo(Act::AttnOut) || redo(Act::Lse) {
            let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
            self.cp.attention_forward(
                be,
                acts.attn_out,
                acts.lse,
                acts.q,
                acts.k,
                acts.v,
                shape,
            )?;
        }
        if redo(Act::H) {
            let w = &p[id.wo];
            let wo = BlockLinears::of(m).wo;
            sp.row_forward_residual(be, wo, acts.attn_out, w, x, acts.h, &mut ws.full)?;
        }
        if redo(Act::NormedFfn) || redo(Act::RstdFfn) {
            let w = &p[id.ffn_norm];
            be.rmsnorm_forward(acts.normed_ffn, acts.rstd_ffn, acts.h, w, d, a.norm_eps);
        }
        // A mixture of experts keeps its routed experts' activations in `ws.moe` (its own
        // forward's, or the recomputed block's): only the SwiGLU (dense, or the shared experts)
        // has projections to redo here.
        if let Some([w1, _, w3]) = id.ffn.swiglu() {
            let mut gate_up = Vec::new();
            if redo(Act::Gate) {
                gate_up.push(Projection::new(
                    Linear::new(d, m.ffn),
                    &p[w1],
                    &mut *acts.gate,
                ));
            }
            if redo(Act::Up) {
                gate_up.push(Projection::new(
                    Linear::new(d, m.ffn),
                    &p[w3],
                    &mut *acts.up,
                ));
            }
            if !gate_up.is_empty() {
                sp.column_forward(be, acts.normed_ffn, acts.normed_ffn_full, d, &mut gate_up)?;
            } else if tp && redo(Act::NormedFfnFull) {
                self.tp
                    .gather_rows(be, acts.normed_ffn, acts.normed_ffn_full)?;
            }
        }
        if redo(Act::Act) && id.ffn.swiglu().is_some() {
            be.swiglu_forward(acts.act, acts.gate, acts.up);
        }
        Ok(())
    }

    /// On entry `ws.dx` holds ∂L/∂(block output) on this rank's rows; on exit ∂L/∂(block input).
    pub fn block_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} backward"));
        self.block_backward_deferring(be, params, grads, ws, l, None)
    }

    /// The input-gradient half of `block_backward` (zero-bubble pipeline schedules): the same
    /// chain to ∂L/∂(block input) and the norms' weight gradients, with the projections' weight
    /// gradients left in `deferred` for `apply_weight_grads`.
    pub fn block_backward_input(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        deferred: &std::cell::RefCell<Vec<DeferredWeightGrad<B>>>,
    ) -> Result<()> {
        let _span = crate::trace::span_named("model", || format!("block {l} input gradient"));
        self.block_backward_deferring(be, params, grads, ws, l, Some(deferred))
    }

    /// The weight-gradient half: the projections' `dW += dyᵀ · x` left by `block_backward_input`.
    pub fn apply_weight_grads(
        &self,
        be: &B,
        grads: &mut ParamSet<B>,
        deferred: Vec<DeferredWeightGrad<B>>,
    ) {
        let _span = crate::trace::span("model", "weight gradients");
        for g in deferred {
            g.apply(be, &mut grads.bufs[g.param]);
        }
    }

    fn block_backward_deferring(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
        deferred: Option<&std::cell::RefCell<Vec<DeferredWeightGrad<B>>>>,
    ) -> Result<()> {
        let (a, m) = (&self.args, &self.local);
        let id = &self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, hd) = (ws.batch, ws.seq, a.dim, m.head_dim);
        let sp = SequenceParallel {
            deferred,
            ..self.sequence_parallel(b * s)
        };
        let BlockLinears {
            wq,
            wk,
            wv,
            wo,
            w1,
            w2,
            w3,
        } = BlockLinears::of(m);
        self.recompute(be, params, ws, l)?;
        let save = ws.plan.blocks[l];
        let acts = BlockActs::pick(&mut ws.layers[l], &mut ws.recomputed, save);
        // QK-norm's weight gradients, out of the set while the block's others are borrowed.
        let mut qk_norm_grads = match (id.q_norm, id.k_norm) {
            (Some(qn), Some(kn)) => Some((
                (qn, std::mem::replace(&mut grads.bufs[qn], be.zeros(0))),
                (kn, std::mem::replace(&mut grads.bufs[kn], be.zeros(0))),
            )),
            _ => None,
        };
        // Feed-forward: ∂L/∂n into ws.dnormed, the SwiGLU's (dense, or the shared experts')
        // first, then the routed experts' added.
        match id.ffn.swiglu() {
            Some([i1, i2, i3]) => {
                let [g_w1, g_w2, g_w3] = grads
                    .bufs
                    .get_disjoint_mut([i1, i2, i3])
                    .expect("a block's parameters are distinct");
                sp.row_backward(
                    be,
                    w2,
                    &ws.dx,
                    &mut ws.full,
                    &p[i2],
                    (g_w2, i2),
                    acts.act,
                    &mut ws.dact,
                )?;
                be.swiglu_backward(&mut ws.dgate, &mut ws.dup, &ws.dact, acts.gate, acts.up);
                sp.column_backward(
                    be,
                    &mut [
                        ProjectionGrad::new(w1, &ws.dgate, &p[i1], g_w1, i1),
                        ProjectionGrad::new(w3, &ws.dup, &p[i3], g_w3, i3),
                    ],
                    self.gathered(acts.normed_ffn, acts.normed_ffn_full),
                    &mut ws.full,
                    &mut ws.dnormed,
                )?;
            }
            None => be.fill(&mut ws.dnormed, 0.0),
        }
        match &id.ffn {
            FeedForwardIds::Dense { .. } => {}
            FeedForwardIds::Moe(experts) => {
                let moe_acts = ws.moe[l].take().ok_or_else(|| {
                    anyhow::anyhow!("block {l}: no mixture-of-experts activations (a titan bug)")
                })?;
                {
                    let mut load = self.expert_load.lock().unwrap_or_else(|e| e.into_inner());
                    for &e in &moe_acts.routing.experts {
                        load[l][e as usize] += 1;
                    }
                }
                let aux_scale = match (&moe_acts.aux, self.args.moe.and_then(|m| m.aux_loss_coef)) {
                    (Some(stats), Some(coef)) => {
                        let share = (self.local.tp * self.local.cp) as f64;
                        let value: f64 = stats.values.iter().map(|&v| v as f64).sum();
                        *self.aux_loss.lock().unwrap_or_else(|e| e.into_inner()) +=
                            coef as f64 * value / self.sequences_per_step as f64 / share;
                        coef / self.sequences_per_step as f32
                    }
                    _ => 0.0,
                };
                let shapes = self.moe_shapes()?;
                moe::backward(
                    be,
                    &shapes,
                    experts,
                    p,
                    &mut grads.bufs,
                    &moe_acts,
                    acts.normed_ffn,
                    &ws.dx,
                    &mut ws.dnormed,
                    self.ep.as_ref(),
                    aux_scale,
                )?;
            }
        }
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut grads.bufs[id.ffn_norm],
            &ws.dnormed,
            acts.h,
            &p[id.ffn_norm],
            acts.rstd_ffn,
            d,
        );
        let [g_wq, g_wk, g_wv, g_wo, g_attn_norm] = grads
            .bufs
            .get_disjoint_mut([id.wq, id.wk, id.wv, id.wo, id.attention_norm])
            .expect("a block's parameters are distinct");
        // Attention.
        sp.row_backward(
            be,
            wo,
            &ws.dx,
            &mut ws.full,
            &p[id.wo],
            (g_wo, id.wo),
            acts.attn_out,
            &mut ws.dattn,
        )?;
        let shape = AttnShape::causal(b, s, m.heads, m.kv_heads, hd);
        self.cp.attention_backward(
            be,
            &mut ws.dq,
            &mut ws.dk,
            &mut ws.dv,
            &ws.dattn,
            acts.q,
            acts.k,
            acts.v,
            acts.attn_out,
            acts.lse,
            shape,
        )?;
        let (cos, sin) = self.rope_tables(&ws.rope);
        be.rope_backward(&mut ws.dq, cos, sin, b, s, m.heads, hd);
        be.rope_backward(&mut ws.dk, cos, sin, b, s, m.kv_heads, hd);
        if let Some(((qn, gq), (kn, gk))) = qk_norm_grads.as_mut() {
            be.fill(&mut ws.dq_raw, 0.0);
            be.fill(&mut ws.dk_raw, 0.0);
            let (q_raw, k_raw) = (&*acts.q_raw, &*acts.k_raw);
            be.rmsnorm_backward(&mut ws.dq_raw, gq, &ws.dq, q_raw, &p[*qn], acts.rstd_q, hd);
            be.rmsnorm_backward(&mut ws.dk_raw, gk, &ws.dk, k_raw, &p[*kn], acts.rstd_k, hd);
        }
        let (dq, dk) = match m.qk_norm {
            true => (&ws.dq_raw, &ws.dk_raw),
            false => (&ws.dq, &ws.dk),
        };
        sp.column_backward(
            be,
            &mut [
                ProjectionGrad::new(wq, dq, &p[id.wq], g_wq, id.wq),
                ProjectionGrad::new(wk, dk, &p[id.wk], g_wk, id.wk),
                ProjectionGrad::new(wv, &ws.dv, &p[id.wv], g_wv, id.wv),
            ],
            self.gathered(acts.normed_attn, acts.normed_attn_full),
            &mut ws.full,
            &mut ws.dnormed,
        )?;
        be.rmsnorm_backward(
            &mut ws.dx,
            g_attn_norm,
            &ws.dnormed,
            &ws.resid[l],
            &p[id.attention_norm],
            acts.rstd_attn,
            d,
        );
        if let Some(((qn, gq), (kn, gk))) = qk_norm_grads {
            grads.bufs[qn] = gq;
            grads.bufs[kn] = gk;
        }
        Ok(())
    }

    /// A column-parallel input as the forward left it: the local rows, or the gathered ones.
    fn gathered<'a>(&self, local: &'a B::Buf, full: &'a B::Buf) -> &'a B::Buf {
        if self.local.tp == 1 {
            local
        } else {
            full
        }
    }

    // ------------------------------------------------------------------ inference with a KV cache

    /// Runs `tokens` at positions `cache.len..` and returns the logits of the last one.
    pub fn forward_cached(
        &self,
        be: &B,
        params: &ParamSet<B>,
        cache: &mut KvCache<B>,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        let a = &self.args;
        if self.local.tp != 1 || self.local.cp != 1 {
            bail!("generation runs the whole model in one process (this one is a tensor- or context-parallel rank)");
        }
        let n = tokens.len();
        let pos = cache.len;
        if n == 0 {
            bail!("forward_cached needs at least one token");
        }
        if pos + n > cache.capacity || pos + n > self.rope_len {
            bail!(
                "generation reached {} tokens, beyond the cache of {}",
                pos + n,
                cache.capacity.min(self.rope_len)
            );
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= a.vocab_size) {
            bail!(
                "token id {bad} is outside the model's vocabulary of {}",
                a.vocab_size
            );
        }
        let (d, f, hd) = (a.dim, a.swiglu_hidden(), a.head_dim());
        let (qd, kvd) = (a.n_heads * hd, a.n_kv_heads * hd);
        let (wq, wkv, wo) = (Linear::new(d, qd), Linear::new(d, kvd), Linear::new(qd, d));
        let (w13, w2) = (Linear::new(d, f), Linear::new(f, d));
        let p = &params.bufs;
        let mut x = be.zeros(n * d);
        be.embedding_forward(&mut x, &p[self.ids.tok_embeddings], tokens, d);
        let (mut normed, mut rstd) = (be.zeros(n * d), be.zeros(n));
        let (mut q, mut k, mut v) = (be.zeros(n * qd), be.zeros(n * kvd), be.zeros(n * kvd));
        // QK-norm's scratch: the projections before it and the statistics.
        let mut qk_norm = a.qk_norm.then(|| {
            let (q_raw, k_raw) = (be.zeros(n * qd), be.zeros(n * kvd));
            let (rq, rk) = (be.zeros(n * a.n_heads), be.zeros(n * a.n_kv_heads));
            (q_raw, k_raw, rq, rk)
        });
        let (mut attn, mut lse) = (be.zeros(n * qd), be.zeros(a.n_heads * n));
        let (mut gate, mut up, mut act) = (be.zeros(n * f), be.zeros(n * f), be.zeros(n * f));
        let (cos, sin) = (&self.rope_cos, &self.rope_sin);
        for l in 0..a.n_layers {
            let id = &self.ids.layers[l];
            be.rmsnorm_forward(
                &mut normed,
                &mut rstd,
                &x,
                &p[id.attention_norm],
                d,
                a.norm_eps,
            );
            match (&mut qk_norm, id.q_norm, id.k_norm) {
                (Some((q_raw, k_raw, rq, rk)), Some(qn), Some(kn)) => {
                    wq.forward(be, q_raw, &normed, &p[id.wq], n);
                    wkv.forward(be, k_raw, &normed, &p[id.wk], n);
                    be.rmsnorm_forward(&mut q, rq, q_raw, &p[qn], hd, a.norm_eps);
                    be.rmsnorm_forward(&mut k, rk, k_raw, &p[kn], hd, a.norm_eps);
                }
                _ => {
                    wq.forward(be, &mut q, &normed, &p[id.wq], n);
                    wkv.forward(be, &mut k, &normed, &p[id.wk], n);
                }
            }
            wkv.forward(be, &mut v, &normed, &p[id.wv], n);
            be.rope_forward(&mut q, cos, sin, 1, n, a.n_heads, hd, pos);
            be.rope_forward(&mut k, cos, sin, 1, n, a.n_kv_heads, hd, pos);
            be.copy_into_at(&mut cache.k[l], pos * kvd, &k);
            be.copy_into_at(&mut cache.v[l], pos * kvd, &v);
            let shape = AttnShape {
                batch: 1,
                q_len: n,
                kv_len: pos + n,
                kv_capacity: cache.capacity,
                n_heads: a.n_heads,
                n_kv_heads: a.n_kv_heads,
                head_dim: hd,
                q_offset: pos,
            };
            be.attention_forward(&mut attn, &mut lse, &q, &cache.k[l], &cache.v[l], shape);
            wo.add_forward(be, &mut x, &attn, &p[id.wo], n);
            be.rmsnorm_forward(&mut normed, &mut rstd, &x, &p[id.ffn_norm], d, a.norm_eps);
            if let Some([i1, i2, i3]) = id.ffn.swiglu() {
                w13.forward(be, &mut gate, &normed, &p[i1], n);
                w13.forward(be, &mut up, &normed, &p[i3], n);
                be.swiglu_forward(&mut act, &gate, &up);
                w2.add_forward(be, &mut x, &act, &p[i2], n);
            }
            match &id.ffn {
                FeedForwardIds::Dense { .. } => {}
                FeedForwardIds::Moe(experts) => {
                    let bias = self.block_expert_bias(l);
                    let shapes = self.moe_shapes()?;
                    moe::forward(
                        be,
                        &shapes,
                        experts,
                        p,
                        &normed,
                        &mut x,
                        bias.as_deref(),
                        self.ep.as_ref(),
                        None,
                    )?;
                }
            }
        }
        cache.len += n;
        let last = be.upload(&be.download(&x)[(n - 1) * d..]);
        let mut last_normed = be.zeros(d);
        let mut last_rstd = be.zeros(1);
        be.rmsnorm_forward(
            &mut last_normed,
            &mut last_rstd,
            &last,
            &p[self.ids.norm],
            d,
            a.norm_eps,
        );
        let mut logits = be.zeros(a.vocab_size);
        be.logits(
            &mut logits,
            &last_normed,
            &p[self.ids.output],
            1,
            d,
            a.vocab_size,
        );
        Ok(be.download(&logits))
    }
}

/// Keys and values of every block for positions `0..len`, laid out `[capacity, n_kv_heads, head_dim]`.
pub struct KvCache<B: Backend> {
    pub k: Vec<B::Buf>,
    pub v: Vec<B::Buf>,
    pub len: usize,
    pub capacity: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(be: &B, args: &ModelArgs, capacity: usize) -> Self {
        let kvd = args.n_kv_heads * args.head_dim();
        KvCache {
            k: (0..args.n_layers)
                .map(|_| be.zeros(capacity * kvd))
                .collect(),
            v: (0..args.n_layers)
                .map(|_| be.zeros(capacity * kvd))
                .collect(),
            len: 0,
            capacity,
        }
    }
}
