//! Finding dataset files and reading them line by line across files, with the file and line of
//! every record at hand for error messages. `.gz` files are decompressed on the fly. And the guard
//! every call into a third-party decoder that may panic on malformed input runs under
//! (`panic_as_error`: the Parquet reader, `tokenizers`).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use flate2::read::MultiGzDecoder;

/// Runs `f`, a call into a third-party decoder that may panic on malformed input, turning a panic
/// into the error `failed` makes of its message (the default hook has already printed it to
/// stderr): a bad file is an error naming it, never a crashed rank.
pub fn panic_as_error<T>(
    f: impl FnOnce() -> Result<T>,
    failed: impl FnOnce(&str) -> anyhow::Error,
) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(failed(&msg))
    })
}

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

/// The longest line a text or JSONL file may hold, in bytes without its line ending (16 MiB). A
/// longer line is an error naming its file and line, found after reading at most this many bytes
/// of it: a file without newlines (or a gzip bomb) never makes a rank hold more than that.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// Lines of several files in order, each with its file and 1-based line number.
pub struct LineReader {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<(Box<dyn BufRead + Send>, PathBuf, usize)>,
    buf: Vec<u8>,
    max_line: usize,
}

/// What one bounded read of a line found.
enum LineEnd {
    /// The end of the file, before any byte of a new line.
    Eof,
    /// A line (its ending removed) is in the buffer.
    Line,
    /// The line is longer than the cap (the buffer holds its first bytes).
    TooLong,
}

/// Reads one line into `buf` (cleared first), at most `max` bytes without its line ending (the
/// trailing `\n` and `\r`s, removed).
fn read_bounded_line(
    reader: &mut dyn BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<LineEnd> {
    buf.clear();
    let mut any = false;
    loop {
        let avail = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            break;
        }
        any = true;
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        // One byte of slack: a `\r` just past the cap may still be part of `\r\n`.
        let room = (max + 1).saturating_sub(buf.len());
        buf.extend_from_slice(&avail[..take.min(room + 1)]);
        reader.consume(take);
        if done {
            break;
        }
        if buf.len() > max + 1 {
            return Ok(LineEnd::TooLong);
        }
    }
    if !any {
        return Ok(LineEnd::Eof);
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    Ok(if buf.len() > max {
        LineEnd::TooLong
    } else {
        LineEnd::Line
    })
}

impl LineReader {
    pub fn new(files: Vec<PathBuf>) -> Self {
        Self::with_max_line(files, MAX_LINE_BYTES)
    }

    /// Like `new`, with another cap on a line's length (tests use a small one).
    pub fn with_max_line(files: Vec<PathBuf>, max_line: usize) -> Self {
        LineReader {
            files,
            next_file: 0,
            current: None,
            buf: Vec::new(),
            max_line,
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

    /// The next line (without its newline) with its file and line number; `None` after the last
    /// file. A line over the cap or not UTF-8 is an error naming its file and line.
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
            let at = *line_no + 1;
            let end = read_bounded_line(reader.as_mut(), &mut self.buf, self.max_line)
                .map_err(|e| anyhow!("{}:{at}: cannot read: {e}", path.display()))?;
            match end {
                LineEnd::Eof => {
                    self.current = None;
                    continue;
                }
                LineEnd::TooLong => bail!(
                    "{}:{at}: line is longer than {} bytes (MAX_LINE_BYTES); is this a text or \
                     JSONL file with one document per line?",
                    path.display(),
                    self.max_line
                ),
                LineEnd::Line => {}
            }
            *line_no = at;
            let (_, path, line_no) = self.current.as_ref().expect("opened above");
            let line = std::str::from_utf8(&self.buf).map_err(|e| {
                anyhow!(
                    "{}:{line_no}: not valid UTF-8 (at byte {} of the line)",
                    path.display(),
                    e.valid_up_to()
                )
            })?;
            return Ok(Some((line, path, *line_no)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines around a cap of 10000 bytes, crossing `BufReader`'s 8 KiB refills.
    #[test]
    fn lines_are_bounded_at_the_cap_whatever_their_ending() {
        let dir = tempfile::tempdir().unwrap();
        let cap = 10_000;
        let at_cap = "a".repeat(cap);
        let cases: [(String, Option<usize>); 5] = [
            (format!("{at_cap}\n"), Some(cap)),
            (format!("{at_cap}\r\n"), Some(cap)),
            (at_cap.clone(), Some(cap)),
            (format!("{at_cap}b\n"), None),
            (format!("{at_cap}bc"), None),
        ];
        for (i, (text, want)) in cases.iter().enumerate() {
            let p = dir.path().join(format!("{i}.txt"));
            std::fs::write(&p, format!("first\n{text}")).unwrap();
            let mut r = LineReader::with_max_line(vec![p.clone()], cap);
            assert_eq!(r.next_line().unwrap().unwrap().0, "first");
            match want {
                Some(len) => {
                    let (line, _, no) = r.next_line().unwrap().unwrap();
                    assert_eq!((line.len(), no), (*len, 2), "case {i}");
                    assert!(r.next_line().unwrap().is_none(), "case {i}");
                }
                None => {
                    let e = r.next_line().unwrap_err().to_string();
                    let at = format!("{}:2: line is longer than {cap} bytes", p.display());
                    assert!(e.contains(&at), "case {i}: {e}");
                }
            }
        }
    }

    #[test]
    fn invalid_utf8_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.txt");
        std::fs::write(&p, b"ok\nab\xffcd\n").unwrap();
        let mut r = LineReader::new(vec![p]);
        r.next_line().unwrap();
        let e = r.next_line().unwrap_err().to_string();
        assert!(e.contains("bad.txt:2: not valid UTF-8 (at byte 2"), "{e}");
    }
}
