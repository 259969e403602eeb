//! A worker of titan's launcher never outlives it.
//!
//! The launcher starts each worker with a parent-death signal (SIGTERM, `launcher::worker_command`):
//! a worker with the flight recorder on writes its dump and exits, one without dies at once. This
//! is the backstop for whatever keeps that path from ending the process (a handler stuck behind a
//! dump another thread is writing, a disk that does not answer): a thread that notices the
//! launcher is gone (the worker was handed to another parent) and, after the grace the SIGTERM
//! path gets, ends the process outright. Files being written are safe either way: checkpoints and
//! dumps go to temporary names renamed when complete, so each is whole or absent.

use std::time::Duration;

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
            // SAFETY: _exit(2) ends the process without running destructors or atexit handlers,
            // none of which may block it now.
            unsafe { libc::_exit(128 + libc::SIGTERM) };
        });
    if let Err(e) = watch {
        errln!("warning: cannot watch the launcher (this worker may outlive it): {e}");
    }
}
