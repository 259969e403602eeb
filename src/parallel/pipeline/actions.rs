//! The vocabulary of pipeline schedules: what an action computes (`Work`), one action, a schedule
//! (each rank's actions and the placement of stages), and `Ends`, the record of when each
//! (stage, microbatch) finished in a unit-cost run, which the list scheduler and the simulator
//! share.

use std::collections::HashMap;
use std::fmt;

/// What an action computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Work {
    Forward,
    /// Input and weight gradients together.
    Backward,
    /// The input gradient only (zero-bubble); its weight gradient follows as `BackwardWeight`.
    BackwardInput,
    BackwardWeight,
}

impl Work {
    pub fn letter(self) -> char {
        match self {
            Work::Forward => 'F',
            Work::Backward => 'B',
            Work::BackwardInput => 'I',
            Work::BackwardWeight => 'W',
        }
    }

    /// Cost under the unit model: a full backward is an input and a weight gradient.
    pub fn unit_cost(self) -> u64 {
        match self {
            Work::Backward => 2,
            _ => 1,
        }
    }
}

/// One compute action: `work` on `stage` for `microbatch`, written `{stage}{F|B|I|W}{microbatch}`
/// as in TorchTitan's CSV files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub stage: usize,
    pub work: Work,
    pub microbatch: usize,
}

impl Action {
    /// Its work's cost under the unit model (`Work::unit_cost`), whatever its stage.
    pub fn unit_cost(self) -> u64 {
        self.work.unit_cost()
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.work.letter(), self.microbatch)
    }
}

pub(super) fn act(stage: usize, work: Work, microbatch: usize) -> Action {
    Action {
        stage,
        work,
        microbatch,
    }
}

/// One schedule: each rank's compute actions in order and the rank holding each stage.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub name: String,
    pub microbatches: usize,
    /// `placement[s]`: the pipeline rank holding stage `s`.
    pub placement: Vec<usize>,
    /// `actions[r]`: rank `r`'s actions in the order it runs them.
    pub actions: Vec<Vec<Action>>,
}

/// When each (stage, microbatch)'s forward and input gradient (`B` or `I`) ended, in a run being
/// simulated: what decides when an action may start.
pub(super) struct Ends {
    stages: usize,
    pub(super) forward: HashMap<(usize, usize), u64>,
    input_grad: HashMap<(usize, usize), u64>,
}

impl Ends {
    pub(super) fn new(stages: usize) -> Self {
        Ends {
            stages,
            forward: HashMap::new(),
            input_grad: HashMap::new(),
        }
    }

    /// When `work` on stage `s` for microbatch `mb` may start, once what it needs has run: the
    /// previous stage's forward; this stage's forward and the next stage's input gradient; the
    /// input gradient before its `W`.
    pub(super) fn ready(&self, work: Work, s: usize, mb: usize) -> Option<u64> {
        match work {
            Work::Forward if s == 0 => Some(0),
            Work::Forward => self.forward.get(&(s - 1, mb)).copied(),
            Work::Backward | Work::BackwardInput => {
                let f = *self.forward.get(&(s, mb))?;
                if s + 1 == self.stages {
                    Some(f)
                } else {
                    self.input_grad.get(&(s + 1, mb)).map(|&g| g.max(f))
                }
            }
            Work::BackwardWeight => self.input_grad.get(&(s, mb)).copied(),
        }
    }

    pub(super) fn record(&mut self, work: Work, s: usize, mb: usize, end: u64) {
        match work {
            Work::Forward => self.forward.insert((s, mb), end),
            Work::Backward | Work::BackwardInput => self.input_grad.insert((s, mb), end),
            Work::BackwardWeight => None,
        };
    }

    /// The first end after `t` of anything recorded.
    pub(super) fn next_end_after(&self, t: u64) -> Option<u64> {
        self.forward
            .values()
            .chain(self.input_grad.values())
            .copied()
            .filter(|&e| e > t)
            .min()
    }
}
