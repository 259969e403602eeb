//! Multi-head latent attention's working buffers besides the block's activations
//! (`MlaScratch`), sized from one rank's shapes; `attention` computes with them.

use crate::backend::Backend;
use crate::model::local_shapes::LocalShapes;

/// MLA's working buffers besides the block's activations: the forward's transient products
/// (reused by the backward for their gradients) and the backward's latent gradients. Empty
/// without MLA.
pub(crate) struct MlaScratch<B: Backend> {
    /// `[n, heads·qk]`: the query projection (backward: its gradient).
    pub(in crate::model::decoder) q_proj: B::Buf,
    /// `[n, heads·(nope + v)]`: the key/value up-projection (backward: its gradient).
    pub(in crate::model::decoder) kv_up: B::Buf,
    /// `[n·heads, rope]` and `[n, rope]`: the rotated parts while RoPE turns them.
    pub(in crate::model::decoder) q_rope: B::Buf,
    pub(in crate::model::decoder) k_rope: B::Buf,
    /// `[n, kv_lora_rank]`: the key/value latent before its norm, contiguous.
    pub(in crate::model::decoder) kv_c: B::Buf,
    /// The backward's: the query latent's gradients after and before its norm, the key/value
    /// projection's, the latent's after and before its norm, and the heads' values'.
    pub(in crate::model::decoder) dq_latent_normed: B::Buf,
    pub(in crate::model::decoder) dq_latent: B::Buf,
    pub(in crate::model::decoder) dkv_latent: B::Buf,
    pub(in crate::model::decoder) dkv_normed: B::Buf,
    pub(in crate::model::decoder) dkv_c: B::Buf,
    pub(in crate::model::decoder) dvalues: B::Buf,
}

/// The sizes of `MlaScratch`'s buffers, in field order.
fn scratch_sizes(m: &LocalShapes, n: usize, backward: bool) -> [usize; 11] {
    let Some(a) = m.mla.as_ref() else {
        return [0; 11];
    };
    let h = m.heads;
    let q_rank = a.q_lora_rank.unwrap_or(0);
    let grad = |len: usize| if backward { len } else { 0 };
    [
        n * h * a.qk_head_dim(),
        n * h * a.kv_b_head_dim(),
        n * h * a.qk_rope_head_dim,
        n * a.qk_rope_head_dim,
        n * a.kv_lora_rank,
        grad(n * q_rank),
        grad(n * q_rank),
        grad(n * a.kv_a_dim()),
        grad(n * a.kv_lora_rank),
        grad(n * a.kv_lora_rank),
        grad(n * m.values_dim()),
    ]
}

/// Values of `MlaScratch` for `n` token rows (the memory estimate's count).
pub fn mla_scratch_floats(m: &LocalShapes, n: usize, backward: bool) -> usize {
    scratch_sizes(m, n, backward).iter().sum()
}

impl<B: Backend> MlaScratch<B> {
    pub(in crate::model::decoder) fn allocate(
        be: &B,
        m: &LocalShapes,
        n: usize,
        backward: bool,
    ) -> Self {
        Self::of_sizes(be, scratch_sizes(m, n, backward))
    }

    /// No buffers: a workspace that borrows them (`Workspace::trade_transient`).
    pub(in crate::model::decoder) fn empty(be: &B) -> Self {
        Self::of_sizes(be, [0; 11])
    }

    fn of_sizes(be: &B, sizes: [usize; 11]) -> Self {
        let [q_proj, kv_up, q_rope, k_rope, kv_c, dq_latent_normed, dq_latent, dkv_latent, dkv_normed, dkv_c, dvalues] =
            sizes.map(|len| be.zeros(len));
        MlaScratch {
            q_proj,
            kv_up,
            q_rope,
            k_rope,
            kv_c,
            dq_latent_normed,
            dq_latent,
            dkv_latent,
            dkv_normed,
            dkv_c,
            dvalues,
        }
    }
}
