//! Generation: the decoder's forward (the block written once, `block::run_block`) over new
//! tokens, attending to the keys and values of the earlier ones kept in a `KvCache`.

use anyhow::{bail, Result};

use super::block::{KvSource, Pass};
use super::{Llama, Workspace};
use crate::backend::Backend;
use crate::model::args::ModelArgs;
use crate::model::params::ParamSet;

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
        let d = a.dim;
        let mut ws = Workspace::for_inference(be, &self.local, 1, n);
        ws.inputs.copy_from_slice(tokens);
        self.embed_forward(be, params, &mut ws)?;
        for (l, (k, v)) in cache.k.iter_mut().zip(&mut cache.v).enumerate() {
            let capacity = cache.capacity;
            let kv = KvSource::Cache {
                k,
                v,
                pos,
                capacity,
            };
            self.run_block(be, params, &mut ws, l, Pass::Forward, kv)?;
        }
        cache.len += n;
        let last = be.upload(&be.download(ws.block_input(a.n_layers))[(n - 1) * d..]);
        let mut last_normed = be.zeros(d);
        let mut last_rstd = be.zeros(1);
        be.rmsnorm_forward(
            &mut last_normed,
            &mut last_rstd,
            &last,
            &params.bufs[self.ids.norm],
            d,
            a.norm_eps,
        );
        let mut logits = be.zeros(a.vocab_size);
        be.logits(
            &mut logits,
            &last_normed,
            &params.bufs[self.ids.output],
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
