//! NCCL's point-to-point traffic: an all-to-all with uneven splits as one group call of a send
//! and a receive per peer (NCCL has no all-to-all of its own), on the communication stream,
//! ordered against compute like every collective of the group (`begin`, `issued`, `wait`).
//! Expert parallelism's rows and context parallelism's ring shifts travel through it; a single
//! send or receive (`start_send`, `start_recv`) carries a pipeline transfer on one of the
//! two-rank channels of `peers`.

use std::ffi::c_void;

use anyhow::{bail, Result};
use cudarc::nccl::{result as nccl, sys};

use super::{nccl_err, InFlight, NcclGroup};
use crate::backend::cuda::CudaBuf;

/// Where each peer's part starts in a buffer laid out by `counts` (one count per rank).
fn offsets(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

impl NcclGroup {
    /// Starts sending `input[part p]` to rank `p` and receiving rank `p`'s part for this rank
    /// into `output[part p]`, the parts laid out by `send_counts` and `recv_counts` (values per
    /// rank; a count of 0 moves nothing).
    pub fn start_all_to_all(
        &self,
        input: &CudaBuf,
        send_counts: &[usize],
        output: &mut CudaBuf,
        recv_counts: &[usize],
    ) -> Result<InFlight> {
        let (sent, received): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        if send_counts.len() != self.size
            || recv_counts.len() != self.size
            || input.len() < sent
            || output.len() < received
        {
            bail!(
                "all_to_all on NCCL group `{}` of {}: {} send counts ({sent} values, input holds {}), {} receive counts ({received} values, output holds {})",
                self.name,
                self.size,
                send_counts.len(),
                input.len(),
                recv_counts.len(),
                output.len()
            );
        }
        self.group_call("all_to_all", || {
            let (src, dst) = (
                input.device_address(&self.stream),
                output.device_address_mut(&self.stream),
            );
            let parts = send_counts
                .iter()
                .zip(offsets(send_counts))
                .zip(recv_counts.iter().zip(offsets(recv_counts)));
            for (peer, ((&send, send_at), (&recv, recv_at))) in parts.enumerate() {
                self.queue_pair(peer, (src, send_at, send), (dst, recv_at, recv))?;
            }
            Ok(())
        })
    }

    /// Starts sending the whole of `buf` to `peer`.
    pub fn start_send(&self, buf: &CudaBuf, peer: usize) -> Result<InFlight> {
        self.check_peer("send", peer)?;
        self.group_call("send", || {
            let src = buf.device_address(&self.stream);
            self.queue_pair(peer, (src, 0, buf.len()), (0, 0, 0))
        })
    }

    /// Starts receiving `buf.len()` values from `peer` into `buf`.
    pub fn start_recv(&self, buf: &mut CudaBuf, peer: usize) -> Result<InFlight> {
        self.check_peer("recv", peer)?;
        self.group_call("recv", || {
            let len = buf.len();
            let dst = buf.device_address_mut(&self.stream);
            self.queue_pair(peer, (0, 0, 0), (dst, 0, len))
        })
    }

    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            bail!(
                "{op} on NCCL group `{}`: rank {peer} is not another rank of a group of {}",
                self.name,
                self.size
            );
        }
        Ok(())
    }

    /// Queues (inside a group call) the send of `count` values at `base + at` floats to `peer`
    /// and the receive of its part, each skipped when empty.
    fn queue_pair(
        &self,
        peer: usize,
        (src, send_at, send): (u64, usize, usize),
        (dst, recv_at, recv): (u64, usize, usize),
    ) -> Result<()> {
        let float = std::mem::size_of::<f32>() as u64;
        if send > 0 {
            // SAFETY: `send` values from `send_at` lie inside the input (checked by the caller).
            unsafe {
                nccl::send(
                    (src + send_at as u64 * float) as *const c_void,
                    send,
                    sys::ncclDataType_t::ncclFloat32,
                    peer as i32,
                    self.comm,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_err("send", e))?;
        }
        if recv > 0 {
            // SAFETY: as above, inside the output.
            unsafe {
                nccl::recv(
                    (dst + recv_at as u64 * float) as *mut c_void,
                    recv,
                    sys::ncclDataType_t::ncclFloat32,
                    peer as i32,
                    self.comm,
                    self.cu_stream(),
                )
            }
            .map_err(|e| nccl_err("recv", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parts_start_where_the_counts_before_them_end() {
        assert_eq!(super::offsets(&[3, 0, 2, 5]), vec![0, 3, 3, 5]);
        assert!(super::offsets(&[]).is_empty());
    }
}
