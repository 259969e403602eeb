//! The shapes and operands of an attention call (`Backend::attention_forward` and its backward):
//! which keys each query sees (the causal limit, documents, a sliding window) and the buffers
//! the forward keeps for the backward.

/// Shapes of one causal attention call. Queries are `[batch, q_len, n_heads, head_dim]`; keys and
/// values are `[batch, kv_capacity, n_kv_heads, head_dim]` of which the first `kv_len` positions are
/// valid. Query row `i` sits `q_offset + i` positions after the first key and attends to the keys
/// `j ≤ q_offset + i` of those there are (`j < kv_len`): the whole causal prefix when the keys run
/// up to the queries (training, generation with a cache), every key when a block of keys lies
/// wholly before the queries (context parallelism's off-diagonal blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub kv_capacity: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub q_offset: usize,
}

impl AttnShape {
    /// The training case: queries and keys are the same sequence.
    pub fn causal(
        batch: usize,
        seq: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        AttnShape {
            batch,
            q_len: seq,
            kv_len: seq,
            kv_capacity: seq,
            n_heads,
            n_kv_heads,
            head_dim,
            q_offset: 0,
        }
    }
}

/// Which keys each query sees within the causal limit: FlexAttention's document mask and sliding
/// window as one description. Query row `i` of a call sits at key index `q_offset + i` and sees key
/// `j` when `first_key(i) ≤ j ≤ q_offset + i`; with neither field set, `first_key` is 0 (plain
/// causal attention).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnMask<'a> {
    /// Per query (`[batch, q_len]`), its position in its document (0 at the document's first
    /// token): the query sees no key of an earlier document. Positions grow by one from query to
    /// query or restart at 0, so a query's first key never lies before its predecessor's (the
    /// kernels rely on it to skip whole tiles).
    pub positions: Option<&'a [u32]>,
    /// A sliding window: a query sees at most the last `window` keys, itself included.
    pub window: Option<usize>,
}

impl AttnMask<'_> {
    /// Every query sees every key up to its own position.
    pub const CAUSAL: AttnMask<'static> = AttnMask {
        positions: None,
        window: None,
    };

    pub fn is_causal(&self) -> bool {
        self.positions.is_none() && self.window.is_none()
    }

    /// The first key query `i` of sequence `b` sees (`s`: the call's shape).
    #[inline]
    pub fn first_key(&self, s: &AttnShape, b: usize, i: usize) -> usize {
        let at = s.q_offset + i;
        let mut first = 0;
        if let Some(positions) = self.positions {
            first = at.saturating_sub(positions[b * s.q_len + i] as usize);
        }
        if let Some(window) = self.window {
            first = first.max((at + 1).saturating_sub(window));
        }
        first
    }
}

/// One attention call's operands: queries `[batch, q_len, n_heads, head_dim]`, keys and values
/// `[batch, kv_capacity, n_kv_heads, head_dim]`, their shape and which keys each query sees.
pub struct AttnInputs<'a, Buf> {
    pub q: &'a Buf,
    pub k: &'a Buf,
    pub v: &'a Buf,
    pub shape: AttnShape,
    pub mask: AttnMask<'a>,
}

impl<Buf> Clone for AttnInputs<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Buf> Copy for AttnInputs<'_, Buf> {}

impl<'a, Buf> AttnInputs<'a, Buf> {
    /// Causal attention of `q` over `k`, `v`.
    pub fn causal(q: &'a Buf, k: &'a Buf, v: &'a Buf, shape: AttnShape) -> Self {
        AttnInputs {
            q,
            k,
            v,
            shape,
            mask: AttnMask::CAUSAL,
        }
    }
    /// The same call with other keys and values and shape (a block of keys: ring attention).
    pub fn with_keys(self, k: &'a Buf, v: &'a Buf, shape: AttnShape) -> Self {
        AttnInputs {
            k,
            v,
            shape,
            ..self
        }
    }
}

/// What attention's forward keeps for its backward: the output and each query row's log-sum-exp
/// (`[batch, n_heads, q_len]`).
pub struct AttnSaved<'a, Buf> {
    pub out: &'a Buf,
    pub lse: &'a Buf,
}

/// Attention's backward outputs, overwritten: the gradients of the queries, keys and values.
pub struct AttnGrads<'a, Buf> {
    pub dq: &'a mut Buf,
    pub dk: &'a mut Buf,
    pub dv: &'a mut Buf,
}
