//! Sharded checkpoints (FSDP, tensor parallel, both): every writing rank writes its own shards of
//! the weights and AdamW moments (`model-rank{r}.safetensors`, `optimizer-rank{r}.safetensors`);
//! `state.json` carries the index — each tensor's global shape, its tensor-parallel split and
//! shard length, the number of shards and of tensor-parallel parts — plus the size and CRC32 of
//! every rank's files. The folder is written under a temporary name and renamed by rank 0 once
//! every rank has reported its files, so a crash leaves no complete-looking checkpoint.
//!
//! A tensor is first split into `tp_parts` tensor-parallel parts (by rows or columns, or held
//! whole by every part), then each part, flattened, into `shards / tp_parts` equal flat shards
//! (FSDP's). Writer `r` holds shard `r / tp_parts` of part `r % tp_parts` (tp innermost, as in the
//! mesh). So no rank ever holds more than its own state while saving.
//!
//! Loading under another layout merges the shards back into full tensors (`merge`), which the
//! caller re-shards for its own: a checkpoint saved by 4 ranks resumes on 2, on 1, or on any other
//! mesh. The layout of writers that wrote it takes each rank's own files as they are
//! (`HostCheckpoint::read_for_writer`).
//!
//! Expert parallelism: a routed expert's tensors are held by the writers of one expert-parallel
//! rank only (`ep_part` of `ep_parts`), which shard them among themselves: writer shard index `s`
//! holds shard `s / ep_parts` when `s % ep_parts == ep_part` (`DeviceMesh::expert_groups`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use serde::{Deserialize, Serialize};

use super::{st, step_dir, to_tensors_of, FileCheck, TrainState};
use crate::backend::Backend;
use crate::comm::group::ProcessGroup;
use crate::comm::mesh::{DeviceMesh, DIMS};
use crate::model::params::{param_specs, TpSharding};
use crate::model::{ModelArgs, ParamSet};
use crate::tensor::Tensor;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardedTensor {
    pub shape: Vec<usize>,
    /// Elements per shard; shard `s` of a tensor-parallel part holds the part's flat elements
    /// `[s·len, (s+1)·len)` (the last one zero-padded).
    pub shard_len: usize,
    /// How the tensor is split into tensor-parallel parts (absent: whole, one part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_split: Option<TpSplit>,
    /// The pipeline stage rank whose writers hold it (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pp_part: usize,
    /// A routed expert under expert parallelism: the expert-parallel ranks (absent: 1), and the
    /// one whose writers hold it.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ep_parts: usize,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ep_part: usize,
}

impl ShardedTensor {
    /// The writer (of its pipeline part's `shards`, `tp_parts` of them per flat shard) holding
    /// flat shard `s` of tensor-parallel part `t`, for `s` below the tensor's shard count.
    fn writer(&self, shards: usize, tp_parts: usize, s: usize, t: usize) -> usize {
        self.pp_part * shards + (s * self.ep_parts + self.ep_part) * tp_parts + t
    }
}

/// Under expert parallelism, which expert-parallel rank's writers hold a tensor: `ep` ranks
/// splitting `num_experts` experts in consecutive runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertParts {
    pub ep: usize,
    pub num_experts: usize,
}

impl ExpertParts {
    /// The split of a rank of shapes `m` (None for a dense model).
    pub fn of_shapes(m: &crate::model::LocalShapes) -> Option<Self> {
        m.moe.map(|moe| ExpertParts {
            ep: m.ep,
            num_experts: moe.router.num_experts,
        })
    }

    /// `(ep_parts, ep_part)` of tensor `name`: `(1, 0)` for any but a routed expert's.
    pub fn of(parts: Option<Self>, name: &str) -> (usize, usize) {
        match (parts, crate::model::params::expert_of(name)) {
            (Some(p), Some(e)) if p.ep > 1 => (p.ep, e / (p.num_experts / p.ep)),
            _ => (1, 0),
        }
    }
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// A tensor's split over the tensor-parallel parts (`model::params::TpSharding`, as saved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpSplit {
    Rows,
    Columns,
    Replicated,
}

impl From<TpSharding> for TpSplit {
    fn from(s: TpSharding) -> Self {
        match s {
            TpSharding::Rows => TpSplit::Rows,
            TpSharding::Columns => TpSplit::Columns,
            TpSharding::Replicated => TpSplit::Replicated,
        }
    }
}

impl From<TpSplit> for TpSharding {
    fn from(s: TpSplit) -> Self {
        match s {
            TpSplit::Rows => TpSharding::Rows,
            TpSplit::Columns => TpSharding::Columns,
            TpSplit::Replicated => TpSharding::Replicated,
        }
    }
}

fn one() -> usize {
    1
}

fn is_one(x: &usize) -> bool {
    *x == 1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// Writers of each pipeline part (files of each kind): tensor-parallel parts × flat shards of
    /// each part.
    pub shards: usize,
    /// Tensor-parallel parts (1: none).
    #[serde(default = "one")]
    pub tp_parts: usize,
    /// Pipeline parts (1: none): the writers of pipeline rank `p` are files
    /// `p·shards .. (p+1)·shards` and hold the tensors whose `pp_part` is `p`, each stage writing
    /// its own.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub pp_parts: usize,
    /// Degrees of the device mesh the checkpoint was saved with (`pp, dp_replicate, dp_shard, cp, tp`).
    #[serde(default)]
    pub mesh: BTreeMap<String, usize>,
    pub tensors: BTreeMap<String, ShardedTensor>,
}

/// The most files of each kind a sharded checkpoint may have (writers × pipeline parts).
const MAX_WRITERS: usize = 1 << 20;

impl ShardIndex {
    /// Checks the index against the model `args` describe (already validated), before anything is
    /// sized from it: the writer counts in range and consistent, every tensor one of the model's
    /// with its shape, its parts in range, and its shard length the one its writers cut. So no
    /// size read from the index overflows or exceeds the model's. Errors name the field.
    pub fn validate(&self, args: &ModelArgs) -> Result<()> {
        let (shards, tp, pp) = (self.shards, self.tp_parts, self.pp_parts.max(1));
        let files = shards.checked_mul(pp).filter(|&n| n <= MAX_WRITERS);
        if shards == 0 || tp == 0 || !shards.is_multiple_of(tp) || files.is_none() {
            bail!(
                "shards = {shards}, tp_parts = {tp}, pp_parts = {pp}: shards must be a positive multiple of tp_parts, and shards × pp_parts at most {MAX_WRITERS}"
            );
        }
        let specs: BTreeMap<String, Vec<usize>> = param_specs(args).into_iter().collect();
        for (name, t) in &self.tensors {
            let want = specs
                .get(name)
                .ok_or_else(|| anyhow!("tensors.{name}: the model has no such tensor"))?;
            if &t.shape != want {
                bail!(
                    "tensors.{name}.shape = {:?}, the model's is {want:?}",
                    t.shape
                );
            }
            self.check_parts(name, t)?;
        }
        Ok(())
    }

    /// Tensor `name`'s pipeline, expert and tensor-parallel parts and shard length (its shape is
    /// the model's).
    fn check_parts(&self, name: &str, t: &ShardedTensor) -> Result<()> {
        let (tp, pp) = (self.tp_parts, self.pp_parts.max(1));
        if t.pp_part >= pp {
            bail!(
                "tensors.{name}.pp_part = {} is not below pp_parts = {pp}",
                t.pp_part
            );
        }
        let ep = t.ep_parts;
        let per_part = tp
            .checked_mul(ep)
            .filter(|&n| n > 0 && self.shards.is_multiple_of(n))
            .map(|n| self.shards / n);
        let Some(per_part) = per_part.filter(|_| t.ep_part < ep) else {
            bail!(
                "tensors.{name}: ep_part = {} of ep_parts = {ep} cannot be held by {} writers of {tp} tensor-parallel parts",
                t.ep_part,
                self.shards
            );
        };
        let split: TpSharding = t.tp_split.map_or(TpSharding::Replicated, Into::into);
        let divides = match split {
            TpSharding::Replicated => tp == 1 || t.tp_split.is_some(),
            TpSharding::Rows => t.shape.first().is_some_and(|r| r.is_multiple_of(tp)),
            TpSharding::Columns => t.shape.get(1).is_some_and(|c| c.is_multiple_of(tp)),
        };
        if !divides {
            bail!(
                "tensors.{name}.tp_split = {:?} does not split shape {:?} into {tp} parts",
                t.tp_split,
                t.shape
            );
        }
        let part: usize = split.local_shape(&t.shape, tp).iter().product();
        let want = part.div_ceil(per_part);
        if t.shard_len != want {
            bail!(
                "tensors.{name}.shard_len = {}, but {per_part} shards of its {part} values hold {want} each",
                t.shard_len
            );
        }
        Ok(())
    }
}

pub fn model_file(rank: usize) -> String {
    format!("model-rank{rank}.safetensors")
}

pub fn optimizer_file(rank: usize) -> String {
    format!("optimizer-rank{rank}.safetensors")
}

/// A pipeline's split of a checkpoint: `parts` pipeline ranks, each writing its stages' tensors
/// (`part_of`: the pipeline rank holding a tensor).
pub struct PipelineParts<'a> {
    pub parts: usize,
    pub part_of: &'a dyn Fn(&str) -> usize,
    /// Whether pipeline rank `p` holds a tensor (a tied embedding is held by two: both write it,
    /// so each reads its own files back; the index names the first).
    pub held_by: &'a dyn Fn(&str, usize) -> bool,
}

/// How the writers of a sharded save tell each other their files: a channel that works from any
/// thread (the launcher's store), so a save can finish on a background thread while the training
/// step's collectives run.
pub trait FileExchange: Send {
    /// Tells the other writers this rank's files of the step-`step` save: their checks (model,
    /// optimizer), or why writing them failed.
    fn publish(
        &self,
        step: u64,
        rank: usize,
        files: std::result::Result<[FileCheck; 2], String>,
    ) -> Result<()>;
    /// Every writer's file checks, in rank order, once all `writers` have published; an error
    /// names a writer that failed or did not answer in time.
    fn collect(&self, step: u64, writers: usize) -> Result<Vec<[FileCheck; 2]>>;
}

/// A writer's part of a sharded checkpoint, staged in memory by `stage`: its two files' bytes,
/// and on writer 0 what completes the checkpoint. `write` puts it on disk, on any thread.
pub struct ShardedSnapshot {
    step: u64,
    rank: usize,
    writers: usize,
    tmp: PathBuf,
    model: Vec<u8>,
    optimizer: Vec<u8>,
    commit: Option<Commit>,
}

/// Writer 0's completion of a save: the temporary folder (removed if the save fails), the state
/// with the index (the files' checks are added once every writer has published them).
struct Commit {
    folder: PathBuf,
    guard: super::atomic::TempFolder,
    state: TrainState,
    keep_latest_k: usize,
}

/// Stages this rank's part of the step-N checkpoint written by every rank of `group`, the
/// writers (collective: all of them must call it), `tp_parts` of them being consecutive
/// tensor-parallel ranks (1: none). `shards`, `exp_avg`, `exp_avg_sq` are this rank's flat
/// shards of its tensor-parallel parts (or the parts whole); `full_shapes` the global shapes.
/// Writer 0 creates the temporary folder first.
#[allow(clippy::too_many_arguments)]
pub fn stage<B: Backend>(
    be: &B,
    group: &dyn ProcessGroup,
    tp_parts: usize,
    mesh: &DeviceMesh,
    folder: &Path,
    shards: &ParamSet<B>,
    exp_avg: &ParamSet<B>,
    exp_avg_sq: &ParamSet<B>,
    full_shapes: &[Vec<usize>],
    pipeline: Option<&PipelineParts>,
    experts: Option<ExpertParts>,
    mut state: TrainState,
    keep_latest_k: usize,
) -> Result<ShardedSnapshot> {
    let (rank, size) = (group.rank(), group.size());
    let pp_parts = pipeline.map_or(1, |p| p.parts);
    assert!(
        size.is_multiple_of(tp_parts * pp_parts),
        "sharded save: {size} writers do not hold {pp_parts} pipeline × {tp_parts} tensor-parallel parts (a titan bug)"
    );
    let per_part = size / pp_parts;
    // A pipeline rank writes only its stages' tensors, an expert-parallel rank only its experts.
    let my_part = rank / per_part;
    let my_ep = (rank % per_part) / tp_parts;
    let here = |name: &str| {
        let (ep_parts, ep_part) = ExpertParts::of(experts, name);
        pipeline.is_none_or(|p| (p.held_by)(name, my_part)) && my_ep % ep_parts == ep_part
    };
    // Rank 0 creates the temporary folder and removes it again if the save fails (any other
    // writer's failure reaches it through the file exchange).
    let step = state.step;
    let guard = match rank {
        0 => Some(super::atomic::TempFolder::create(folder, step, "sharded")?),
        _ => None,
    };
    let tmp = super::atomic::tmp_path(folder, step, "sharded");
    group.barrier()?;
    let model = st::to_bytes(&to_tensors_of(be, shards, "", &here), None)?;
    let mut moments = to_tensors_of(be, exp_avg, "exp_avg.", &here);
    moments.extend(to_tensors_of(be, exp_avg_sq, "exp_avg_sq.", &here));
    let optimizer = st::to_bytes(&moments, None)?;
    let commit = guard.map(|guard| {
        let tensors = shards
            .names
            .iter()
            .zip(full_shapes)
            .map(|(n, full)| {
                // Rank 0 holds no shard of another stage's tensor or another rank's expert: each
                // length follows from the part's size, as its own writers cut it.
                let (ep_parts, ep_part) = ExpertParts::of(experts, n);
                let split = TpSharding::of(n);
                let part: usize = split.local_shape(full, tp_parts).iter().product();
                (
                    n.clone(),
                    ShardedTensor {
                        shape: full.clone(),
                        shard_len: part.div_ceil(per_part / tp_parts / ep_parts),
                        tp_split: (tp_parts > 1).then(|| split.into()),
                        pp_part: pipeline.map_or(0, |p| (p.part_of)(n)),
                        ep_parts,
                        ep_part,
                    },
                )
            })
            .collect();
        let mesh = DIMS
            .iter()
            .map(|d| (d.to_string(), mesh.degree(d)))
            .collect();
        state.sharding = Some(ShardIndex {
            shards: per_part,
            tp_parts,
            pp_parts,
            mesh,
            tensors,
        });
        Commit {
            folder: folder.to_path_buf(),
            guard,
            state,
            keep_latest_k,
        }
    });
    Ok(ShardedSnapshot {
        step,
        rank,
        writers: size,
        tmp,
        model,
        optimizer,
        commit,
    })
}

impl ShardedSnapshot {
    /// Writes this rank's files and publishes their checks through `exchange`; writer 0 then
    /// waits for every writer's, records them in `state.json` and renames the folder into place
    /// (returning it). Writers finish at their storage's pace: they meet in the exchange, whose
    /// wait is the save's (long) one, not a collective's.
    pub fn write(self, exchange: &dyn FileExchange) -> Result<Option<PathBuf>> {
        let files = self.write_files();
        let told = files.as_ref().map(|f| *f).map_err(|e| format!("{e:#}"));
        let published = exchange.publish(self.step, self.rank, told);
        files?;
        published?;
        let Some(mut commit) = self.commit else {
            return Ok(None);
        };
        let all = exchange.collect(self.step, self.writers)?;
        for (r, [model, optimizer]) in all.into_iter().enumerate() {
            commit.state.files.insert(model_file(r), model);
            commit.state.files.insert(optimizer_file(r), optimizer);
        }
        super::finish_save(
            &commit.folder,
            commit.guard,
            commit.state,
            commit.keep_latest_k,
        )
        .map(Some)
    }

    fn write_files(&self) -> Result<[FileCheck; 2]> {
        if write_drill("TITAN_CHECKPOINT_WRITE_FAILS", self.rank, self.step) {
            bail!(
                "TITAN_CHECKPOINT_WRITE_FAILS: writer {} fails its step-{} files (fault drill)",
                self.rank,
                self.step
            );
        }
        let model = super::write_synced(&self.tmp.join(model_file(self.rank)), &self.model)?;
        if write_drill("TITAN_CHECKPOINT_WRITE_STALLS", self.rank, self.step) {
            errln!(
                "TITAN_CHECKPOINT_WRITE_STALLS: writer {} stalls half-way through its step-{} files for {WRITE_STALL:?} (fault drill)",
                self.rank,
                self.step
            );
            std::thread::sleep(WRITE_STALL);
        }
        let optimizer =
            super::write_synced(&self.tmp.join(optimizer_file(self.rank)), &self.optimizer)?;
        Ok([model, optimizer])
    }
}

/// How long the `TITAN_CHECKPOINT_WRITE_STALLS` drill stalls a writer.
const WRITE_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Fault drills on writer `RANK`'s files of the step-`STEP` save (`var=RANK:STEP`), so the paths
/// of a failing and a hanging disk can be tested: `TITAN_CHECKPOINT_WRITE_FAILS` makes them fail
/// to write, as a full disk would; `TITAN_CHECKPOINT_WRITE_STALLS` stalls the writer between its
/// two files (`WRITE_STALL`), as a disk that stops answering would.
fn write_drill(var: &str, rank: usize, step: u64) -> bool {
    std::env::var(var).is_ok_and(|spec| {
        spec.split_once(':')
            .is_some_and(|(r, s)| r == rank.to_string() && s == step.to_string())
    })
}

/// Full tensors of a sharded checkpoint, `kind` being the weights (`model`) or the moments
/// (`optimizer`).
/// The tensors of a file, by name.
pub type NamedTensors = Vec<(String, Tensor)>;

/// `read` gives the tensors of one of the checkpoint's files by name (verified by the caller).
pub fn merge(
    dir: &Path,
    index: &ShardIndex,
    kind: &str,
    read: &dyn Fn(&str) -> Result<NamedTensors>,
) -> Result<Vec<(String, Tensor)>> {
    if index.shards == 0 || index.tp_parts == 0 || !index.shards.is_multiple_of(index.tp_parts) {
        bail!(
            "{}: the shard index has {} shards, not a multiple of its {} tensor-parallel parts",
            dir.display(),
            index.shards,
            index.tp_parts
        );
    }
    let pp = index.pp_parts.max(1);
    let mut parts: Vec<BTreeMap<String, Tensor>> = Vec::new();
    for r in 0..index.shards * pp {
        let f = if kind == "model" {
            model_file(r)
        } else {
            optimizer_file(r)
        };
        parts.push(read(&f)?.into_iter().collect());
    }
    // Every tensor is in some writer's files (a routed expert's only in its rank's writers').
    let names: std::collections::BTreeSet<String> =
        parts.iter().flat_map(|p| p.keys().cloned()).collect();
    let mut out = Vec::new();
    for name in names {
        let base = name
            .strip_prefix("exp_avg_sq.")
            .or_else(|| name.strip_prefix("exp_avg."))
            .unwrap_or(&name);
        let info = index
            .tensors
            .get(base)
            .ok_or_else(|| anyhow!("{}: shard index has no tensor `{base}`", dir.display()))?;
        if info.pp_part >= pp {
            bail!(
                "{}: the shard index puts `{base}` in pipeline part {} of {pp}",
                dir.display(),
                info.pp_part
            );
        }
        let tp = index.tp_parts.max(1);
        let split: TpSharding = info.tp_split.map_or(TpSharding::Replicated, Into::into);
        if tp > 1 && info.tp_split.is_none() {
            bail!(
                "{}: the shard index gives `{base}` no tensor-parallel split",
                dir.display()
            );
        }
        let part_numel: usize = split.local_shape(&info.shape, tp).iter().product();
        let ep = info.ep_parts.max(1);
        if info.ep_part >= ep || !index.shards.is_multiple_of(tp * ep) {
            bail!(
                "{}: the shard index puts `{base}` on expert-parallel rank {} of {ep}, which {} writers of {tp} tensor-parallel parts cannot hold",
                dir.display(),
                info.ep_part,
                index.shards
            );
        }
        let per_part = index.shards / tp / ep;
        // Each shard is taken out of its part as it is merged, so the parts shrink while the
        // merged tensors grow: the merge holds about one copy of the checkpoint, not two.
        let mut tp_values = Vec::with_capacity(tp);
        for t in 0..tp {
            // The index was checked against the model (`validate`); a size that still overflows
            // is refused rather than allocated.
            let capacity = info.shard_len.checked_mul(per_part).ok_or_else(|| {
                anyhow!(
                    "{}: tensors.{base}.shard_len = {} overflows over {per_part} shards",
                    dir.display(),
                    info.shard_len
                )
            })?;
            let mut data = Vec::with_capacity(capacity.min(part_numel));
            for s in 0..per_part {
                let r = info.writer(index.shards, tp, s, t);
                let shard = parts[r].remove(&name).ok_or_else(|| {
                    anyhow!("{}: rank {r}'s shard of `{name}` is missing", dir.display())
                })?;
                if shard.numel() != info.shard_len {
                    bail!(
                        "{}: rank {r}'s shard of `{name}` holds {} values, the index says {}",
                        dir.display(),
                        shard.numel(),
                        info.shard_len
                    );
                }
                data.extend(shard.to_f32_vec());
            }
            if data.len() < part_numel {
                bail!(
                    "{}: the shards of `{name}` hold {} values, its tensor-parallel part needs {part_numel}",
                    dir.display(),
                    data.len()
                );
            }
            data.truncate(part_numel);
            tp_values.push(data);
        }
        let data = if tp == 1 {
            tp_values.pop().expect("one part")
        } else {
            split.join(&tp_values, &info.shape)
        };
        out.push((name, Tensor::from_f32(info.shape.clone(), data)));
    }
    Ok(out)
}

/// The folder a sharded save of `step` would be renamed to (for messages).
pub fn target(folder: &Path, step: u64) -> PathBuf {
    step_dir(folder, step)
}
