//! Expert parallelism: the all-to-alls that carry a mixture-of-experts layer's dispatched rows to
//! their experts' ranks and back (the collectives behind
//! `model::crossings::expert::ExpertParallelOps`).
//!
//! Each layer and direction costs two exchanges over the expert-parallel group: first the rows per
//! expert (small, so every rank knows how many rows it will receive from each peer), then the rows
//! themselves, of uneven sizes, with the group's timeout. The rows travel on the device
//! communicator the group carries (`comm::device_group`: NCCL's grouped sends and receives on
//! GPUs), else through the host (`ProcessGroup::all_to_all`); the counts, a few numbers the
//! router computed on the host, always through the host. The time spent is counted, so `titan
//! bench train` can report it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use crate::backend::Backend;
use crate::comm::device_group::all_to_all_on;
use crate::comm::group::ProcessGroup;
use crate::model::crossings::expert::ExpertParallelOps;

/// An expert-parallel group.
pub struct ExpertParallelGroup {
    group: Arc<dyn ProcessGroup>,
    /// Nanoseconds spent in the row all-to-alls since the group was made.
    exchange_nanos: AtomicU64,
}

impl ExpertParallelGroup {
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        ExpertParallelGroup {
            group,
            exchange_nanos: AtomicU64::new(0),
        }
    }
}

impl<B: Backend> ExpertParallelOps<B> for ExpertParallelGroup {
    fn degree(&self) -> usize {
        self.group.size()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn exchange_counts(&self, counts: &[usize]) -> Result<Vec<Vec<usize>>> {
        let n = self.group.size();
        let per = counts.len() / n;
        // Exact in f32 up to 2^24 rows per expert.
        let send: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let mut recv = vec![0.0f32; per * n];
        self.group
            .all_to_all(&send, &vec![per; n], &mut recv, &vec![per; n])?;
        Ok(recv
            .chunks(per.max(1))
            .take(n)
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect())
    }

    fn all_to_all_rows(
        &self,
        be: &B,
        rows: B::Buf,
        send: &[usize],
        recv: &[usize],
        width: usize,
    ) -> Result<B::Buf> {
        let start = Instant::now();
        let scaled = |c: &[usize]| c.iter().map(|&r| r * width).collect::<Vec<usize>>();
        let (send, recv) = (scaled(send), scaled(recv));
        let output = all_to_all_on(be, self.group.as_ref(), rows, &send, &recv)?;
        self.exchange_nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(output)
    }

    fn exchange_seconds(&self) -> f64 {
        self.exchange_nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }
}
