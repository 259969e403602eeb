//! Where a workspace's token rows sit: each token's position in its document, which RoPE rotates
//! it by and which limits what attention lets it see (block-causal attention over packed
//! documents, TorchTitan's `block_causal`), and the RoPE tables that follow from them.
//!
//! A sequence of the data loader is a window of the concatenated `[BOS] doc [EOS]` stream, so it
//! may hold the end of one document and the starts of others. With documents on
//! (`Decoder::with_documents`), a token's position restarts at 0 at every document start (the tokens
//! the loader marked, `token_marks::DOCUMENT_START`) and at the sequence's first token: a document
//! cut by the window continues as a new one, as TorchTitan canonicalises it. Positions are derived
//! from the marked tokens themselves, so every rank that holds the tokens (every pipeline stage,
//! every tensor-parallel rank) derives the same ones with nothing sent.

use crate::backend::{AttnMask, Backend, RopeShape};
use crate::model::token_marks::starts_document;

/// Each token's position in its document: 0 at the first token of `row` and at every token
/// marked as a document's start, one more than its predecessor's elsewhere.
pub fn document_positions(row: &[u32]) -> Vec<u32> {
    let mut positions = Vec::with_capacity(row.len());
    let mut next = 0u32;
    for &token in row {
        if starts_document(token) {
            next = 0;
        }
        positions.push(next);
        next += 1;
    }
    positions
}

/// The RoPE tables and document positions one run of the blocks reads.
pub(super) struct Positions<'a, B: Backend> {
    pub(super) cos: &'a B::Buf,
    pub(super) sin: &'a B::Buf,
    /// The tables hold one row per token (documents restart their positions), not one per
    /// position.
    per_token: bool,
    /// Each token's position in its document (`[batch, seq]`) when some sequence holds more than
    /// one; `None`: every sequence one document (plain causal attention).
    in_document: Option<&'a [u32]>,
    /// Each token's place in its chunk of chunked attention (`chunk_positions`; None without).
    in_chunk: Option<&'a [u32]>,
}

impl<B: Backend> Clone for Positions<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Positions<'_, B> {}

impl<'a, B: Backend> Positions<'a, B> {
    /// `tables` hold a row per token exactly when `in_document` is given.
    pub(super) fn new(
        (cos, sin): (&'a B::Buf, &'a B::Buf),
        in_document: Option<&'a [u32]>,
        in_chunk: Option<&'a [u32]>,
    ) -> Self {
        Positions {
            cos,
            sin,
            per_token: in_document.is_some(),
            in_document,
            in_chunk,
        }
    }

    /// The RoPE call on `[batch, seq, heads, head_dim]` rows.
    pub(super) fn rope(
        &self,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
    ) -> RopeShape {
        RopeShape::new(batch, seq, heads, head_dim).tables_per_token(self.per_token)
    }

    /// Which keys each query sees: its own document's up to itself (and its own chunk's, in a
    /// `chunked` block), within the block's sliding window (`window`) when it has one.
    pub(super) fn mask(&self, window: Option<usize>, chunked: bool) -> AttnMask<'a> {
        // No chunk starting inside a document: the chunk mask is the document mask.
        let positions = match chunked {
            true => self.in_chunk.or(self.in_document),
            false => self.in_document,
        };
        AttnMask { positions, window }
    }
}

/// Each token's place in its chunk of `chunk` positions (chunked attention: a query sees the
/// earlier keys of its chunk only), where `indices` are the tokens' positions in their sequence
/// and `in_document` their positions in their documents: a document's start starts a chunk
/// too, so the mask is the document mask and the chunk mask at once. Like document positions,
/// these grow by one or restart at 0, as `AttnMask::positions` needs.
pub fn chunk_positions(indices: &[usize], in_document: &[u32], chunk: usize) -> Vec<u32> {
    indices
        .iter()
        .zip(in_document)
        .map(|(&at, &doc)| ((at % chunk) as u32).min(doc))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_restart_at_each_document_start_and_at_the_row_start() {
        use crate::model::token_marks::DOCUMENT_START;
        let start = 1 | DOCUMENT_START;
        assert_eq!(
            document_positions(&[7, 8, start, 5, 6, 9, start, 4]),
            vec![0, 1, 0, 1, 2, 3, 0, 1]
        );
        assert_eq!(document_positions(&[1, 1, 3]), vec![0, 1, 2], "unmarked");
        assert_eq!(document_positions(&[start, start, start]), vec![0, 0, 0]);
        assert!(document_positions(&[]).is_empty());
    }
}
