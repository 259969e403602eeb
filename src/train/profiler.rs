//! Per-step profiling (`[profiling]`): which steps record spans and memory, and what is written
//! after them: each rank's Chrome trace, its memory timeline, and the pipeline's measured bubble.

use anyhow::Result;

use crate::backend::Backend;
use crate::config::Config;
use crate::memory_timeline;
use crate::parallel::layout::RankLayout;

/// The profiling of one run's steps on one rank.
pub struct StepProfiler<'a> {
    pub cfg: &'a Config,
    pub rank: usize,
    /// Whether this rank prints (where the files went).
    pub quiet: bool,
    /// The first step this run executes, and its last.
    pub first_step: u64,
    pub last_step: u64,
}

impl StepProfiler<'_> {
    /// Before `step`: starts recording if the step is profiled. Returns whether its outputs are
    /// written after it.
    pub fn begin<B: Backend>(&self, step: u64, layout: &mut RankLayout<B>) -> Result<bool> {
        let p = &self.cfg.profiling;
        let (profiled, write_trace) = p.phase(step);
        // The pipeline's measured bubble covers the profiled steps only.
        let first_profiled = step == self.first_step || !p.phase(step - 1).0;
        if profiled && p.enable_profiling && first_profiled {
            layout.pipeline_bubbles()?;
        }
        crate::trace::set_recording(profiled && p.enable_profiling);
        memory_timeline::set_recording(profiled && p.enable_memory_snapshot);
        Ok(write_trace)
    }

    /// After `step`: the memory timeline and the trace (with the pipeline's bubble) when the
    /// profiled window ends here or the run does; `say` prints where they went.
    pub fn end<B: Backend>(
        &self,
        step: u64,
        write_trace: bool,
        layout: &mut RankLayout<B>,
        say: &dyn Fn(String),
    ) -> Result<()> {
        let window_ends = write_trace || step == self.last_step;
        if window_ends && memory_timeline::recording() {
            self.write_memory_timeline(step, say);
        }
        if window_ends && crate::trace::recording() {
            if let Some(b) = layout.pipeline_bubbles()? {
                let per_rank: Vec<String> = b
                    .iter()
                    .enumerate()
                    .map(|(r, x)| format!("rank {r} {x:.3}"))
                    .collect();
                if !self.quiet {
                    say(format!(
                        "pipeline bubble measured over the profiled steps (share of the schedule's time waiting for other ranks): {}",
                        per_rank.join(", ")
                    ));
                }
            }
            self.write_trace(step, say);
        }
        Ok(())
    }

    fn write_memory_timeline(&self, step: u64, say: &dyn Fn(String)) {
        let rank = self.rank;
        memory_timeline::set_recording(false);
        let dir = self
            .cfg
            .dump_folder()
            .join(&self.cfg.profiling.save_memory_snapshot_folder)
            .join(format!("iteration_{step}"));
        let stem = format!("rank{rank}_memory");
        match memory_timeline::write(&dir, &stem, rank, memory_timeline::take()) {
            Ok(()) if !self.quiet => say(format!("memory timeline {}/{stem}.svg", dir.display())),
            Ok(()) => {}
            Err(e) => errln!("warning: rank {rank}: memory timeline not written: {e:#}"),
        }
    }

    fn write_trace(&self, step: u64, say: &dyn Fn(String)) {
        let rank = self.rank;
        crate::trace::set_recording(false);
        let events = crate::trace::take();
        let path = self
            .cfg
            .dump_folder()
            .join(&self.cfg.profiling.save_traces_folder)
            .join(format!("iteration_{step}"))
            .join(format!("rank{rank}_trace.json"));
        // A trace that cannot be written costs the trace, not the run.
        match crate::trace::write(&path, rank, &events) {
            Ok(()) if !self.quiet => say(format!("profiler trace {}", path.display())),
            Ok(()) => {}
            Err(e) => errln!("warning: rank {rank}: profiler trace not written: {e:#}"),
        }
    }
}
