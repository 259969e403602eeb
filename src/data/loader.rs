//! The stateful data loader: documents are tokenized as `[BOS] text [EOS]` (the BOS marked as a
//! document's start, `model::token_marks`; in token shards, `[training] document_start_id`'s
//! tokens), concatenated, and cut
//! into windows of `seq_len + 1` tokens (inputs and shifted targets), `local_batch_size` windows per
//! micro-batch; or, with `[training] packing = "first_fit"`, packed whole into windows padded with
//! ignored tokens (`packing.rs`: every call packs the `dp_size × local_batch_size` windows of the
//! global micro-batch, so the packing too is the same for any data-parallel degree). Every data-parallel rank walks the same global stream of windows and keeps its own
//! block of each `dp_size × local_batch_size` windows, so ranks train on disjoint data, a step's global
//! batch is the same for any data-parallel degree (exact loss parity with one process), and the
//! position (epoch, documents consumed, tokens left over from the last document) is the same on every
//! rank: it is saved in checkpoints and resumes under any data-parallel degree. The price is that each
//! rank tokenizes the whole stream (cheap next to a training step).

use std::path::Path;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::chat::{chat_rows, encode_chat, parse_row, ChatTemplate, ChatTokens};
use super::documents::{DocumentSource, JsonlSource, SyntheticSource, TextSource};
use super::packing::{FirstFitBins, Packing};
use super::tokenizer::Tokenizer;
use super::tokens::TokenShards;
use crate::config::Config;
use crate::model::token_marks::{token_id, DOCUMENT_START, NOT_A_TARGET};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    /// Documents consumed in this epoch, or token windows for token shards (the same on every rank).
    pub consumed: u64,
    /// Tokens of the last document read not yet emitted (under first-fit packing, the whole
    /// document that did not fit the last micro-batch's windows).
    pub buffer: Vec<u32>,
}

/// Where a loader's documents come from.
struct Source<'a> {
    /// The config section naming it, for errors.
    section: &'static str,
    dataset: &'a str,
    path: &'a str,
    seed: u64,
    packing: Packing,
    document_start: Option<u32>,
    /// `[model] tokenizer_path`, beside which a chat dataset's template lies.
    tokenizer_path: &'a str,
}

enum Stream {
    Documents {
        source: Box<dyn DocumentSource>,
        tokenizer: Box<dyn Tokenizer>,
        /// Chat rows rendered with this template (`chat.rs`); None: plain text documents.
        chat: Option<Box<ChatTemplate>>,
    },
    Tokens(TokenShards),
}

pub struct DataLoader {
    stream: Stream,
    batch: usize,
    seq: usize,
    vocab: usize,
    dp_rank: usize,
    dp_size: usize,
    packing: Packing,
    /// Token shards: the id whose tokens the loader marks as documents' starts.
    document_start: Option<u32>,
    state: LoaderState,
}

impl DataLoader {
    /// The loader a job configures. `vocab` is the model's vocabulary (token ids are checked against it).
    pub fn from_config(
        cfg: &Config,
        tokenizer: Box<dyn Tokenizer>,
        vocab: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<Self> {
        let t = &cfg.training;
        let source = Source {
            section: "training",
            dataset: &t.dataset,
            path: &t.dataset_path,
            seed: t.seed,
            packing: Packing::parse(&t.packing)?,
            document_start: t.document_start_id,
            tokenizer_path: &cfg.model.tokenizer_path,
        };
        Self::open(
            source,
            tokenizer,
            vocab,
            t.local_batch_size,
            t.seq_len,
            dp_rank,
            dp_size,
        )
    }

    /// The held-out data of `[validation]`, from its start. Its synthetic corpus is another
    /// stream than training's (another seed).
    pub fn for_validation(
        cfg: &Config,
        tokenizer: Box<dyn Tokenizer>,
        vocab: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<Self> {
        let v = &cfg.validation;
        let source = Source {
            section: "validation",
            dataset: &v.dataset,
            path: &v.dataset_path,
            seed: cfg.training.seed ^ 0x5eed_da7a,
            packing: Packing::parse(&cfg.training.packing)?,
            document_start: cfg.training.document_start_id,
            tokenizer_path: &cfg.model.tokenizer_path,
        };
        let (batch, seq) = cfg.validation_shape();
        Self::open(source, tokenizer, vocab, batch, seq, dp_rank, dp_size)
    }

    #[allow(clippy::too_many_arguments)]
    fn open(
        src: Source<'_>,
        tokenizer: Box<dyn Tokenizer>,
        vocab: usize,
        batch: usize,
        seq: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<Self> {
        let path = Path::new(src.path);
        let documents = |source: Box<dyn DocumentSource>, tokenizer| Stream::Documents {
            source,
            tokenizer,
            chat: None,
        };
        let stream = match src.dataset {
            "synthetic" => documents(Box::new(SyntheticSource::new(src.seed)), tokenizer),
            "text" => documents(Box::new(TextSource::open(path)?), tokenizer),
            "jsonl" => documents(Box::new(JsonlSource::open(path)?), tokenizer),
            "parquet" => documents(
                Box::new(super::parquet::ParquetSource::open(path)?),
                tokenizer,
            ),
            "chat" => {
                if src.tokenizer_path.is_empty() {
                    bail!("[{}] dataset = \"chat\" renders rows with the tokenizer's chat template: set [model] tokenizer_path to a Hugging Face tokenizer.json with one beside it (chat_template.jinja or tokenizer_config.json)", src.section);
                }
                Stream::Documents {
                    source: chat_rows(path)?,
                    tokenizer,
                    chat: Some(Box::new(ChatTemplate::beside(Path::new(
                        src.tokenizer_path,
                    ))?)),
                }
            }
            "tokens_u16" => Stream::Tokens(TokenShards::open(path, 2)?),
            "tokens_u32" => Stream::Tokens(TokenShards::open(path, 4)?),
            other => bail!("[{}] dataset = `{other}` is not known", src.section),
        };
        if let Stream::Documents { tokenizer, .. } = &stream {
            check_ids(&[tokenizer.bos_id()], vocab, "the tokenizer's BOS id")?;
            check_ids(&[tokenizer.eos_id()], vocab, "the tokenizer's EOS id")?;
        } else if let Some(id) = src.document_start {
            check_ids(&[id], vocab, "[training] document_start_id")?;
        }
        if src.packing == Packing::FirstFit && matches!(stream, Stream::Tokens(_)) {
            bail!("[training] packing = \"first_fit\" packs whole documents, and [{}] dataset = `{}` is pre-tokenized shards without document boundaries: use concat_then_split, or a document dataset (text, jsonl, parquet)", src.section, src.dataset);
        }
        Ok(DataLoader {
            stream,
            batch,
            seq,
            vocab,
            dp_rank,
            dp_size,
            packing: src.packing,
            document_start: src.document_start,
            state: LoaderState::default(),
        })
    }

    pub fn describe(&self) -> String {
        match &self.stream {
            Stream::Documents { source, .. } => source.describe(),
            Stream::Tokens(t) => format!("{} pre-tokenized tokens", t.total_tokens()),
        }
    }

    /// Where the last document read came from: its file and line, or its index in the epoch.
    fn last_position(&self) -> String {
        let position = match &self.stream {
            Stream::Documents { source, .. } => source.last_position(),
            Stream::Tokens(_) => None,
        };
        position.unwrap_or_else(|| {
            let (n, epoch) = (self.state.consumed, self.state.epoch);
            format!("{n} of epoch {epoch} ({})", self.describe())
        })
    }

    pub fn state(&self) -> LoaderState {
        self.state.clone()
    }

    /// Puts the loader where `state` says (documents are re-read and skipped up to it). `state`
    /// comes from a checkpoint's `state.json` (field `data`): its buffered tokens are checked
    /// against the model's vocabulary, since they go to the model without passing the tokenizer.
    pub fn restore(&mut self, state: LoaderState) -> Result<()> {
        let ids: Vec<u32> = state.buffer.iter().map(|&t| token_id(t)).collect();
        check_ids(&ids, self.vocab, "checkpoint field `data.buffer`")?;
        if let Stream::Documents { source, .. } = &mut self.stream {
            source.reset();
            source.skip(state.consumed)?;
        }
        self.state = state;
        Ok(())
    }

    /// `[batch, seq + 1]` token ids, row-major: this rank's share of the next `dp_size × batch`
    /// windows of the global stream.
    pub fn next_batch(&mut self) -> Result<Vec<u32>> {
        if self.packing == Packing::FirstFit {
            return self.next_packed_batch();
        }
        let window = self.seq + 1;
        let mut out = vec![0u32; self.batch * window];
        for k in 0..self.dp_size * self.batch {
            if k / self.batch == self.dp_rank {
                let row = k % self.batch;
                self.next_window(Some(&mut out[row * window..(row + 1) * window]))?;
            } else {
                self.next_window(None)?;
            }
        }
        Ok(out)
    }

    /// Fills `row` with the next window of the global stream, or only steps past it.
    fn next_window(&mut self, row: Option<&mut [u32]>) -> Result<()> {
        let window = self.seq + 1;
        match &mut self.stream {
            Stream::Tokens(shards) => {
                let windows = shards.total_tokens() / window as u64;
                if windows == 0 {
                    bail!("token shards hold {} tokens, fewer than one window of seq_len+1 = {window}", shards.total_tokens());
                }
                if self.state.consumed >= windows {
                    self.state.epoch = self.state.epoch.saturating_add(1);
                    self.state.consumed = 0;
                    errln!("dataset exhausted: starting epoch {}", self.state.epoch);
                }
                if let Some(row) = row {
                    shards.read(self.state.consumed * window as u64, row, self.vocab)?;
                    if let Some(start) = self.document_start {
                        row.iter_mut()
                            .filter(|t| **t == start)
                            .for_each(|t| *t |= DOCUMENT_START);
                    }
                }
                self.state.consumed += 1;
            }
            Stream::Documents { .. } => {
                while self.state.buffer.len() < window {
                    let doc = self.next_document()?;
                    self.state.buffer.extend_from_slice(&doc);
                }
                if let Some(row) = row {
                    row.copy_from_slice(&self.state.buffer[..window]);
                }
                self.state.buffer.drain(..window);
            }
        }
        Ok(())
    }

    /// The next document of the stream as `[BOS] ids [EOS]`, a new epoch begun at its end.
    fn next_document(&mut self) -> Result<Vec<u32>> {
        let Stream::Documents {
            source,
            tokenizer,
            chat,
        } = &mut self.stream
        else {
            bail!("token shards have no documents (a titan bug: checked when the loader opened)");
        };
        loop {
            let Some(doc) = source.next_document()? else {
                if self.state.consumed == 0 {
                    bail!("dataset ({}) has no documents", source.describe());
                }
                self.state.epoch = self.state.epoch.saturating_add(1);
                self.state.consumed = 0;
                source.reset();
                errln!("dataset exhausted: starting epoch {}", self.state.epoch);
                continue;
            };
            self.state.consumed = self.state.consumed.saturating_add(1);
            if let Some(template) = chat {
                let at = source.last_position().unwrap_or_else(|| source.describe());
                let messages = parse_row(&doc, &at)?;
                let chat = encode_chat(template, tokenizer.as_ref(), &messages, &at)?;
                check_ids(&chat.ids, self.vocab, "the tokenizer's output")?;
                return Ok(marked_chat(chat));
            }
            let ids = tokenizer.encode(&doc)?;
            check_ids(&ids, self.vocab, "the tokenizer's output")?;
            let mut tokens = Vec::with_capacity(ids.len() + 2);
            tokens.push(tokenizer.bos_id() | DOCUMENT_START);
            tokens.extend_from_slice(&ids);
            tokens.push(tokenizer.eos_id());
            return Ok(tokens);
        }
    }

    /// First-fit packing: whole documents into the global micro-batch's windows, this rank's
    /// share of them. The document that fits no window waits in `state.buffer` for the next call.
    fn next_packed_batch(&mut self) -> Result<Vec<u32>> {
        let window = self.seq + 1;
        let mut bins = FirstFitBins::new(self.dp_size * self.batch, window);
        loop {
            let mut doc = match self.state.buffer.is_empty() {
                true => self.next_document()?,
                false => std::mem::take(&mut self.state.buffer),
            };
            if doc.len() > window {
                if self.dp_rank == 0 {
                    let at = self.last_position();
                    errln!("warning: document {at} has {} tokens with BOS and EOS (or its chat template's), more than a sample's seq_len + 1 = {window}: first_fit packing keeps its first {window}", doc.len());
                }
                doc.truncate(window);
            }
            if !bins.place(&doc) {
                self.state.buffer = doc;
                break;
            }
        }
        let mine = self.dp_rank * self.batch..(self.dp_rank + 1) * self.batch;
        Ok(bins.into_samples()[mine].concat())
    }
}

/// A conversation's tokens as the model reads them: its first token marked as a document's start,
/// every token but the assistant's marked not a target.
fn marked_chat(chat: ChatTokens) -> Vec<u32> {
    chat.ids
        .iter()
        .zip(&chat.assistant_mask)
        .enumerate()
        .map(|(i, (&id, &assistant))| {
            let start = if i == 0 { DOCUMENT_START } else { 0 };
            let prompt = if assistant == 0 { NOT_A_TARGET } else { 0 };
            id | start | prompt
        })
        .collect()
}

/// Every id of `ids` below `vocab`; otherwise an error naming `what`, the id, its index and the
/// vocabulary size.
fn check_ids(ids: &[u32], vocab: usize, what: &str) -> Result<()> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        None => Ok(()),
        Some(i) if ids.len() == 1 => bail!(
            "{what} is {}, outside the model's vocabulary of {vocab} ids",
            ids[i]
        ),
        Some(i) => bail!(
            "{what}[{i}] is token id {}, outside the model's vocabulary of {vocab} ids (0..{vocab})",
            ids[i]
        ),
    }
}
