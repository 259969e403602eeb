//! Pipeline stage transfers between GPUs (`DevicePeers` on CUDA buffers): one two-rank NCCL
//! communicator per directed pair of ring neighbours in the pipeline group, each on a stream of
//! its own.
//!
//! Why a channel per direction: NCCL runs the operations of one communicator in the order they
//! were queued, and a send of a large buffer does not finish before its peer receives it. Two
//! pipeline ranks each queueing a send to the other before the matching receive (rank 0 sends
//! microbatch 1's activations while rank 1 sends microbatch 0's gradient) would wait on each other
//! forever on one communicator or one stream. With a communicator and a stream per direction, what
//! rank `a` sends `b` travels on `a→b` alone, in the order both know from the schedule
//! (`parallel::pipeline::transfer`), and nothing else waits behind a receive whose peer is still
//! computing.
//!
//! Which channels: titan's stages are placed in loops (`r → r + 1 mod size`) or in a V (back down
//! from the last rank), so every transfer is between ring neighbours (a test of every schedule
//! holds this); a custom schedule (`pipeline_parallel_schedule_csv`) that places consecutive
//! stages on other ranks is refused at its first step, naming the ranks (`reaches`). Every rank
//! joins its channels in one global order (by the pair's lower then higher rank, then
//! direction), so no two ranks wait on each other's next channel.
//!
//! Each transfer is started after the compute queued so far (`NcclGroup::begin`: the buffer was
//! written by it) and waited for on the calling thread within the group's timeout (a dead peer is
//! an error, and aborts every channel), so a buffer sent may be freed, and one received read,
//! once the call returns. Status: compiled, never run (it needs two GPUs; `scripts/gpu_check.sh`
//! has the stage); the same calls run on the CPU through `host_device::HostDeviceGroup`.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, Result};

use super::NcclGroup;
use crate::backend::cuda::{CudaBackend, CudaBuf};
use crate::comm::device_group::DevicePeers;
use crate::comm::store::StoreClient;

pub struct NcclPeers {
    name: String,
    rank: usize,
    /// `(from, to)` in group ranks: the channel carrying what `from` sends `to`; in it `from` is
    /// rank 0 and `to` rank 1.
    channels: HashMap<(usize, usize), NcclGroup>,
}

/// Every directed pair of ring neighbours among `size` ranks, in the order every rank joins them.
fn neighbour_pairs(size: usize) -> Vec<(usize, usize)> {
    let mut pairs: Vec<(usize, usize)> = (0..size)
        .flat_map(|r| {
            let next = (r + 1) % size;
            [(r, next), (next, r)]
        })
        .filter(|(a, b)| a != b)
        .collect();
    pairs.sort_by_key(|&(a, b)| (a.min(b), a.max(b), a));
    pairs.dedup();
    pairs
}

impl NcclPeers {
    /// Joins this rank's channels of the pipeline group `name` (`rank` of `size`), each on a new
    /// stream of `be`'s GPU; `timeouts`: each channel's init and each transfer's.
    pub fn connect(
        store: &StoreClient,
        (name, rank, size): (&str, usize, usize),
        be: &CudaBackend,
        timeouts: (Duration, Duration),
    ) -> Result<Self> {
        let mut channels = HashMap::new();
        for (from, to) in neighbour_pairs(size) {
            if from != rank && to != rank {
                continue;
            }
            let channel = format!("{name}/{from}-to-{to}");
            let me = usize::from(to == rank);
            let stream = be.channel_stream()?;
            let group = NcclGroup::connect_on(store, (&channel, me, 2), be, timeouts, stream)?;
            channels.insert((from, to), group);
        }
        Ok(NcclPeers {
            name: name.to_string(),
            rank,
            channels,
        })
    }

    fn channel(&self, from: usize, to: usize) -> Result<&NcclGroup> {
        self.channels.get(&(from, to)).ok_or_else(|| {
            anyhow!(
                "pipeline group `{}`: no NCCL channel from rank {from} to rank {to} (channels join ring neighbours only)",
                self.name
            )
        })
    }
}

impl DevicePeers<CudaBackend> for NcclPeers {
    fn send(&self, _be: &CudaBackend, buf: &CudaBuf, peer: usize) -> Result<()> {
        let channel = self.channel(self.rank, peer)?;
        let sent = channel.start_send(buf, 1)?;
        channel.wait(sent)
    }

    fn recv(&self, _be: &CudaBackend, buf: &mut CudaBuf, peer: usize) -> Result<()> {
        let channel = self.channel(peer, self.rank)?;
        let received = channel.start_recv(buf, 0)?;
        channel.wait(received)
    }

    fn reaches(&self, peer: usize) -> bool {
        self.channels.contains_key(&(self.rank, peer))
            && self.channels.contains_key(&(peer, self.rank))
    }

    fn abort(&self) {
        for channel in self.channels.values() {
            channel.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::neighbour_pairs;

    #[test]
    fn channels_join_ring_neighbours_both_ways_in_one_order() {
        assert!(neighbour_pairs(1).is_empty());
        assert_eq!(neighbour_pairs(2), vec![(0, 1), (1, 0)]);
        assert_eq!(
            neighbour_pairs(4),
            vec![
                (0, 1),
                (1, 0),
                (0, 3),
                (3, 0),
                (1, 2),
                (2, 1),
                (2, 3),
                (3, 2)
            ]
        );
    }
}
