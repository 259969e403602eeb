//! The one decoder every model family runs (Llama 3, Qwen3, DeepSeek-V3: `model::families`),
//! with an explicit forward (saving what the backward needs) and backward, written once in one
//! tensor-parallel rank's shapes (`LocalShapes`; with one rank, the model's). A family selects its
//! block features through `ModelArgs` (QK-norm, multi-head latent attention in `mla/`, a mixture
//! of experts); the block reads them, nothing here names a family.
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
//! Context parallelism splits each sequence over a group (`model::crossings::context`): a rank's
//! workspace holds its shard of every sequence, RoPE rotates its rows by their global positions,
//! and attention crosses the group (`ContextParallelOps`); nothing else in the block changes.
//!
//! Activations live in a `Workspace` sized once for a (batch, seq) shape and reused every step.

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::backend::{cpu::rope::rope_tables, Backend, IGNORE_INDEX};

use crate::model::args::ModelArgs;
use crate::model::crossings::context::{ContextParallelOps, SequenceShard};
use crate::model::crossings::expert::ExpertParallelOps;
use crate::model::crossings::single_rank::SingleRank;
use crate::model::crossings::tensor::TensorParallelOps;
use crate::model::float8_convert::Float8Conversion;
use crate::model::local_shapes::LocalShapes;
use crate::model::moe;
use crate::model::params::{local_param_specs, ParamIds, ParamSet};
use crate::model::token_marks;

mod backward;
mod block;
mod generate;
mod head;
pub mod mla;
mod positions;
mod residual;
mod run;
mod workspace;
mod workspace_floats;

pub use generate::KvCache;
pub use positions::document_positions;
use positions::Positions;
pub use workspace::{LayerActs, Workspace};
pub use workspace_floats::{workspace_floats, WorkspaceFloats, WorkspacePart};

/// A decoder model bound to a backend: shapes, parameter indices, RoPE tables and the
/// tensor- and context-parallel groups its blocks cross.
pub struct Decoder<B: Backend> {
    pub args: ModelArgs,
    /// The shapes this rank computes with.
    pub local: LocalShapes,
    pub ids: ParamIds,
    tp: Arc<dyn TensorParallelOps<B>>,
    cp: Arc<dyn ContextParallelOps<B>>,
    /// The expert-parallel group a mixture of experts' rows travel over (one rank: `SingleRank`).
    ep: Arc<dyn ExpertParallelOps<B>>,
    /// Each mixture-of-experts block's routing bias (`load_balance_coeff`; empty without), moved
    /// after every step by `update_expert_bias`. (The step's expert load and auxiliary loss are
    /// counted in the workspaces: `Workspace::take_expert_stats`.)
    expert_bias: Vec<Vec<f32>>,
    /// The same on the device, where the router reads it: uploaded when it moves (once per step),
    /// not by every block's forward.
    expert_bias_bufs: Vec<B::Buf>,
    /// Sequences in an optimizer step over the whole job (the global batch): the auxiliary loss is
    /// a mean over them.
    sequences_per_step: usize,
    rope_cos: B::Buf,
    rope_sin: B::Buf,
    rope_len: usize,
    /// The tables' host copies, gathered per token for sequences of several documents.
    rope_host: (Vec<f32>, Vec<f32>),
    /// Block-causal attention over the documents the data marks (`with_documents`); false:
    /// each sequence is one document.
    documents: bool,
    /// Which linears compute in float8 (`[model] converters`; none by default).
    float8: Float8Conversion,
    /// Ones of the head width: the weight of a weightless QK-norm (Llama 4's; None without).
    unit_weight: Option<B::Buf>,
}

impl<B: Backend> Decoder<B> {
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
            "Decoder: shapes and group disagree on the TP degree"
        );
        let (cos, sin) = rope_tables(args.rope_dim(), max_seq, args.rope_theta, args.rope_scaling);
        let expert_bias = match &args.moe {
            Some(moe) if moe.load_balance_coeff.is_some() => {
                vec![vec![0.0; moe.router.num_experts]; args.n_layers]
            }
            _ => Vec::new(),
        };
        let unit_weight = args
            .l2_qk_norm
            .then(|| backend.upload(&vec![1.0; args.head_dim()]));
        Ok(Decoder {
            ids: ParamIds::new(&args),
            args,
            local,
            tp,
            cp: Arc::new(SingleRank),
            ep: Arc::new(SingleRank),
            expert_bias_bufs: expert_bias.iter().map(|b| backend.upload(b)).collect(),
            expert_bias,
            sequences_per_step: 1,
            rope_cos: backend.upload(&cos),
            rope_sin: backend.upload(&sin),
            rope_len: max_seq,
            rope_host: (cos, sin),
            documents: false,
            float8: Float8Conversion::default(),
            unit_weight,
        })
    }

    /// This model with the linears `float8` converted computing in float8 (TorchTitan applies its
    /// model converters before parallelizing; here they only mark which linears cast their
    /// operands, so the order does not matter).
    pub fn with_float8(mut self, float8: Float8Conversion) -> Self {
        self.float8 = float8;
        self
    }

    /// Which linears compute in float8.
    pub fn float8(&self) -> &Float8Conversion {
        &self.float8
    }

    /// This model with its attention spread over a context-parallel group (`self.local` says
    /// which shard of each sequence this rank holds).
    pub fn with_context_parallel(mut self, cp: Arc<dyn ContextParallelOps<B>>) -> Self {
        assert_eq!(
            self.local.cp,
            cp.degree(),
            "Decoder: shapes and group disagree on the CP degree"
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
            "Decoder: shapes and group disagree on the EP degree or rank"
        );
        self.ep = ep;
        self
    }

    /// This model with block-causal attention over the documents packed in each sequence, each
    /// starting at a token the data marked (`token_marks::DOCUMENT_START`, `positions.rs`).
    pub fn with_documents(mut self) -> Self {
        self.documents = true;
        self
    }

    /// This model in a job whose optimizer steps take `sequences` sequences (the global batch):
    /// the MoE auxiliary loss is their mean.
    pub fn with_sequences_per_step(mut self, sequences: usize) -> Self {
        self.sequences_per_step = sequences.max(1);
        self
    }

    /// With the auxiliary loss: which sequence each of this rank's rows of a block's forward
    /// belongs to (its sequence-parallel rows under TP; its shard of each under CP), and the sum
    /// of per-sequence figures over the TP and CP ranks sharing them.
    fn sequence_rows<'a>(
        &self,
        batch: usize,
        seq: usize,
        sum: &'a (dyn Fn(&mut B::Buf) -> Result<()> + 'a),
    ) -> Option<moe::aux_loss::SequenceRows<'a, B>> {
        self.args.moe.as_ref()?.aux_loss_coef?;
        let rows = self.local.rows(batch * seq);
        let span = moe::aux_loss::SequenceSpan {
            first: self.local.tp_rank * rows,
            seq,
            sequences: batch,
        };
        Some(moe::aux_loss::SequenceRows { span, sum })
    }

    /// Sums per-sequence figures over the TP and CP ranks, on the backend's buffer (each group's
    /// device communicator, else its host transport); every one of them calls this together.
    fn sum_over_sequence_ranks(&self, be: &B, figures: &mut B::Buf) -> Result<()> {
        if self.local.tp > 1 {
            self.tp.all_reduce_sum(be, figures)?;
        }
        self.cp.sum_over_group(be, figures)
    }

    /// The expert-parallel group (degree 1 without expert parallelism).
    pub fn ep(&self) -> &dyn ExpertParallelOps<B> {
        self.ep.as_ref()
    }

    /// The context-parallel group (degree 1 without context parallelism).
    pub fn cp(&self) -> &dyn ContextParallelOps<B> {
        self.cp.as_ref()
    }

    /// Every MoE block's expert bias (None without load balancing).
    pub fn expert_bias(&self) -> Option<Vec<Vec<f32>>> {
        (!self.expert_bias.is_empty()).then(|| self.expert_bias.clone())
    }

    /// Restores the expert bias of a checkpoint (it must be this model's shape).
    pub fn set_expert_bias(&mut self, be: &B, saved: &[Vec<f32>]) -> Result<()> {
        let bias = &mut self.expert_bias;
        let shape = |b: &[Vec<f32>]| b.iter().map(Vec::len).collect::<Vec<_>>();
        if shape(bias) != shape(saved) {
            bail!(
                "the checkpoint's expert bias has {} blocks of {:?} experts; this model's has {} blocks of {:?} (is load_balance_coeff set alike?)",
                saved.len(),
                saved.first().map(Vec::len),
                bias.len(),
                bias.first().map(Vec::len)
            );
        }
        *bias = saved.to_vec();
        self.expert_bias_bufs = saved.iter().map(|b| be.upload(b)).collect();
        Ok(())
    }

    /// After a step: each block's bias moves `load_balance_coeff` toward the mean of `load`, the
    /// step's tokens per expert summed over the job (so every rank moves it alike).
    pub fn update_expert_bias(&mut self, be: &B, load: &[Vec<u64>]) {
        let Some(coeff) = self.args.moe.and_then(|m| m.load_balance_coeff) else {
            return;
        };
        // A dense block has no experts to balance (its bias stays zero, unused).
        let biases = self.expert_bias.iter_mut().zip(&mut self.expert_bias_bufs);
        for (layer, ((b, buf), l)) in biases.zip(load).enumerate() {
            if self.args.moe_at(layer).is_some() {
                moe::router::update_expert_bias(b, l, coeff);
                *buf = be.upload(b);
            }
        }
    }

    /// Block `l`'s routing bias on the device, when load balancing is on.
    fn block_expert_bias(&self, l: usize) -> Option<&B::Buf> {
        self.expert_bias_bufs.get(l)
    }

    /// The positions of each sequence this rank holds.
    pub fn sequence_shard(&self) -> SequenceShard {
        SequenceShard {
            degree: self.local.cp,
            rank: self.local.cp_rank,
        }
    }

    /// The targets of `[rows, seq+1]` token rows that count toward this rank's loss: those at its
    /// positions, padding and tokens marked not a target left out (`token_marks`).
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
                            .filter(|&&t| token_marks::target(t) != IGNORE_INDEX)
                            .count()
                    })
                    .sum::<usize>()
            })
            .sum()
    }

    /// Where a workspace's rows sit: the model's RoPE tables, or the rows' own (a
    /// context-parallel shard's, or a row per token for sequences of several documents), and
    /// the documents' positions.
    fn positions<'a>(
        &'a self,
        own: &'a Option<(B::Buf, B::Buf)>,
        in_document: &'a Option<Vec<u32>>,
        in_chunk: &'a Option<Vec<u32>>,
    ) -> Positions<'a, B> {
        debug_assert!(
            self.local.cp == 1 || own.is_some(),
            "a context-parallel workspace gets its RoPE tables from load_tokens"
        );
        let tables = match own {
            Some((cos, sin)) => (cos, sin),
            None => (&self.rope_cos, &self.rope_sin),
        };
        Positions::new(tables, in_document.as_deref(), in_chunk.as_deref())
    }

    /// The rows of the model's RoPE tables at `positions`, one a token, on the device.
    fn rope_rows(
        &self,
        be: &B,
        positions: impl Iterator<Item = usize> + Clone,
    ) -> (B::Buf, B::Buf) {
        let half = self.args.rope_dim() / 2;
        let rows = |table: &[f32]| -> Vec<f32> {
            positions
                .clone()
                .flat_map(|p| &table[p * half..(p + 1) * half])
                .copied()
                .collect()
        };
        (
            be.upload(&rows(&self.rope_host.0)),
            be.upload(&rows(&self.rope_host.1)),
        )
    }

    /// With documents on, each input token's position in its document (of the rank's rows: with
    /// context parallelism, its shard's, found from the whole sequences in `tokens`) and the RoPE
    /// tables' rows for them; nothing when every sequence is one document (then attention and
    /// RoPE are exactly the causal ones). With chunked attention, each token's place in its chunk
    /// (`positions::chunk_positions`); nothing when no chunk starts inside a document.
    fn load_documents(&self, be: &B, ws: &mut Workspace<B>, tokens: &[u32]) -> Result<()> {
        let chunk = self.args.attention_chunk_size;
        ws.chunks = None;
        if !self.documents && chunk.is_none() {
            return Ok(());
        }
        let s = ws.seq * self.local.cp;
        let shard = self.sequence_shard().positions(s);
        let positions: Vec<u32> = tokens
            .chunks(s + 1)
            .flat_map(|row| {
                let whole = match self.documents {
                    true => document_positions(&row[..s]),
                    false => (0..s as u32).collect(),
                };
                shard.iter().map(move |&p| whole[p])
            })
            .collect();
        if let Some(c) = chunk {
            let indices: Vec<usize> = shard
                .iter()
                .copied()
                .cycle()
                .take(positions.len())
                .collect();
            let in_chunk = positions::chunk_positions(&indices, &positions, c);
            ws.chunks = (in_chunk != positions).then_some(in_chunk);
        }
        let one_document = positions
            .chunks(ws.seq)
            .all(|row| row.iter().zip(&shard).all(|(&p, &at)| p as usize == at));
        if one_document {
            // The model's tables, or the shard's (made again by `load_tokens`).
            (ws.documents, ws.rope) = (None, None);
            return Ok(());
        }
        ws.rope = Some(self.rope_rows(be, positions.iter().map(|&p| p as usize)));
        ws.documents = Some(positions);
        Ok(())
    }

    /// Names and shapes of this rank's parameters (its tensor-parallel parts).
    pub fn param_specs(&self) -> Vec<(String, Vec<usize>)> {
        local_param_specs(&self.args, self.local.tp)
    }

    /// The tensor-parallel group (degree 1 without tensor parallelism).
    pub fn tp(&self) -> &dyn TensorParallelOps<B> {
        self.tp.as_ref()
    }

    /// Checks `tokens` (`[batch, seq+1]`, whole sequences) and splits them into the workspace's
    /// inputs and targets: with context parallelism, those at this rank's positions. This is where
    /// token ids enter the model: one outside the vocabulary is an error here, before any kernel.
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
        // The data loader's marks cleared (`token_marks`); padding (first-fit packing) is
        // IGNORE_INDEX: targets that count for nothing, inputs that embed as zeros.
        let ids: Vec<u32> = tokens.iter().map(|&t| token_marks::token_id(t)).collect();
        check_ids_but(&ids, s + 1, self.args.vocab_size, IGNORE_INDEX)?;
        let chunks = self.sequence_shard().chunks(s);
        for (r, (row, marked)) in ids.chunks(s + 1).zip(tokens.chunks(s + 1)).enumerate() {
            let mut at = r * ws.seq;
            for c in &chunks {
                let n = c.len();
                ws.inputs[at..at + n].copy_from_slice(&row[c.clone()]);
                let targets = marked[c.start + 1..c.end + 1].iter();
                for (t, &m) in ws.targets[at..at + n].iter_mut().zip(targets) {
                    *t = token_marks::target(m);
                }
                at += n;
            }
        }
        self.load_documents(be, ws, tokens)?;
        if self.local.cp > 1 && ws.rope.is_none() {
            // The shard's rows of the model's tables (their global positions).
            ws.rope = Some(self.rope_rows(be, self.sequence_shard().positions(s).into_iter()));
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
            be.embedding_forward(ws.resid.write(0), table, &ws.inputs, d);
        } else {
            be.embedding_forward(&mut ws.full, table, &ws.local_ids, d);
            self.tp
                .reduce_scatter_rows(be, &ws.full, ws.resid.write(0))?;
        }
        ws.resid.commit(be, 0);
        Ok(())
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
        if be.len(dtable) == 0 {
            return Ok(()); // frozen (LoRA): every rank alike, so no collective is skipped alone
        }
        if self.local.tp == 1 {
            be.embedding_backward(dtable, &ws.dx, &ws.inputs, d);
            return Ok(());
        }
        self.tp.gather_rows(be, &ws.dx, &mut ws.full)?;
        be.embedding_backward(dtable, &ws.full, &ws.local_ids, d);
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
}

/// Where token ids enter the model (training batches, prompts): every id below `vocab`, or an
/// error naming the first that is not, its position (row and column of rows of `width`) and the
/// vocabulary size. No kernel then sees an id outside its table.
pub fn check_token_ids(tokens: &[u32], width: usize, vocab: usize) -> Result<()> {
    check_ids_but(tokens, width, vocab, None)
}

/// `check_token_ids` with `allowed` (padding) let through.
fn check_ids_but(
    tokens: &[u32],
    width: usize,
    vocab: usize,
    allowed: impl Into<Option<u32>>,
) -> Result<()> {
    let allowed = allowed.into();
    let Some(i) = tokens
        .iter()
        .position(|&t| t as usize >= vocab && Some(t) != allowed)
    else {
        return Ok(());
    };
    let width = width.max(1);
    bail!(
        "token id {} at position {i} (row {}, column {}) is outside the model's vocabulary of {vocab} ids",
        tokens[i],
        i / width,
        i % width
    )
}
