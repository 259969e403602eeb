//! Data: tokenizers, document sources (synthetic, text, JSONL, Parquet), pre-tokenized shards and the
//! stateful, data-parallel-aware loader that packs them into training windows.

pub mod bpe;
pub mod chat;
pub mod documents;
pub mod files;
pub mod loader;
pub mod packing;
pub mod parquet;
pub mod synthetic;
pub mod tokenizer;
pub mod tokens;

pub use loader::{DataLoader, LoaderState};
pub use tokenizer::{load_tokenizer, ByteTokenizer, Tokenizer};
