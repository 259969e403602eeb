//! List scheduling under unit costs, which generates the zero-bubble schedules
//! (`InterleavedZeroBubble`, `ZBVZeroBubble`, `DualPipeV`): whenever a rank is free it runs a ready
//! backward first, then a forward while its microbatches in flight stay under the schedule's limit
//! (1F1B's memory), and fills the remaining gaps with deferred weight gradients.

use anyhow::{anyhow, bail, Result};

use super::actions::{act, Action, Ends, Schedule, Work};

/// When a list-scheduled backward is split into `I` and `W`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SplitBackward {
    /// Always (zero-bubble): weight gradients wait for idle time.
    Always,
    /// Full backwards while the rank still has forwards to run, split ones after (DualPipeV: full
    /// forward-backward pairs in the steady phase, weight gradients filling the cool-down).
    AfterLastForward,
}

/// A ready candidate `(stage, microbatch)`: the lowest microbatch, then the deepest stage.
fn better(candidate: Option<(usize, usize)>, s: usize, mb: usize) -> bool {
    candidate.is_none_or(|(cs, cm)| (mb, usize::MAX - s) < (cm, usize::MAX - cs))
}

/// Generates a schedule by list scheduling under unit costs (see the module doc): ranks take,
/// when free, a ready backward (lowest microbatch, deepest stage), else a ready forward if fewer
/// than `limit[r]` of its microbatches hold activations (forwards of a rank's deeper stages
/// always go, so a microbatch in flight can always reach its backward), else a deferred weight
/// gradient.
pub(super) fn list_schedule(
    name: String,
    m: usize,
    placement: Vec<usize>,
    limit: Vec<usize>,
    split: SplitBackward,
) -> Result<Schedule> {
    let p = limit.len();
    let n_stages = placement.len();
    let stages_of: Vec<Vec<usize>> = (0..p)
        .map(|r| (0..n_stages).filter(|&s| placement[s] == r).collect())
        .collect();
    let mut ends = Ends::new(n_stages);
    let mut pending_w: Vec<Vec<(usize, usize)>> = vec![Vec::new(); p];
    let mut next_forward = vec![0usize; n_stages];
    let mut backwarded = vec![0usize; n_stages];
    let mut in_flight = vec![0usize; p];
    let mut free = vec![0u64; p];
    let mut actions: Vec<Vec<Action>> = vec![Vec::new(); p];
    // Work units: a forward 1, a backward 2 (full, or I and W).
    let total: usize = n_stages * m * 3;
    let mut done = 0usize;
    let active = |r: usize,
                  next_forward: &[usize],
                  backwarded: &[usize],
                  pending_w: &[Vec<(usize, usize)>]| {
        stages_of[r]
            .iter()
            .any(|&s| next_forward[s] < m || backwarded[s] < m)
            || !pending_w[r].is_empty()
    };
    // Each pass schedules an action or moves a rank's clock forward; far more passes than
    // actions mean the scheduler is going round in circles (a bug), which must not hang a start.
    let mut passes = 0usize;
    while done < total {
        passes += 1;
        if passes > 64 * total * p + 1024 {
            bail!("{name}: list scheduling did not finish (a bug)");
        }
        let r = (0..p)
            .filter(|&r| active(r, &next_forward, &backwarded, &pending_w))
            .min_by_key(|&r| (free[r], r))
            .ok_or_else(|| anyhow!("{name}: list scheduling ran out of work early (a bug)"))?;
        let t = free[r];
        // Ready candidates, and the earliest known time another becomes ready.
        let (mut backward, mut forward) = (None, None);
        let mut wake = u64::MAX;
        let mut consider =
            |slot: &mut Option<(usize, usize)>, ready: Option<u64>, s, mb| match ready {
                Some(at) if at <= t && better(*slot, s, mb) => *slot = Some((s, mb)),
                Some(at) if at > t => wake = wake.min(at),
                _ => {}
            };
        for &s in &stages_of[r] {
            let mb = backwarded[s];
            if mb < next_forward[s] {
                consider(&mut backward, ends.ready(Work::Backward, s, mb), s, mb);
            }
            let mb = next_forward[s];
            // Activations held are limited at the rank's first stage only.
            let allowed = s != stages_of[r][0] || in_flight[r] < limit[r];
            if mb < m && allowed {
                consider(&mut forward, ends.ready(Work::Forward, s, mb), s, mb);
            }
        }
        let forwards_left = stages_of[r]
            .iter()
            .map(|&s| m - next_forward[s])
            .sum::<usize>();
        let first_stage = stages_of[r][0];
        if let Some((s, mb)) = backward {
            let full = match split {
                SplitBackward::Always => false,
                SplitBackward::AfterLastForward => forwards_left > 0,
            };
            let work = if full {
                Work::Backward
            } else {
                Work::BackwardInput
            };
            let end = t + work.unit_cost();
            actions[r].push(act(s, work, mb));
            ends.record(work, s, mb, end);
            backwarded[s] += 1;
            free[r] = end;
            if full {
                if s == first_stage {
                    in_flight[r] -= 1;
                }
                done += 2;
            } else {
                pending_w[r].push((s, mb));
                done += 1;
            }
        } else if let Some((s, mb)) = forward {
            actions[r].push(act(s, Work::Forward, mb));
            ends.record(Work::Forward, s, mb, t + 1);
            next_forward[s] += 1;
            if s == first_stage {
                in_flight[r] += 1;
            }
            free[r] = t + 1;
            done += 1;
        } else if !pending_w[r].is_empty() {
            let (s, mb) = pending_w[r].remove(0);
            actions[r].push(act(s, Work::BackwardWeight, mb));
            free[r] = t + 1;
            done += 1;
            if s == first_stage {
                in_flight[r] -= 1;
            }
        } else {
            // Nothing ready: wait for the next input known to arrive, the next action to end, or
            // another rank's next action (integer costs: it ends at t + 1 at the earliest).
            let others = (0..p)
                .filter(|&o| o != r && active(o, &next_forward, &backwarded, &pending_w))
                .map(|o| free[o].max(t + 1))
                .min()
                .unwrap_or(u64::MAX);
            let until = wake
                .min(ends.next_end_after(t).unwrap_or(u64::MAX))
                .min(others);
            if until == u64::MAX {
                bail!("{name}: list scheduling is stuck at time {t} on rank {r} (a bug)");
            }
            free[r] = until;
        }
    }
    Ok(Schedule {
        name,
        microbatches: m,
        placement,
        actions,
    })
}
