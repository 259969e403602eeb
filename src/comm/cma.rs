//! Cross-memory attach: reading another local process's memory with one copy
//! (`process_vm_readv`), the way MPI moves large messages between ranks of one node. The collectives
//! of a group whose ranks all share this host use it instead of sockets, whose two copies through the
//! kernel (and per-message system calls) halve the bandwidth. No crate wraps this single system call
//! beyond `libc`, so it is written here.
//!
//! A group turns it on only when every rank could read a probe word from every peer at connect
//! time (the call can be forbidden by a container's seccomp profile or by Yama's ptrace scope); the
//! environment variable `TITAN_COMM_NO_CMA=1` turns it off.

use std::io;
use std::sync::OnceLock;

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
