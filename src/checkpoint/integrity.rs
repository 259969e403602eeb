//! What a checkpoint must pass before any of it is used or anything is sized from it:
//! - `state.json` is covered by a SHA-256 in `state.json.sha256` beside it (`sha256sum`'s format,
//!   so `sha256sum -c state.json.sha256` checks it by hand). A checkpoint without that file
//!   (written before it existed) still loads, with a warning; a mismatch is an error naming the
//!   file. The CRC32 and size of every other file are inside `state.json`, so they are covered too.
//! - its model arguments pass `ModelArgs::validate` (ranges and consistency), its shard index
//!   matches the model those arguments describe (`ShardIndex::validate`), every file it lists is a
//!   plain file name inside the step's folder, and the expert bias has the model's shape;
//! - every file's size on disk is checked against the recorded one before it is read, and the
//!   weights a reader is about to allocate against the bytes the weight files hold.
//!
//! Errors name the file, and the field where one is at fault.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

use super::{FileCheck, TrainState, STATE_FILE};

/// The SHA-256 of `state.json`, beside it.
pub const STATE_SHA_FILE: &str = "state.json.sha256";

/// The largest `state.json` read (it holds shapes, checks and the data loader's position).
const MAX_STATE_BYTES: u64 = 1 << 30;

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes `state.json` and its checksum into the step's (temporary) folder `dir`, each synced.
pub(crate) fn write_state(dir: &Path, state: &TrainState) -> Result<()> {
    let text = serde_json::to_string_pretty(state)?;
    super::write_synced(&dir.join(STATE_FILE), text.as_bytes())?;
    let line = format!("{}  {STATE_FILE}\n", sha256_hex(text.as_bytes()));
    super::write_synced(&dir.join(STATE_SHA_FILE), line.as_bytes())?;
    Ok(())
}

/// The text of `dir`'s `state.json`, checked against its SHA-256 (a warning when the checksum
/// file is absent: a checkpoint of an earlier titan).
pub(crate) fn read_state_text(dir: &Path) -> Result<String> {
    let path = dir.join(STATE_FILE);
    let len = std::fs::metadata(&path)
        .with_context(|| {
            format!(
                "checkpoint {} is incomplete: cannot read {}",
                dir.display(),
                path.display()
            )
        })?
        .len();
    if len > MAX_STATE_BYTES {
        bail!(
            "checkpoint state {} is {len} bytes, more than the {MAX_STATE_BYTES} a state.json can be",
            path.display()
        );
    }
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    match std::fs::read_to_string(dir.join(STATE_SHA_FILE)) {
        Ok(line) => check_sha(&path, &bytes, &line)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => warn_unverified(dir),
        Err(e) => bail!(
            "checkpoint {}: cannot read {STATE_SHA_FILE}: {e}",
            dir.display()
        ),
    }
    String::from_utf8(bytes)
        .map_err(|_| anyhow!("checkpoint state {} is corrupt: not UTF-8", path.display()))
}

/// `bytes` (of `path`) against the first field of the checksum file's `line`.
fn check_sha(path: &Path, bytes: &[u8], line: &str) -> Result<()> {
    let want = line.split_whitespace().next().unwrap_or("");
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!(
            "checkpoint state checksum {} is corrupt: `{}` is not a SHA-256",
            path.with_file_name(STATE_SHA_FILE).display(),
            want.chars().take(80).collect::<String>()
        );
    }
    if !want.eq_ignore_ascii_case(&sha256_hex(bytes)) {
        bail!(
            "checkpoint state {} is corrupt: its SHA-256 does not match the one in {STATE_SHA_FILE} (written at save time)",
            path.display()
        );
    }
    Ok(())
}

/// One warning per folder for a checkpoint without `state.json.sha256`.
fn warn_unverified(dir: &Path) {
    static WARNED: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if warned.insert(dir.to_path_buf()) {
        errln!(
            "warning: checkpoint {} has no {STATE_SHA_FILE} (written by an earlier titan): its state.json is read unverified",
            dir.display()
        );
    }
}

/// Everything in `state` (of `dir`'s `state.json`) that sizes or locates what is read next.
pub(crate) fn check_state(dir: &Path, state: &TrainState) -> Result<()> {
    let path = dir.join(STATE_FILE);
    let args = &state.model_args;
    args.validate()
        .map_err(|e| anyhow!("{}: model_args: {e}", path.display()))?;
    for name in state.files.keys() {
        if !is_plain_file_name(name) {
            bail!(
                "{}: files: `{name}` is not a file name inside the checkpoint folder",
                path.display()
            );
        }
    }
    if let Some(index) = &state.sharding {
        index
            .validate(args)
            .map_err(|e| anyhow!("{}: sharding: {e}", path.display()))?;
    }
    if let Some(bias) = &state.expert_bias {
        let experts = args.moe.as_ref().map_or(0, |m| m.router.num_experts);
        if bias.len() != args.n_layers || bias.iter().any(|b| b.len() != experts) {
            bail!(
                "{}: expert_bias: {} blocks, the model has {} blocks of {experts} experts",
                path.display(),
                bias.len(),
                args.n_layers
            );
        }
    }
    Ok(())
}

/// A name of one file directly inside a folder (no separator, not `.` or `..`, not hidden).
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\\', '\0'])
}

/// The size of `dir/file` on disk against `check`, before it is read.
pub(crate) fn check_size(dir: &Path, file: &str, check: &FileCheck) -> Result<()> {
    let p = dir.join(file);
    let len = std::fs::metadata(&p)
        .with_context(|| format!("checkpoint {}: cannot read {file}", dir.display()))?
        .len();
    if len != check.bytes {
        bail!(
            "checkpoint file {} is truncated or altered: {len} bytes, expected {}",
            p.display(),
            check.bytes
        );
    }
    Ok(())
}

/// `dir/file`'s size and CRC32 against `check`, read in pieces (constant memory).
pub(crate) fn verify_file(dir: &Path, file: &str, check: &FileCheck) -> Result<()> {
    check_size(dir, file, check)?;
    let p = dir.join(file);
    let mut f = std::fs::File::open(&p).with_context(|| format!("cannot open {}", p.display()))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", p.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    if hasher.finalize() != check.crc32 {
        bail!(
            "checkpoint file {} is corrupt: its CRC32 does not match the one recorded at save time",
            p.display()
        );
    }
    Ok(())
}

/// The model's weights (f32) fit in the weight files `state` lists, as they are on disk: checked
/// before a reader allocates the weights from the model arguments.
pub(crate) fn check_weights_present(dir: &Path, state: &TrainState) -> Result<()> {
    let mut present = 0u64;
    for name in state.files.keys().filter(|n| n.starts_with("model")) {
        let p = dir.join(name);
        let len = std::fs::metadata(&p)
            .with_context(|| format!("checkpoint {}: cannot read {name}", dir.display()))?
            .len();
        present = present.saturating_add(len);
    }
    // Within `ModelArgs::validate`'s bounds the count stays below 2⁶².
    let params = state.model_args.num_params() as u64;
    let needed = params.saturating_mul(4);
    if needed > present {
        bail!(
            "{}: model_args describe {params} parameters ({needed} bytes), but its weight files hold only {present} bytes",
            dir.join(STATE_FILE).display()
        );
    }
    Ok(())
}
