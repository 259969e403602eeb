//! A worker never outlives its launcher, and leaves no socket behind when stopped.
//!
//! SIGTERM reaches a worker when its launcher stops the group (a rank failed) or dies (the
//! parent-death signal `launcher::worker_command` sets); torchrun and SLURM send it too. One
//! thread answers it (`end_on_terminate`): the flight recorder's dump when it is on, this
//! process's Unix sockets (and the job's socket folder once empty) removed, exit 128 + 15.
//! The backstop for whatever keeps that path from ending the process (a dump another thread is
//! writing, a disk that does not answer) is a thread that notices the launcher is gone (the
//! worker was handed to another parent) and, after the grace the SIGTERM path gets, ends the
//! process outright. Files being written are safe either way: checkpoints and dumps go to
//! temporary names renamed when complete, so each is whole or absent.

use std::time::Duration;

use anyhow::{Context, Result};

use crate::comm::{conn, flight_recorder};

/// Set by the launcher on each worker: its own pid.
pub const LAUNCHER_PID_ENV: &str = "TITAN_LAUNCHER_PID";

/// How often the watch looks at the worker's parent.
const POLL: Duration = Duration::from_millis(200);

/// How long the SIGTERM path (the flight recorder's dump) has to end the process itself once the
/// launcher is gone. With `POLL` it keeps a worker's exit within 10 s of its launcher's death.
const GRACE: Duration = Duration::from_secs(5);

/// In a worker started by titan's launcher (`LAUNCHER_PID_ENV` set), watches for the launcher's
/// death and ends this process `GRACE` after it; elsewhere (one process, torchrun, SLURM) nothing.
pub fn exit_with_launcher() {
    let Some(launcher) = std::env::var(LAUNCHER_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<libc::pid_t>().ok())
    else {
        return;
    };
    let watch = std::thread::Builder::new()
        .name("launcher-watch".into())
        .spawn(move || {
            // SAFETY: getppid(2) has no preconditions.
            while unsafe { libc::getppid() } == launcher {
                std::thread::sleep(POLL);
            }
            std::thread::sleep(GRACE);
            errln!("the launcher (pid {launcher}) is gone: this worker exits");
            // The sockets go on a thread of their own: a disk that does not answer must not keep
            // this backstop from ending the process.
            let (done, cleaned) = std::sync::mpsc::channel();
            let _ = std::thread::Builder::new().spawn(move || {
                conn::remove_own_sockets();
                let _ = done.send(());
            });
            let _ = cleaned.recv_timeout(Duration::from_secs(1));
            // SAFETY: _exit(2) ends the process without running destructors or atexit handlers,
            // none of which may block it now.
            unsafe { libc::_exit(128 + libc::SIGTERM) };
        });
    if let Err(e) = watch {
        errln!("warning: cannot watch the launcher (this worker may outlive it): {e}");
    }
}

/// In a worker of a multi-process job: on SIGTERM, writes the flight recorder's dump (when on),
/// removes this process's sockets and exits with 128 + 15, as the default action would.
pub fn end_on_terminate() -> Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM])
        .context("cannot watch for SIGTERM")?;
    std::thread::Builder::new()
        .name("terminate".into())
        .spawn(move || {
            if signals.forever().next().is_some() {
                // Whatever the dump meets, the process exits: this thread is what ends it.
                let _ = std::panic::catch_unwind(|| {
                    flight_recorder::dump_once(
                        "stopped by the launcher (SIGTERM): another rank failed or it stopped",
                    )
                });
                conn::remove_own_sockets();
                // SAFETY: _exit(2) ends the process at once, as SIGTERM's default action would,
                // without the exit handlers and destructors other threads may still be using.
                unsafe { libc::_exit(128 + 15) };
            }
        })?;
    Ok(())
}
