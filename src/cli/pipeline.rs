//! `titan pipeline show`: a pipeline schedule's action list per rank, its timeline under unit costs
//! (forward 1, input-gradient 1, weight-gradient 1, full backward 2) as text and as an SVG, and its
//! bubble fraction.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::parallel::pipeline::schedule::{
    generate, Action, Schedule, ScheduleKind, Timeline, Work,
};

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV or LoopedBFS.
    #[arg(long, default_value = "1F1B")]
    pub schedule: String,
    /// A schedule in TorchTitan's CSV format instead of --schedule (its ranks, stages and
    /// microbatches come from the file).
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Pipeline ranks.
    #[arg(long, default_value_t = 4)]
    pub pp: usize,
    #[arg(long, default_value_t = 8)]
    pub microbatches: usize,
    /// Stages per rank (looped schedules; default 2 for them, 1 for GPipe and 1F1B).
    #[arg(long)]
    pub stages_per_rank: Option<usize>,
    /// Write the timeline as an SVG here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

pub fn show(a: &ShowArgs) -> Result<()> {
    let schedule = match &a.csv {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Schedule::from_csv(&text, &path.display().to_string())?
        }
        None => {
            let kind = ScheduleKind::parse(&a.schedule)?;
            generate(
                kind,
                a.pp,
                kind.stages_per_rank(a.stages_per_rank)?,
                a.microbatches,
            )?
        }
    };
    let timeline = schedule.simulate(Action::unit_cost)?;
    out!("{}", describe(&schedule, &timeline));
    if let Some(path) = &a.svg {
        std::fs::write(path, svg(&schedule, &timeline))
            .with_context(|| format!("cannot write {}", path.display()))?;
        outln!("timeline: {}", path.display());
    }
    Ok(())
}

/// The action lists, a character grid of the timeline (one column per time unit; forwards as the
/// microbatch's digit, backwards as letters), and the bubble fractions.
pub fn describe(s: &Schedule, t: &Timeline) -> String {
    let mut out = format!(
        "{}: {} ranks, {} stages, {} microbatches\n",
        s.name,
        s.ranks(),
        s.stages(),
        s.microbatches
    );
    for (r, list) in s.actions.iter().enumerate() {
        let names: Vec<String> = list.iter().map(|a| a.to_string()).collect();
        let _ = writeln!(
            out,
            "rank {r} (stages {:?}, up to {} microbatches held): {}",
            s.stages_of(r),
            s.microbatch_lifetimes(r).1,
            names.join(" ")
        );
    }
    let _ = writeln!(
        out,
        "\ntimeline under unit costs (one column per unit: [stage] F forward, B full backward, I input gradient, W weight gradient, then the microbatch; . idle):"
    );
    let bubbles = t.rank_bubbles();
    // With several stages per rank a cell names the stage too.
    let several = s.stages() > s.ranks();
    let label = |a: &crate::parallel::pipeline::schedule::Action| {
        if several {
            a.to_string()
        } else {
            format!("{}{}", a.work.letter(), a.microbatch)
        }
    };
    let width = t
        .ranks
        .iter()
        .flatten()
        .map(|a| label(&a.action).len() + 1)
        .max()
        .unwrap_or(2);
    for (r, timed) in t.ranks.iter().enumerate() {
        let mut row = vec![format!("{:>width$}", "."); t.makespan as usize];
        for a in timed {
            for unit in a.start..a.end {
                row[unit as usize] = format!("{:>width$}", label(&a.action));
            }
        }
        let _ = writeln!(out, "rank {r} |{}| bubble {:.3}", row.concat(), bubbles[r]);
    }
    let _ = writeln!(
        out,
        "bubble fraction {:.3} (idle time over {} ranks × {} units)",
        t.bubble(),
        s.ranks(),
        t.makespan
    );
    out
}

fn colour(w: Work) -> &'static str {
    match w {
        Work::Forward => "#4e79a7",
        Work::Backward => "#e15759",
        Work::BackwardInput => "#f28e2b",
        Work::BackwardWeight => "#59a14f",
    }
}

/// One row per rank, one box per action (labelled stage and microbatch), time to the right.
pub fn svg(s: &Schedule, t: &Timeline) -> String {
    let (unit, row, left, top) = (28.0, 34.0, 70.0, 40.0);
    let width = left + unit * t.makespan as f64 + 20.0;
    let height = top + row * s.ranks() as f64 + 60.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{left}" y="20" font-size="13" font-weight="bold">{}: bubble {:.3} under unit costs</text>"#,
        s.name.replace('&', "&amp;").replace('<', "&lt;"),
        t.bubble()
    );
    for (r, timed) in t.ranks.iter().enumerate() {
        let y = top + row * r as f64;
        let _ = writeln!(
            out,
            r#"<text x="8" y="{}">rank {r}</text>"#,
            y + row / 2.0 + 4.0
        );
        for a in timed {
            let x = left + unit * a.start as f64;
            let w = unit * (a.end - a.start) as f64;
            let _ = writeln!(
                out,
                r##"<rect x="{x}" y="{y}" width="{}" height="{}" fill="{}" stroke="white"/><text x="{}" y="{}" fill="white" text-anchor="middle">{}</text>"##,
                w,
                row - 4.0,
                colour(a.action.work),
                x + w / 2.0,
                y + row / 2.0 + 2.0,
                a.action
            );
        }
    }
    let ly = top + row * s.ranks() as f64 + 24.0;
    for (i, (w, label)) in [
        (Work::Forward, "forward"),
        (Work::Backward, "full backward"),
        (Work::BackwardInput, "input gradient"),
        (Work::BackwardWeight, "weight gradient"),
    ]
    .into_iter()
    .enumerate()
    {
        let x = left + 130.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{label}</text>"#,
            ly - 10.0,
            colour(w),
            x + 16.0,
            ly
        );
    }
    out.push_str("</svg>\n");
    out
}
