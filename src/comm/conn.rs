//! Point-to-point byte streams between ranks: a Unix socket in the job's private folder (mode 0700)
//! when every rank is on this host (about twice the bandwidth of loopback TCP), TCP otherwise.
//! Addresses travel through the store as `unix:PATH` or `tcp:HOST:PORT`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

pub enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    /// Connects to an address published by `Listener::bind`.
    pub fn connect(addr: &str) -> std::io::Result<Conn> {
        match addr.split_once(':') {
            Some(("unix", path)) => UnixStream::connect(path).map(Conn::Unix),
            Some(("tcp", a)) => TcpStream::connect(a).map(Conn::Tcp),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("bad peer address `{addr}`"),
            )),
        }
    }

    /// The process at the other end of a Unix socket and its user, from the kernel
    /// (`SO_PEERCRED`, recorded when the connection was made): not what the peer says. None over
    /// TCP.
    pub fn peer_credentials(&self) -> Option<(i32, u32)> {
        use std::os::fd::AsRawFd;
        let Conn::Unix(s) = self else {
            return None;
        };
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut cred as *mut libc::ucred as *mut libc::c_void,
                &mut len,
            )
        };
        (rc == 0).then_some((cred.pid, cred.uid))
    }

    /// Over a Unix socket, an error unless the peer runs as this process's user.
    pub fn check_same_user(&self) -> std::io::Result<()> {
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        match self.peer_credentials() {
            Some((_, uid)) if uid != me => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("the peer runs as user {uid}, this rank as {me}"),
            )),
            _ => Ok(()),
        }
    }

    pub fn try_clone(&self) -> std::io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    /// Blocking mode with these read and write timeouts (Nagle off for TCP).
    pub fn set_timeouts(&self, read: Duration, write: Duration) -> std::io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(read))?;
                s.set_write_timeout(Some(write))
            }
            Conn::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(read))?;
                s.set_write_timeout(Some(write))
            }
        }
    }
}

impl crate::comm::auth::TimedStream for Conn {
    fn set_read_timeout_to(&mut self, timeout: Duration) -> std::io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(Some(timeout)),
            Conn::Unix(s) => s.set_read_timeout(Some(timeout)),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Tcp(s) => s.flush(),
            Conn::Unix(s) => s.flush(),
        }
    }
}

/// A non-blocking listener; a Unix socket file is removed when it is dropped.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Listens on `host` (a Unix socket in the job's private folder, `job_socket_dir`, when `host`
    /// is loopback) and returns the address peers connect to.
    pub fn bind(
        host: &str,
        job_id: &str,
        group: &str,
        rank: usize,
    ) -> std::io::Result<(Listener, String)> {
        if host == "127.0.0.1" || host == "localhost" {
            let dir = job_socket_dir(job_id)?;
            // Short whatever the group's name: a Unix socket path holds at most 107 bytes.
            let path = dir.join(format!(
                "{:08x}-{rank}-{}.sock",
                crc32fast::hash(group.as_bytes()),
                std::process::id()
            ));
            let _ = std::fs::remove_file(&path);
            let l = match UnixListener::bind(&path) {
                // The last rank of an earlier run removed the empty folder meanwhile
                // (`remove_own_sockets`): make it again.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    job_socket_dir(job_id)?;
                    UnixListener::bind(&path)?
                }
                bound => bound?,
            };
            l.set_nonblocking(true)?;
            let addr = format!("unix:{}", path.display());
            Ok((Listener::Unix(l, path), addr))
        } else {
            let l = TcpListener::bind(format!("{host}:0"))?;
            l.set_nonblocking(true)?;
            let addr = format!("tcp:{}", l.local_addr()?);
            Ok((Listener::Tcp(l), addr))
        }
    }

    pub fn accept(&self) -> std::io::Result<Conn> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Conn::Tcp(s)),
            Listener::Unix(l, _) => l.accept().map(|(s, _)| Conn::Unix(s)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The environment variable naming this launch (set by titan's launcher for its workers): two
/// jobs that share a secret still get separate socket folders.
pub const RUN_ID_ENV: &str = "TITAN_RUN_ID";

/// Where `job_socket_dir` puts the sockets of job `job_id` in launch `run` (the launcher removes
/// its own folder at the end).
pub fn job_socket_path(job_id: &str, run: Option<&str>) -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let name = match run {
        Some(run) => format!("titan-{uid}-{job_id}-{run}"),
        None => format!("titan-{uid}-{job_id}"),
    };
    let tmp = std::env::temp_dir();
    // Room for the folder name and "/xxxxxxxx-rank-pid.sock" within 107 bytes.
    let base = if tmp.as_os_str().len() + name.len() + 40 <= 107 {
        tmp
    } else {
        PathBuf::from("/tmp")
    };
    base.join(name)
}

/// The job's socket folder this process made or used (`job_socket_dir`).
static SOCKET_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// At this process's exit: removes the Unix sockets it bound in its job's socket folder (a
/// listener not dropped before `exit` leaves its file) and, in a launch of titan's launcher (its
/// own folder, every rank in it started on this host, so in this pid namespace), those of ranks
/// that died without doing so (their pid, the name's last field, gone); then the folder itself
/// once no live rank's socket is in it. Titan's launcher removes its workers' folder; a rank
/// started by torchrun, SLURM or mpirun, or one whose launcher was killed, has only this.
pub fn remove_own_sockets() {
    let Some(dir) = SOCKET_DIR.get() else {
        return;
    };
    let me = std::process::id() as libc::pid_t;
    // Other hosts' ranks may share a folder without a run id (a shared temp folder), where their
    // pids mean nothing here.
    let reap_dead = std::env::var_os(RUN_ID_ENV).is_some();
    if let Ok(listing) = std::fs::read_dir(dir) {
        for entry in listing.flatten() {
            let name = entry.file_name();
            let owner = name
                .to_string_lossy()
                .strip_suffix(".sock")
                .and_then(|n| n.rsplit('-').next()?.parse::<libc::pid_t>().ok());
            if owner.is_some_and(|pid| pid == me || (reap_dead && !process_alive(pid))) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    // Fails, as it should, while another rank's sockets are still there.
    let _ = std::fs::remove_dir(dir);
}

/// Whether process `pid` exists (a process of another user counts as alive).
fn process_alive(pid: libc::pid_t) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
}

/// The job's folder of Unix sockets: `titan-{uid}-{job_id}` in the temp folder (or in `/tmp` when
/// the temp folder's path would make socket paths too long), mode 0700, owned by this user. Made
/// by whichever rank comes first; a folder of that name owned by another user, or open to others,
/// is refused rather than used.
pub fn job_socket_dir(job_id: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let run = std::env::var(RUN_ID_ENV)
        .ok()
        .filter(|r| !r.is_empty() && r.len() <= 16 && r.bytes().all(|b| b.is_ascii_alphanumeric()));
    let dir = job_socket_path(job_id, run.as_deref());
    let _ = SOCKET_DIR.set(dir.clone());
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a private folder of this user (owner {}, mode {:o}); remove it",
                dir.display(),
                meta.uid(),
                meta.permissions().mode() & 0o777
            ),
        ));
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_socket_folder_is_private_and_a_shared_one_is_refused() {
        let job = format!("test{}", std::process::id());
        let dir = job_socket_dir(&job).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let (l, addr) = Listener::bind("127.0.0.1", &job, "a-group-name-that-is-long", 3).unwrap();
        assert!(addr.len() < 100 && addr.starts_with(&format!("unix:{}", dir.display())));
        drop(l);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = job_socket_dir(&job).unwrap_err().to_string();
        assert!(e.contains("not a private folder"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
