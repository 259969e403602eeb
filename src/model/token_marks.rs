//! What a training row says about its tokens besides their ids: the data loader marks the first
//! token of every document and the tokens that are not targets (the prompt of a chat sample), and
//! the model reads the marks where tokens enter it (`Decoder::load_tokens`, `count_targets`).
//!
//! The marks are the two top bits of each `u32` (vocabularies stay below 2²⁴: `args::BOUNDS`), so
//! rows travel unchanged through every layout that slices them (data-parallel shares, pipeline
//! microbatches, context-parallel chunks). `IGNORE_INDEX` is padding: no input (it embeds as
//! zeros) and no target.

use crate::backend::IGNORE_INDEX;

/// The token starts a document: block-causal attention lets it and what follows in its document
/// see nothing before it, and RoPE restarts its positions there.
pub const DOCUMENT_START: u32 = 1 << 31;
/// The token is an input but not a target: as the next token of its predecessor it counts for
/// nothing in the loss (a chat sample's prompt, its user and system turns).
pub const NOT_A_TARGET: u32 = 1 << 30;
const ID: u32 = NOT_A_TARGET - 1;

/// The token's id, its marks cleared (padding stays `IGNORE_INDEX`).
pub fn token_id(t: u32) -> u32 {
    if t == IGNORE_INDEX {
        IGNORE_INDEX
    } else {
        t & ID
    }
}

/// The token as a target: its id, or `IGNORE_INDEX` for padding and tokens marked not a target.
pub fn target(t: u32) -> u32 {
    if t == IGNORE_INDEX || t & NOT_A_TARGET != 0 {
        IGNORE_INDEX
    } else {
        t & ID
    }
}

/// Whether the token starts a document.
pub fn starts_document(t: u32) -> bool {
    t != IGNORE_INDEX && t & DOCUMENT_START != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_leave_the_id_and_padding_stays_padding() {
        let t = 1234 | DOCUMENT_START | NOT_A_TARGET;
        assert_eq!(
            (token_id(t), target(t), starts_document(t)),
            (1234, IGNORE_INDEX, true)
        );
        assert_eq!((token_id(7), target(7), starts_document(7)), (7, 7, false));
        let pad = IGNORE_INDEX;
        assert_eq!(
            (token_id(pad), target(pad), starts_document(pad)),
            (pad, pad, false)
        );
    }
}
