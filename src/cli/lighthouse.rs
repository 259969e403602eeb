//! `titan lighthouse`: the coordinator replica groups agree on each step's quorum through
//! (`[fault_tolerance]`, torchft's lighthouse; the protocol is `comm::quorum`'s). It runs until it
//! is stopped.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use crate::comm::auth::JobSecret;
use crate::comm::quorum::{Lighthouse, LighthouseOptions};

#[derive(Args, Debug)]
pub struct LighthouseArgs {
    /// Port to listen on (0: any free one; the address is printed).
    #[arg(long, default_value_t = 29510)]
    pub port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub bind: String,
    /// Replica groups a quorum needs at least.
    #[arg(long, default_value_t = 1)]
    pub min_replicas: usize,
    /// How long a round waits, once it has the minimum, for the previous quorum's replicas
    /// (a replica silent this long is left out).
    #[arg(long, default_value_t = 10_000)]
    pub join_timeout_ms: u64,
    /// The secret every replica group is started with (their --job-secret-file): only they join.
    #[arg(long)]
    pub job_secret_file: PathBuf,
}

pub fn run(args: &LighthouseArgs) -> Result<()> {
    let secret = JobSecret::from_file(&args.job_secret_file)?;
    let options = LighthouseOptions {
        min_replicas: args.min_replicas,
        join_timeout: Duration::from_millis(args.join_timeout_ms),
    };
    let lh = Lighthouse::start(&format!("{}:{}", args.bind, args.port), &secret, options)?;
    outln!(
        "lighthouse listening on {} (quorum of at least {} replica groups, join timeout {} ms)",
        lh.addr,
        args.min_replicas,
        args.join_timeout_ms
    );
    loop {
        std::thread::park();
    }
}
