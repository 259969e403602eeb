//! Launch: the multi-process launcher and the worker's view of its environment.

pub mod checkpoint_exchange;
pub mod device_groups;
pub mod env;
pub mod groups;
pub mod launcher;
pub mod orphan;
pub mod rendezvous;
pub mod secret;

use std::time::Duration;

use anyhow::{bail, Result};

use crate::comm::auth::JobSecret;
use crate::comm::flight_recorder;
use crate::comm::group::{ProcessGroup, TcpGroup};
use crate::comm::mesh::DeviceMesh;
use crate::comm::store::{StoreClient, StoreServer};
use crate::config::Config;

/// The longest a rank waits for rank 0 to finish a checkpoint save (`Distributed::checkpoint_saved`).
const SAVE_WAIT: Duration = Duration::from_secs(1800);

/// A worker's place in a multi-process job and its groups.
pub struct Distributed {
    pub rank: usize,
    pub world: usize,
    pub mesh: DeviceMesh,
    /// Every group of this rank, joined once (`groups::GroupJoiner`), each with its store name.
    pub groups: groups::RankGroups,
    /// Ranks on this node (the launcher's processes per node).
    pub local_world_size: usize,
    /// The rendezvous store, for groups formed later (NCCL's unique id).
    store: StoreClient,
    /// The timeouts of `[comm]` (init, each collective).
    timeouts: (Duration, Duration),
    /// Restart generation: store keys of this run never meet a previous run's.
    generation: u64,
    /// Keeps a store hosted by this rank alive.
    _store: Option<StoreServer>,
}

impl Distributed {
    /// `None` when this process is not part of a multi-process job (or is alone in it).
    pub fn from_env(cfg: &Config) -> Result<Option<Distributed>> {
        let Some(env) = env::WorkerEnv::detect()? else {
            return Ok(None);
        };
        if env.world_size == 1 {
            return Ok(None);
        }
        let mesh = check_mesh(cfg, env.world_size)?;
        let (init, op) = (
            Duration::from_secs(cfg.comm.init_timeout_seconds),
            Duration::from_secs(cfg.comm.train_timeout_seconds),
        );
        let secret = secret::for_worker(env.rank, cfg.comm.insecure_no_auth)?;
        let (store, store_server, host) = rendezvous(&env, &secret, init)?;
        let gen = env.generation;
        start_flight_recorder(cfg, &env, &store, init)?;
        orphan::end_on_terminate()?;
        let transport = groups::TcpGroups {
            store: &store,
            host: &host,
            init,
            op,
        };
        let joiner = groups::GroupJoiner {
            maker: &transport,
            mesh: &mesh,
            rank: env.rank,
            world: env.world_size,
            generation: gen,
        };
        let groups = joiner.join_all(cfg.parallelism.expert_parallel_degree)?;
        Ok(Some(Distributed {
            rank: env.rank,
            world: env.world_size,
            mesh,
            groups,
            local_world_size: env.local_world_size,
            store,
            timeouts: (init, op),
            generation: gen,
            _store: store_server,
        }))
    }

    /// How long rank 0, serving the store itself, waits at its end for the other ranks to be
    /// done with it (`Drop`).
    const GOODBYE_WAIT: Duration = Duration::from_secs(10);

    /// After a checkpoint save, before the next collective: rank 0 finishes a save last (it
    /// renames the folder once every writer has reported, or writes the whole checkpoint alone),
    /// so it says so through the store and every other rank waits for that. A rank that writes
    /// little or nothing (HSDP's other replicas, DDP's other ranks) would otherwise wait for the
    /// writers inside its next collective, which gives up after `train_timeout_seconds`; here it
    /// waits up to `SAVE_WAIT` (a rank that dies meanwhile is caught by the launcher at once).
    ///
    /// Rank 0 publishes how its save ended (`outcome`: a failure of its own or one a writer
    /// reported to it), and every rank returns that: all ranks agree whether the save failed,
    /// so under `[checkpoint] on_save_failure = "warn"` they all go on together.
    pub fn checkpoint_saved(&self, step: u64, outcome: Result<(), String>) -> Result<()> {
        let key = format!("checkpoint-saved/g{}/step-{step}", self.generation);
        if self.rank == 0 {
            let value = match &outcome {
                Ok(()) => b"1".to_vec(),
                Err(e) => format!("failed:{e}").into_bytes(),
            };
            self.store.set(&key, &value)?;
            return outcome.map_err(|e| anyhow::anyhow!("{e}"));
        }
        let wait = SAVE_WAIT.max(self.timeouts.0);
        let value = self.store.get_within(&key, wait).map_err(|_| {
            anyhow::anyhow!(
                "rank {}: rank 0 did not finish saving the step-{step} checkpoint within {wait:.0?}",
                self.rank
            )
        })?;
        match value.strip_prefix(b"failed:") {
            None => Ok(()),
            Some(why) => Err(anyhow::anyhow!(
                "rank 0 could not save the step-{step} checkpoint: {}",
                String::from_utf8_lossy(why)
            )),
        }
    }

    /// The file exchange of this rank's writers group's sharded checkpoint saves, on a store
    /// connection of its own (a background save waits on it); None when checkpoints are written
    /// whole.
    pub fn file_exchange(&self) -> Result<Option<checkpoint_exchange::StoreFileExchange>> {
        let Some(name) = self.groups.writers_name.as_ref() else {
            return Ok(None);
        };
        Ok(Some(checkpoint_exchange::StoreFileExchange {
            store: self.store.reconnect()?,
            prefix: format!("checkpoint-files/g{}/{name}", self.generation),
            wait: SAVE_WAIT.max(self.timeouts.0),
        }))
    }

    /// An NCCL communicator over the ranks of `group` (named `name` in the store), on `be`'s GPU
    /// (every rank of the group calls this together; the unique id travels through the store).
    pub fn nccl_over(
        &self,
        group: &dyn ProcessGroup,
        name: &str,
        be: &crate::backend::cuda::CudaBackend,
    ) -> Result<crate::comm::nccl::NcclGroup> {
        crate::comm::nccl::NcclGroup::connect(
            &self.store,
            &format!("{name}-nccl"),
            group.rank(),
            group.size(),
            be,
            self.timeouts.0,
            self.timeouts.1,
        )
    }

    /// The NCCL point-to-point channels of this rank's pipeline `group` (`comm::nccl::peers`).
    pub fn nccl_peers_over(
        &self,
        group: &dyn ProcessGroup,
        name: &str,
        be: &crate::backend::cuda::CudaBackend,
    ) -> Result<crate::comm::nccl::NcclPeers> {
        let who = (&format!("{name}-nccl") as &str, group.rank(), group.size());
        crate::comm::nccl::NcclPeers::connect(&self.store, who, be, self.timeouts)
    }
}

/// Turns the flight recorder on (`[comm] trace_buf_size > 0`): the ranks agree on a run id through
/// the store (so the analyzer can tell dumps of different runs apart); SIGTERM from the launcher
/// makes this rank write its dump before it exits (`orphan::end_on_terminate`).
fn start_flight_recorder(
    cfg: &Config,
    env: &env::WorkerEnv,
    store: &StoreClient,
    init: Duration,
) -> Result<()> {
    if cfg.comm.trace_buf_size == 0 {
        return Ok(());
    }
    let key = format!("flight-recorder/run/g{}", env.generation);
    if env.rank == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let run = format!("{:x}-{nanos:x}-g{}", std::process::id(), env.generation);
        store.set(&key, run.as_bytes())?;
    }
    let run = store.get_within(&key, init).map_err(|_| {
        anyhow::anyhow!(
            "rank {}: rank 0 did not publish the run id within {init:.0?}",
            env.rank
        )
    })?;
    let dir = std::path::Path::new(&cfg.job.dump_folder).join(&cfg.comm.save_traces_folder);
    flight_recorder::configure(
        env.rank,
        env.world_size,
        &String::from_utf8_lossy(&run),
        cfg.comm.trace_buf_size,
        &dir,
    )
}

/// Ranks started without titan's launcher (torchrun, SLURM) meet at a store that rank 0 serves
/// and that ends with rank 0's process: without this, rank 0 could exit while another rank still
/// reads the run's last keys (the final checkpoint's outcome), which then fails as if rank 0 had
/// never finished saving. Every other rank says goodbye through the store; rank 0 waits a bounded
/// while for all of them (a rank that died is not waited for long).
impl Drop for Distributed {
    fn drop(&mut self) {
        let key = |r: usize| format!("goodbye/g{}/rank{r}", self.generation);
        if self.rank != 0 {
            let _ = self.store.set(&key(self.rank), b"1");
            return;
        }
        if self._store.is_none() {
            return;
        }
        let deadline = std::time::Instant::now() + Self::GOODBYE_WAIT;
        for r in 1..self.world {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || self.store.get_within(&key(r), left).is_err() {
                break;
            }
        }
    }
}

/// The device mesh `[parallelism]` asks for over `world` ranks (its degrees must multiply to it).
pub fn check_mesh(cfg: &Config, world: usize) -> Result<DeviceMesh> {
    let p = &cfg.parallelism;
    let mesh = DeviceMesh::new(
        p.pipeline_parallel_degree,
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        world,
    )?;
    let (ep, shard) = (
        p.expert_parallel_degree,
        mesh.degree("dp_shard") * mesh.degree("cp"),
    );
    if ep > 1 && !shard.is_multiple_of(ep) {
        bail!("[parallelism] expert_parallel_degree = {ep} must divide data_parallel_shard_degree {} × context_parallel_degree {} = {shard}: expert parallelism borrows its ranks from them", mesh.degree("dp_shard"), mesh.degree("cp"));
    }
    Ok(mesh)
}

/// Joins (and on rank 0, when no launcher hosts it, serves) the rendezvous store; returns the
/// client, the server if this rank hosts it, and the address peers reach this rank at.
pub fn rendezvous(
    env: &env::WorkerEnv,
    secret: &JobSecret,
    init: Duration,
) -> Result<(StoreClient, Option<StoreServer>, String)> {
    let addr = format!("{}:{}", env.master_addr, env.store_port);
    let store_server = if env.rank == 0 && !env.store_hosted {
        Some(StoreServer::start(&addr, secret)?)
    } else {
        None
    };
    let store = StoreClient::connect(&addr, secret, init)?;
    let host = match std::env::var("TITAN_HOST") {
        Ok(h) if !h.is_empty() => h,
        _ if env.world_size == env.local_world_size => "127.0.0.1".to_string(),
        _ => bail!("rank {}: a multi-node job needs TITAN_HOST set to this node's address (peers connect to it)", env.rank),
    };
    Ok((store, store_server, host))
}

/// The group of all ranks, named `name` (benchmarks).
pub fn world_group(
    env: &env::WorkerEnv,
    name: &str,
    init: Duration,
    op: Duration,
) -> Result<(TcpGroup, Option<StoreServer>)> {
    let secret = secret::for_worker(env.rank, false)?;
    let (store, server, host) = rendezvous(env, &secret, init)?;
    let group = TcpGroup::connect(
        &store,
        &format!("{name}-g{}", env.generation),
        env.rank,
        env.world_size,
        &host,
        init,
        op,
    )?;
    Ok((group, server))
}
