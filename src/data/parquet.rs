//! Parquet datasets (HF `datasets` style): one document per row of the `text` column.

use std::path::Path;

use anyhow::{bail, Result};

use super::documents::DocumentSource;

pub struct ParquetSource;

impl ParquetSource {
    pub fn open(path: &Path) -> Result<Self> {
        bail!("Parquet datasets are not supported yet (dataset_path {}): convert to JSONL with a `text` field, or use dataset = \"jsonl\"", path.display())
    }
}

impl DocumentSource for ParquetSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        Ok(None)
    }
    fn reset(&mut self) {}
    fn describe(&self) -> String {
        "parquet".into()
    }
}
