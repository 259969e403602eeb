//! `titan plot METRICS.jsonl [MORE.jsonl ...] [--out FILE.svg]`: the curves of one run or of
//! several side by side (two layouts, two commits) without TensorBoard: loss with the validation
//! loss, gradient norm, and tokens/s against steps, one panel each, one colour per run; where a
//! run's `world_size` changes (an elastic job's membership) or its `live_replicas` (replica groups
//! in the fault-tolerance quorum), a dotted line across the panels, labelled with the old and new
//! number.
//!
//! Written by hand: an SVG line chart is a few dozen elements, and the plotting crates lay out
//! their text with a font engine (system fonts or an embedded font file) that SVG, which leaves
//! text to the viewer, does not need.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// `metrics.jsonl` files (or dump folders holding one), one run each.
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The SVG to write (default: `metrics.svg` beside the first run's file).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One run's series: `(step, value)` per key.
struct Run {
    label: String,
    series: Vec<(&'static str, Vec<(f64, f64)>)>,
    /// The steps where the job's membership changed: (step, what changed, as "2 → 1 ranks").
    changes: Vec<(f64, String)>,
}

/// The panels: title, and the keys drawn in it (the second dashed).
const PANELS: [(&str, &[&str]); 3] = [
    ("loss (dashed: validation)", &["loss", "validation_loss"]),
    ("gradient norm", &["grad_norm"]),
    ("tokens/s", &["tokens_per_s"]),
];
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

fn read_run(path: &Path) -> Result<Run> {
    let file = if path.is_dir() {
        path.join("metrics.jsonl")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let keys = ["loss", "validation_loss", "grad_norm", "tokens_per_s"];
    let mut series: Vec<(&'static str, Vec<(f64, f64)>)> =
        keys.iter().map(|&k| (k, Vec::new())).collect();
    let mut changes = Vec::new();
    // What a step line says of the membership: its ranks (an elastic job's change), and the
    // replica groups in its quorum (fault tolerance).
    let mut members: [(&str, &str, Option<u64>); 2] = [
        ("world_size", "ranks", None),
        ("live_replicas", "replica groups", None),
    ];
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON line", file.display(), n + 1))?;
        let Some(step) = v.get("step").and_then(|s| s.as_f64()) else {
            bail!("{}:{}: no `step`", file.display(), n + 1);
        };
        for (key, what, last) in members.iter_mut() {
            if let Some(now) = v.get(*key).and_then(|w| w.as_u64()) {
                if let Some(before) = last.filter(|&b| b != now) {
                    changes.push((step, format!("{before} → {now} {what}")));
                }
                *last = Some(now);
            }
        }
        for (key, points) in series.iter_mut() {
            if let Some(x) = v
                .get(*key)
                .and_then(|x| x.as_f64())
                .filter(|x| x.is_finite())
            {
                points.push((step, x));
            }
        }
    }
    if series.iter().all(|(_, p)| p.is_empty()) {
        bail!("{}: no step metrics to plot", file.display());
    }
    let label = file.parent().and_then(|p| p.file_name()).map_or_else(
        || file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(Run {
        label,
        series,
        changes,
    })
}

/// Text safe inside SVG.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG of `runs`, one panel per `PANELS` entry.
fn svg(runs: &[Run]) -> String {
    let (pw, ph, margin) = (520.0, 300.0, 60.0);
    let width = pw + 2.0 * margin;
    let height = PANELS.len() as f64 * (ph + margin) + margin + 20.0 * runs.len() as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (p, (title, keys)) in PANELS.iter().enumerate() {
        let (x0, y0) = (margin, margin + p as f64 * (ph + margin));
        let points: Vec<(f64, f64)> = runs
            .iter()
            .flat_map(|r| r.series.iter().filter(|(k, _)| keys.contains(k)))
            .flat_map(|(_, s)| s.iter().copied())
            .collect();
        let _ = writeln!(
            out,
            r#"<text x="{x0}" y="{}" font-weight="bold">{}</text>"#,
            y0 - 10.0,
            escape(title)
        );
        let _ = writeln!(
            out,
            r##"<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>"##
        );
        if points.is_empty() {
            continue;
        }
        let range = |f: fn(&(f64, f64)) -> f64| {
            let lo = points.iter().map(f).fold(f64::INFINITY, f64::min);
            let hi = points.iter().map(f).fold(f64::NEG_INFINITY, f64::max);
            if hi > lo {
                (lo, hi)
            } else {
                (lo - 0.5, hi + 0.5)
            }
        };
        let ((sx0, sx1), (vy0, vy1)) = (range(|p| p.0), range(|p| p.1));
        let x = |s: f64| x0 + (s - sx0) / (sx1 - sx0) * pw;
        let y = |v: f64| y0 + ph - (v - vy0) / (vy1 - vy0) * ph;
        for i in 0..=4 {
            let f = i as f64 / 4.0;
            let (s, v) = (sx0 + f * (sx1 - sx0), vy0 + f * (vy1 - vy0));
            let _ = writeln!(
                out,
                r##"<text x="{}" y="{}" text-anchor="middle" fill="#555">{s:.0}</text><text x="{}" y="{}" text-anchor="end" fill="#555">{}</text>"##,
                x(s),
                y0 + ph + 16.0,
                x0 - 6.0,
                y(v) + 4.0,
                format_tick(v)
            );
        }
        for (r, run) in runs.iter().enumerate() {
            let colour = COLOURS[r % COLOURS.len()];
            for (k, (_, s)) in run
                .series
                .iter()
                .filter(|(key, _)| keys.contains(key))
                .enumerate()
            {
                if s.is_empty() {
                    continue;
                }
                let pts: Vec<String> = s
                    .iter()
                    .map(|&(st, v)| format!("{:.1},{:.1}", x(st), y(v)))
                    .collect();
                let dash = if k > 0 {
                    r#" stroke-dasharray="6 4""#
                } else {
                    ""
                };
                let _ = writeln!(
                    out,
                    r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{}"/>"#,
                    pts.join(" ")
                );
            }
        }
        for (r, run) in runs.iter().enumerate() {
            let colour = COLOURS[r % COLOURS.len()];
            for (step, change) in &run.changes {
                let xs = x(*step);
                let _ = writeln!(
                    out,
                    r#"<line x1="{xs:.1}" y1="{y0}" x2="{xs:.1}" y2="{}" stroke="{colour}" stroke-dasharray="2 3"/><text x="{:.1}" y="{}" fill="{colour}">{change}</text>"#,
                    y0 + ph,
                    xs + 3.0,
                    y0 + 12.0 + 14.0 * r as f64
                );
            }
        }
        let _ = writeln!(
            out,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#555">step</text>"##,
            x0 + pw / 2.0,
            y0 + ph + 32.0
        );
    }
    let legend_y = margin + PANELS.len() as f64 * (ph + margin);
    for (r, run) in runs.iter().enumerate() {
        let y = legend_y + 20.0 * r as f64;
        let _ = writeln!(
            out,
            r#"<rect x="{margin}" y="{}" width="14" height="4" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            y - 4.0,
            COLOURS[r % COLOURS.len()],
            margin + 20.0,
            y + 2.0,
            escape(&run.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn format_tick(v: f64) -> String {
    if v.abs() >= 1000.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

pub fn run(a: &PlotArgs) -> Result<()> {
    let runs: Vec<Run> = a.runs.iter().map(|p| read_run(p)).collect::<Result<_>>()?;
    let out = a.out.clone().unwrap_or_else(|| {
        let first = &a.runs[0];
        let dir = if first.is_dir() {
            first.clone()
        } else {
            first.parent().map(Path::to_path_buf).unwrap_or_default()
        };
        dir.join("metrics.svg")
    });
    std::fs::write(&out, svg(&runs)).with_context(|| format!("cannot write {}", out.display()))?;
    outln!("wrote {}", out.display());
    Ok(())
}
