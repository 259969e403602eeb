//! The names of a block's projections (`BlockProjection`): which linears a block has, as float8
//! conversion, the parameter ids and the shapes of one rank (`LocalShapes::projection`) name them.

/// A block's projections (`Linear`s), one list for every attention: grouped-query attention
/// has `Wq`, `Wk`, `Wv`; multi-head latent attention `Wq` (or `WqA` and `WqB`), `WkvA`, `WkvB`;
/// both `Wo` and the feed-forward's SwiGLU (when the block has one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockProjection {
    Wq,
    Wk,
    Wv,
    WqA,
    WqB,
    WkvA,
    WkvB,
    Wo,
    W1,
    W2,
    W3,
}

impl BlockProjection {
    pub const ALL: [BlockProjection; 11] = [
        BlockProjection::Wq,
        BlockProjection::Wk,
        BlockProjection::Wv,
        BlockProjection::WqA,
        BlockProjection::WqB,
        BlockProjection::WkvA,
        BlockProjection::WkvB,
        BlockProjection::Wo,
        BlockProjection::W1,
        BlockProjection::W2,
        BlockProjection::W3,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    /// Its name in the block's parameter names (`layers.N.attention.wq`, `….feed_forward.w1`).
    pub fn name(self) -> &'static str {
        use BlockProjection::*;
        match self {
            Wq => "wq",
            Wk => "wk",
            Wv => "wv",
            WqA => "wq_a",
            WqB => "wq_b",
            WkvA => "wkv_a",
            WkvB => "wkv_b",
            Wo => "wo",
            W1 => "w1",
            W2 => "w2",
            W3 => "w3",
        }
    }

    /// Whether tensor parallelism splits its inputs (row-parallel: `wo`, `w2`); the others split
    /// their outputs or (MLA's latent down-projections) are replicated.
    pub fn row_parallel(self) -> bool {
        matches!(self, BlockProjection::Wo | BlockProjection::W2)
    }

    /// Whether it belongs to the feed-forward (else to attention).
    pub fn in_feed_forward(self) -> bool {
        matches!(
            self,
            BlockProjection::W1 | BlockProjection::W2 | BlockProjection::W3
        )
    }
}
