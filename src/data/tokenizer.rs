//! Tokenizers: the built-in byte-level one (no files needed) and any Hugging Face `tokenizer.json`
//! through the `tokenizers` crate (Llama 3's included).

use std::path::Path;

use anyhow::{anyhow, bail, Result};

/// Token ids, each with the byte range of `text` it covers.
pub type IdsWithOffsets = (Vec<u32>, Vec<(usize, usize)>);

pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`, without BOS/EOS.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// `encode` with each token's byte range in `text` (where its text starts and ends).
    fn encode_with_offsets(&self, text: &str) -> Result<IdsWithOffsets>;
    fn decode(&self, ids: &[u32]) -> Result<String>;
    fn vocab_size(&self) -> usize;
    fn bos_id(&self) -> u32;
    fn eos_id(&self) -> u32;
}

/// Bytes 0..=255 are their own ids; 256 is BOS and 257 EOS.
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const BOS: u32 = 256;
    pub const EOS: u32 = 257;
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn encode_with_offsets(&self, text: &str) -> Result<IdsWithOffsets> {
        Ok((
            self.encode(text)?,
            (0..text.len()).map(|i| (i, i + 1)).collect(),
        ))
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn vocab_size(&self) -> usize {
        258
    }
    fn bos_id(&self) -> u32 {
        Self::BOS
    }
    fn eos_id(&self) -> u32 {
        Self::EOS
    }
}

/// Special tokens looked up, in order, for BOS and EOS.
const BOS_NAMES: &[&str] = &["<|begin_of_text|>", "<s>", "<|bos|>", "<|endoftext|>"];
const EOS_NAMES: &[&str] = &["<|end_of_text|>", "</s>", "<|eos|>", "<|endoftext|>"];

pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    bos: u32,
    eos: u32,
}

impl HfTokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            bail!("tokenizer file {} does not exist", path.display());
        }
        // The `tokenizers` crate panics on some malformed files (a bad `decoder` section).
        let inner = super::files::panic_as_error(
            || {
                tokenizers::Tokenizer::from_file(path)
                    .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))
            },
            |msg| {
                anyhow!(
                    "cannot load tokenizer {}: the tokenizers crate failed on it (a malformed file): {msg}",
                    path.display()
                )
            },
        )?;
        let find = |names: &[&str]| names.iter().find_map(|n| inner.token_to_id(n));
        let bos = find(BOS_NAMES).ok_or_else(|| {
            anyhow!(
                "tokenizer {} has no BOS token (looked for {})",
                path.display(),
                BOS_NAMES.join(", ")
            )
        })?;
        let eos = find(EOS_NAMES).ok_or_else(|| {
            anyhow!(
                "tokenizer {} has no EOS token (looked for {})",
                path.display(),
                EOS_NAMES.join(", ")
            )
        })?;
        Ok(HfTokenizer { inner, bos, eos })
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizer: {e}"))?
            .get_ids()
            .to_vec())
    }
    fn encode_with_offsets(&self, text: &str) -> Result<IdsWithOffsets> {
        // The tokenizers crate's offsets are byte offsets into `text`.
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizer: {e}"))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("tokenizer: {e}"))
    }
    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    fn bos_id(&self) -> u32 {
        self.bos
    }
    fn eos_id(&self) -> u32 {
        self.eos
    }
}

/// The tokenizer a job asks for: a `tokenizer.json` path, or the byte-level one when empty.
pub fn load_tokenizer(path: &str) -> Result<Box<dyn Tokenizer>> {
    if path.is_empty() {
        Ok(Box::new(ByteTokenizer))
    } else {
        Ok(Box::new(HfTokenizer::from_file(Path::new(path))?))
    }
}
