//! How a checkpoint folder comes into place without ever leaving a lie or a leak behind:
//! - the files are written into a temporary folder (`.tmp-step-N-…`), which a failed save removes
//!   (`TempFolder`, on any error or panic) and start-up removes if a killed process left it
//!   (`remove_stale`);
//! - every file and then the temporary folder itself are fsynced before the rename, and the parent
//!   folder after it, so a power loss cannot leave a renamed folder with missing contents;
//! - a step saved again (a run resumed from an earlier step) first renames the old `step-N/` aside
//!   (`.old-step-N-…`), renames the new one in, and only then removes the old one: there is always
//!   a complete `step-N/`, or the aside copy that start-up puts back;
//! - a failed save's error names the last complete checkpoint (`save_failed`); once the new step
//!   is in place, an old one that cannot be pruned is only a warning.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::{list_steps, step_dir, TrainState};

const TMP_PREFIX: &str = ".tmp-step-";
const OLD_PREFIX: &str = ".old-step-";

/// A temporary checkpoint folder, removed when dropped unless it was renamed into place.
pub(crate) struct TempFolder {
    path: PathBuf,
    placed: bool,
}

/// The temporary folder of a save of `step` (`tag`: the writing process, or `sharded`).
pub(crate) fn tmp_path(folder: &Path, step: u64, tag: &str) -> PathBuf {
    folder.join(format!("{TMP_PREFIX}{step}-{tag}"))
}

impl TempFolder {
    /// Creates `folder/.tmp-step-{step}-{tag}` afresh (and `folder` if needed).
    pub(crate) fn create(folder: &Path, step: u64, tag: &str) -> Result<Self> {
        std::fs::create_dir_all(folder)
            .with_context(|| format!("cannot create checkpoint folder {}", folder.display()))?;
        let path = tmp_path(folder, step, tag);
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(TempFolder {
            path,
            placed: false,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempFolder {
    fn drop(&mut self) {
        if !self.placed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// fsync of a folder (its entries); a file system that cannot sync folders is not an error.
fn sync_dir(dir: &Path) -> Result<()> {
    let f = std::fs::File::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    match f.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        r => r.with_context(|| format!("cannot fsync {}", dir.display())),
    }
}

/// Writes `state.json` (and its checksum) into the complete temporary folder, syncs it, renames it
/// to `step-N/` (an existing one renamed aside first, removed after) and prunes old checkpoints
/// down to `keep_latest_k` (0 keeps all).
pub(crate) fn finish_save(
    folder: &Path,
    mut tmp: TempFolder,
    state: TrainState,
    keep_latest_k: usize,
) -> Result<PathBuf> {
    let step = state.step;
    super::integrity::write_state(tmp.path(), &state)?;
    sync_dir(tmp.path())?;
    let final_dir = step_dir(folder, step);
    install(folder, tmp.path(), &final_dir, step)?;
    tmp.placed = true;
    if keep_latest_k > 0 {
        prune(folder, keep_latest_k);
    }
    Ok(final_dir)
}

/// Removes all but the latest `keep` complete checkpoints. The new one is in place by now, so a
/// checkpoint that cannot be removed is a warning, not a failed save.
fn prune(folder: &Path, keep: usize) {
    let steps = match list_steps(folder) {
        Ok(steps) => steps,
        Err(e) => return errln!("warning: old checkpoints not pruned: {e:#}"),
    };
    for &old in steps.iter().take(steps.len().saturating_sub(keep)) {
        let dir = step_dir(folder, old);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            errln!("warning: old checkpoint {} not removed: {e}", dir.display());
        }
    }
}

/// Renames `tmp` to `final_dir`; an existing `final_dir` is renamed aside first (and back if the
/// rename fails) and removed once the new one is in place.
fn install(folder: &Path, tmp: &Path, final_dir: &Path, step: u64) -> Result<()> {
    let aside = match std::fs::symlink_metadata(final_dir) {
        Ok(m) if m.is_dir() => {
            let a = folder.join(format!("{OLD_PREFIX}{step}-{}", std::process::id()));
            std::fs::rename(final_dir, &a)
                .with_context(|| format!("cannot move the old {} aside", final_dir.display()))?;
            Some(a)
        }
        _ => None,
    };
    if let Err(e) = std::fs::rename(tmp, final_dir) {
        if let Some(a) = &aside {
            let _ = std::fs::rename(a, final_dir);
        }
        return Err(e)
            .with_context(|| format!("cannot move checkpoint into {}", final_dir.display()));
    }
    sync_dir(folder)?;
    if let Some(a) = aside {
        if let Err(e) = std::fs::remove_dir_all(&a) {
            errln!(
                "warning: the replaced checkpoint {} could not be removed: {e}",
                a.display()
            );
        }
    }
    Ok(())
}

/// At start-up (rank 0, before choosing a checkpoint): removes the temporary folders of saves that
/// were interrupted, and settles an interrupted overwrite: the aside copy of a step is put back
/// when the step is missing, else removed.
pub fn remove_stale(folder: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("cannot list {}", folder.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(TMP_PREFIX) {
            errln!(
                "removing {}: the temporary folder of an interrupted checkpoint save",
                path.display()
            );
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        } else if let Some(rest) = name.strip_prefix(OLD_PREFIX) {
            settle_aside(folder, &path, rest)?;
        }
    }
    Ok(())
}

/// An aside copy `path` (`.old-step-{rest}`): back to `step-N/` when that is missing, else removed.
fn settle_aside(folder: &Path, path: &Path, rest: &str) -> Result<()> {
    let step = rest.split('-').next().and_then(|s| s.parse::<u64>().ok());
    if let Some(step) = step {
        let dir = step_dir(folder, step);
        if !dir.exists() && path.join(super::STATE_FILE).exists() {
            errln!(
                "restoring {} from {} (a save of that step was interrupted)",
                dir.display(),
                path.display()
            );
            return std::fs::rename(path, &dir)
                .with_context(|| format!("cannot restore {}", dir.display()));
        }
    }
    std::fs::remove_dir_all(path).with_context(|| format!("cannot remove {}", path.display()))
}

/// The context of a failed save of `step` into `folder`: what was not saved and the last complete
/// checkpoint, the one a restart resumes from.
pub fn save_failed(folder: &Path, step: u64) -> String {
    let last = match list_steps(folder) {
        Ok(steps) => match steps.last() {
            Some(s) => format!(
                "the last complete checkpoint is step-{s} ({})",
                step_dir(folder, *s).display()
            ),
            None => "there is no complete checkpoint yet".to_string(),
        },
        Err(e) => format!("its complete checkpoints cannot be listed: {e}"),
    };
    format!(
        "checkpoint step-{step} was not saved in {} ({last})",
        folder.display()
    )
}
