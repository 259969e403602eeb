//! Pipeline schedules as data: for each pipeline rank, the list of compute actions it runs in
//! order — forward (`F`), full backward (`B`), or a backward split into its input-gradient part
//! (`I`) and weight-gradient part (`W`) — each on one stage and one microbatch. One function
//! generates each schedule TorchTitan runs; a custom one loads from TorchTitan's CSV format.
//! The transfers between ranks follow from the placement of stages (`lower`).
//!
//! Before a schedule runs it is checked: every (stage, microbatch) has exactly one forward and
//! either one full backward or one `I` and one `W`, each on the rank holding its stage; and a
//! simulation under unit costs (forward 1, `I` 1, `W` 1, full backward 2) must finish, which is
//! the proof that the ranks cannot deadlock waiting on each other (each rank runs its list in
//! order and blocks only on the activations and gradients it receives). The same simulation gives
//! the timeline `titan pipeline show` draws and the bubble fraction.
//!
//! The looped schedules (`Interleaved1F1B`, `InterleavedZeroBubble`, `LoopedBFS`) are generated
//! in `interleaved.rs` and DualPipeV in `dual_pipe_v.rs`, each as PyTorch orders it. `ZBVZeroBubble`
//! (and DualPipeV with fewer than two microbatches per stage, which PyTorch refuses) come from
//! `list_schedule.rs`: list scheduling under unit costs, whenever a rank is free it runs a ready
//! backward first, then a forward while its microbatches in flight stay under the schedule's
//! limit (1F1B's memory), and fills the remaining gaps with deferred weight gradients; its
//! ZBVZeroBubble has PyTorch's bubble or a smaller one (measured for P 2–8, M P–4P).

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};

use super::actions::{act, Ends};
pub use super::actions::{Action, Schedule, Work};
use super::dual_pipe_v::dual_pipe_v;
use super::interleaved::{interleaved, looped_bfs, microbatches_per_round};
use super::list_schedule::{list_schedule, SplitBackward};

/// The schedules TorchTitan offers (`[parallelism] pipeline_parallel_schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    GPipe,
    OneFOneB,
    Interleaved1F1B,
    InterleavedZeroBubble,
    ZbvZeroBubble,
    DualPipeV,
    LoopedBfs,
}

pub const SCHEDULE_NAMES: [&str; 7] = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "LoopedBFS",
];

/// The schedules `titan plan` weighs: all but LoopedBFS, which has Interleaved1F1B's unit-cost
/// bubble (equal for every P and M measured) while holding every microbatch's activations, so it
/// is never the better layout.
pub fn planned_schedule_names() -> impl Iterator<Item = &'static str> {
    SCHEDULE_NAMES.into_iter().filter(|n| *n != "LoopedBFS")
}

impl ScheduleKind {
    /// Every schedule, in `SCHEDULE_NAMES` order.
    pub const ALL: [ScheduleKind; 7] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::ZbvZeroBubble,
        ScheduleKind::DualPipeV,
        ScheduleKind::LoopedBfs,
    ];

    /// TorchTitan's name (any case).
    pub fn parse(name: &str) -> Result<Self> {
        SCHEDULE_NAMES
            .iter()
            .position(|n| n.eq_ignore_ascii_case(name))
            .map(|i| Self::ALL[i])
            .ok_or_else(|| {
                anyhow!(
                    "[parallelism] pipeline_parallel_schedule = `{name}` is not known (accepted: {}; or a CSV file in pipeline_parallel_schedule_csv)",
                    SCHEDULE_NAMES.join(", ")
                )
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved1F1B => "Interleaved1F1B",
            ScheduleKind::InterleavedZeroBubble => "InterleavedZeroBubble",
            ScheduleKind::ZbvZeroBubble => "ZBVZeroBubble",
            ScheduleKind::DualPipeV => "DualPipeV",
            ScheduleKind::LoopedBfs => "LoopedBFS",
        }
    }

    /// Stages each rank holds: one for single-stage schedules, two for the looped and "V" ones
    /// unless `pipeline_parallel_layers_per_stage` asks for more (looped only).
    pub fn stages_per_rank(self, asked: Option<usize>) -> Result<usize> {
        match (self, asked) {
            (ScheduleKind::GPipe | ScheduleKind::OneFOneB, None | Some(1)) => Ok(1),
            (ScheduleKind::GPipe | ScheduleKind::OneFOneB, Some(v)) => bail!(
                "{} runs one stage per rank, not {v}: use Interleaved1F1B or InterleavedZeroBubble for more",
                self.name()
            ),
            (ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV, None | Some(2)) => Ok(2),
            (ScheduleKind::ZbvZeroBubble | ScheduleKind::DualPipeV, Some(v)) => bail!(
                "{} places exactly two stages per rank (a \"V\"), not {v}",
                self.name()
            ),
            (_, None) => Ok(2),
            (_, Some(0)) => bail!("{}: stages per rank must be at least 1", self.name()),
            (_, Some(v)) => Ok(v),
        }
    }
}

/// Stage `s` on rank `s mod ranks` (looped: interleaved schedules, and one stage per rank).
fn looped(ranks: usize, stages_per_rank: usize) -> Vec<usize> {
    (0..ranks * stages_per_rank).map(|s| s % ranks).collect()
}

/// Rank `r` holds stages `r` and `2·ranks − 1 − r` (a "V": the first and last stage on rank 0).
fn v_shape(ranks: usize) -> Vec<usize> {
    (0..2 * ranks)
        .map(|s| if s < ranks { s } else { 2 * ranks - 1 - s })
        .collect()
}

/// The schedule `kind` for `ranks` pipeline ranks holding `stages_per_rank` stages each, over
/// `microbatches`, checked.
pub fn generate(
    kind: ScheduleKind,
    ranks: usize,
    stages_per_rank: usize,
    microbatches: usize,
) -> Result<Schedule> {
    let (p, v, m) = (ranks, stages_per_rank, microbatches);
    if p == 0 || v == 0 {
        bail!("a pipeline needs at least one rank and one stage per rank");
    }
    if m < p {
        bail!(
            "{} over {p} pipeline ranks needs at least {p} microbatches, got {m}: raise [training] local_batch_size or lower [parallelism] pipeline_parallel_microbatch_size",
            kind.name()
        );
    }
    let name = kind.name().to_string();
    let schedule = match kind {
        ScheduleKind::GPipe => Schedule {
            name,
            microbatches: m,
            placement: looped(p, 1),
            actions: (0..p)
                .map(|r| {
                    let forwards = (0..m).map(|i| act(r, Work::Forward, i));
                    forwards
                        .chain((0..m).map(|i| act(r, Work::Backward, i)))
                        .collect()
                })
                .collect(),
        },
        ScheduleKind::OneFOneB => Schedule {
            name,
            microbatches: m,
            placement: looped(p, 1),
            actions: (0..p).map(|r| one_f_one_b(r, p, m)).collect(),
        },
        ScheduleKind::Interleaved1F1B | ScheduleKind::InterleavedZeroBubble => {
            let round = microbatches_per_round(&name, p, m)?;
            let zero_bubble = kind == ScheduleKind::InterleavedZeroBubble;
            Schedule {
                name,
                microbatches: m,
                placement: looped(p, v),
                actions: (0..p)
                    .map(|r| interleaved(r, p, v, m, round, zero_bubble))
                    .collect(),
            }
        }
        ScheduleKind::LoopedBfs => Schedule {
            name,
            microbatches: m,
            placement: looped(p, v),
            actions: (0..p).map(|r| looped_bfs(r, p, v, m)).collect(),
        },
        ScheduleKind::ZbvZeroBubble => {
            list_schedule(name, m, v_shape(p), vec![2 * p; p], SplitBackward::Always)?
        }
        // DeepSeek's phases need a microbatch per stage at least (PyTorch refuses fewer); with
        // fewer, the list scheduler orders the same V.
        ScheduleKind::DualPipeV if m >= 2 * p => Schedule {
            name,
            microbatches: m,
            placement: v_shape(p),
            actions: (0..p).map(|r| dual_pipe_v(r, p, m)).collect(),
        },
        ScheduleKind::DualPipeV => list_schedule(
            name,
            m,
            v_shape(p),
            vec![2 * p + 1; p],
            SplitBackward::AfterLastForward,
        )?,
    };
    schedule.check()?;
    Ok(schedule)
}

/// 1F1B on rank `r`: the forwards that fill the pipeline ahead of it, then one forward and one
/// backward in turn, then the backwards left.
fn one_f_one_b(r: usize, p: usize, m: usize) -> Vec<Action> {
    let warmup = (p - 1 - r).min(m);
    let mut a: Vec<Action> = (0..warmup).map(|i| act(r, Work::Forward, i)).collect();
    for i in 0..m - warmup {
        a.push(act(r, Work::Forward, warmup + i));
        a.push(act(r, Work::Backward, i));
    }
    a.extend((m - warmup..m).map(|i| act(r, Work::Backward, i)));
    a
}

/// An action with its start and end under some costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    pub action: Action,
    pub start: u64,
    pub end: u64,
}

/// A simulated run: each rank's actions with their times.
#[derive(Debug, Clone)]
pub struct Timeline {
    pub ranks: Vec<Vec<Timed>>,
    pub makespan: u64,
}

impl Timeline {
    /// Idle time over the run's length on each rank.
    pub fn rank_bubbles(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|a| {
                let busy: u64 = a.iter().map(|t| t.end - t.start).sum();
                1.0 - busy as f64 / self.makespan.max(1) as f64
            })
            .collect()
    }

    /// Idle time over all ranks' time.
    pub fn bubble(&self) -> f64 {
        let b = self.rank_bubbles();
        b.iter().sum::<f64>() / b.len().max(1) as f64
    }
}

impl Schedule {
    pub fn ranks(&self) -> usize {
        self.actions.len()
    }

    pub fn stages(&self) -> usize {
        self.placement.len()
    }

    /// The stages rank `r` holds, in order.
    pub fn stages_of(&self, r: usize) -> Vec<usize> {
        (0..self.stages())
            .filter(|&s| self.placement[s] == r)
            .collect()
    }

    /// Checks completeness and deadlock-freedom (see the module doc).
    pub fn check(&self) -> Result<()> {
        let (n, m) = (self.stages(), self.microbatches);
        if let Some(r) = (0..self.ranks()).find(|&r| self.stages_of(r).is_empty()) {
            bail!(
                "schedule {}: rank {r} holds no stage (every pipeline rank needs one)",
                self.name
            );
        }
        let mut count: HashMap<(usize, Work, usize), usize> = HashMap::new();
        for (r, list) in self.actions.iter().enumerate() {
            for a in list {
                if a.stage >= n || a.microbatch >= m {
                    bail!("schedule {}: rank {r}'s action {a} is outside {n} stages × {m} microbatches", self.name);
                }
                if self.placement[a.stage] != r {
                    bail!(
                        "schedule {}: rank {r} runs {a} but stage {} is on rank {}",
                        self.name,
                        a.stage,
                        self.placement[a.stage]
                    );
                }
                *count.entry((a.stage, a.work, a.microbatch)).or_default() += 1;
            }
        }
        for s in 0..n {
            for mb in 0..m {
                let c = |w: Work| count.get(&(s, w, mb)).copied().unwrap_or(0);
                let (f, b, i, w) = (
                    c(Work::Forward),
                    c(Work::Backward),
                    c(Work::BackwardInput),
                    c(Work::BackwardWeight),
                );
                let on = self.placement[s];
                if f != 1 {
                    bail!("schedule {}: rank {on} has {f} forwards of stage {s} microbatch {mb} ({s}F{mb}); exactly one is needed", self.name);
                }
                let whole = b == 1 && i == 0 && w == 0;
                let split = b == 0 && i == 1 && w == 1;
                if !whole && !split {
                    bail!("schedule {}: stage {s} microbatch {mb} on rank {on} has {b} full backwards ({s}B{mb}), {i} input-gradient ({s}I{mb}) and {w} weight-gradient ({s}W{mb}) backwards; it needs one B, or one I and one W", self.name);
                }
            }
        }
        self.simulate(Action::unit_cost).map(|_| ())
    }

    /// Runs the schedule under `cost`: each rank in list order, each action starting once its
    /// rank is free and its inputs exist (the previous stage's forward; the next stage's input
    /// gradient and this stage's forward; a `W` after its `I`), each costing `cost(action)`
    /// (its work on its stage). Transfers take no time. An error names where every rank is stuck
    /// when the ranks wait on each other.
    pub fn simulate(&self, cost: impl Fn(Action) -> u64) -> Result<Timeline> {
        let p = self.ranks();
        let mut ends = Ends::new(self.stages());
        let mut next = vec![0usize; p];
        let mut free = vec![0u64; p];
        let mut timed: Vec<Vec<Timed>> = vec![Vec::new(); p];
        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(&a) = self.actions[r].get(next[r]) {
                    let Some(ready) = ends.ready(a.work, a.stage, a.microbatch) else {
                        break;
                    };
                    let start = ready.max(free[r]);
                    let end = start + cost(a);
                    ends.record(a.work, a.stage, a.microbatch, end);
                    timed[r].push(Timed {
                        action: a,
                        start,
                        end,
                    });
                    free[r] = end;
                    next[r] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|r| next[r] == self.actions[r].len()) {
                break;
            }
            if !progressed {
                let stuck: Vec<String> = (0..p)
                    .filter_map(|r| {
                        let a = self.actions[r].get(next[r])?;
                        let (s, mb) = (a.stage, a.microbatch);
                        let waits = match a.work {
                            Work::Forward => format!("{}F{mb}", s - 1),
                            Work::BackwardWeight => format!("{s}I{mb}"),
                            _ if !ends.forward.contains_key(&(s, mb)) => format!("{s}F{mb}"),
                            _ => format!(
                                "the input gradient of stage {} ({}B{mb} or {}I{mb})",
                                s + 1,
                                s + 1,
                                s + 1
                            ),
                        };
                        Some(format!("rank {r} at {a} waits for {waits}"))
                    })
                    .collect();
                bail!("schedule {} deadlocks: {}", self.name, stuck.join("; "));
            }
        }
        let makespan = free.iter().copied().max().unwrap_or(0);
        Ok(Timeline {
            ranks: timed,
            makespan,
        })
    }

    /// The stage boundaries pipeline rank `r` sends and receives across (a boundary between two
    /// stages on different ranks, one of them `r`'s): per microbatch, `r` sends and receives once
    /// across each, an activation forward or a gradient back. 1F1B's end ranks cross one,
    /// its middle ranks two; the looped schedules cross at every boundary; a "V" keeps its turn
    /// on one rank.
    pub fn crossings_of(&self, r: usize) -> usize {
        self.placement
            .windows(2)
            .filter(|w| w[0] != w[1] && (w[0] == r || w[1] == r))
            .count()
    }

    /// The bubble fraction under unit costs.
    pub fn unit_bubble(&self) -> Result<f64> {
        Ok(self.simulate(Action::unit_cost)?.bubble())
    }

    /// For each of rank `r`'s actions, whether it is the last of its microbatch on that rank (its
    /// activations can go), and the most microbatches the rank holds at once, from each one's
    /// first action to its last: the workspaces it needs.
    pub fn microbatch_lifetimes(&self, r: usize) -> (Vec<bool>, usize) {
        let list = &self.actions[r];
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (i, a) in list.iter().enumerate() {
            last.insert(a.microbatch, i);
        }
        let is_last: Vec<bool> = list
            .iter()
            .enumerate()
            .map(|(i, a)| last[&a.microbatch] == i)
            .collect();
        let mut live = std::collections::HashSet::new();
        let mut most = 0;
        for (a, &end) in list.iter().zip(&is_last) {
            live.insert(a.microbatch);
            most = most.max(live.len());
            if end {
                live.remove(&a.microbatch);
            }
        }
        (is_last, most)
    }

    /// The most weight gradients rank `r` holds deferred at once (from an `I` to its `W`),
    /// counted in blocks: `blocks(stage)` per deferred (stage, microbatch).
    pub fn max_deferred_blocks(&self, r: usize, blocks: impl Fn(usize) -> usize) -> usize {
        let (mut held, mut most) = (0usize, 0usize);
        for a in &self.actions[r] {
            match a.work {
                Work::BackwardInput => {
                    held += blocks(a.stage);
                    most = most.max(held);
                }
                Work::BackwardWeight => held -= blocks(a.stage),
                _ => {}
            }
        }
        most
    }

    /// TorchTitan's compute-only CSV: a line per rank, its actions separated by commas.
    pub fn to_csv(&self) -> String {
        self.actions
            .iter()
            .map(|list| {
                list.iter()
                    .map(Action::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
                    + "\n"
            })
            .collect()
    }

    /// A schedule from TorchTitan's CSV format, as PyTorch's `_dump_csv` writes it (`source`
    /// names it in errors): a line per rank, actions `{stage}{F|B|I|W}{microbatch}`; an
    /// `OVERLAP_F_B` cell `(0F3;3B1)OVERLAP_F_B` (a forward of one microbatch run against the
    /// backward of another, DualPipeV's) runs its actions in the order written, which gives the
    /// numbers of any overlap; the transfer, FSDP and gradient-reduction actions
    /// (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`, their `WAIT_`s, `UNSHARD`, `RESHARD`, `REDUCE_GRAD`,
    /// `WAIT_REDUCE_GRAD`) are skipped, since titan derives its own. Stages and microbatches are
    /// counted from the file, and the schedule is checked.
    pub fn from_csv(text: &str, source: &str) -> Result<Schedule> {
        let mut actions: Vec<Vec<Action>> = Vec::new();
        let mut placement: HashMap<usize, usize> = HashMap::new();
        let mut microbatches = 0usize;
        for (line_no, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let r = actions.len();
            let mut list = Vec::new();
            for (col, cell) in line.split(',').enumerate() {
                let at = || format!("{source} line {} column {}", line_no + 1, col + 1);
                for a in parse_cell(cell.trim(), &at)? {
                    if let Some(&other) = placement.get(&a.stage) {
                        if other != r {
                            bail!("{}: stage {} appears on rank {r} and on rank {other}; a stage lives on one rank", at(), a.stage);
                        }
                    }
                    placement.insert(a.stage, r);
                    microbatches = microbatches.max(a.microbatch.saturating_add(1));
                    list.push(a);
                }
            }
            actions.push(list);
        }
        if actions.is_empty() {
            bail!("{source}: no actions (expected a line of actions per pipeline rank)");
        }
        let n = placement.keys().max().map_or(0, |s| s.saturating_add(1));
        let placement: Vec<usize> = (0..n)
            .map(|s| {
                placement.get(&s).copied().ok_or_else(|| {
                    anyhow!("{source}: stage {s} has no actions (stages 0..{n} appear)")
                })
            })
            .collect::<Result<_>>()?;
        same_forwards_everywhere(&actions, source)?;
        // Every stage runs every microbatch forward once: numbers beyond what the file's
        // forwards can cover are refused before anything is sized by them.
        let forwards = actions
            .iter()
            .flatten()
            .filter(|a| a.work == Work::Forward)
            .count();
        if n.checked_mul(microbatches)
            .is_none_or(|cells| cells > forwards)
        {
            bail!("{source}: it names stages up to {} and microbatches up to {} but holds {forwards} forwards; a schedule has one forward per stage and microbatch", n.saturating_sub(1), microbatches.saturating_sub(1));
        }
        let schedule = Schedule {
            name: format!("CSV {source}"),
            microbatches,
            placement,
            actions,
        };
        schedule
            .check()
            .with_context(|| format!("checking {source}"))?;
        Ok(schedule)
    }
}

/// Every stage of a CSV schedule runs forwards of the same microbatches, or the file is not one
/// schedule: named here, before the count check (which would name the first missing action of
/// the microbatch count the file's largest number implies, not the stage that is off).
fn same_forwards_everywhere(actions: &[Vec<Action>], source: &str) -> Result<()> {
    use std::collections::{BTreeMap, BTreeSet};
    let mut forwards: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for a in actions.iter().flatten().filter(|a| a.work == Work::Forward) {
        forwards.entry(a.stage).or_default().insert(a.microbatch);
    }
    let Some((&first_stage, first)) = forwards.iter().next() else {
        return Ok(());
    };
    let Some((s, theirs)) = forwards.iter().find(|(_, set)| *set != first) else {
        return Ok(());
    };
    let show = |set: &BTreeSet<usize>| match (set.first(), set.last()) {
        (Some(a), Some(b)) if b - a + 1 == set.len() => format!("{a}–{b}"),
        _ => format!("{set:?}"),
    };
    // PyTorch 2.15's PipelineScheduleSingle schedules (1F1B) number the last stage's forwards
    // from 1 in the order they dump (`_get_pipeline_order`), not in the one they run.
    let hint = match (first.first(), theirs.first()) {
        (Some(0), Some(1)) => " (PyTorch's Schedule1F1B writes its last stage's forwards from 1 in the order it dumps, which is not the order it runs; titan's own `--parallelism.pipeline_parallel_schedule 1F1B` is the schedule it means)",
        _ => "",
    };
    bail!(
        "{source}: stage {s} runs forwards of microbatches {} but stage {first_stage} of {}: the file is not one schedule{hint}",
        show(theirs),
        show(first)
    )
}

/// The compute actions of one CSV cell (`at` says where it is, for errors): none for an empty
/// cell or a communication action, one for `{stage}{F|B|I|W}{microbatch}`, the sub-actions of
/// an `OVERLAP_F_B` cell in their order.
fn parse_cell(cell: &str, at: &dyn Fn() -> String) -> Result<Vec<Action>> {
    if cell.is_empty() || cell.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    if let Some(inner) = cell.strip_prefix('(') {
        let (subs, kind) = inner
            .split_once(')')
            .ok_or_else(|| anyhow!("{}: `{cell}` opens `(` without closing it", at()))?;
        if kind != "OVERLAP_F_B" {
            bail!("{}: `{cell}` groups actions as `{kind}`; titan knows OVERLAP_F_B groups (e.g. `(0F3;3B1)OVERLAP_F_B`)", at());
        }
        let mut out = Vec::new();
        for sub in subs.split(';') {
            out.extend(parse_cell(sub.trim(), at)?);
        }
        return Ok(out);
    }
    let digits = cell
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(cell.len());
    let stage: usize = cell[..digits]
        .parse()
        .map_err(|_| anyhow!("{}: `{cell}` does not start with a stage number", at()))?;
    let rest = &cell[digits..];
    let kind_len = rest
        .find(|c: char| c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (kind, mb) = rest.split_at(kind_len);
    let work = match kind {
        "F" => Work::Forward,
        "B" => Work::Backward,
        "I" => Work::BackwardInput,
        "W" => Work::BackwardWeight,
        "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B" | "WAIT_SEND_F" | "WAIT_SEND_B" | "UNSHARD"
        | "RESHARD" | "REDUCE_GRAD" | "WAIT_REDUCE_GRAD" => return Ok(Vec::new()),
        _ => bail!("{}: `{cell}` is not an action (expected STAGE then F, B, I or W then MICROBATCH, e.g. 0F1, or an OVERLAP_F_B group)", at()),
    };
    let microbatch: usize = mb
        .parse()
        .map_err(|_| anyhow!("{}: `{cell}` does not end with a microbatch number", at()))?;
    Ok(vec![act(stage, work, microbatch)])
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
