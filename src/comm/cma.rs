//! Cross-memory attach: reading another local process's memory with one copy
//! (`process_vm_readv`), the way MPI moves large messages between ranks of one node. The collectives
//! of a group whose ranks all share this host use it instead of sockets, whose two copies through the
//! kernel (and per-message system calls) halve the bandwidth. No crate wraps this single system call
//! beyond `libc`, so it is written here.
//!
//! A group turns it on only when every rank could read a probe word from every peer at connect
//! time (the call can be forbidden by a container's seccomp profile or by Yama's ptrace scope); the
//! environment variable `TITAN_COMM_NO_CMA=1` turns it off. `agree` is that decision, taken alike on every
//! rank through the store.

use std::io;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::store::StoreClient;

/// A random word of this process, read by peers to check that they read the right process: a pid
/// can name another process in a peer's pid namespace, and without ASLR every titan process has its
/// probe at the same address, but no other process holds this value there.
static PROBE: OnceLock<u64> = OnceLock::new();

/// This process's probe word.
pub fn probe_value() -> u64 {
    *PROBE.get_or_init(|| rand::random::<u64>() | 1)
}

/// Where this process keeps its probe word.
pub fn probe_address() -> u64 {
    probe_value();
    PROBE.get().expect("initialised above") as *const u64 as u64
}

/// Whether this process should try cross-memory attach at all (`TITAN_COMM_NO_CMA` set to anything
/// but empty, `0` or `false` turns it off).
pub fn allowed() -> bool {
    let off = std::env::var("TITAN_COMM_NO_CMA")
        .map(|v| !matches!(v.trim(), "" | "0" | "false"))
        .unwrap_or(false);
    cfg!(target_os = "linux") && !off
}

/// Lets this process's siblings (the other ranks its launcher started) read it, and no one else
/// beyond what the system already allows. Under Yama's `ptrace_scope = 1` (Ubuntu's default) only
/// ancestors may read a process; naming the parent as this process's ptracer
/// (`PR_SET_PTRACER`) admits the parent and its descendants: the launcher (titan's, torchrun) and
/// the ranks it started. Not `PR_SET_PTRACER_ANY`, which would open this process to every process
/// of the user. Ranks under different parents fail the probe and use sockets. Nothing changes
/// where Yama is absent; `TITAN_COMM_NO_CMA=1` keeps the restriction as it is.
#[cfg(target_os = "linux")]
pub fn allow_peer_reads() {
    // SAFETY: getppid cannot fail; prctl with these arguments only changes this process's Yama
    // ptracer setting, and a failure (no Yama) is harmless and ignored.
    unsafe {
        let parent = libc::getppid();
        if parent > 1 {
            libc::prctl(libc::PR_SET_PTRACER, parent as libc::c_ulong, 0, 0, 0);
        }
    }
}

#[cfg(not(target_os = "linux"))]
pub fn allow_peer_reads() {}

/// Copies `dst.len()` bytes from address `remote` in process `pid` into `dst`.
#[cfg(target_os = "linux")]
pub fn read_bytes(pid: i32, remote: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr() as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` covers memory this process owns mutably; the kernel checks `remote` and
        // fails (EFAULT/ESRCH/EPERM) instead of touching anything invalid.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote_iov, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub fn read_bytes(_pid: i32, _remote: u64, _dst: &mut [u8]) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "cross-memory attach needs Linux",
    ))
}

/// Reads `dst.len()` floats from address `remote` in process `pid`.
pub fn read_f32(pid: i32, remote: u64, dst: &mut [f32]) -> io::Result<()> {
    // SAFETY: any byte pattern is a valid f32; the view covers exactly `dst`.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, std::mem::size_of_val(dst))
    };
    read_bytes(pid, remote, bytes)
}

/// Whether the word at `address` in process `pid` reads back as `expected` (a peer's probe).
pub fn can_read(pid: i32, address: u64, expected: u64) -> bool {
    let mut b = [0u8; 8];
    read_bytes(pid, address, &mut b).is_ok() && u64::from_ne_bytes(b) == expected
}

/// Decides, identically on every rank, whether the group copies by direct reads. Round 1: each rank
/// publishes whether it is willing (local sockets, not disabled) with its pid and probe. Round 2
/// (only when all are willing): each rank reads every peer's probe and publishes whether all read
/// back right. Direct reads are used only when every rank could read every peer.
pub(super) fn agree(
    store: &StoreClient,
    name: &str,
    rank: usize,
    size: usize,
    willing: bool,
    link_pids: &[Option<i32>],
    timeout: Duration,
) -> Result<Option<Vec<i32>>> {
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let never =
        |peer: usize| anyhow!("group `{name}` rank {rank}: rank {peer} never finished connecting");
    let me = if willing {
        allow_peer_reads();
        format!(
            "{}:{}:{}",
            std::process::id(),
            probe_address(),
            probe_value()
        )
    } else {
        "no".to_string()
    };
    store.set(&format!("group/{name}/cma-offer/{rank}"), me.as_bytes())?;
    let mut offers = Vec::with_capacity(size);
    for peer in 0..size {
        let v = store
            .get_within(&format!("group/{name}/cma-offer/{peer}"), left())
            .map_err(|_| never(peer))?;
        let v = String::from_utf8_lossy(&v).into_owned();
        let mut parts = v.split(':');
        let mut field = || parts.next().and_then(|f| f.parse::<u64>().ok());
        offers.push(match (field(), field(), field()) {
            (Some(pid), Some(address), Some(value)) => Some((pid as i32, address, value)),
            _ => None,
        });
    }
    if offers.iter().any(Option::is_none) {
        return Ok(None);
    }
    let offers: Vec<(i32, u64, u64)> = offers.into_iter().flatten().collect();
    let readable =
        offers
            .iter()
            .enumerate()
            .filter(|(p, _)| *p != rank)
            .all(|(p, &(pid, address, value))| {
                // The pid a peer offers must be the one the kernel names at the link's other end.
                link_pids.get(p).copied().flatten() == Some(pid) && can_read(pid, address, value)
            });
    store.set(
        &format!("group/{name}/cma-ok/{rank}"),
        if readable { b"1" } else { b"0" },
    )?;
    let mut all = readable;
    for peer in (0..size).filter(|&p| p != rank) {
        let v = store
            .get_within(&format!("group/{name}/cma-ok/{peer}"), left())
            .map_err(|_| never(peer))?;
        all &= v.as_slice() == b"1";
    }
    Ok(all.then(|| offers.iter().map(|o| o.0).collect()))
}
