//! The Llama 3 decoder with an explicit forward (saving what the backward needs) and backward.
//!
//! Per block: `h = x + Attention(RMSNorm(x))`, `out = h + W2·(silu(W1·n) ∘ W3·n)` with `n = RMSNorm(h)`.
//! Activations live in a `Workspace` sized once for a (batch, seq) shape and reused every step.

use anyhow::{bail, Result};

use crate::backend::{cpu::rope::rope_tables, AttnShape, Backend, LossSum};

use super::args::ModelArgs;
use super::params::{param_specs, LayerIds, ParamIds, ParamSet};

/// What one block keeps from its forward for its backward.
pub struct LayerActs<B: Backend> {
    pub normed_attn: B::Buf,
    pub rstd_attn: B::Buf,
    pub q: B::Buf,
    pub k: B::Buf,
    pub v: B::Buf,
    pub attn_out: B::Buf,
    pub lse: B::Buf,
    pub h: B::Buf,
    pub normed_ffn: B::Buf,
    pub rstd_ffn: B::Buf,
    pub gate: B::Buf,
    pub up: B::Buf,
    pub act: B::Buf,
}

/// Every activation and gradient buffer of one training step, allocated once per shape.
pub struct Workspace<B: Backend> {
    pub batch: usize,
    pub seq: usize,
    /// Input of block `l` at `resid[l]`; the last entry is the final block's output.
    resid: Vec<B::Buf>,
    layers: Vec<LayerActs<B>>,
    normed_final: B::Buf,
    rstd_final: B::Buf,
    // backward scratch
    dx: B::Buf,
    dnormed: B::Buf,
    dq: B::Buf,
    dk: B::Buf,
    dv: B::Buf,
    dattn: B::Buf,
    dgate: B::Buf,
    dup: B::Buf,
    dact: B::Buf,
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

/// Float counts of the workspace for a shape: the single source for allocation and memory estimates.
pub fn workspace_floats(args: &ModelArgs, batch: usize, seq: usize) -> usize {
    let n = batch * seq;
    let (d, f, hd) = (args.dim, args.ffn_hidden, args.head_dim());
    let (qd, kvd) = (args.n_heads * hd, args.n_kv_heads * hd);
    let per_layer =
        n * (d + 1 + qd + 2 * kvd + qd + d + d + 1 + 3 * f) + batch * args.n_heads * seq;
    let resid = (args.n_layers + 1) * n * d;
    let scratch = n * (2 * d + 2 * qd + 2 * kvd + 3 * f);
    args.n_layers * per_layer + resid + n * (d + 1) + scratch
}

/// Values of the workspace allocated by `Backend::zeros_bf16_activation` (each layer's two norm
/// outputs, gate and up projections and SwiGLU output, and the backward's SwiGLU input and output
/// gradients), whose f32 storage a device may leave out.
pub fn workspace_bf16_activation_floats(args: &ModelArgs, batch: usize, seq: usize) -> usize {
    let n = batch * seq;
    args.n_layers * n * (2 * args.dim + 3 * args.ffn_hidden) + 3 * n * args.ffn_hidden
}

/// Values of the workspace whose producers may keep a bf16 copy beside them (or their values in
/// bf16 alone) for the GEMMs, attention and SwiGLU kernels that read them
/// (`Backend::activation_copy_bytes`): each layer's normed inputs, rotated q and k, attention
/// output, gate and up projections and SwiGLU output, the final norm's output, and the backward's
/// SwiGLU input and output gradients, rotated dq and dk, and block-input gradient.
pub fn workspace_copied_floats(args: &ModelArgs, batch: usize, seq: usize) -> usize {
    let n = batch * seq;
    let (d, f) = (args.dim, args.ffn_hidden);
    let (qd, kvd) = (
        args.n_heads * args.head_dim(),
        args.n_kv_heads * args.head_dim(),
    );
    args.n_layers * n * (2 * d + 2 * qd + kvd + 3 * f) + n * d + n * (3 * f + d + qd + kvd)
}

impl<B: Backend> Workspace<B> {
    pub fn new(backend: &B, args: &ModelArgs, batch: usize, seq: usize) -> Self {
        let n = batch * seq;
        let (d, f, hd) = (args.dim, args.ffn_hidden, args.head_dim());
        let (qd, kvd) = (args.n_heads * hd, args.n_kv_heads * hd);
        let z = |len: usize| backend.zeros(len);
        Workspace {
            batch,
            seq,
            resid: (0..=args.n_layers).map(|_| z(n * d)).collect(),
            layers: (0..args.n_layers)
                .map(|_| LayerActs {
                    // The norms' and SwiGLU's outputs are read only by GEMMs, and the gate and up
                    // projections only by SwiGLU: a device may keep them in bf16 alone.
                    normed_attn: backend.zeros_bf16_activation(n * d),
                    rstd_attn: z(n),
                    q: z(n * qd),
                    k: z(n * kvd),
                    v: z(n * kvd),
                    attn_out: z(n * qd),
                    lse: z(batch * args.n_heads * seq),
                    h: z(n * d),
                    normed_ffn: backend.zeros_bf16_activation(n * d),
                    rstd_ffn: z(n),
                    gate: backend.zeros_bf16_activation(n * f),
                    up: backend.zeros_bf16_activation(n * f),
                    act: backend.zeros_bf16_activation(n * f),
                })
                .collect(),
            normed_final: z(n * d),
            rstd_final: z(n),
            dx: z(n * d),
            dnormed: z(n * d),
            dq: z(n * qd),
            dk: z(n * kvd),
            dv: z(n * kvd),
            dattn: z(n * qd),
            // Read only by GEMMs (dgate, dup) or SwiGLU's backward (dact).
            dgate: backend.zeros_bf16_activation(n * f),
            dup: backend.zeros_bf16_activation(n * f),
            dact: backend.zeros_bf16_activation(n * f),
            inputs: vec![0; n],
            targets: vec![0; n],
        }
    }
}

/// Called by `forward_backward_with` when a block's gradients are final.
pub trait BlockGradHook<B: Backend> {
    fn block_done(&mut self, be: &B, layer: &LayerIds, grads: &mut ParamSet<B>) -> Result<()>;
}

/// A Llama model bound to a backend: shapes, parameter indices and RoPE tables.
pub struct Llama<B: Backend> {
    pub args: ModelArgs,
    pub ids: ParamIds,
    rope_cos: B::Buf,
    rope_sin: B::Buf,
    rope_len: usize,
}

impl<B: Backend> Llama<B> {
    /// `max_seq` bounds the positions the RoPE tables cover (training seq_len or generation length).
    pub fn new(backend: &B, args: ModelArgs, max_seq: usize) -> Result<Self> {
        args.validate()?;
        let (cos, sin) = rope_tables(args.head_dim(), max_seq, args.rope_theta, args.rope_scaling);
        Ok(Llama {
            ids: ParamIds::new(&args),
            args,
            rope_cos: backend.upload(&cos),
            rope_sin: backend.upload(&sin),
            rope_len: max_seq,
        })
    }

    pub fn param_specs(&self) -> Vec<(String, Vec<usize>)> {
        param_specs(&self.args)
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
        self.forward_blocks(be, params, ws, tokens)?;
        let loss = self.head_forward_backward(be, params, grads, ws, grad_scale);
        for l in (0..self.args.n_layers).rev() {
            self.block_backward(be, params, grads, ws, l);
            if let Some(h) = hook.as_deref_mut() {
                h.block_done(be, &self.ids.layers[l], grads)?;
            }
        }
        self.embed_backward(be, grads, ws);
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
        self.forward_blocks(be, params, ws, tokens)?;
        self.final_norm(be, params, ws);
        Ok(be.cross_entropy_forward_backward(
            &ws.normed_final,
            &params.bufs[self.ids.output],
            &ws.targets,
            self.args.dim,
            self.args.vocab_size,
            0.0,
            None,
        ))
    }

    /// Tokens in, through the embedding and every block (activations saved in `ws`).
    fn forward_blocks(
        &self,
        be: &B,
        params: &ParamSet<B>,
        ws: &mut Workspace<B>,
        tokens: &[u32],
    ) -> Result<()> {
        self.load_tokens(ws, tokens)?;
        self.embed_forward(be, params, ws);
        for l in 0..self.args.n_layers {
            self.block_forward(be, params, ws, l);
        }
        Ok(())
    }

    /// Checks `tokens` (`[batch, seq+1]`) and splits them into the workspace's inputs and targets.
    pub fn load_tokens(&self, ws: &mut Workspace<B>, tokens: &[u32]) -> Result<()> {
        let (b, s) = (ws.batch, ws.seq);
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
        for r in 0..b {
            let row = &tokens[r * (s + 1)..(r + 1) * (s + 1)];
            ws.inputs[r * s..(r + 1) * s].copy_from_slice(&row[..s]);
            ws.targets[r * s..(r + 1) * s].copy_from_slice(&row[1..]);
        }
        Ok(())
    }

    pub fn embed_forward(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>) {
        be.embedding_forward(
            &mut ws.resid[0],
            &params.bufs[self.ids.tok_embeddings],
            &ws.inputs,
            self.args.dim,
        );
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
    ) -> LossSum {
        self.final_norm(be, params, ws);
        let a = &self.args;
        let d = a.dim;
        let p = &params.bufs;
        be.fill(&mut ws.dnormed, 0.0);
        let loss = be.cross_entropy_forward_backward(
            &ws.normed_final,
            &p[self.ids.output],
            &ws.targets,
            d,
            a.vocab_size,
            grad_scale,
            Some((&mut ws.dnormed, &mut grads.bufs[self.ids.output])),
        );
        be.fill(&mut ws.dx, 0.0);
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut grads.bufs[self.ids.norm],
            &ws.dnormed,
            &ws.resid[a.n_layers],
            &p[self.ids.norm],
            &ws.rstd_final,
            d,
        );
        loss
    }

    /// Adds the embedding gradient (after the first block's backward).
    pub fn embed_backward(&self, be: &B, grads: &mut ParamSet<B>, ws: &Workspace<B>) {
        be.embedding_backward(
            &mut grads.bufs[self.ids.tok_embeddings],
            &ws.dx,
            &ws.inputs,
            self.args.dim,
        );
    }

    pub fn block_forward(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>, l: usize) {
        let a = &self.args;
        let id = self.ids.layers[l];
        let p = &params.bufs;
        let (b, s, d, f, hd) = (ws.batch, ws.seq, a.dim, a.ffn_hidden, a.head_dim());
        let n = b * s;
        let (qd, kvd) = (a.n_heads * hd, a.n_kv_heads * hd);
        let (before, after) = ws.resid.split_at_mut(l + 1);
        let x = &before[l];
        let out = &mut after[0];
        let acts = &mut ws.layers[l];
        be.rmsnorm_forward(
            &mut acts.normed_attn,
            &mut acts.rstd_attn,
            x,
            &p[id.attention_norm],
            d,
            a.norm_eps,
        );
        be.matmul(
            &mut acts.q,
            &acts.normed_attn,
            &p[id.wq],
            n,
            d,
            qd,
            false,
            true,
            false,
        );
        be.matmul(
            &mut acts.k,
            &acts.normed_attn,
            &p[id.wk],
            n,
            d,
            kvd,
            false,
            true,
            false,
        );
        be.matmul(
            &mut acts.v,
            &acts.normed_attn,
            &p[id.wv],
            n,
            d,
            kvd,
            false,
            true,
            false,
        );
        be.rope_forward(
            &mut acts.q,
            &self.rope_cos,
            &self.rope_sin,
            b,
            s,
            a.n_heads,
            hd,
            0,
        );
        be.rope_forward(
            &mut acts.k,
            &self.rope_cos,
            &self.rope_sin,
            b,
            s,
            a.n_kv_heads,
            hd,
            0,
        );
        let shape = AttnShape::causal(b, s, a.n_heads, a.n_kv_heads, hd);
        be.attention_forward(
            &mut acts.attn_out,
            &mut acts.lse,
            &acts.q,
            &acts.k,
            &acts.v,
            shape,
        );
        // h = x + attn_out · woᵀ
        be.matmul_add(
            &mut acts.h,
            x,
            &acts.attn_out,
            &p[id.wo],
            n,
            qd,
            d,
            false,
            true,
        );
        be.rmsnorm_forward(
            &mut acts.normed_ffn,
            &mut acts.rstd_ffn,
            &acts.h,
            &p[id.ffn_norm],
            d,
            a.norm_eps,
        );
        be.matmul(
            &mut acts.gate,
            &acts.normed_ffn,
            &p[id.w1],
            n,
            d,
            f,
            false,
            true,
            false,
        );
        be.matmul(
            &mut acts.up,
            &acts.normed_ffn,
            &p[id.w3],
            n,
            d,
            f,
            false,
            true,
            false,
        );
        be.swiglu_forward(&mut acts.act, &acts.gate, &acts.up);
        be.matmul_add(out, &acts.h, &acts.act, &p[id.w2], n, f, d, false, true);
    }

    /// On entry `ws.dx` holds ∂L/∂(block output); on exit ∂L/∂(block input).
    pub fn block_backward(
        &self,
        be: &B,
        params: &ParamSet<B>,
        grads: &mut ParamSet<B>,
        ws: &mut Workspace<B>,
        l: usize,
    ) {
        let a = &self.args;
        let id = self.ids.layers[l];
        let p = &params.bufs;
        let g = &mut grads.bufs;
        let (b, s, d, f, hd) = (ws.batch, ws.seq, a.dim, a.ffn_hidden, a.head_dim());
        let n = b * s;
        let (qd, kvd) = (a.n_heads * hd, a.n_kv_heads * hd);
        let acts = &ws.layers[l];
        // Feed-forward.
        be.matmul(
            &mut ws.dact,
            &ws.dx,
            &p[id.w2],
            n,
            d,
            f,
            false,
            false,
            false,
        );
        be.matmul(&mut g[id.w2], &ws.dx, &acts.act, d, n, f, true, false, true);
        be.swiglu_backward(&mut ws.dgate, &mut ws.dup, &ws.dact, &acts.gate, &acts.up);
        // Each gradient's two GEMMs back to back, so a device converts it to bf16 once.
        be.matmul(
            &mut ws.dnormed,
            &ws.dgate,
            &p[id.w1],
            n,
            f,
            d,
            false,
            false,
            false,
        );
        be.matmul(
            &mut g[id.w1],
            &ws.dgate,
            &acts.normed_ffn,
            f,
            n,
            d,
            true,
            false,
            true,
        );
        be.matmul(
            &mut ws.dnormed,
            &ws.dup,
            &p[id.w3],
            n,
            f,
            d,
            false,
            false,
            true,
        );
        be.matmul(
            &mut g[id.w3],
            &ws.dup,
            &acts.normed_ffn,
            f,
            n,
            d,
            true,
            false,
            true,
        );
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut g[id.ffn_norm],
            &ws.dnormed,
            &acts.h,
            &p[id.ffn_norm],
            &acts.rstd_ffn,
            d,
        );
        // Attention.
        be.matmul(
            &mut ws.dattn,
            &ws.dx,
            &p[id.wo],
            n,
            d,
            qd,
            false,
            false,
            false,
        );
        be.matmul(
            &mut g[id.wo],
            &ws.dx,
            &acts.attn_out,
            d,
            n,
            qd,
            true,
            false,
            true,
        );
        let shape = AttnShape::causal(b, s, a.n_heads, a.n_kv_heads, hd);
        be.attention_backward(
            &mut ws.dq,
            &mut ws.dk,
            &mut ws.dv,
            &ws.dattn,
            &acts.q,
            &acts.k,
            &acts.v,
            &acts.attn_out,
            &acts.lse,
            shape,
        );
        be.rope_backward(
            &mut ws.dq,
            &self.rope_cos,
            &self.rope_sin,
            b,
            s,
            a.n_heads,
            hd,
        );
        be.rope_backward(
            &mut ws.dk,
            &self.rope_cos,
            &self.rope_sin,
            b,
            s,
            a.n_kv_heads,
            hd,
        );
        be.matmul(
            &mut ws.dnormed,
            &ws.dq,
            &p[id.wq],
            n,
            qd,
            d,
            false,
            false,
            false,
        );
        be.matmul(
            &mut g[id.wq],
            &ws.dq,
            &acts.normed_attn,
            qd,
            n,
            d,
            true,
            false,
            true,
        );
        be.matmul(
            &mut ws.dnormed,
            &ws.dk,
            &p[id.wk],
            n,
            kvd,
            d,
            false,
            false,
            true,
        );
        be.matmul(
            &mut g[id.wk],
            &ws.dk,
            &acts.normed_attn,
            kvd,
            n,
            d,
            true,
            false,
            true,
        );
        be.matmul(
            &mut ws.dnormed,
            &ws.dv,
            &p[id.wv],
            n,
            kvd,
            d,
            false,
            false,
            true,
        );
        be.matmul(
            &mut g[id.wv],
            &ws.dv,
            &acts.normed_attn,
            kvd,
            n,
            d,
            true,
            false,
            true,
        );
        be.rmsnorm_backward(
            &mut ws.dx,
            &mut g[id.attention_norm],
            &ws.dnormed,
            &ws.resid[l],
            &p[id.attention_norm],
            &acts.rstd_attn,
            d,
        );
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
        let (d, f, hd) = (a.dim, a.ffn_hidden, a.head_dim());
        let (qd, kvd) = (a.n_heads * hd, a.n_kv_heads * hd);
        let p = &params.bufs;
        let mut x = be.zeros(n * d);
        be.embedding_forward(&mut x, &p[self.ids.tok_embeddings], tokens, d);
        let (mut normed, mut rstd) = (be.zeros(n * d), be.zeros(n));
        let (mut q, mut k, mut v) = (be.zeros(n * qd), be.zeros(n * kvd), be.zeros(n * kvd));
        let (mut attn, mut lse) = (be.zeros(n * qd), be.zeros(a.n_heads * n));
        let (mut gate, mut up, mut act) = (be.zeros(n * f), be.zeros(n * f), be.zeros(n * f));
        for l in 0..a.n_layers {
            let id = self.ids.layers[l];
            be.rmsnorm_forward(
                &mut normed,
                &mut rstd,
                &x,
                &p[id.attention_norm],
                d,
                a.norm_eps,
            );
            be.matmul(&mut q, &normed, &p[id.wq], n, d, qd, false, true, false);
            be.matmul(&mut k, &normed, &p[id.wk], n, d, kvd, false, true, false);
            be.matmul(&mut v, &normed, &p[id.wv], n, d, kvd, false, true, false);
            be.rope_forward(
                &mut q,
                &self.rope_cos,
                &self.rope_sin,
                1,
                n,
                a.n_heads,
                hd,
                pos,
            );
            be.rope_forward(
                &mut k,
                &self.rope_cos,
                &self.rope_sin,
                1,
                n,
                a.n_kv_heads,
                hd,
                pos,
            );
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
            be.matmul(&mut x, &attn, &p[id.wo], n, qd, d, false, true, true);
            be.rmsnorm_forward(&mut normed, &mut rstd, &x, &p[id.ffn_norm], d, a.norm_eps);
            be.matmul(&mut gate, &normed, &p[id.w1], n, d, f, false, true, false);
            be.matmul(&mut up, &normed, &p[id.w3], n, d, f, false, true, false);
            be.swiglu_forward(&mut act, &gate, &up);
            be.matmul(&mut x, &act, &p[id.w2], n, f, d, false, true, true);
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
