//! Document sources: each yields text documents in a fixed order and can restart from the first
//! (a new epoch). Synthetic documents, lines of text files (as HF's `text` datasets do) and the
//! `text` field of JSONL records (C4 style, optionally gzipped).

use std::path::Path;

use anyhow::{anyhow, bail, Result};

use super::files::{list_files, LineReader};
use super::synthetic::synthetic_document;

pub trait DocumentSource: Send {
    /// The next document, or `None` at the end of the epoch.
    fn next_document(&mut self) -> Result<Option<String>>;
    /// Back to the first document.
    fn reset(&mut self);
    /// Skips `n` documents (used to resume).
    fn skip(&mut self, n: u64) -> Result<()> {
        for i in 0..n {
            if self.next_document()?.is_none() {
                bail!("dataset ended after {i} documents while resuming at document {n}: has it changed since the checkpoint?");
            }
        }
        Ok(())
    }
    fn describe(&self) -> String;
    /// Where the last document came from (a file and line), for errors about it.
    fn last_position(&self) -> Option<String> {
        None
    }
}

pub struct SyntheticSource {
    seed: u64,
    next: u64,
}

impl SyntheticSource {
    pub fn new(seed: u64) -> Self {
        SyntheticSource { seed, next: 0 }
    }
}

impl DocumentSource for SyntheticSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        let doc = synthetic_document(self.seed, self.next);
        self.next = self.next.wrapping_add(1);
        Ok(Some(doc))
    }
    fn reset(&mut self) {
        self.next = 0;
    }
    fn skip(&mut self, n: u64) -> Result<()> {
        self.next = self.next.checked_add(n).ok_or_else(|| {
            anyhow!("cannot resume at synthetic document {n}: the position overflows (checkpoint field `data.consumed`)")
        })?;
        Ok(())
    }
    fn describe(&self) -> String {
        "built-in synthetic corpus".into()
    }
}

/// Every non-empty line of the text files is one document.
pub struct TextSource {
    lines: LineReader,
    path: String,
}

impl TextSource {
    pub fn open(path: &Path) -> Result<Self> {
        Ok(TextSource {
            lines: LineReader::new(list_files(path, &[])?),
            path: path.display().to_string(),
        })
    }
}

impl DocumentSource for TextSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        while let Some((line, _, _)) = self.lines.next_line()? {
            if !line.trim().is_empty() {
                return Ok(Some(line.to_string()));
            }
        }
        Ok(None)
    }
    fn reset(&mut self) {
        self.lines.reset();
    }
    fn describe(&self) -> String {
        format!("text files at {}", self.path)
    }
}

/// Chat rows (`chat.rs`), one JSON object per line, each handed on whole: the loader parses and
/// renders it.
pub struct ChatSource {
    lines: LineReader,
    path: String,
    last: Option<String>,
}

impl ChatSource {
    pub fn open(path: &Path) -> Result<Self> {
        Ok(ChatSource {
            lines: LineReader::new(list_files(path, &[".jsonl", ".jsonl.gz", ".json.gz"])?),
            path: path.display().to_string(),
            last: None,
        })
    }
}

impl DocumentSource for ChatSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        while let Some((line, file, line_no)) = self.lines.next_line()? {
            if line.trim().is_empty() {
                continue;
            }
            self.last = Some(format!("{}:{line_no}", file.display()));
            return Ok(Some(line.to_string()));
        }
        Ok(None)
    }
    fn reset(&mut self) {
        self.lines.reset();
    }
    fn describe(&self) -> String {
        format!("chat JSONL at {}", self.path)
    }
    fn last_position(&self) -> Option<String> {
        self.last.clone()
    }
}

/// One JSON object per line with a string field `text`.
pub struct JsonlSource {
    lines: LineReader,
    path: String,
}

impl JsonlSource {
    pub fn open(path: &Path) -> Result<Self> {
        Ok(JsonlSource {
            lines: LineReader::new(list_files(path, &[".jsonl", ".jsonl.gz", ".json.gz"])?),
            path: path.display().to_string(),
        })
    }
}

impl DocumentSource for JsonlSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        while let Some((line, file, line_no)) = self.lines.next_line()? {
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| anyhow!("{}:{line_no}: not valid JSON: {e}", file.display()))?;
            let text = value.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                anyhow!(
                    "{}:{line_no}: record has no string field `text`",
                    file.display()
                )
            })?;
            return Ok(Some(text.to_string()));
        }
        Ok(None)
    }
    fn reset(&mut self) {
        self.lines.reset();
    }
    fn describe(&self) -> String {
        format!("JSONL at {}", self.path)
    }
}
