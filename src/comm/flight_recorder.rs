//! The flight recorder (`[comm] trace_buf_size`, `save_traces_folder`): every process group keeps a
//! ring buffer of its latest collectives and transfers (per-group sequence number, operation,
//! element count, peer, state, times, error), and a rank writes them all to
//! `{dump_folder}/{save_traces_folder}/rank_{r}.json` when a collective fails (timeout, a peer that
//! closed its connection, ranks out of step) or when the launcher stops it because another rank
//! died (SIGTERM). `titan debug flight-recorder DIR` reads the dumps of every rank and says what went
//! wrong (`analyze`).
//!
//! The recorder is process-wide: `configure` sets this rank's identity and where to write, and
//! each group asks `for_group` for its buffer when it is created. Recording one collective is a
//! mutex lock and a push (the collective itself moves kilobytes to gigabytes), and a full buffer
//! drops its oldest entry, so memory stays bounded by `trace_buf_size` entries per group.
//!
//! Written by hand: PyTorch's flight recorder lives inside its NCCL process group; no Rust crate
//! records collectives of a program's own transport.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

/// Where a recorded operation got to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Started,
    Completed,
    Failed,
}

/// One collective or transfer of one group, as this rank saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The group's operations numbered from 0 in the order this rank called them: the same number
    /// on every rank means the same collective, unless the ranks fell out of step.
    pub seq: u64,
    pub op: String,
    /// Elements (f32) this rank contributes (the input of a gather or scatter, the buffer of an
    /// all-reduce or transfer).
    pub elements: usize,
    /// The other rank of a send or receive (group rank), or a broadcast's root.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peer: Option<usize>,
    pub state: State,
    /// Microseconds since the Unix epoch (ranks on one host share the clock).
    pub started_us: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub ended_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

/// The ring buffer of one group.
pub struct GroupRecord {
    name: String,
    /// Global ranks of the group, in group-rank order.
    ranks: Vec<usize>,
    capacity: usize,
    next_seq: AtomicU64,
    entries: Mutex<VecDeque<Entry>>,
    /// Test hook (`TITAN_SKIP_COLLECTIVE`): the sequence number this rank skips once.
    skip_at: Option<u64>,
    skipped: AtomicBool,
}

/// A recorded operation in flight: `finish` marks it completed or failed.
pub struct Recording {
    record: Arc<GroupRecord>,
    seq: u64,
    op: String,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl GroupRecord {
    /// The group's name, as its dumps give it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The group's global ranks, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Records the start of `op`; `None` when the fault drill makes this rank skip it (the caller
    /// then returns without communicating, as a rank with a bug in its control flow would).
    pub fn start(
        self: &Arc<Self>,
        op: &str,
        elements: usize,
        peer: Option<usize>,
    ) -> Option<Recording> {
        // Numbered under the buffer's lock: threads sharing a group (a pipeline's sending and
        // receiving threads) never draw the same number.
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let seq = self.next_seq.load(Ordering::SeqCst);
        if self.skip_at == Some(seq) && !self.skipped.swap(true, Ordering::SeqCst) {
            errln!(
                "TITAN_SKIP_COLLECTIVE: skipping {op} #{seq} on group `{}` (fault drill)",
                self.name
            );
            return None;
        }
        self.next_seq.store(seq + 1, Ordering::SeqCst);
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(Entry {
            seq,
            op: op.to_string(),
            elements,
            peer,
            state: State::Started,
            started_us: now_us(),
            ended_us: None,
            error: None,
        });
        Some(Recording {
            record: self.clone(),
            seq,
            op: op.to_string(),
        })
    }
}

impl Recording {
    /// Marks the operation completed, or failed with its error; the first failure on this rank
    /// writes the dump.
    pub fn finish<T>(self, result: &Result<T>) {
        {
            let mut entries = self
                .record
                .entries
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(e) = entries.iter_mut().rev().find(|e| e.seq == self.seq) {
                e.ended_us = Some(now_us());
                match result {
                    Ok(_) => e.state = State::Completed,
                    Err(err) => {
                        e.state = State::Failed;
                        e.error = Some(format!("{err:#}"));
                    }
                }
            }
        }
        if let Err(err) = result {
            dump_once(&format!(
                "{} #{} on group `{}` failed: {err:#}",
                self.op, self.seq, self.record.name
            ));
        }
    }
}

/// This rank's identity and the recorder's settings.
struct Recorder {
    rank: usize,
    world: usize,
    /// Identifies the job (agreed through the store): dumps of different runs are not compared.
    run: String,
    capacity: usize,
    dir: PathBuf,
    skip_at: Option<u64>,
    groups: Mutex<Vec<Arc<GroupRecord>>>,
    dumped: AtomicBool,
}

static RECORDER: OnceLock<Recorder> = OnceLock::new();
static DUMPING: Mutex<()> = Mutex::new(());

/// Turns the recorder on for this process (once; later calls are ignored): `capacity` entries per
/// group (0 = off), dumps into `dir`. Reads the `TITAN_SKIP_COLLECTIVE=RANK:SEQ` fault drill: that
/// rank skips operation number SEQ of each of its groups once.
pub fn configure(rank: usize, world: usize, run: &str, capacity: usize, dir: &Path) -> Result<()> {
    if capacity == 0 {
        return Ok(());
    }
    let skip_at = match std::env::var("TITAN_SKIP_COLLECTIVE") {
        Ok(spec) => {
            let (r, s) = spec
                .split_once(':')
                .ok_or_else(|| anyhow!("TITAN_SKIP_COLLECTIVE={spec}: expected RANK:SEQ"))?;
            let r: usize = r
                .parse()
                .map_err(|_| anyhow!("TITAN_SKIP_COLLECTIVE={spec}: bad rank"))?;
            let s: u64 = s
                .parse()
                .map_err(|_| anyhow!("TITAN_SKIP_COLLECTIVE={spec}: bad sequence number"))?;
            (r == rank && std::env::var("TITAN_GENERATION").map_or(true, |g| g == "0")).then_some(s)
        }
        Err(_) => None,
    };
    let _ = RECORDER.set(Recorder {
        rank,
        world,
        run: run.to_string(),
        capacity,
        dir: dir.to_path_buf(),
        skip_at,
        groups: Mutex::new(Vec::new()),
        dumped: AtomicBool::new(false),
    });
    Ok(())
}

/// The ring buffer of a new group of global `ranks`, when the recorder is on.
pub fn for_group(name: &str, ranks: &[usize]) -> Option<Arc<GroupRecord>> {
    let rec = RECORDER.get()?;
    let group = Arc::new(GroupRecord {
        name: name.to_string(),
        ranks: ranks.to_vec(),
        capacity: rec.capacity,
        next_seq: AtomicU64::new(0),
        entries: Mutex::new(VecDeque::new()),
        skip_at: rec.skip_at,
        skipped: AtomicBool::new(false),
    });
    rec.groups
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(group.clone());
    Some(group)
}

/// A rank's dump file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dump {
    pub rank: usize,
    pub world: usize,
    pub run: String,
    /// Why it was written.
    pub reason: String,
    pub written_us: u64,
    pub groups: Vec<GroupDump>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupDump {
    pub name: String,
    pub ranks: Vec<usize>,
    pub entries: Vec<Entry>,
}

/// Writes this rank's dump (once per process; later failures, which follow from the first, are
/// not written again). A folder that cannot be written is a warning: the error being reported
/// matters more.
pub fn dump_once(reason: &str) {
    let Some(rec) = RECORDER.get() else {
        return;
    };
    // Held while the dump is written: a SIGTERM arriving meanwhile waits for it before the
    // process exits, so a dump is never cut short.
    let _writing = DUMPING.lock().unwrap_or_else(|e| e.into_inner());
    if rec.dumped.swap(true, Ordering::SeqCst) {
        return;
    }
    let groups = rec
        .groups
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|g| GroupDump {
            name: g.name.clone(),
            ranks: g.ranks.clone(),
            entries: g
                .entries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned()
                .collect(),
        })
        .collect();
    let dump = Dump {
        rank: rec.rank,
        world: rec.world,
        run: rec.run.clone(),
        reason: reason.to_string(),
        written_us: now_us(),
        groups,
    };
    let path = rec.dir.join(format!("rank_{}.json", rec.rank));
    let tmp = rec.dir.join(format!(".rank_{}.json.tmp", rec.rank));
    let written = std::fs::create_dir_all(&rec.dir)
        .map_err(anyhow::Error::from)
        .and_then(|_| Ok(serde_json::to_vec_pretty(&dump)?))
        .and_then(|bytes| Ok(std::fs::write(&tmp, bytes)?))
        .and_then(|_| Ok(std::fs::rename(&tmp, &path)?));
    match written {
        Ok(()) => errln!("flight recorder: wrote {}", path.display()),
        Err(e) => errln!(
            "warning: flight recorder could not write {}: {e:#}",
            path.display()
        ),
    }
}

/// Reads every `rank_*.json` in `dir`.
pub fn read_dumps(dir: &Path) -> Result<Vec<Dump>> {
    let mut dumps = Vec::new();
    let listing = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the flight recorder folder {}", dir.display()))?;
    for entry in listing {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("rank_") && name.ends_with(".json")) {
            continue;
        }
        let parsed = std::fs::read_to_string(&path)
            .map_err(anyhow::Error::from)
            .and_then(|text| Ok(serde_json::from_str::<Dump>(&text)?));
        match parsed {
            Ok(dump) => dumps.push(dump),
            Err(e) => errln!(
                "warning: {} is not a readable flight recorder dump, left out: {e:#}",
                path.display()
            ),
        }
    }
    if dumps.is_empty() {
        bail!(
            "{} holds no flight recorder dumps (rank_*.json): a run writes them to {{dump_folder}}/comm_traces when a collective fails, with [comm] trace_buf_size > 0",
            dir.display()
        );
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(dumps)
}

/// What the dumps of one run say went wrong, as one paragraph.
pub fn analyze(dumps: &[Dump]) -> String {
    if let Some(mixed) = analyze_newest_run(dumps) {
        return mixed;
    }
    let mut findings: Vec<String> = Vec::new();
    let world = dumps.iter().map(|d| d.world).max().unwrap_or(0);
    let present: Vec<usize> = dumps.iter().map(|d| d.rank).collect();
    let missing: Vec<usize> = (0..world).filter(|r| !present.contains(r)).collect();
    if !missing.is_empty() {
        findings.push(missing_ranks(dumps, &missing, world));
    }
    // Per group: compare what every rank recorded under each sequence number.
    let mut groups: BTreeMap<&str, Vec<(usize, &GroupDump)>> = BTreeMap::new();
    for d in dumps {
        for g in &d.groups {
            groups.entry(g.name.as_str()).or_default().push((d.rank, g));
        }
    }
    for (name, members) in &groups {
        findings.extend(disagreement(name, members));
        findings.extend(ranks_behind(name, members));
        let reporting: Vec<usize> = members.iter().map(|(r, _)| *r).collect();
        let silent: Vec<usize> = members[0]
            .1
            .ranks
            .iter()
            .copied()
            .filter(|r| !reporting.contains(r) && !missing.contains(r))
            .collect();
        if !silent.is_empty() {
            findings.push(format!(
                "group `{name}` has ranks {silent:?} whose dumps do not list it"
            ));
        }
    }
    let reasons: Vec<String> = dumps
        .iter()
        .map(|d| format!("rank {}: {}", d.rank, d.reason))
        .collect();
    if findings.is_empty() {
        findings.push("every rank recorded the same collectives and none is behind".into());
    }
    format!(
        "{}. Why each rank wrote its dump: {}.",
        findings.join("; "),
        reasons.join("; ")
    )
}

/// With dumps of several runs: the newest run's analysis, naming and leaving out the older ones
/// (a rank that died in an earlier run and wrote nothing since). None for one run.
fn analyze_newest_run(dumps: &[Dump]) -> Option<String> {
    let runs: BTreeMap<&str, Vec<usize>> = dumps.iter().fold(BTreeMap::new(), |mut m, d| {
        m.entry(d.run.as_str()).or_default().push(d.rank);
        m
    });
    if runs.len() <= 1 {
        return None;
    }
    let newest = dumps
        .iter()
        .max_by_key(|d| d.written_us)
        .map(|d| d.run.clone())
        .unwrap_or_default();
    let stale: Vec<String> = runs
        .iter()
        .filter(|(run, _)| **run != newest)
        .map(|(run, ranks)| format!("run {run}: ranks {ranks:?}"))
        .collect();
    let current: Vec<Dump> = dumps.iter().filter(|d| d.run == newest).cloned().collect();
    Some(format!(
        "These dumps come from different runs: analysing the newest (run {newest}) and leaving out {} (clear the folder before a new run). {}",
        stale.join("; "),
        analyze(&current)
    ))
}

/// Which global ranks the failures blame (a peer that closed its connection or did not answer),
/// each with the earliest failure naming it.
fn blamed_ranks(dumps: &[Dump]) -> BTreeMap<usize, (u64, String)> {
    let mut blamed: BTreeMap<usize, (u64, String)> = BTreeMap::new();
    for d in dumps {
        for g in &d.groups {
            for e in g.entries.iter().filter(|e| e.state == State::Failed) {
                let Some(peer) = e.error.as_deref().and_then(peer_named) else {
                    continue;
                };
                let Some(&global) = g.ranks.get(peer) else {
                    continue;
                };
                let when = e.ended_us.unwrap_or(e.started_us);
                let what = format!(
                    "rank {}'s {} #{} on group `{}`",
                    d.rank, e.op, e.seq, g.name
                );
                let slot = blamed.entry(global).or_insert((when, what.clone()));
                if when < slot.0 {
                    *slot = (when, what);
                }
            }
        }
    }
    blamed
}

/// The ranks that wrote no dump, and which of them died first.
fn missing_ranks(dumps: &[Dump], missing: &[usize], world: usize) -> String {
    let blamed = blamed_ranks(dumps);
    let mut dead: Vec<(u64, usize, String)> = missing
        .iter()
        .filter_map(|r| blamed.get(r).map(|(t, w)| (*t, *r, w.clone())))
        .collect();
    dead.sort();
    let first = match (dead.first(), missing) {
        (Some((_, r, what)), _) => {
            format!("; rank {r} died first: {what} found its connection closed or unanswered")
        }
        // No survivor's collective failed before the launcher stopped it: the one silent
        // rank is the one that died.
        (None, [r]) => {
            format!("; rank {r} died first (the others were stopped because a rank failed)")
        }
        (None, _) => String::new(),
    };
    format!(
        "ranks {missing:?} of {world} wrote no dump (they died or were killed before they could){first}"
    )
}

/// Collectives only: the ranks of a group call the same ones in the same order, while a send on
/// one rank is a receive on another.
fn is_collective(e: &&Entry) -> bool {
    e.op != "send" && e.op != "recv"
}

/// The first collective number under which the ranks of group `name` recorded a different op or
/// size (an all-to-all's sizes differ by design: only its op must agree).
fn disagreement(name: &str, members: &[(usize, &GroupDump)]) -> Option<String> {
    let mut by_seq: BTreeMap<u64, Vec<(usize, &Entry)>> = BTreeMap::new();
    for (rank, g) in members {
        for e in g.entries.iter().filter(is_collective) {
            by_seq.entry(e.seq).or_default().push((*rank, e));
        }
    }
    let (seq, es) = by_seq.iter().find(|(_, es)| {
        es.iter().any(|(_, e)| {
            e.op != es[0].1.op || (e.op != "all_to_all" && e.elements != es[0].1.elements)
        })
    })?;
    let said: Vec<String> = es
        .iter()
        .map(|(r, e)| format!("rank {r} called {} of {} elements", e.op, e.elements))
        .collect();
    Some(format!(
        "on group `{name}` the ranks disagree on collective #{seq}: {} (a rank skipped or added a collective before it)",
        said.join(", ")
    ))
}

/// The ranks of group `name` that never entered the latest collective another rank started.
fn ranks_behind(name: &str, members: &[(usize, &GroupDump)]) -> Option<String> {
    let latest = |g: &GroupDump| -> Option<Entry> {
        g.entries
            .iter()
            .filter(is_collective)
            .max_by_key(|e| e.seq)
            .cloned()
    };
    let last_seq = |g: &GroupDump| latest(g).map(|e| e.seq);
    let n = members.iter().filter_map(|(_, g)| last_seq(g)).max()?;
    let behind_at: Vec<String> = members
        .iter()
        .filter(|(_, g)| last_seq(g).is_none_or(|s| s < n))
        .map(|(r, g)| match latest(g) {
            Some(e) => format!("rank {r} (last: {} #{})", e.op, e.seq),
            None => format!("rank {r} (none recorded)"),
        })
        .collect();
    if behind_at.is_empty() {
        return None;
    }
    let waiting: Vec<String> = members
        .iter()
        .filter_map(|(r, g)| {
            g.entries
                .iter()
                .filter(is_collective)
                .find(|e| e.seq == n)
                .map(|e| format!("rank {r} ({}, {:?})", e.op, e.state))
        })
        .collect();
    Some(format!(
        "on group `{name}` {} never entered collective #{n}, which {} started",
        behind_at.join(" and "),
        waiting.join(" and ")
    ))
}

/// The group rank an error message blames ("peer rank 3 ...").
fn peer_named(error: &str) -> Option<usize> {
    let at = error.find("peer rank ")? + "peer rank ".len();
    let digits: String = error[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, op: &str, elements: usize, state: State, error: Option<&str>) -> Entry {
        Entry {
            seq,
            op: op.into(),
            elements,
            peer: None,
            state,
            started_us: 1000 + seq,
            ended_us: None,
            error: error.map(str::to_string),
        }
    }

    fn dump(rank: usize, run: &str, entries: Vec<Entry>) -> Dump {
        Dump {
            rank,
            world: 2,
            run: run.into(),
            reason: "test".into(),
            written_us: 0,
            groups: vec![GroupDump {
                name: "dp".into(),
                ranks: vec![0, 1],
                entries,
            }],
        }
    }

    #[test]
    fn names_the_rank_behind_and_the_disagreement() {
        let a = dump(
            0,
            "r",
            vec![
                entry(0, "all_gather", 8, State::Completed, None),
                entry(1, "all_reduce", 1, State::Failed, Some("x")),
            ],
        );
        let b = dump(
            1,
            "r",
            vec![entry(0, "all_gather", 8, State::Completed, None)],
        );
        let text = analyze(&[a.clone(), b]);
        assert!(
            text.contains("rank 1 (last: all_gather #0) never entered collective #1"),
            "{text}"
        );
        let c = dump(
            1,
            "r",
            vec![
                entry(0, "all_gather", 8, State::Completed, None),
                entry(1, "reduce_scatter", 16, State::Failed, Some("x")),
            ],
        );
        let text = analyze(&[a, c]);
        assert!(
            text.contains("disagree on collective #1: rank 0 called all_reduce of 1 elements, rank 1 called reduce_scatter of 16"),
            "{text}"
        );
    }

    #[test]
    fn uneven_all_to_alls_are_no_disagreement() {
        // Expert parallelism: each rank sends the rows its tokens routed, a size of its own.
        let ranks: Vec<Dump> = [24, 40]
            .into_iter()
            .enumerate()
            .map(|(r, n)| {
                dump(
                    r,
                    "r",
                    vec![entry(0, "all_to_all", n, State::Completed, None)],
                )
            })
            .collect();
        let text = analyze(&ranks);
        assert!(!text.contains("disagree"), "{text}");
    }

    #[test]
    fn names_the_dead_rank_and_refuses_mixed_runs() {
        let a = dump(
            0,
            "r",
            vec![entry(
                4,
                "all_gather",
                8,
                State::Failed,
                Some("all_gather on group `dp` (rank 0 of 2): peer rank 1 closed the connection"),
            )],
        );
        let text = analyze(std::slice::from_ref(&a));
        assert!(text.contains("ranks [1] of 2 wrote no dump"), "{text}");
        assert!(text.contains("rank 1 died first"), "{text}");
        let stopped = dump(
            0,
            "r",
            vec![entry(4, "all_gather", 8, State::Started, None)],
        );
        let text = analyze(&[stopped]);
        assert!(
            text.contains("rank 1 died first (the others were stopped"),
            "{text}"
        );
        let b = dump(1, "other", vec![]);
        assert!(analyze(&[a, b]).contains("different runs"));
    }
}
