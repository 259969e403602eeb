//! Who this process is in a multi-process job: read from titan's own launcher, `torchrun`, SLURM
//! (`srun`) or Open MPI (`mpirun`) environment variables.

use anyhow::{anyhow, bail, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    /// Port of titan's rendezvous store.
    pub store_port: u16,
    /// The launcher hosts the store; otherwise rank 0 does.
    pub store_hosted: bool,
    /// Restart generation (keys of a restarted group never mix with the previous one's).
    pub generation: u64,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn num<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match var(name) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| anyhow!("environment variable {name}={v} is not a number")),
    }
}

impl WorkerEnv {
    /// `None` for a plain single-process run.
    pub fn detect() -> Result<Option<WorkerEnv>> {
        // (rank, world, local rank, local world) from the first launcher whose variables are set.
        let found = if let (Some(r), Some(w)) = (num::<usize>("RANK")?, num::<usize>("WORLD_SIZE")?)
        {
            Some((
                r,
                w,
                num("LOCAL_RANK")?.unwrap_or(r),
                num("LOCAL_WORLD_SIZE")?.unwrap_or(w),
            ))
        } else if let (Some(r), Some(w)) =
            (num::<usize>("SLURM_PROCID")?, num::<usize>("SLURM_NTASKS")?)
        {
            let local_world = var("SLURM_NTASKS_PER_NODE")
                .and_then(|v| v.split('(').next().and_then(|x| x.parse().ok()))
                .unwrap_or(w);
            Some((r, w, num("SLURM_LOCALID")?.unwrap_or(0), local_world))
        } else if let (Some(r), Some(w)) = (
            num::<usize>("OMPI_COMM_WORLD_RANK")?,
            num::<usize>("OMPI_COMM_WORLD_SIZE")?,
        ) {
            Some((
                r,
                w,
                num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(w),
            ))
        } else {
            None
        };
        let Some((rank, world_size, local_rank, local_world_size)) = found else {
            return Ok(None);
        };
        if rank >= world_size {
            bail!("rank {rank} is not below the world size {world_size} (check RANK/WORLD_SIZE or the launcher's equivalents)");
        }
        let master_addr = var("MASTER_ADDR")
            .or_else(|| var("SLURM_LAUNCH_NODE_IPADDR"))
            .unwrap_or_else(|| "127.0.0.1".into());
        let master_port: u16 = num("MASTER_PORT")?.unwrap_or(29500);
        // torchrun's own store already listens on MASTER_PORT; titan's goes one above it.
        let store_port = match num::<u16>("TITAN_STORE_PORT")? {
            Some(p) => p,
            None if var("TORCHELASTIC_RUN_ID").is_some() => master_port + 1,
            None => master_port,
        };
        Ok(Some(WorkerEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            store_port,
            store_hosted: var("TITAN_STORE_HOSTED").is_some(),
            generation: num("TITAN_GENERATION")?.unwrap_or(0),
        }))
    }
}
