//! A process group known only by its shape: its size and this rank's place in it. `titan plan`
//! sizes a layout's ranks with these (the same shapes, pipeline plans and memory estimates as the
//! joined groups of a running job give) without starting a process; every collective fails,
//! naming the group, since nothing is connected.

use anyhow::{bail, Result};

use super::group::{ProcessGroup, ReduceOp};

/// `size` ranks, this one at `rank`, no transport.
pub struct ShapeGroup {
    rank: usize,
    size: usize,
    name: String,
}

impl ShapeGroup {
    pub fn new(name: &str, rank: usize, size: usize) -> Self {
        assert!(rank < size, "shape group {name}: rank {rank} of {size}");
        ShapeGroup {
            rank,
            size,
            name: name.to_string(),
        }
    }

    fn unconnected(&self, what: &str) -> Result<()> {
        bail!(
            "{what} on group {}: a planned group has a shape but no transport (titan plan sizes layouts without running them)",
            self.name
        )
    }
}

impl ProcessGroup for ShapeGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<()> {
        self.unconnected("all_reduce")
    }
    fn all_gather(&self, _input: &[f32], _output: &mut [f32]) -> Result<()> {
        self.unconnected("all_gather")
    }
    fn reduce_scatter(&self, _input: &[f32], _output: &mut [f32], _op: ReduceOp) -> Result<()> {
        self.unconnected("reduce_scatter")
    }
    fn broadcast(&self, _buf: &mut [f32], _root: usize) -> Result<()> {
        self.unconnected("broadcast")
    }
    fn send(&self, _buf: &[f32], _peer: usize) -> Result<()> {
        self.unconnected("send")
    }
    fn recv(&self, _buf: &mut [f32], _peer: usize) -> Result<()> {
        self.unconnected("recv")
    }
    fn all_to_all(
        &self,
        _input: &[f32],
        _send_counts: &[usize],
        _output: &mut [f32],
        _recv_counts: &[usize],
    ) -> Result<()> {
        self.unconnected("all_to_all")
    }
    fn barrier(&self) -> Result<()> {
        self.unconnected("barrier")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_group_has_a_shape_and_refuses_collectives_by_name() {
        let g = ShapeGroup::new("tp[4]", 1, 2);
        assert_eq!((g.rank(), g.size(), g.name()), (1, 2, "tp[4]"));
        let e = g.all_reduce(&mut [1.0], ReduceOp::Sum).unwrap_err();
        assert!(format!("{e}").contains("tp[4]"), "{e}");
    }
}
