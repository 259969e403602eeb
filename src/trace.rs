//! Profiler traces (`[profiling] enable_profiling`): spans of what each thread of a rank did —
//! kernels, blocks forward and backward, collectives with their bytes and group, data loading,
//! the optimizer, checkpoints — written in the Chrome trace event format, which Perfetto and
//! `chrome://tracing` open.
//!
//! Recording is process-wide and off by default: a span then costs one relaxed atomic load. The
//! trainer turns it on for the steps it profiles and writes what was recorded once they are done
//! (`take`, `write`), so memory stays bounded by the profiled steps. Each thread is its own track
//! (`tid`), named by its thread name, so the FSDP and tensor-parallel communication threads show
//! beside the compute thread. On CUDA a kernel's span is the host time of its launch (the GPU's
//! own time needs device events: not recorded yet).
//!
//! Written by hand: the format is a JSON list of objects, which `serde_json` writes; no crate of
//! the Rust ML ecosystem records Chrome traces of a program's own spans.

use std::borrow::Cow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};

static RECORDING: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());
static NEXT_TRACK: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's track number and name.
    static TRACK: (u64, String) = (
        NEXT_TRACK.fetch_add(1, Ordering::Relaxed),
        std::thread::current().name().unwrap_or("worker").to_string(),
    );
}

/// Where times are measured from (the first use in the process).
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// One finished span.
#[derive(Debug, Clone)]
pub struct Event {
    pub name: Cow<'static, str>,
    pub category: &'static str,
    /// Microseconds from the process's origin, and the span's length.
    pub start_us: f64,
    pub duration_us: f64,
    pub track: u64,
    pub track_name: String,
    pub args: Option<Value>,
}

/// Whether spans are being recorded now.
#[inline]
pub fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Starts (or stops) recording.
pub fn set_recording(on: bool) {
    origin();
    RECORDING.store(on, Ordering::Relaxed);
}

/// The spans recorded so far, leaving none.
pub fn take() -> Vec<Event> {
    std::mem::take(&mut *EVENTS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A span being measured; recorded when dropped.
pub struct Span {
    name: Cow<'static, str>,
    category: &'static str,
    start: Instant,
    args: Option<Value>,
}

impl Drop for Span {
    fn drop(&mut self) {
        let end = Instant::now();
        let o = origin();
        let (track, track_name) = TRACK.with(|t| (t.0, t.1.clone()));
        let event = Event {
            name: std::mem::take(&mut self.name),
            category: self.category,
            start_us: self.start.saturating_duration_since(o).as_secs_f64() * 1e6,
            duration_us: end.saturating_duration_since(self.start).as_secs_f64() * 1e6,
            track,
            track_name,
            args: self.args.take(),
        };
        EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(event);
    }
}

/// A span of `category` named `name`, when recording.
#[inline]
pub fn span(category: &'static str, name: impl Into<Cow<'static, str>>) -> Option<Span> {
    recording().then(|| Span {
        name: name.into(),
        category,
        start: Instant::now(),
        args: None,
    })
}

/// A span with arguments (computed only when recording).
#[inline]
pub fn span_with(
    category: &'static str,
    name: impl Into<Cow<'static, str>>,
    args: impl FnOnce() -> Value,
) -> Option<Span> {
    recording().then(|| Span {
        name: name.into(),
        category,
        start: Instant::now(),
        args: Some(args()),
    })
}

/// A span whose name is built only when recording.
#[inline]
pub fn span_named(category: &'static str, name: impl FnOnce() -> String) -> Option<Span> {
    recording().then(|| Span {
        name: name().into(),
        category,
        start: Instant::now(),
        args: None,
    })
}

/// `events` of rank `rank` as a Chrome trace (`{"traceEvents": [...]}`) in `path`.
pub fn write(path: &Path, rank: usize, events: &[Event]) -> Result<()> {
    let mut out: Vec<Value> = Vec::with_capacity(events.len() + 8);
    out.push(json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": format!("rank {rank}")}}));
    let mut named = std::collections::BTreeSet::new();
    for e in events {
        if named.insert(e.track) {
            out.push(json!({"name": "thread_name", "ph": "M", "pid": rank, "tid": e.track, "args": {"name": e.track_name}}));
        }
        let mut v = json!({
            "name": e.name, "cat": e.category, "ph": "X", "pid": rank, "tid": e.track,
            "ts": e.start_us, "dur": e.duration_us,
        });
        if let Some(a) = &e.args {
            v["args"] = a.clone();
        }
        out.push(v);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let text = serde_json::to_string(&json!({"traceEvents": out, "displayTimeUnit": "ms"}))?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
