//! Pre-tokenized binary shards: files of little-endian uint16 or uint32 token ids, read as one
//! stream in file-name order, with random access by global token offset.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::files::list_files;

pub struct TokenShards {
    files: Vec<(PathBuf, u64)>,
    bytes_per_token: u64,
    total: u64,
}

impl TokenShards {
    pub fn open(path: &Path, bytes_per_token: u64) -> Result<Self> {
        let mut files = Vec::new();
        let mut total = 0;
        for p in list_files(path, &[".bin"])? {
            let len = std::fs::metadata(&p)
                .with_context(|| format!("cannot stat {}", p.display()))?
                .len();
            if len % bytes_per_token != 0 {
                bail!("token shard {} has {len} bytes, not a multiple of {bytes_per_token} (is it uint{} data?)", p.display(), bytes_per_token * 8);
            }
            total += len / bytes_per_token;
            files.push((p, len / bytes_per_token));
        }
        if total == 0 {
            bail!("token shards at {} hold no tokens", path.display());
        }
        Ok(TokenShards {
            files,
            bytes_per_token,
            total,
        })
    }

    pub fn total_tokens(&self) -> u64 {
        self.total
    }

    /// `out.len()` tokens starting at global `offset`, checked against `vocab`.
    pub fn read(&self, offset: u64, out: &mut [u32], vocab: usize) -> Result<()> {
        let mut pos = offset;
        let mut filled = 0;
        let mut start = 0u64;
        for (path, n) in &self.files {
            if filled == out.len() {
                break;
            }
            if pos >= start + n {
                start += n;
                continue;
            }
            let local = pos - start;
            let take = ((n - local) as usize).min(out.len() - filled);
            let mut f = File::open(path)
                .with_context(|| format!("cannot open token shard {}", path.display()))?;
            f.seek(SeekFrom::Start(local * self.bytes_per_token))?;
            let mut bytes = vec![0u8; take * self.bytes_per_token as usize];
            f.read_exact(&mut bytes).with_context(|| {
                format!("token shard {} is shorter than it was", path.display())
            })?;
            for (i, c) in bytes
                .chunks_exact(self.bytes_per_token as usize)
                .enumerate()
            {
                let id = if self.bytes_per_token == 2 {
                    u16::from_le_bytes([c[0], c[1]]) as u32
                } else {
                    u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                };
                if id as usize >= vocab {
                    bail!("token shard {} holds token id {id} at token {} but the model's vocabulary has {vocab} entries", path.display(), local + i as u64);
                }
                out[filled + i] = id;
            }
            filled += take;
            pos += take as u64;
            start += n;
        }
        if filled != out.len() {
            bail!(
                "token shards end at {} tokens; asked for {}..{}",
                self.total,
                offset,
                offset + out.len() as u64
            );
        }
        Ok(())
    }
}
