//! `titan tokenizer train`: a byte-level BPE tokenizer trained with the `tokenizers` crate and saved
//! as an HF `tokenizer.json`, with Llama 3's BOS/EOS special tokens.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::documents::{DocumentSource, JsonlSource, TextSource};

pub fn train_bpe(input: &Path, vocab_size: usize, output: &Path) -> Result<()> {
    if vocab_size < 258 + 2 {
        bail!("--vocab-size {vocab_size} is too small: byte-level BPE needs at least 260 (256 bytes, 2 special tokens, merges)");
    }
    let name = input.display().to_string();
    let mut source: Box<dyn DocumentSource> =
        if name.ends_with(".jsonl") || name.ends_with(".jsonl.gz") || name.ends_with(".json.gz") {
            Box::new(JsonlSource::open(input)?)
        } else {
            Box::new(TextSource::open(input)?)
        };
    let mut docs = Vec::new();
    while let Some(d) = source.next_document()? {
        docs.push(d);
    }
    if docs.is_empty() {
        bail!("{name} holds no text to train a tokenizer on");
    }
    let specials = vec![
        AddedToken::from("<|begin_of_text|>", true),
        AddedToken::from("<|end_of_text|>", true),
    ];
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer: tokenizers::models::TrainerWrapper = trainer.into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer
        .train(&mut trainer, docs.iter())
        .map_err(|e| anyhow!("tokenizer training failed: {e}"))?;
    if let Some(dir) = output.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    tokenizer
        .save(output, true)
        .map_err(|e| anyhow!("cannot write {}: {e}", output.display()))?;
    outln!(
        "trained byte-level BPE on {} documents: {} tokens -> {}",
        docs.len(),
        tokenizer.get_vocab_size(true),
        output.display()
    );
    Ok(())
}
