//! Generation's pieces: the `KvCache` of the earlier tokens' keys and values, which a workspace
//! holds while the walk runs the blocks over new tokens (the block written once,
//! `block::run_block`, reading and extending the cache), and the head that keeps the last
//! position's logits. The step itself is `Decoder::forward_cached` in `parallel/walk.rs`.

use anyhow::{bail, Result};

use super::{Decoder, Workspace};
use crate::backend::Backend;
use crate::model::args::ModelArgs;
use crate::model::params::ParamSet;

impl<B: Backend> Decoder<B> {
    /// Whether `tokens` can run next at positions `cache.len..` (the walk then runs them:
    /// `Decoder::forward_cached` in `parallel/walk.rs`).
    pub fn check_generation_step(&self, cache: &KvCache<B>, tokens: &[u32]) -> Result<()> {
        let a = &self.args;
        if self.local.tp != 1 || self.local.cp != 1 {
            bail!("generation runs the whole model in one process (this one is a tensor- or context-parallel rank)");
        }
        let (n, pos) = (tokens.len(), cache.len);
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
        super::check_token_ids(tokens, n, a.vocab_size)?;
        Ok(())
    }

    /// The head of a generation step (after the last block's forward over the new tokens): the
    /// logits of the last position, kept in the workspace (`Workspace::last_logits`).
    pub fn head_last_logits(&self, be: &B, params: &ParamSet<B>, ws: &mut Workspace<B>) {
        let (a, n) = (&self.args, ws.batch * ws.seq);
        let d = a.dim;
        let last = be.upload(&be.download(ws.resid.read(be, a.n_layers))[(n - 1) * d..]);
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
        ws.last_logits = be.download(&logits);
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

    /// This cache, leaving an empty one in its place (a workspace holds it for one walk).
    pub fn take(&mut self) -> Self {
        std::mem::replace(
            self,
            KvCache {
                k: Vec::new(),
                v: Vec::new(),
                len: self.len,
                capacity: self.capacity,
            },
        )
    }
}
