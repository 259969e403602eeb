//! Which job secret a process uses (`comm/auth.rs` proves it on every connection): the launcher's
//! choice for its workers, and a worker's from its environment.

use std::path::Path;

use anyhow::{bail, Result};

use crate::comm::auth::{JobSecret, SECRET_ENV, SECRET_FILE_ENV};

const MULTI_NODE_HINT: &str = "put 64 hex digits (e.g. `openssl rand -hex 32`) in a file of mode 0600 on every node and pass --job-secret-file FILE (or set TITAN_JOB_SECRET); [comm] insecure_no_auth = true runs without one, letting any host that reaches the ports join the job";

/// The secret a launcher hands its workers: `--job-secret-file`, else the environment's, else
/// (one node) a fresh one; several nodes must share one, so without it they are refused unless
/// `insecure_no_auth`.
pub fn for_launcher(
    file: Option<&Path>,
    nnodes: usize,
    insecure_no_auth: bool,
) -> Result<JobSecret> {
    if let Some(path) = file {
        return JobSecret::from_file(path);
    }
    if let Some(secret) = JobSecret::from_env()? {
        return Ok(secret);
    }
    match (nnodes, insecure_no_auth) {
        (1, _) => Ok(JobSecret::generate()),
        (_, true) => {
            errln!("warning: [comm] insecure_no_auth = true: this multi-node job's store and ranks accept any connection");
            Ok(JobSecret::insecure())
        }
        _ => bail!("a multi-node job needs a job secret shared by its nodes: {MULTI_NODE_HINT}"),
    }
}

/// A worker's secret: `TITAN_JOB_SECRET` (the launcher sets it) or `TITAN_JOB_SECRET_FILE`;
/// without either, refused unless `insecure_no_auth` (torchrun, SLURM: give every rank the
/// variable or the file).
pub fn for_worker(rank: usize, insecure_no_auth: bool) -> Result<JobSecret> {
    match JobSecret::from_env()? {
        Some(secret) => Ok(secret),
        None if insecure_no_auth => Ok(JobSecret::insecure()),
        None => bail!("rank {rank}: no job secret ({SECRET_ENV} or {SECRET_FILE_ENV}); `titan train --nproc` sets one for its workers, other launchers must give every rank the same: {MULTI_NODE_HINT}"),
    }
}
