//! The memory timeline (`[profiling] enable_memory_snapshot`): the bytes a rank holds in each
//! category — weights, gradients, optimizer state, activations, gathered FSDP blocks, communication
//! buffers, kernel scratch — beside the memory the process really uses (its resident set; on CUDA
//! the categories are device memory and the line is still the host's: not the device's yet), sampled at every change and at the step's phases over the profiled
//! steps, written as JSON and as an SVG plot. Also written when a run is refused for lack of
//! memory (the estimate's categories) and when a run fails (what was held at that moment).
//!
//! The categories are a ledger the code that allocates keeps: the rank's composition sets what
//! stays for the whole run (its weights, gradient and optimizer buffers, the activation workspace
//! titan plans before the first step, the kernels' scratch), and FSDP adds and removes the blocks
//! it gathers, the full gradients it holds until their reduce-scatter, and the packed buffers of
//! its collectives in flight. The measured line shows what the ledger misses (allocator slack,
//! the runtime, the data loader).
//!
//! Written by hand: no crate records an application's own categories of memory over time.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// What the held bytes are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    Weights,
    Gradients,
    OptimizerState,
    Activations,
    GatheredBlocks,
    CommBuffers,
    KernelScratch,
}

pub const CATEGORIES: [Category; 7] = [
    Category::Weights,
    Category::Gradients,
    Category::OptimizerState,
    Category::Activations,
    Category::GatheredBlocks,
    Category::CommBuffers,
    Category::KernelScratch,
];

impl Category {
    pub fn name(self) -> &'static str {
        match self {
            Category::Weights => "weights",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer_state",
            Category::Activations => "activations",
            Category::GatheredBlocks => "gathered_blocks",
            Category::CommBuffers => "comm_buffers",
            Category::KernelScratch => "kernel_scratch",
        }
    }

    fn index(self) -> usize {
        CATEGORIES
            .iter()
            .position(|c| *c == self)
            .expect("every category is listed")
    }
}

static HELD: [AtomicI64; 7] = [const { AtomicI64::new(0) }; 7];
static RECORDING: AtomicBool = AtomicBool::new(false);
static SAMPLES: Mutex<Vec<Sample>> = Mutex::new(Vec::new());

/// The held bytes of every category at one moment, and the measured use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Microseconds since the Unix epoch.
    pub t_us: u64,
    /// What happened just before (a phase of the step or the category that changed).
    pub label: String,
    /// Bytes per category, in `CATEGORIES` order (names in the file's `categories`).
    pub bytes: Vec<u64>,
    pub measured_bytes: u64,
}

/// A rank's timeline file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Timeline {
    pub rank: usize,
    /// What the measured line is (`resident set`).
    pub measured: String,
    pub categories: Vec<String>,
    pub samples: Vec<Sample>,
}

/// Sets a category's held bytes (what the composition allocates once).
pub fn set(c: Category, bytes: u64) {
    HELD[c.index()].store(bytes as i64, Ordering::Relaxed);
    sample_if_recording(|| format!("{} set", c.name()));
}

/// Adds `delta` bytes (negative when freed) to a category.
pub fn add(c: Category, delta: i64) {
    HELD[c.index()].fetch_add(delta, Ordering::Relaxed);
    sample_if_recording(|| {
        format!(
            "{} {}",
            c.name(),
            if delta >= 0 { "allocated" } else { "freed" }
        )
    });
}

/// Marks a phase of the step (recorded only while recording).
pub fn mark(label: impl FnOnce() -> String) {
    sample_if_recording(label);
}

/// Whether samples are being recorded now.
pub fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Starts or stops recording samples.
pub fn set_recording(on: bool) {
    let was = RECORDING.swap(on, Ordering::Relaxed);
    if on && !was {
        sample_if_recording(|| "recording starts".into());
    }
}

/// The samples recorded so far, leaving none.
pub fn take() -> Vec<Sample> {
    std::mem::take(&mut *SAMPLES.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The held bytes now, as one sample.
pub fn now(label: &str) -> Sample {
    Sample {
        t_us: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64),
        label: label.to_string(),
        bytes: HELD
            .iter()
            .map(|h| h.load(Ordering::Relaxed).max(0) as u64)
            .collect(),
        measured_bytes: resident_bytes(),
    }
}

fn sample_if_recording(label: impl FnOnce() -> String) {
    if RECORDING.load(Ordering::Relaxed) {
        let s = now(&label());
        SAMPLES.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }
}

/// This process's resident set (`VmRSS`), in bytes.
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Writes `{stem}.json` and `{stem}.svg` for `samples` of `rank`.
pub fn write(dir: &Path, stem: &str, rank: usize, samples: Vec<Sample>) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let timeline = Timeline {
        rank,
        measured: "resident set".into(),
        categories: CATEGORIES.iter().map(|c| c.name().to_string()).collect(),
        samples,
    };
    let json = dir.join(format!("{stem}.json"));
    std::fs::write(&json, serde_json::to_vec_pretty(&timeline)?)
        .with_context(|| format!("cannot write {}", json.display()))?;
    let svg = dir.join(format!("{stem}.svg"));
    std::fs::write(&svg, plot(&timeline))
        .with_context(|| format!("cannot write {}", svg.display()))?;
    Ok(())
}

const COLOURS: [&str; 7] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
];

/// Stacked areas of the categories against the sample's time, with the measured use as a line.
fn plot(t: &Timeline) -> String {
    let (w, h, margin) = (760.0, 360.0, 70.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">"#,
        w + 2.0 * margin + 160.0,
        h + 2.0 * margin
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{margin}" y="{}" font-weight="bold">rank {}: memory by category (MiB) and {} (line)</text>"#,
        margin - 20.0,
        t.rank,
        t.measured
    );
    let _ = writeln!(
        out,
        r##"<rect x="{margin}" y="{margin}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##
    );
    if t.samples.is_empty() {
        out.push_str("</svg>\n");
        return out;
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let t0 = t.samples[0].t_us as f64;
    let t1 = (t.samples.last().expect("not empty").t_us as f64).max(t0 + 1.0);
    let top = t
        .samples
        .iter()
        .map(|s| mib(s.bytes.iter().sum::<u64>()).max(mib(s.measured_bytes)))
        .fold(1e-9, f64::max);
    let x = |us: u64| margin + (us as f64 - t0) / (t1 - t0) * w;
    let y = |v: f64| margin + h - v / top * h;
    // Stacks drawn as steps: a category keeps its value until the next sample.
    let mut below = vec![0.0f64; t.samples.len()];
    for (c, colour) in COLOURS.iter().enumerate().take(t.categories.len()) {
        let above: Vec<f64> = t
            .samples
            .iter()
            .zip(&below)
            .map(|(s, b)| b + mib(s.bytes.get(c).copied().unwrap_or(0)))
            .collect();
        if above == below {
            continue;
        }
        let mut pts = Vec::new();
        for (i, s) in t.samples.iter().enumerate() {
            let next = t.samples.get(i + 1).map_or(s.t_us, |n| n.t_us);
            pts.push(format!("{:.1},{:.1}", x(s.t_us), y(above[i])));
            pts.push(format!("{:.1},{:.1}", x(next), y(above[i])));
        }
        for (i, s) in t.samples.iter().enumerate().rev() {
            let next = t.samples.get(i + 1).map_or(s.t_us, |n| n.t_us);
            pts.push(format!("{:.1},{:.1}", x(next), y(below[i])));
            pts.push(format!("{:.1},{:.1}", x(s.t_us), y(below[i])));
        }
        let _ = writeln!(
            out,
            r#"<polygon fill="{colour}" fill-opacity="0.8" stroke="none" points="{}"/>"#,
            pts.join(" ")
        );
        below = above;
    }
    let line: Vec<String> = t
        .samples
        .iter()
        .map(|s| format!("{:.1},{:.1}", x(s.t_us), y(mib(s.measured_bytes))))
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline fill="none" stroke="black" stroke-width="1.5" points="{}"/>"#,
        line.join(" ")
    );
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        let _ = writeln!(
            out,
            r##"<text x="{}" y="{}" text-anchor="end" fill="#555">{:.1}</text><text x="{}" y="{}" text-anchor="middle" fill="#555">{:.0} ms</text>"##,
            margin - 6.0,
            y(f * top) + 4.0,
            f * top,
            margin + f * w,
            margin + h + 16.0,
            f * (t1 - t0) / 1000.0
        );
    }
    for (c, name) in t.categories.iter().enumerate() {
        let ly = margin + 20.0 * c as f64;
        let _ = writeln!(
            out,
            r#"<rect x="{}" y="{}" width="14" height="10" fill="{}"/><text x="{}" y="{}">{name}</text>"#,
            margin + w + 16.0,
            ly,
            COLOURS[c % COLOURS.len()],
            margin + w + 36.0,
            ly + 9.0
        );
    }
    let ly = margin + 20.0 * t.categories.len() as f64;
    let _ = writeln!(
        out,
        r#"<rect x="{}" y="{}" width="14" height="2" fill="black"/><text x="{}" y="{}">{}</text>"#,
        margin + w + 16.0,
        ly + 4.0,
        margin + w + 36.0,
        ly + 9.0,
        t.measured
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plot_stacks_every_held_category() {
        let sample = |t_us, bytes: Vec<u64>| Sample {
            t_us,
            label: "x".into(),
            bytes,
            measured_bytes: 5 << 20,
        };
        let t = Timeline {
            rank: 0,
            measured: "resident set".into(),
            categories: CATEGORIES.iter().map(|c| c.name().to_string()).collect(),
            samples: vec![
                sample(0, vec![1 << 20, 1 << 20, 2 << 20, 0, 0, 0, 0]),
                sample(1000, vec![1 << 20, 1 << 20, 2 << 20, 0, 1 << 20, 0, 0]),
            ],
        };
        let svg = plot(&t);
        // Four non-zero categories: four areas, and the measured line.
        assert_eq!(svg.matches("<polygon").count(), 4, "{svg}");
        assert_eq!(svg.matches("<polyline").count(), 1);
    }
}
