//! Parquet datasets (HF `datasets` style): one document per row of the string column `text`, or
//! for chat data (`chat.rs`) each row's `messages` (a list of `role`/`content`) or `prompt` and
//! `response`, handed on as the row's JSON; read row by row with the `parquet` crate's record
//! reader (only those columns are decoded).
//!
//! The `parquet` crate can panic on malformed input (a corrupt page, a bad dictionary index); every
//! call into it runs under `catch_unwind`, so a bad file is an error naming the file (and row),
//! never a crashed rank.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::RowAccessor;
use parquet::schema::types::Type;

use super::documents::DocumentSource;
use super::files::{list_files, panic_as_error};

/// What a row is read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowKind {
    /// The string column `text`.
    Text,
    /// The row's chat columns as one JSON object.
    Chat,
}

pub struct ParquetSource {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<(RowIter<'static>, PathBuf, usize)>,
    path: String,
    kind: RowKind,
}

impl ParquetSource {
    /// Rows of the string column `text`.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_as(path, RowKind::Text)
    }

    /// Chat rows: `messages`, or `prompt` and `response`, each row as its JSON object.
    pub fn open_chat(path: &Path) -> Result<Self> {
        Self::open_as(path, RowKind::Chat)
    }

    fn open_as(path: &Path, kind: RowKind) -> Result<Self> {
        let files = list_files(path, &[".parquet"])?;
        // Fail early (not at the first batch) when a file is unreadable or lacks the columns.
        for f in &files {
            Self::open_rows(f, kind)?;
        }
        Ok(ParquetSource {
            files,
            next_file: 0,
            current: None,
            path: path.display().to_string(),
            kind,
        })
    }

    fn open_rows(path: &Path, kind: RowKind) -> Result<RowIter<'static>> {
        let file = File::open(path)
            .with_context(|| format!("cannot open data file {}", path.display()))?;
        guarded(path, None, || Self::rows_of(path, file, kind))
    }

    /// The rows of `file`'s columns `kind` reads (the decoder may panic here: see `guarded`).
    fn rows_of(path: &Path, file: File, kind: RowKind) -> Result<RowIter<'static>> {
        let reader = SerializedFileReader::new(file)
            .map_err(|e| anyhow!("{}: not a readable Parquet file: {e}", path.display()))?;
        let schema = reader.metadata().file_metadata().schema_descr_ptr();
        let root = schema.root_schema();
        let field = |name: &str| root.get_fields().iter().find(|f| f.name() == name).cloned();
        let fields = match kind {
            RowKind::Text => vec![field("text")],
            RowKind::Chat => match field("messages") {
                Some(m) => vec![Some(m)],
                None => vec![field("prompt"), field("response")],
            },
        };
        let Some(fields) = fields.into_iter().collect::<Option<Vec<_>>>() else {
            let names: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
            let wanted = match kind {
                RowKind::Text => "column `text`",
                RowKind::Chat => "column `messages`, nor `prompt` and `response`",
            };
            bail!(
                "{}: no {wanted} (columns: {})",
                path.display(),
                names.join(", ")
            );
        };
        let projection = Type::group_type_builder(root.name())
            .with_fields(fields)
            .build()
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        RowIter::from_file_into(Box::new(reader))
            .project(Some(projection))
            .map_err(|e| anyhow!("{}: {e}", path.display()))
    }

    /// The next row's text (or chat JSON), `None` at the end of the file.
    fn next_text(
        rows: &mut RowIter<'static>,
        path: &Path,
        (row_no, kind): (usize, RowKind),
    ) -> Result<Option<String>> {
        let Some(row) = rows.next() else {
            return Ok(None);
        };
        let row = row.map_err(|e| anyhow!("{} row {row_no}: {e}", path.display()))?;
        if kind == RowKind::Chat {
            return Ok(Some(row.to_json_value().to_string()));
        }
        let text = row.get_string(0).map_err(|e| {
            anyhow!(
                "{} row {row_no}: column `text` is not a non-null string ({e})",
                path.display()
            )
        })?;
        Ok(Some(text.clone()))
    }
}

/// Runs `f`, a call into the `parquet` crate, turning a panic of the decoder into an error naming
/// `path` and the row it was reading, if any (`files::panic_as_error`).
fn guarded<T>(path: &Path, row: Option<usize>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    panic_as_error(f, |msg| {
        let doing = row.map_or("opening it".into(), |r| format!("at row {r}"));
        anyhow!(
            "{}: the Parquet decoder failed {doing} (a corrupt or unsupported file): {msg}",
            path.display()
        )
    })
}

impl DocumentSource for ParquetSource {
    fn next_document(&mut self) -> Result<Option<String>> {
        loop {
            if self.current.is_none() {
                if self.next_file >= self.files.len() {
                    return Ok(None);
                }
                let p = self.files[self.next_file].clone();
                self.next_file += 1;
                self.current = Some((Self::open_rows(&p, self.kind)?, p, 0));
            }
            let kind = self.kind;
            let (rows, path, row_no) = self.current.as_mut().expect("opened above");
            *row_no += 1;
            let (path, at) = (&*path, *row_no);
            match guarded(path, Some(at), || Self::next_text(rows, path, (at, kind))) {
                Ok(Some(text)) => return Ok(Some(text)),
                Ok(None) => self.current = None,
                Err(e) => {
                    // A reader that panicked is not used again.
                    self.current = None;
                    return Err(e);
                }
            }
        }
    }

    fn reset(&mut self) {
        self.next_file = 0;
        self.current = None;
    }

    fn describe(&self) -> String {
        format!("Parquet at {}", self.path)
    }

    fn last_position(&self) -> Option<String> {
        let (_, path, row) = self.current.as_ref()?;
        Some(format!("{} row {row}", path.display()))
    }
}

/// Writes `texts` as a Parquet file with columns `id` (INT64) and `text` (UTF-8): for tests and
/// for users who want to produce a small Parquet dataset.
pub fn write_text_parquet(path: &Path, texts: &[String]) -> Result<()> {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let schema = Arc::new(parquet::schema::parser::parse_message_type(
        "message schema { REQUIRED INT64 id; REQUIRED BYTE_ARRAY text (UTF8); }",
    )?);
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut writer =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build()))?;
    let mut group = writer.next_row_group()?;
    let ids: Vec<i64> = (0..texts.len() as i64).collect();
    let mut col = group
        .next_column()?
        .ok_or_else(|| anyhow!("schema has no id column"))?;
    col.typed::<Int64Type>().write_batch(&ids, None, None)?;
    col.close()?;
    let values: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(t.as_str())).collect();
    let mut col = group
        .next_column()?
        .ok_or_else(|| anyhow!("schema has no text column"))?;
    col.typed::<ByteArrayType>()
        .write_batch(&values, None, None)?;
    col.close()?;
    group.close()?;
    writer.close()?;
    if texts.is_empty() {
        bail!("wrote an empty Parquet file {}", path.display());
    }
    Ok(())
}
