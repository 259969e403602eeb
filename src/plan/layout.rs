//! The layouts `titan plan` weighs: every way to lay a job over `world` ranks (the mesh degrees,
//! expert parallelism, the pipeline schedule and its microbatches, activation checkpointing), as
//! the `--section.key value` overrides that select one. `enumerate` lists the candidates; which
//! of them titan accepts is decided by the trainer's own checks (`plan::weigh`).

use crate::model::activation_checkpoint::AcMode;
use crate::parallel::pipeline::schedule::SCHEDULE_NAMES;

/// One layout of a job.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Layout {
    pub pp: usize,
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub cp: usize,
    pub tp: usize,
    /// Expert parallelism (borrowed from `dp_shard × cp`); 1 without.
    pub ep: usize,
    /// The pipeline schedule's name (`SCHEDULE_NAMES`), None without a pipeline.
    pub schedule: Option<&'static str>,
    /// Rows of a pipeline microbatch (the local batch without a pipeline).
    pub microbatch_size: usize,
    /// Sequences each data-parallel rank computes per microbatch step (`local_batch_size`).
    pub local_batch: usize,
    pub ac: AcChoice,
}

/// The activation-checkpointing modes weighed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AcChoice {
    None,
    Op,
    Full,
}

impl AcChoice {
    pub const ALL: [AcChoice; 3] = [AcChoice::None, AcChoice::Op, AcChoice::Full];

    pub fn mode(self) -> AcMode {
        match self {
            AcChoice::None => AcMode::None,
            AcChoice::Op => AcMode::Op,
            AcChoice::Full => AcMode::Full,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AcChoice::None => "none",
            AcChoice::Op => "op",
            AcChoice::Full => "full",
        }
    }

    /// `[activation_checkpoint]`'s keys for this mode.
    fn keys(self) -> [(&'static str, &'static str); 2] {
        let option = ("activation_checkpoint.selective_ac_option", "op");
        match self {
            AcChoice::None => [("activation_checkpoint.mode", "none"), option],
            AcChoice::Op => [("activation_checkpoint.mode", "selective"), option],
            AcChoice::Full => [("activation_checkpoint.mode", "full"), option],
        }
    }
}

/// What the enumeration may vary.
#[derive(Debug, Clone)]
pub struct Space {
    pub world: usize,
    /// The largest tensor-parallel degree (a node's devices: TP stays inside one).
    pub max_tp: usize,
    /// Routed experts (None: a dense model, no expert parallelism).
    pub experts: Option<usize>,
    /// Sequences per optimizer step over the job; None keeps `local_batch` per data-parallel rank.
    pub global_batch: Option<usize>,
    /// `[training] local_batch_size` when the global batch is not fixed.
    pub local_batch: usize,
    /// Whether to weigh activation checkpointing (else only `fixed_ac`).
    pub vary_ac: bool,
    pub fixed_ac: AcChoice,
}

/// The divisors of `n`, ascending.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every `(pp, dp_replicate, dp_shard, cp, tp)` whose product is `world`, tp at most `max_tp`.
pub fn meshes(world: usize, max_tp: usize) -> Vec<[usize; 5]> {
    let mut out = Vec::new();
    for pp in divisors(world) {
        for dpr in divisors(world / pp) {
            for cp in divisors(world / pp / dpr) {
                for tp in divisors(world / pp / dpr / cp) {
                    if tp <= max_tp {
                        out.push([pp, dpr, world / pp / dpr / cp / tp, cp, tp]);
                    }
                }
            }
        }
    }
    out
}

/// Every candidate layout of `space`: each mesh, each expert degree dividing `dp_shard × cp` and
/// the experts, the local batch the global batch gives each data-parallel rank, each schedule
/// with `pp`, `2·pp`, `4·pp` or `8·pp` microbatches dividing the local batch, each checkpointing
/// mode. Whether titan accepts one is for its checks to say.
pub fn enumerate(space: &Space) -> Vec<Layout> {
    let mut out = Vec::new();
    let acs: Vec<AcChoice> = match space.vary_ac {
        true => AcChoice::ALL.to_vec(),
        false => vec![space.fixed_ac],
    };
    for [pp, dp_replicate, dp_shard, cp, tp] in meshes(space.world, space.max_tp) {
        let dp = dp_replicate * dp_shard;
        let local_batch = match space.global_batch {
            Some(g) if !g.is_multiple_of(dp) => continue,
            Some(g) => g / dp,
            None => space.local_batch,
        };
        let eps = match space.experts {
            Some(n) => divisors(dp_shard * cp)
                .into_iter()
                .filter(|e| n.is_multiple_of(*e))
                .collect(),
            None => vec![1],
        };
        let pipelines = pipelines(pp, local_batch);
        for &ep in &eps {
            for &(schedule, microbatch_size) in &pipelines {
                for &ac in &acs {
                    out.push(Layout {
                        pp,
                        dp_replicate,
                        dp_shard,
                        cp,
                        tp,
                        ep,
                        schedule,
                        microbatch_size,
                        local_batch,
                        ac,
                    });
                }
            }
        }
    }
    out
}

/// The schedules and microbatch sizes weighed for `pp` stages over `local_batch` rows.
fn pipelines(pp: usize, local_batch: usize) -> Vec<(Option<&'static str>, usize)> {
    if pp == 1 {
        return vec![(None, local_batch)];
    }
    let counts = [pp, 2 * pp, 4 * pp, 8 * pp];
    let sizes: Vec<usize> = counts
        .iter()
        .filter(|m| **m <= local_batch && local_batch.is_multiple_of(**m))
        .map(|m| local_batch / m)
        .collect();
    SCHEDULE_NAMES
        .iter()
        .flat_map(|s| sizes.iter().map(move |m| (Some(*s), *m)))
        .collect()
}

impl Layout {
    /// The `--section.key value` flags that select this layout, in pairs.
    pub fn overrides(&self) -> Vec<String> {
        let mut flags: Vec<(&str, String)> = vec![
            ("parallelism.pipeline_parallel_degree", self.pp.to_string()),
            (
                "parallelism.data_parallel_replicate_degree",
                self.dp_replicate.to_string(),
            ),
            (
                "parallelism.data_parallel_shard_degree",
                self.dp_shard.to_string(),
            ),
            ("parallelism.context_parallel_degree", self.cp.to_string()),
            ("parallelism.tensor_parallel_degree", self.tp.to_string()),
            ("parallelism.expert_parallel_degree", self.ep.to_string()),
            ("training.local_batch_size", self.local_batch.to_string()),
        ];
        if let Some(s) = self.schedule {
            flags.push(("parallelism.pipeline_parallel_schedule", s.to_string()));
            flags.push((
                "parallelism.pipeline_parallel_microbatch_size",
                self.microbatch_size.to_string(),
            ));
        }
        flags.extend(self.ac.keys().map(|(k, v)| (k, v.to_string())));
        flags
            .into_iter()
            .flat_map(|(k, v)| [format!("--{k}"), v])
            .collect()
    }

    /// Pipeline microbatches per local batch (1 without a pipeline).
    pub fn microbatches(&self) -> usize {
        self.local_batch / self.microbatch_size
    }

    /// A short name: the degrees above 1 (`dp_shard 4 × tp 2`), the schedule and microbatches,
    /// the checkpointing.
    pub fn describe(&self) -> String {
        let dims = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
            ("ep", self.ep),
        ];
        let mut parts: Vec<String> = dims
            .iter()
            .filter(|(_, d)| *d > 1)
            .map(|(n, d)| format!("{n} {d}"))
            .collect();
        if parts.is_empty() {
            parts.push("one rank".into());
        }
        let mut s = parts.join(" × ");
        if let Some(sched) = self.schedule {
            s += &format!(" ({sched}, {} mb)", self.microbatches());
        }
        s
    }
}
