//! Checkpoints: one folder per step (`step-N/`) holding the weights and the AdamW moments as
//! safetensors plus `state.json` (step, data-loader position, model shapes, a CRC32 and size of every
//! file) and its SHA-256 (`state.json.sha256`). A checkpoint is written into a temporary folder,
//! synced and renamed into place (`atomic`), so a crash never leaves a half-written `step-N/`;
//! loading checks the state, the model it describes and every size against the bytes present
//! before allocating anything from them (`integrity`), and verifies every file's checksum.

pub mod atomic;
pub mod hf;
mod hf_fp8;
mod hf_mxfp4;
pub mod integrity;
pub mod peft;
pub mod resume;
pub mod sharded;
pub mod st;
pub mod writer;

pub(crate) use atomic::finish_save;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::data::LoaderState;
use crate::model::params::TpSharding;
use crate::model::{ModelArgs, ParamSet};
use crate::tensor::Tensor;

pub const FORMAT_VERSION: u32 = 1;
pub(crate) const STATE_FILE: &str = "state.json";
const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct FileCheck {
    pub bytes: u64,
    pub crc32: u32,
}

/// Everything besides tensors that a resume needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    pub format_version: u32,
    pub step: u64,
    pub model_args: ModelArgs,
    pub seed: u64,
    pub data: LoaderState,
    /// The tokenizer the model was trained with (empty: built-in byte-level).
    #[serde(default)]
    pub tokenizer_path: String,
    /// Set for checkpoints written shard by shard (FSDP): how to merge them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<sharded::ShardIndex>,
    /// Files of the checkpoint and their checks (filled in by `save`).
    #[serde(default)]
    pub files: BTreeMap<String, FileCheck>,
    /// Mixture-of-experts models with load balancing: every block's expert bias (`[layer]
    /// [expert]`), the same on every rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bias: Option<Vec<Vec<f32>>>,
    /// The optimizer whose state the checkpoint holds (absent in checkpoints written before it
    /// was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<SavedOptimizer>,
}

/// What a checkpoint's optimizer state means: the optimizer (`[optimizer] name`: Muon's
/// matrices keep a momentum buffer where AdamW keeps its first moment) and which tensors each
/// parameter group took (its `match` patterns; its learning rate and decay may change between
/// runs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedOptimizer {
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<Vec<String>>,
}

impl std::fmt::Display for SavedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.param_groups.is_empty() {
            true => write!(f, "{} without parameter groups", self.name),
            false => write!(
                f,
                "{} with parameter groups matching {:?}",
                self.name, self.param_groups
            ),
        }
    }
}

pub fn step_dir(folder: &Path, step: u64) -> PathBuf {
    folder.join(format!("step-{step}"))
}

/// Host copies of a parameter set, by name.
pub fn to_tensors<B: Backend>(be: &B, set: &ParamSet<B>, prefix: &str) -> Vec<(String, Tensor)> {
    to_tensors_of(be, set, prefix, &|_| true)
}

/// `to_tensors` of the tensors whose name `keep` accepts (a pipeline rank's stages) and that are
/// allocated: a frozen weight's moments (LoRA's base) do not exist and are not written.
pub fn to_tensors_of<B: Backend>(
    be: &B,
    set: &ParamSet<B>,
    prefix: &str,
    keep: &dyn Fn(&str) -> bool,
) -> Vec<(String, Tensor)> {
    let allocated = |s: &[usize], b: &B::Buf| be.len(b) > 0 || s.iter().product::<usize>() == 0;
    set.names
        .iter()
        .zip(&set.shapes)
        .zip(&set.bufs)
        .filter(|((n, s), b)| keep(n) && allocated(s, b))
        .map(|((n, s), b)| {
            (
                format!("{prefix}{n}"),
                Tensor::from_f32(s.clone(), be.download(b)),
            )
        })
        .collect()
}

/// Fills `set` from `tensors`, requiring every name with its exact shape.
pub fn fill_from<B: Backend>(
    be: &B,
    set: &mut ParamSet<B>,
    tensors: &[(String, Tensor)],
    prefix: &str,
    file: &Path,
) -> Result<()> {
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for i in 0..set.len() {
        let get = |n: &str| by_name.get(n).copied();
        let values = tensor_values(get, prefix, &set.names[i], &set.shapes[i], file)?;
        set.bufs[i] = be.upload(&values);
    }
    Ok(())
}

/// The values of tensor `{prefix}{name}` of `tensors`, which must have `shape`.
fn tensor_values<'t>(
    get: impl Fn(&str) -> Option<&'t Tensor>,
    prefix: &str,
    name: &str,
    shape: &[usize],
    file: &Path,
) -> Result<Vec<f32>> {
    let name = format!("{prefix}{name}");
    let t = get(name.as_str())
        .ok_or_else(|| anyhow!("{}: tensor `{name}` is missing", file.display()))?;
    if t.shape != shape {
        bail!(
            "{}: tensor `{name}` has shape {:?}, the model needs {:?}",
            file.display(),
            t.shape,
            shape
        );
    }
    Ok(t.to_f32_vec())
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<FileCheck> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.sync_all()?;
    Ok(FileCheck {
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(bytes),
    })
}

/// Writes `step-N/` atomically and prunes old checkpoints down to `keep_latest_k` (0 keeps all).
pub fn save<B: Backend>(
    be: &B,
    folder: &Path,
    params: &ParamSet<B>,
    exp_avg: &ParamSet<B>,
    exp_avg_sq: &ParamSet<B>,
    state: TrainState,
    keep_latest_k: usize,
) -> Result<PathBuf> {
    Snapshot::take(be, params, exp_avg, exp_avg_sq)?.write(folder, state, keep_latest_k)
}

/// A whole checkpoint serialised in memory: what an asynchronous save hands to its writer thread,
/// so training can change the weights while the files are written.
pub struct Snapshot {
    model: Vec<u8>,
    optimizer: Vec<u8>,
}

impl Snapshot {
    pub fn take<B: Backend>(
        be: &B,
        params: &ParamSet<B>,
        exp_avg: &ParamSet<B>,
        exp_avg_sq: &ParamSet<B>,
    ) -> Result<Self> {
        let model = st::to_bytes(&to_tensors(be, params, ""), None)?;
        let mut moments = to_tensors(be, exp_avg, "exp_avg.");
        moments.extend(to_tensors(be, exp_avg_sq, "exp_avg_sq."));
        let optimizer = st::to_bytes(&moments, None)?;
        Ok(Snapshot { model, optimizer })
    }

    /// Writes the files into a temporary folder, then `finish_save` (atomic rename, pruning). A
    /// failure removes the temporary folder and names the last complete checkpoint.
    pub fn write(self, folder: &Path, state: TrainState, keep_latest_k: usize) -> Result<PathBuf> {
        let step = state.step;
        self.write_into(folder, state, keep_latest_k)
            .with_context(|| atomic::save_failed(folder, step))
    }

    fn write_into(
        self,
        folder: &Path,
        mut state: TrainState,
        keep_latest_k: usize,
    ) -> Result<PathBuf> {
        let pid = std::process::id().to_string();
        let tmp = atomic::TempFolder::create(folder, state.step, &pid)?;
        state.files.insert(
            MODEL_FILE.into(),
            write_synced(&tmp.path().join(MODEL_FILE), &self.model)?,
        );
        state.files.insert(
            OPTIMIZER_FILE.into(),
            write_synced(&tmp.path().join(OPTIMIZER_FILE), &self.optimizer)?,
        );
        finish_save(folder, tmp, state, keep_latest_k)
    }
}

/// Steps of the complete checkpoints in `folder` (those with a `state.json`), ascending.
pub fn list_steps(folder: &Path) -> Result<Vec<u64>> {
    let mut steps = Vec::new();
    if !folder.exists() {
        return Ok(steps);
    }
    for entry in std::fs::read_dir(folder)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|s| s.strip_prefix("step-"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(STATE_FILE).exists() {
            steps.push(n);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Reads and verifies `state.json` and the sizes and checksums of the files it lists (each read
/// in pieces: nothing is held).
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let state = read_state_file(dir)?;
    for (file, check) in &state.files {
        integrity::verify_file(dir, file, check)?;
    }
    Ok(state)
}

/// `state.json` alone, checked (`integrity`: its SHA-256, the model arguments, the shard index,
/// the file names); its files are verified as they are read (`verified_bytes`).
pub(crate) fn read_state_file(dir: &Path) -> Result<TrainState> {
    let path = dir.join(STATE_FILE);
    let text = integrity::read_state_text(dir)?;
    let state: TrainState = serde_json::from_str(&text)
        .map_err(|e| anyhow!("checkpoint state {} is corrupt: {e}", path.display()))?;
    if state.format_version != FORMAT_VERSION {
        bail!(
            "checkpoint {} has format version {}, this titan reads {FORMAT_VERSION}",
            dir.display(),
            state.format_version
        );
    }
    integrity::check_state(dir, &state)?;
    Ok(state)
}

/// The bytes of checkpoint file `file`, checked against the size (before reading) and CRC32
/// `state` recorded for it at save time.
fn verified_bytes(dir: &Path, state: &TrainState, file: &str) -> Result<Vec<u8>> {
    let p = dir.join(file);
    let check = state.files.get(file).ok_or_else(|| {
        anyhow!(
            "checkpoint {}: {file} is not among the files its state.json records",
            dir.display()
        )
    })?;
    integrity::check_size(dir, file, check)?;
    let bytes = std::fs::read(&p)
        .with_context(|| format!("checkpoint {}: cannot read {file}", dir.display()))?;
    if bytes.len() as u64 != check.bytes {
        bail!(
            "checkpoint file {} is truncated or altered: {} bytes, expected {}",
            p.display(),
            bytes.len(),
            check.bytes
        );
    }
    if crc32fast::hash(&bytes) != check.crc32 {
        bail!(
            "checkpoint file {} is corrupt: its CRC32 does not match the one recorded at save time",
            p.display()
        );
    }
    Ok(bytes)
}

/// The tensors of checkpoint file `file`, verified (`verified_bytes`).
fn read_verified(dir: &Path, state: &TrainState, file: &str) -> Result<Vec<(String, Tensor)>> {
    let bytes = verified_bytes(dir, state, file)?;
    st::from_bytes(&bytes).map_err(|e| anyhow!("{}: {e}", dir.join(file).display()))
}

/// Full tensors of the weights (`model`) or moments (`optimizer`), merged from shards when the
/// checkpoint was written shard by shard; every file read is verified.
fn read_tensors(dir: &Path, state: &TrainState, kind: &str) -> Result<Vec<(String, Tensor)>> {
    match &state.sharding {
        Some(index) => sharded::merge(dir, index, kind, &|file| read_verified(dir, state, file)),
        None => read_verified(
            dir,
            state,
            if kind == "model" {
                MODEL_FILE
            } else {
                OPTIMIZER_FILE
            },
        ),
    }
}

/// A rank's place among the ranks that write a sharded checkpoint together
/// (`Distributed::writers`): writer `rank` of `size`, of which `tp` consecutive ones hold the
/// tensor-parallel parts of each tensor and `size / tp` the flat shards of each part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterPlace {
    pub rank: usize,
    pub size: usize,
    pub tp: usize,
    /// Pipeline parts (1: none): `size / pp` writers hold each stage's tensors.
    pub pp: usize,
    /// Under expert parallelism, the degree and the experts it splits: a routed expert's
    /// tensors are sharded over `1 / ep` of the writers.
    pub experts: Option<sharded::ExpertParts>,
}

impl WriterPlace {
    /// Values per shard of tensor `name`'s tensor-parallel part of `part_numel` values.
    pub fn shard_len(&self, name: &str, part_numel: usize) -> usize {
        let (ep_parts, _) = sharded::ExpertParts::of(self.experts, name);
        part_numel.div_ceil(self.size / self.pp / self.tp / ep_parts)
    }
}

/// A verified checkpoint whose weights and AdamW moments are read into host memory one file kind
/// at a time, when first asked for (the weights, then the moments: the weights are dropped when
/// the moments are read), and handed out one tensor at a time. FSDP takes its shards of each
/// without the full tensors reaching a device; a rank of the layout that wrote a sharded
/// checkpoint holds only its own shards (every file is still read once, for its CRC).
pub struct HostCheckpoint {
    pub state: TrainState,
    dir: PathBuf,
    /// The tensors are only one writer's shards (a sharded checkpoint read by a rank of the
    /// layout that wrote it), not full tensors.
    own_shards: Option<WriterPlace>,
    /// The kind read last (`model` or `optimizer`) and its tensors by name.
    loaded: Mutex<Option<(&'static str, Arc<LoadedTensors>)>>,
}

/// The tensors of one file kind, and the file to name in errors.
struct LoadedTensors {
    by_name: BTreeMap<String, Tensor>,
    file: PathBuf,
}

impl HostCheckpoint {
    /// Opens the checkpoint in `dir`, which must be of the model `expect_args` configures.
    pub fn read(dir: &Path, expect_args: &ModelArgs) -> Result<Self> {
        Self::read_for(dir, expect_args, None)
    }

    /// As `read`, for `writer`'s place among the ranks that write a sharded checkpoint: of a
    /// checkpoint written by the same layout of writers, only this rank's own files are held (its
    /// shards or tensor-parallel parts as they were saved); any other is merged.
    pub fn read_for_writer(
        dir: &Path,
        expect_args: &ModelArgs,
        writer: WriterPlace,
    ) -> Result<Self> {
        Self::read_for(dir, expect_args, Some(writer))
    }

    fn read_for(dir: &Path, expect_args: &ModelArgs, writer: Option<WriterPlace>) -> Result<Self> {
        // Each file is verified when it is read: a rank that needs only its own shard files
        // reads no other.
        let state = read_state_file(dir)?;
        if !state.model_args.same_model(expect_args) {
            bail!(
                "checkpoint {} was saved for a different model ({:?}) than this job configures ({:?})",
                dir.display(),
                state.model_args,
                expect_args
            );
        }
        let own_shards = writer.filter(|w| {
            state.sharding.as_ref().is_some_and(|index| {
                index.shards * index.pp_parts.max(1) == w.size
                    && index.pp_parts.max(1) == w.pp
                    && index.tp_parts.max(1) == w.tp
                    && index.tensors.iter().all(|(name, t)| {
                        let part = TpSharding::of(name).local_shape(&t.shape, w.tp);
                        (t.ep_parts, t.ep_part) == sharded::ExpertParts::of(w.experts, name)
                            && t.shard_len == w.shard_len(name, part.iter().product())
                    })
            })
        });
        Ok(HostCheckpoint {
            state,
            dir: dir.to_path_buf(),
            own_shards,
            loaded: Mutex::new(None),
        })
    }

    /// The tensors of `kind` (`model` or `optimizer`), read now unless they were the last read.
    fn tensors(&self, kind: &'static str) -> Result<Arc<LoadedTensors>> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((k, t)) = loaded.as_ref() {
            if *k == kind {
                return Ok(t.clone());
            }
        }
        // The other kind goes first, so the two are never held together.
        *loaded = None;
        let (tensors, file) = match self.own_shards {
            Some(WriterPlace { rank, .. }) => {
                let name = if kind == "model" {
                    sharded::model_file(rank)
                } else {
                    sharded::optimizer_file(rank)
                };
                (
                    read_verified(&self.dir, &self.state, &name)?,
                    self.dir.join(&name),
                )
            }
            None => (
                read_tensors(&self.dir, &self.state, kind)?,
                self.dir.join(if kind == "model" {
                    MODEL_FILE
                } else {
                    OPTIMIZER_FILE
                }),
            ),
        };
        let t = Arc::new(LoadedTensors {
            by_name: tensors.into_iter().collect(),
            file,
        });
        *loaded = Some((kind, t.clone()));
        Ok(t)
    }

    /// Whether a checkpoint read as this writer's own files put each tensor in the pipeline part
    /// `holder` gives it now (a pipeline rank whose stages changed, by another schedule or split,
    /// must merge instead: its files hold other tensors). True when not read as own files.
    pub fn same_stages(&self, holder: &dyn Fn(&str) -> usize) -> bool {
        match (&self.own_shards, &self.state.sharding) {
            (Some(_), Some(index)) => index
                .tensors
                .iter()
                .all(|(name, t)| t.pp_part == holder(name)),
            _ => true,
        }
    }

    /// The values of weight `name` (or with `moment` = `exp_avg.`/`exp_avg_sq.`, of that AdamW
    /// moment), which must have `shape`.
    pub fn values(&self, moment: Option<&str>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        assert!(
            self.own_shards.is_none(),
            "full tensors asked of a checkpoint read as one rank's shards (a titan bug)"
        );
        self.lookup(moment, name, shape)
    }

    /// This writer's shard of weight `name` or a moment, of its tensor-parallel part of shape
    /// `part_shape`, straight from the checkpoint when it was read as this writer's files (the
    /// part itself when each part is one shard); None when it holds full tensors (the caller cuts
    /// its part from `values`).
    pub fn own_shard(
        &self,
        moment: Option<&str>,
        name: &str,
        part_shape: &[usize],
    ) -> Result<Option<Vec<f32>>> {
        let Some(w) = self.own_shards else {
            return Ok(None);
        };
        let saved = if w.size / w.pp == w.tp {
            part_shape.to_vec()
        } else {
            vec![w.shard_len(name, part_shape.iter().product())]
        };
        self.lookup(moment, name, &saved).map(Some)
    }

    fn lookup(&self, moment: Option<&str>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (kind, prefix) = match moment {
            None => ("model", ""),
            Some(prefix) => ("optimizer", prefix),
        };
        let t = self.tensors(kind)?;
        tensor_values(|n| t.by_name.get(n), prefix, name, shape, &t.file)
    }

    /// Fills the weights and both moments.
    pub fn fill<B: Backend>(
        &self,
        be: &B,
        params: &mut ParamSet<B>,
        exp_avg: &mut ParamSet<B>,
        exp_avg_sq: &mut ParamSet<B>,
    ) -> Result<()> {
        for (set, moment) in [
            (params, None),
            (exp_avg, Some("exp_avg.")),
            (exp_avg_sq, Some("exp_avg_sq.")),
        ] {
            for i in 0..set.len() {
                let values = self.values(moment, &set.names[i], &set.shapes[i])?;
                set.bufs[i] = be.upload(&values);
            }
        }
        Ok(())
    }
}

/// Loads weights and moments from a verified checkpoint folder into the given sets.
pub fn load<B: Backend>(
    be: &B,
    dir: &Path,
    expect_args: &ModelArgs,
    params: &mut ParamSet<B>,
    exp_avg: &mut ParamSet<B>,
    exp_avg_sq: &mut ParamSet<B>,
) -> Result<TrainState> {
    let host = HostCheckpoint::read(dir, expect_args)?;
    host.fill(be, params, exp_avg, exp_avg_sq)?;
    Ok(host.state)
}

/// Model weights only (generation, export), with the shapes recorded in the checkpoint.
pub fn load_weights<B: Backend>(be: &B, dir: &Path) -> Result<(ModelArgs, ParamSet<B>)> {
    let dir = resolve_checkpoint_dir(dir)?;
    // The weight files are verified as they are read; the moments are not needed.
    let state = read_state_file(&dir)?;
    integrity::check_weights_present(&dir, &state)?;
    let specs = crate::model::params::param_specs(&state.model_args);
    let mut params = ParamSet::zeros(be, &specs);
    let model_path = dir.join(MODEL_FILE);
    fill_from(
        be,
        &mut params,
        &read_tensors(&dir, &state, "model")?,
        "",
        &model_path,
    )?;
    Ok((state.model_args, params))
}

/// Accepts a `step-N/` folder, or a folder of them (taking the latest), or a job's dump folder.
pub fn resolve_checkpoint_dir(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    for folder in [dir.to_path_buf(), dir.join("checkpoint")] {
        if let Some(&last) = list_steps(&folder)?.last() {
            return Ok(step_dir(&folder, last));
        }
    }
    if !dir.exists() {
        bail!("checkpoint folder {} does not exist", dir.display());
    }
    bail!(
        "{} holds no complete checkpoint (a step-N/ folder with state.json)",
        dir.display()
    )
}
