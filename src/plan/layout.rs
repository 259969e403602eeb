//! The layouts `titan plan` weighs: every way to lay a job over `world` ranks (the mesh degrees,
//! expert parallelism, the pipeline schedule and its microbatches, activation checkpointing), as
//! the `--section.key value` overrides that select one. `enumerate` lists the candidates; which
//! of them titan accepts is decided by the trainer's own checks (`plan::weigh`).

use crate::model::activation_checkpoint::AcMode;
use crate::parallel::pipeline::schedule::planned_schedule_names;

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
    /// The pipeline schedule's name (`planned_schedule_names`), None without a pipeline.
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
    /// The largest pipeline degree (the model's blocks: a stage holds at least one).
    pub max_pp: usize,
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
        if pp > space.max_pp {
            continue;
        }
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

/// The most pipeline microbatches weighed (more only shrink a bubble already small, and a
/// schedule's simulation grows with them), unless the pipeline needs more.
pub const MAX_MICROBATCHES: usize = 64;

/// The schedules and microbatch sizes weighed for `pp` stages over `local_batch` rows.
fn pipelines(pp: usize, local_batch: usize) -> Vec<(Option<&'static str>, usize)> {
    if pp == 1 {
        return vec![(None, local_batch)];
    }
    let counts = [pp, 2 * pp, 4 * pp, 8 * pp];
    let sizes: Vec<usize> = counts
        .iter()
        .filter(|m| **m <= MAX_MICROBATCHES.max(pp))
        .filter(|m| **m <= local_batch && local_batch.is_multiple_of(**m))
        .map(|m| local_batch / m)
        .collect();
    planned_schedule_names()
        .flat_map(|s| sizes.iter().map(move |m| (Some(s), *m)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every layout of `space` by brute force: all 6-tuples of degrees up to the world size whose
    /// mesh product is the world, with the same rules written plainly.
    fn brute_force(space: &Space) -> BTreeSet<Layout> {
        let w = space.world;
        let mut out = BTreeSet::new();
        let range = || 1..=w;
        for pp in range() {
            for dpr in range() {
                for dps in range() {
                    for cp in range() {
                        for tp in range() {
                            if pp * dpr * dps * cp * tp != w
                                || tp > space.max_tp
                                || pp > space.max_pp
                            {
                                continue;
                            }
                            let dp = dpr * dps;
                            let local = match space.global_batch {
                                Some(g) if g % dp != 0 => continue,
                                Some(g) => g / dp,
                                None => space.local_batch,
                            };
                            for ep in range() {
                                let legal = match space.experts {
                                    None => ep == 1,
                                    Some(n) => (dps * cp) % ep == 0 && n % ep == 0,
                                };
                                if !legal {
                                    continue;
                                }
                                for mbs in 1..=local {
                                    let m = local / mbs;
                                    let pipelined = pp > 1
                                        && local % mbs == 0
                                        && [pp, 2 * pp, 4 * pp, 8 * pp].contains(&m)
                                        && (m <= MAX_MICROBATCHES || m == pp);
                                    let schedules: Vec<Option<&'static str>> = match pp {
                                        1 if mbs == local => vec![None],
                                        1 => vec![],
                                        _ if pipelined => {
                                            planned_schedule_names().map(Some).collect()
                                        }
                                        _ => vec![],
                                    };
                                    for schedule in schedules {
                                        for ac in AcChoice::ALL {
                                            out.insert(Layout {
                                                pp,
                                                dp_replicate: dpr,
                                                dp_shard: dps,
                                                cp,
                                                tp,
                                                ep,
                                                schedule,
                                                microbatch_size: mbs,
                                                local_batch: local,
                                                ac,
                                            });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn the_enumeration_is_the_brute_force_list() {
        let cases = [
            (8, 8, 8, None, Some(16), 4),
            (12, 4, 3, Some(8), None, 8),
            (6, 2, 6, None, Some(12), 2),
            (16, 8, 4, Some(16), Some(32), 2),
            (16, 16, 16, None, Some(1024), 2),
        ];
        for (world, max_tp, max_pp, experts, global_batch, local_batch) in cases {
            let space = Space {
                world,
                max_tp,
                max_pp,
                experts,
                global_batch,
                local_batch,
                vary_ac: true,
                fixed_ac: AcChoice::None,
            };
            let listed = enumerate(&space);
            let set: BTreeSet<Layout> = listed.iter().cloned().collect();
            assert_eq!(set.len(), listed.len(), "world {world}: duplicates");
            let want = brute_force(&space);
            assert!(!want.is_empty());
            assert_eq!(
                set, want,
                "world {world}, max_tp {max_tp}, experts {experts:?}"
            );
        }
    }

    #[test]
    fn a_layout_round_trips_through_its_overrides() {
        let l = Layout {
            pp: 2,
            dp_replicate: 1,
            dp_shard: 2,
            cp: 1,
            tp: 2,
            ep: 1,
            schedule: Some("Interleaved1F1B"),
            microbatch_size: 2,
            local_batch: 8,
            ac: AcChoice::Op,
        };
        let cfg = crate::config::Config::load(None, &l.overrides()).unwrap();
        let p = &cfg.parallelism;
        assert_eq!(
            (
                p.pipeline_parallel_degree,
                p.data_parallel_shard_degree,
                p.tensor_parallel_degree
            ),
            (2, 2, 2)
        );
        assert_eq!(p.pipeline_parallel_schedule, "Interleaved1F1B");
        assert_eq!(p.pipeline_parallel_microbatch_size, 2);
        assert_eq!(cfg.training.local_batch_size, 8);
        assert_eq!(
            cfg.activation_checkpoint.mode().unwrap(),
            crate::model::activation_checkpoint::AcMode::Op
        );
        assert_eq!(l.microbatches(), 4);
        assert_eq!(
            l.describe(),
            "pp 2 × dp_shard 2 × tp 2 (Interleaved1F1B, 4 mb)"
        );
    }
}
