//! Finding dataset files and reading them line by line across files, with the file and line of
//! every record at hand for error messages. `.gz` files are decompressed on the fly.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use flate2::read::MultiGzDecoder;

/// `path` itself, or every file under it (recursively, sorted) whose name ends with one of `suffixes`
/// (any file when `suffixes` is empty).
pub fn list_files(path: &Path, suffixes: &[&str]) -> Result<Vec<PathBuf>> {
    if !path.exists() {
        bail!("dataset path {} does not exist", path.display());
    }
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            let p = entry?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if !name.starts_with('.')
                    && (suffixes.is_empty() || suffixes.iter().any(|s| name.ends_with(s)))
                {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    if out.is_empty() {
        let want = if suffixes.is_empty() {
            "any file".to_string()
        } else {
            suffixes.join(", ")
        };
        bail!(
            "dataset folder {} holds no data files (looked for {want})",
            path.display()
        );
    }
    Ok(out)
}

/// Lines of several files in order, each with its file and 1-based line number.
pub struct LineReader {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<(Box<dyn BufRead + Send>, PathBuf, usize)>,
    buf: String,
}

impl LineReader {
    pub fn new(files: Vec<PathBuf>) -> Self {
        LineReader {
            files,
            next_file: 0,
            current: None,
            buf: String::new(),
        }
    }

    pub fn reset(&mut self) {
        self.next_file = 0;
        self.current = None;
    }

    fn open(path: &Path) -> Result<Box<dyn BufRead + Send>> {
        let f = File::open(path)
            .with_context(|| format!("cannot open data file {}", path.display()))?;
        let gz = path.extension().is_some_and(|e| e == "gz");
        Ok(if gz {
            Box::new(BufReader::new(MultiGzDecoder::new(f)))
        } else {
            Box::new(BufReader::new(f))
        })
    }

    /// The next line (without its newline) with its file and line number; `None` after the last file.
    pub fn next_line(&mut self) -> Result<Option<(&str, &Path, usize)>> {
        loop {
            if self.current.is_none() {
                if self.next_file >= self.files.len() {
                    return Ok(None);
                }
                let p = self.files[self.next_file].clone();
                self.next_file += 1;
                self.current = Some((Self::open(&p)?, p, 0));
            }
            let (reader, path, line_no) = self.current.as_mut().expect("opened above");
            self.buf.clear();
            let n = reader.read_line(&mut self.buf).map_err(|e| {
                anyhow::anyhow!("{}:{}: cannot read: {e}", path.display(), *line_no + 1)
            })?;
            if n == 0 {
                self.current = None;
                continue;
            }
            *line_no += 1;
            let trimmed = self.buf.trim_end_matches(['\n', '\r']).len();
            self.buf.truncate(trimmed);
            let (_, path, line_no) = self.current.as_ref().expect("opened above");
            return Ok(Some((&self.buf, path, *line_no)));
        }
    }
}
