//! Process groups: the collectives every parallelism uses, behind one trait (the CPU transport
//! here; NCCL will implement the same trait), and the TCP transport.
//!
//! The TCP transport connects every pair of ranks once (addresses exchanged through the store) and
//! runs ring algorithms, whose per-rank traffic stays ~2·size/ranks as ranks grow: all-reduce =
//! reduce-scatter + all-gather. Each step sends on a scoped thread while receiving, so the ring
//! never deadlocks on socket buffers. Every socket operation has the group's timeout, and errors name
//! the operation, the group, this rank and the peer that failed (a killed peer shows as a closed
//! connection at once; a hung one as a timeout). Data travels as native little-endian f32 bytes.
//! When every rank is on this host and may read its peers' memory, all-reduce, all-gather and
//! reduce-scatter copy straight between processes instead (`cma`), with the sockets only carrying
//! the three small messages that order each collective's phases.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use super::cma;
use super::conn::Conn;
use super::flight_recorder::GroupRecord;
use super::frame::{FramedReader, FramedWriter, RecvError};
use super::peers::{connect_peers, PeerSetup};
use super::store::StoreClient;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
}

/// Where a group keeps the device communicator attached to it (`device_group::attach`): an
/// `Arc<dyn DeviceGroup<B>>` for the backend `B` it was made on.
pub type DeviceSlot = std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>;

pub trait ProcessGroup: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn name(&self) -> &str;
    /// In place; `Avg` divides the sum by the group size.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
    /// `output` (`size × input.len()`) receives every rank's `input` in rank order.
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()>;
    /// `input` is `size` equal chunks; `output` receives the reduction of chunk `rank`.
    fn reduce_scatter(&self, input: &[f32], output: &mut [f32], op: ReduceOp) -> Result<()>;
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;
    fn send(&self, buf: &[f32], peer: usize) -> Result<()>;
    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<()>;
    /// Rank `r` sends `input[offsets of send_counts]` part `p` to rank `p` and receives part `r` of
    /// every rank into `output`, laid out by `recv_counts` (uneven splits allowed).
    fn all_to_all(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// The slot for the device communicator over the same ranks (None: this group cannot carry
    /// one, e.g. a shape-only group of the planner).
    fn device_slot(&self) -> Option<&DeviceSlot> {
        None
    }
    /// The flight recorder's buffer of this group's operations, when the recorder is on.
    fn flight_record(&self) -> Option<Arc<GroupRecord>> {
        None
    }
}

fn as_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

fn as_bytes_mut(x: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

/// `[start, end)` of chunk `i` of `len` split `n` ways.
fn chunk(len: usize, n: usize, i: usize) -> (usize, usize) {
    (i * len / n, (i + 1) * len / n)
}

/// `buf[a]` to read and `buf[b]` to write, for two non-overlapping ranges.
fn disjoint(buf: &mut [f32], a: (usize, usize), b: (usize, usize)) -> (&[f32], &mut [f32]) {
    if a.1 <= b.0 {
        let (lo, hi) = buf.split_at_mut(b.0);
        (&lo[a.0..a.1], &mut hi[..b.1 - b.0])
    } else {
        let (lo, hi) = buf.split_at_mut(a.0);
        (&hi[..a.1 - a.0], &mut lo[b.0..b.1])
    }
}

fn reduce_into(acc: &mut [f32], x: &[f32], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
    }
}

struct Link {
    reader: Mutex<FramedReader>,
    writer: Mutex<FramedWriter>,
}

impl Link {
    fn new(s: Conn) -> std::io::Result<Self> {
        Ok(Link {
            writer: Mutex::new(FramedWriter::new(s.try_clone()?)),
            reader: Mutex::new(FramedReader::new(s)),
        })
    }
}

pub struct TcpGroup {
    name: String,
    rank: usize,
    size: usize,
    /// Connection to each peer (`None` at this rank's own index), split in a reading and a writing
    /// handle so a send and a receive with the same peer (two-rank rings) never wait on each other.
    peers: Vec<Option<Link>>,
    timeout: Duration,
    /// Process id of every rank when all share this host and can read each other's memory
    /// (`cma`): the all-reduce, all-gather and reduce-scatter then copy straight between processes.
    peer_pids: Option<Vec<i32>>,
    /// Collectives started on this group; every direct-read phase message carries it, so ranks that
    /// fall out of step (one failed, the others went on) are an error, not a read of a stale buffer.
    sequence: AtomicU64,
    /// Set by the first failure: the sockets may hold half a message, so later collectives refuse.
    broken: AtomicBool,
    /// The flight recorder's buffer of this group's operations, when it is on.
    record: Option<Arc<GroupRecord>>,
    /// The device communicator over the same ranks, once one is attached.
    device: DeviceSlot,
}

impl TcpGroup {
    /// Joins group `name` of `size` ranks as `rank`: publishes a listening address in the store,
    /// connects to lower ranks and accepts higher ones, within `init_timeout`. Collectives then use
    /// `op_timeout`.
    pub fn connect(
        store: &StoreClient,
        name: &str,
        rank: usize,
        size: usize,
        host: &str,
        init_timeout: Duration,
        op_timeout: Duration,
    ) -> Result<Self> {
        if rank >= size {
            bail!("group `{name}`: rank {rank} is outside a group of {size}");
        }
        let setup = PeerSetup {
            store,
            name,
            rank,
            size,
            host,
            init_timeout,
        };
        let (conns, unix) = connect_peers(&setup)?;
        let willing = unix && cma::allowed();
        let peers = conns
            .into_iter()
            .map(|c| c.map(Link::new).transpose())
            .collect::<std::io::Result<Vec<_>>>()?;
        for link in peers.iter().flatten() {
            let s = link.reader.lock().unwrap_or_else(|e| e.into_inner());
            let s = s.conn();
            s.set_timeouts(op_timeout, op_timeout)?;
        }
        let peer_pids = if size > 1 {
            let link_pids: Vec<Option<i32>> = peers
                .iter()
                .map(|l| {
                    let s = l.as_ref()?.reader.lock().unwrap_or_else(|e| e.into_inner());
                    s.conn().peer_credentials().map(|(pid, _)| pid)
                })
                .collect();
            cma::agree(store, name, rank, size, willing, &link_pids, init_timeout)?
        } else {
            None
        };
        Ok(TcpGroup {
            name: name.to_string(),
            rank,
            size,
            peers,
            timeout: op_timeout,
            peer_pids,
            sequence: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            record: None,
            device: DeviceSlot::new(),
        })
    }

    /// Records this group's operations in the flight recorder's `record` (see `flight_recorder`).
    pub fn with_record(mut self, record: Option<Arc<GroupRecord>>) -> Self {
        self.record = record;
        self
    }

    /// Runs one operation under the flight recorder (when on): started before, completed or
    /// failed after. The recorder's fault drill may skip it.
    fn recorded(
        &self,
        op: &str,
        elements: usize,
        peer: Option<usize>,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let Some(record) = &self.record else {
            return body();
        };
        let Some(recording) = record.start(op, elements, peer) else {
            return Ok(());
        };
        let result = body();
        recording.finish(&result);
        result
    }

    /// Whether the collectives copy directly between processes (see `cma`).
    pub fn uses_cross_memory_attach(&self) -> bool {
        self.peer_pids.is_some()
    }

    /// Back to sockets for every collective; all ranks of the group must call it (tests compare
    /// both transports).
    pub fn disable_cross_memory_attach(&mut self) {
        self.peer_pids = None;
    }

    fn link(&self, peer: usize) -> Result<&Link> {
        self.peers
            .get(peer)
            .and_then(|p| p.as_ref())
            .ok_or_else(|| anyhow!("group `{}`: no rank {peer} (size {})", self.name, self.size))
    }

    fn io_error(&self, op: &str, peer: usize, e: std::io::Error) -> anyhow::Error {
        let why = match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                "did not answer within {:.0?} (train_timeout_seconds)",
                self.timeout
            ),
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => "closed the connection (did it exit?)".into(),
            _ => e.to_string(),
        };
        anyhow!(
            "{op} on group `{}` (rank {} of {}): peer rank {peer} {why}",
            self.name,
            self.rank,
            self.size
        )
    }

    fn send_bytes(&self, op: &str, peer: usize, bytes: &[u8]) -> Result<()> {
        let mut w = self
            .link(peer)?
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        w.send(bytes)
            .map_err(|e| self.fail(self.io_error(op, peer, e)))
    }

    fn recv_bytes(&self, op: &str, peer: usize, bytes: &mut [u8]) -> Result<()> {
        let mut r = self
            .link(peer)?
            .reader
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.recv(bytes).map_err(|e| {
            self.fail(match e {
                RecvError::Io(e) => self.io_error(op, peer, e),
                RecvError::OutOfStep {
                    index,
                    len,
                    expected_index,
                    expected_len,
                } => anyhow!(
                    "{op} on group `{}` (rank {} of {}): peer rank {peer} sent its message #{index} of {len} bytes where this rank expected message #{expected_index} of {expected_len} bytes: the ranks called different collectives (or with different sizes)",
                    self.name,
                    self.rank,
                    self.size
                ),
            })
        })
    }

    /// Sends `out` to `to` on a scoped thread while receiving `inp` from `from`.
    fn exchange(&self, op: &str, to: usize, out: &[u8], from: usize, inp: &mut [u8]) -> Result<()> {
        std::thread::scope(|sc| {
            let sender = sc.spawn(|| self.send_bytes(op, to, out));
            let received = self.recv_bytes(op, from, inp);
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(anyhow!("{op}: sender thread panicked")));
            received.and(sent)
        })
    }

    /// Marks the group unusable and passes the error on.
    fn fail(&self, e: anyhow::Error) -> anyhow::Error {
        self.broken.store(true, Ordering::SeqCst);
        e
    }

    /// Refuses a collective on a group that failed before.
    fn check_usable(&self, op: &str) -> Result<()> {
        if self.broken.load(Ordering::SeqCst) {
            bail!(
                "{op} on group `{}` (rank {} of {}): the group failed in an earlier operation",
                self.name,
                self.rank,
                self.size
            );
        }
        Ok(())
    }

    /// One phase of a direct-read collective: sends (collective number, phase, address, length) to
    /// every peer and returns every rank's address. An address is only ever read through `cma`,
    /// which answers a bad one with an error (offsets into it wrap, never panic). Also a barrier: it returns once every rank has
    /// reached this phase of this collective, with the same length.
    fn exchange_phase(
        &self,
        op: &str,
        seq: u64,
        phase: u64,
        addr: u64,
        len: usize,
    ) -> Result<Vec<u64>> {
        let mut msg = [0u8; 32];
        for (k, v) in [seq, phase, addr, len as u64].into_iter().enumerate() {
            msg[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        // 32 bytes always fit in a socket's buffer, so sending to everyone before receiving cannot
        // deadlock, and needs no sender threads (this is on the latency path).
        for p in (0..self.size).filter(|&p| p != self.rank) {
            self.send_bytes(op, p, &msg)?;
        }
        let mut addrs = vec![addr; self.size];
        for (p, a) in addrs
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != self.rank)
        {
            let mut b = [0u8; 32];
            self.recv_bytes(op, p, &mut b)?;
            let word =
                |k: usize| u64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().expect("8 bytes"));
            if (word(0), word(1)) != (seq, phase) || word(3) != len as u64 {
                return Err(self.fail(anyhow!(
                    "{op} on group `{}` (rank {} of {}): peer rank {p} is out of step (its collective {} phase {} with {} values, ours {seq} phase {phase} with {len}): the ranks called different collectives",
                    self.name,
                    self.rank,
                    self.size,
                    word(0),
                    word(1),
                    word(3)
                )));
            }
            *a = word(2);
        }
        Ok(addrs)
    }

    /// Reads `dst.len()` floats at `remote` from peer `peer`'s memory.
    fn read_peer(
        &self,
        op: &str,
        pids: &[i32],
        peer: usize,
        remote: u64,
        dst: &mut [f32],
    ) -> Result<()> {
        cma::read_f32(pids[peer], remote, dst).map_err(|e| {
            self.broken.store(true, Ordering::SeqCst);
            anyhow!(
                "{op} on group `{}` (rank {} of {}): reading peer rank {peer}'s memory failed: {e} (did it exit?)",
                self.name,
                self.rank,
                self.size
            )
        })
    }

    /// `acc[i] op= peer's floats at remote + i`, for this rank's chunk, read in cache-sized blocks.
    fn reduce_from_peers(
        &self,
        op_name: &str,
        pids: &[i32],
        remotes: &[u64],
        acc: &mut [f32],
        op: ReduceOp,
    ) -> Result<()> {
        const BLOCK: usize = 16 << 10;
        let mut tmp = vec![0f32; BLOCK.min(acc.len())];
        for (b, block) in acc.chunks_mut(BLOCK).enumerate() {
            for p in (0..self.size).filter(|&p| p != self.rank) {
                let t = &mut tmp[..block.len()];
                let at = remotes[p].wrapping_add((b * BLOCK * 4) as u64);
                self.read_peer(op_name, pids, p, at, t)?;
                reduce_into(block, t, op);
            }
        }
        Ok(())
    }

    /// All-reduce by direct reads: rank r reduces chunk r from every peer's buffer in place, then
    /// reads every other chunk from its owner. Three word exchanges order the phases: all inputs
    /// ready; all chunks reduced; all reads done (a buffer may change only after the last).
    fn cma_all_reduce(&self, pids: &[i32], buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let (n, r, len) = (self.size, self.rank, buf.len());
        let seq = self.sequence.fetch_add(1, Ordering::SeqCst);
        let addrs = self.exchange_phase("all_reduce", seq, 0, buf.as_ptr() as u64, len)?;
        let (c0, c1) = chunk(len, n, r);
        let remotes: Vec<u64> = addrs
            .iter()
            .map(|a| a.wrapping_add((c0 * 4) as u64))
            .collect();
        self.reduce_from_peers("all_reduce", pids, &remotes, &mut buf[c0..c1], op)?;
        self.exchange_phase("all_reduce", seq, 1, 0, len)?;
        for p in (0..n).filter(|&p| p != r) {
            let (p0, p1) = chunk(len, n, p);
            self.read_peer(
                "all_reduce",
                pids,
                p,
                addrs[p].wrapping_add((p0 * 4) as u64),
                &mut buf[p0..p1],
            )?;
        }
        self.exchange_phase("all_reduce", seq, 2, 0, len)?;
        Ok(())
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Ring reduce-scatter in place over `buf` split in `size` chunks: afterwards chunk `rank` holds
    /// the reduction over all ranks.
    fn ring_reduce_scatter(&self, op_name: &str, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let (n, r, len) = (self.size, self.rank, buf.len());
        let mut incoming = vec![0f32; len.div_ceil(n) + 1];
        for step in 0..n - 1 {
            let send_c = (r + 2 * n - step - 1) % n;
            let recv_c = (r + 2 * n - step - 2) % n;
            let (s0, s1) = chunk(len, n, send_c);
            let (r0, r1) = chunk(len, n, recv_c);
            let inp = &mut incoming[..r1 - r0];
            self.exchange(
                op_name,
                self.next(),
                as_bytes(&buf[s0..s1]),
                self.prev(),
                as_bytes_mut(inp),
            )?;
            reduce_into(&mut buf[r0..r1], inp, op);
        }
        Ok(())
    }

    /// Ring all-gather in place: chunk `rank` of `buf` is this rank's; afterwards all chunks are filled.
    fn ring_all_gather(&self, op_name: &str, buf: &mut [f32]) -> Result<()> {
        let (n, r, len) = (self.size, self.rank, buf.len());
        for step in 0..n - 1 {
            let send_c = (r + n - step) % n;
            let recv_c = (r + 2 * n - step - 1) % n;
            let (out, inp) = disjoint(buf, chunk(len, n, send_c), chunk(len, n, recv_c));
            self.exchange(
                op_name,
                self.next(),
                as_bytes(out),
                self.prev(),
                as_bytes_mut(inp),
            )?;
        }
        Ok(())
    }
}

/// The operations themselves; `ProcessGroup` runs each under the flight recorder.
impl TcpGroup {
    fn all_reduce_now(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let _span = crate::trace::span_with(
            "collective",
            "all_reduce",
            || serde_json::json!({"bytes": buf.len() * 4, "group": self.name(), "ranks": self.size()}),
        );
        self.check_usable("all_reduce")?;
        if let Some(pids) = &self.peer_pids {
            self.cma_all_reduce(pids, buf, op)?;
        } else if self.size > 1 {
            self.ring_reduce_scatter("all_reduce", buf, op)?;
            self.ring_all_gather("all_reduce", buf)?;
        }
        if op == ReduceOp::Avg {
            let inv = 1.0 / self.size as f32;
            buf.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(())
    }

    fn all_gather_now(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        let _span = crate::trace::span_with(
            "collective",
            "all_gather",
            || serde_json::json!({"bytes": output.len() * 4, "group": self.name(), "ranks": self.size()}),
        );
        self.check_usable("all_gather")?;
        if output.len() != input.len() * self.size {
            bail!(
                "all_gather on group `{}`: output holds {} values, needs {} × {}",
                self.name,
                output.len(),
                self.size,
                input.len()
            );
        }
        let c = input.len();
        output[self.rank * c..(self.rank + 1) * c].copy_from_slice(input);
        if let Some(pids) = &self.peer_pids {
            let seq = self.sequence.fetch_add(1, Ordering::SeqCst);
            let addrs = self.exchange_phase("all_gather", seq, 0, input.as_ptr() as u64, c)?;
            for p in (0..self.size).filter(|&p| p != self.rank) {
                self.read_peer(
                    "all_gather",
                    pids,
                    p,
                    addrs[p],
                    &mut output[p * c..(p + 1) * c],
                )?;
            }
            self.exchange_phase("all_gather", seq, 1, 0, c)?;
        } else if self.size > 1 {
            self.ring_all_gather("all_gather", output)?;
        }
        Ok(())
    }

    fn reduce_scatter_now(&self, input: &[f32], output: &mut [f32], op: ReduceOp) -> Result<()> {
        let _span = crate::trace::span_with(
            "collective",
            "reduce_scatter",
            || serde_json::json!({"bytes": input.len() * 4, "group": self.name(), "ranks": self.size()}),
        );
        self.check_usable("reduce_scatter")?;
        if input.len() != output.len() * self.size {
            bail!(
                "reduce_scatter on group `{}`: input holds {} values, needs {} × {}",
                self.name,
                input.len(),
                self.size,
                output.len()
            );
        }
        let c = output.len();
        if let Some(pids) = &self.peer_pids {
            output.copy_from_slice(&input[self.rank * c..(self.rank + 1) * c]);
            let seq = self.sequence.fetch_add(1, Ordering::SeqCst);
            let addrs =
                self.exchange_phase("reduce_scatter", seq, 0, input.as_ptr() as u64, input.len())?;
            let remotes: Vec<u64> = addrs
                .iter()
                .map(|a| a.wrapping_add((self.rank * c * 4) as u64))
                .collect();
            self.reduce_from_peers("reduce_scatter", pids, &remotes, output, op)?;
            self.exchange_phase("reduce_scatter", seq, 1, 0, input.len())?;
        } else {
            let mut work = input.to_vec();
            if self.size > 1 {
                self.ring_reduce_scatter("reduce_scatter", &mut work, op)?;
            }
            output.copy_from_slice(&work[self.rank * c..(self.rank + 1) * c]);
        }
        if op == ReduceOp::Avg {
            let inv = 1.0 / self.size as f32;
            output.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(())
    }

    fn broadcast_now(&self, buf: &mut [f32], root: usize) -> Result<()> {
        if root >= self.size {
            bail!(
                "broadcast on group `{}`: root {root} outside a group of {}",
                self.name,
                self.size
            );
        }
        if self.rank == root {
            for peer in (0..self.size).filter(|&p| p != root) {
                self.send_bytes("broadcast", peer, as_bytes(buf))?;
            }
            Ok(())
        } else {
            self.recv_bytes("broadcast", root, as_bytes_mut(buf))
        }
    }

    fn send_now(&self, buf: &[f32], peer: usize) -> Result<()> {
        self.send_bytes("send", peer, as_bytes(buf))
    }

    fn recv_now(&self, buf: &mut [f32], peer: usize) -> Result<()> {
        self.recv_bytes("recv", peer, as_bytes_mut(buf))
    }

    fn all_to_all_now(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<()> {
        let n = self.size;
        if send_counts.len() != n
            || recv_counts.len() != n
            || send_counts.iter().sum::<usize>() != input.len()
            || recv_counts.iter().sum::<usize>() != output.len()
        {
            bail!("all_to_all on group `{}`: counts {send_counts:?} / {recv_counts:?} do not match {} ranks and buffers of {} / {}", self.name, n, input.len(), output.len());
        }
        let offsets = |counts: &[usize]| {
            counts
                .iter()
                .scan(0, |acc, &c| {
                    let o = *acc;
                    *acc += c;
                    Some(o)
                })
                .collect::<Vec<usize>>()
        };
        let (so, ro) = (offsets(send_counts), offsets(recv_counts));
        output[ro[self.rank]..ro[self.rank] + recv_counts[self.rank]]
            .copy_from_slice(&input[so[self.rank]..so[self.rank] + send_counts[self.rank]]);
        std::thread::scope(|sc| {
            let senders: Vec<_> = (0..n)
                .filter(|&p| p != self.rank)
                .map(|p| {
                    let part = &input[so[p]..so[p] + send_counts[p]];
                    sc.spawn(move || self.send_bytes("all_to_all", p, as_bytes(part)))
                })
                .collect();
            let mut result = Ok(());
            for p in (0..n).filter(|&p| p != self.rank) {
                if result.is_ok() {
                    result = self.recv_bytes(
                        "all_to_all",
                        p,
                        as_bytes_mut(&mut output[ro[p]..ro[p] + recv_counts[p]]),
                    );
                }
            }
            for s in senders {
                let sent = s
                    .join()
                    .unwrap_or_else(|_| Err(anyhow!("all_to_all: sender thread panicked")));
                if result.is_ok() {
                    result = sent;
                }
            }
            result
        })
    }
}

impl ProcessGroup for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        &self.name
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.recorded("all_reduce", buf.len(), None, || {
            self.all_reduce_now(buf, op)
        })
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        self.recorded("all_gather", input.len(), None, || {
            self.all_gather_now(input, output)
        })
    }

    fn reduce_scatter(&self, input: &[f32], output: &mut [f32], op: ReduceOp) -> Result<()> {
        self.recorded("reduce_scatter", input.len(), None, || {
            self.reduce_scatter_now(input, output, op)
        })
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.recorded("broadcast", buf.len(), Some(root), || {
            self.broadcast_now(buf, root)
        })
    }

    fn send(&self, buf: &[f32], peer: usize) -> Result<()> {
        self.recorded("send", buf.len(), Some(peer), || self.send_now(buf, peer))
    }

    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<()> {
        self.recorded("recv", buf.len(), Some(peer), || self.recv_now(buf, peer))
    }

    fn all_to_all(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<()> {
        self.recorded("all_to_all", input.len(), None, || {
            self.all_to_all_now(input, send_counts, output, recv_counts)
        })
    }

    fn barrier(&self) -> Result<()> {
        let mut one = [1.0f32];
        self.all_reduce(&mut one, ReduceOp::Sum)
    }

    fn device_slot(&self) -> Option<&DeviceSlot> {
        Some(&self.device)
    }

    fn flight_record(&self) -> Option<Arc<GroupRecord>> {
        self.record.clone()
    }
}
