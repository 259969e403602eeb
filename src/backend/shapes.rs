//! The shapes of the backend's GEMM and RoPE calls (`GemmShape`, `GemmOutput`, `RopeShape`).

/// The shape of one matrix product `out[m,n] (+)= op(a)[m,k] · op(b)[k,n]` and how its operands
/// are stored: `a` as `[m,k]`, or `[k,m]` when `trans_a`; `b` as `[k,n]`, or `[n,k]` when
/// `trans_b`. Built by name: `GemmShape::new(rows, d_in, d_out).b_transposed()` is `x · Wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
}

impl GemmShape {
    /// `[m,k] · [k,n]`, both operands stored as they are multiplied.
    pub fn new(m: usize, k: usize, n: usize) -> Self {
        GemmShape {
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
        }
    }
    /// `a` is stored `[k,m]` and read transposed (a weight gradient `dyᵀ · x`).
    pub fn a_transposed(self) -> Self {
        GemmShape {
            trans_a: true,
            ..self
        }
    }
    /// `b` is stored `[n,k]` and read transposed (a linear layer `x · Wᵀ`).
    pub fn b_transposed(self) -> Self {
        GemmShape {
            trans_b: true,
            ..self
        }
    }
}

/// The shape of one RoPE call on `[batch, seq, heads, head_dim]` (interleaved pairs), token `s` of
/// each sequence at position `pos_offset + s` of the tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub pos_offset: usize,
    /// The tables hold one row per token (`[batch · seq, head_dim/2]`, token `t` at row `t`):
    /// each token's own position (documents packed in a sequence restart theirs).
    pub per_token: bool,
}

impl RopeShape {
    /// Sequences starting at position 0 (training).
    pub fn new(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        RopeShape {
            batch,
            seq,
            heads,
            head_dim,
            pos_offset: 0,
            per_token: false,
        }
    }
    /// Sequences starting at position `pos_offset` (generation after a KV cache of that length).
    pub fn at(self, pos_offset: usize) -> Self {
        RopeShape { pos_offset, ..self }
    }
    /// Tables with one row per token (`per_token`), or per position when `per_token` is false.
    pub fn tables_per_token(self, per_token: bool) -> Self {
        RopeShape { per_token, ..self }
    }
    /// The table rows the call reads.
    pub fn table_rows(&self) -> usize {
        match self.per_token {
            true => self.batch * self.seq,
            false => self.pos_offset + self.seq,
        }
    }
    /// The values the call rotates.
    pub fn values(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }
}

/// Whether a matrix product replaces its output or is added to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmOutput {
    Overwrite,
    Accumulate,
}

impl GemmOutput {
    /// `Accumulate` when `accumulate`, else `Overwrite`.
    pub fn accumulate_if(accumulate: bool) -> Self {
        if accumulate {
            GemmOutput::Accumulate
        } else {
            GemmOutput::Overwrite
        }
    }
    pub fn accumulates(self) -> bool {
        self == GemmOutput::Accumulate
    }
}
