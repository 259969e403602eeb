//! How many threads a process computes with: rayon's global pool, sized once per process, and a
//! job's rank's share of its host's cores.

use anyhow::Result;

use crate::config::Config;

/// Sizes rayon's global pool once per process (`threads = 0` keeps rayon's default: every core).
pub fn init_threads(threads: usize) {
    if threads > 0 {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
}

/// Sizes rayon's global pool once per process for a job's rank: `[training] threads`, where 0
/// shares the host's cores out among its ranks (each taking every core would oversubscribe them
/// `--nproc` times over), unless RAYON_NUM_THREADS says otherwise.
pub fn init_rank_threads(cfg: &Config) -> Result<()> {
    let rayon_env = std::env::var_os("RAYON_NUM_THREADS").is_some();
    let threads = match (
        cfg.training.threads,
        crate::launch::env::WorkerEnv::detect()?,
    ) {
        (0, Some(env)) if env.local_world_size > 1 && !rayon_env => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / env.local_world_size).max(1)
        }
        (n, _) => n,
    };
    init_threads(threads);
    Ok(())
}
