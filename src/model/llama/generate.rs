//! Generation: the decoder run over new tokens with the keys and values of the earlier ones
//! kept in a `KvCache`.

use anyhow::{bail, Result};

use super::Llama;
use crate::backend::{AttnShape, Backend};
use crate::model::args::ModelArgs;
use crate::model::linear::Linear;
use crate::model::moe;
use crate::model::params::{FeedForwardIds, ParamSet};

impl<B: Backend> Llama<B> {
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
