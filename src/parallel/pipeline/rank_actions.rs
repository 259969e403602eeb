//! A rank's action list as a generator appends it: each stage's next forward and backward
//! microbatch counted per stage, and the weight-gradient halves of split backwards waiting in
//! order. The phase-by-phase generators (DualPipeV, the interleaved schedules) share it.

use std::collections::{HashMap, VecDeque};

use super::actions::{act, Action, Work};

/// A rank's actions as they are appended: each stage's next forward and backward microbatch,
/// and the input-gradient halves whose weight gradients wait (oldest first).
pub(super) struct RankActions {
    pub(super) list: Vec<Action>,
    next_forward: HashMap<usize, usize>,
    next_backward: HashMap<usize, usize>,
    weights_waiting: VecDeque<(usize, usize)>,
}

impl RankActions {
    pub(super) fn new() -> Self {
        RankActions {
            list: Vec::new(),
            next_forward: HashMap::new(),
            next_backward: HashMap::new(),
            weights_waiting: Default::default(),
        }
    }

    pub(super) fn forward(&mut self, stage: usize) {
        let mb = self.next_forward.entry(stage).or_default();
        self.list.push(act(stage, Work::Forward, *mb));
        *mb += 1;
    }

    /// The next backward of `stage`, whole, or its input half (`split`) with the weight half
    /// left waiting.
    pub(super) fn backward(&mut self, stage: usize, split: bool) {
        let mb = self.next_backward.entry(stage).or_default();
        let work = if split {
            self.weights_waiting.push_back((stage, *mb));
            Work::BackwardInput
        } else {
            Work::Backward
        };
        self.list.push(act(stage, work, *mb));
        *mb += 1;
    }

    /// The oldest waiting weight gradient, if any.
    pub(super) fn weight(&mut self) {
        if let Some((stage, mb)) = self.weights_waiting.pop_front() {
            self.list.push(act(stage, Work::BackwardWeight, mb));
        }
    }

    /// Every weight gradient still waiting, oldest first.
    pub(super) fn remaining_weights(&mut self) {
        while !self.weights_waiting.is_empty() {
            self.weight();
        }
    }
}
