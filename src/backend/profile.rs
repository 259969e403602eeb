//! Optional per-kernel wall-clock accounting (`titan bench train --profile-ops`): calls and seconds
//! per op, to see where a step goes without an external profiler. On a device that queues work
//! (CUDA) each timed op waits for the device before and after, so the time is the op's own; that
//! serialises the step, so a profiled run is slower than a plain one.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Default)]
pub struct OpProfiler {
    totals: Option<Mutex<BTreeMap<&'static str, (u64, f64)>>>,
}

/// A device whose queued work the profiler waits for.
pub trait WaitForDevice {
    fn wait_for_device(&self);
}

/// Records its lifetime under an op name when dropped.
pub struct OpTimer<'a> {
    profiler: &'a OpProfiler,
    name: &'static str,
    start: Option<Instant>,
    device: Option<&'a dyn WaitForDevice>,
    /// The op's span in a profiler trace, when one is being recorded (`crate::trace`).
    _span: Option<crate::trace::Span>,
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        if let (Some(start), Some(totals)) = (self.start, &self.profiler.totals) {
            if let Some(d) = self.device {
                d.wait_for_device();
            }
            let mut t = totals.lock().unwrap_or_else(|e| e.into_inner());
            let e = t.entry(self.name).or_default();
            e.0 += 1;
            e.1 += start.elapsed().as_secs_f64();
        }
    }
}

impl OpProfiler {
    pub fn enabled() -> Self {
        OpProfiler {
            totals: Some(Mutex::new(BTreeMap::new())),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.totals.is_some()
    }

    #[inline]
    pub fn time(&self, name: &'static str) -> OpTimer<'_> {
        OpTimer {
            profiler: self,
            name,
            start: self.totals.as_ref().map(|_| Instant::now()),
            device: None,
            _span: crate::trace::span("kernel", name),
        }
    }

    /// Times `name` on a queueing device: waits for earlier work first and for the op's own work
    /// when the timer drops (nothing when profiling is off).
    #[inline]
    pub fn time_on<'a>(&'a self, name: &'static str, device: &'a dyn WaitForDevice) -> OpTimer<'a> {
        let start = self.totals.as_ref().map(|_| {
            device.wait_for_device();
            Instant::now()
        });
        OpTimer {
            profiler: self,
            name,
            start,
            device: Some(device),
            _span: crate::trace::span("kernel", name),
        }
    }

    pub fn reset(&self) {
        if let Some(t) = &self.totals {
            t.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// One line per op, most expensive first, with its share of `wall_s`.
    pub fn report(&self, wall_s: f64) -> String {
        let Some(t) = &self.totals else {
            return String::new();
        };
        let t = t.lock().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = t.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let mut out = format!(
            "{:<32} {:>8} {:>10} {:>7}\n",
            "op", "calls", "seconds", "share"
        );
        for (name, (calls, secs)) in rows {
            out += &format!(
                "{name:<32} {calls:>8} {secs:>10.3} {:>6.1}%\n",
                100.0 * secs / wall_s
            );
        }
        out
    }
}
