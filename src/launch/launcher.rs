//! `titan train --nproc N`: starts N local worker processes (one rank each), hosts the rendezvous
//! store, prefixes each rank's output with its rank, and supervises them: when a rank fails every
//! other rank is stopped and the launcher exits non-zero naming the rank and its last error lines;
//! with `--max-restarts K` the whole group is restarted (workers resume from the latest complete
//! checkpoint), and with `--nnodes MIN:MAX` each restart takes the nodes present
//! (`rendezvous`). Workers die with the launcher (a parent-death signal), and SIGINT or SIGTERM to
//! the launcher stops them as a failure does.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::comm::auth::{JobSecret, SECRET_ENV, SECRET_FILE_ENV};
use crate::comm::conn::RUN_ID_ENV;
use crate::comm::store::{StoreClient, StoreServer};
use crate::launch::rendezvous::{Elastic, Membership};

#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc: usize,
    /// Nodes in the job: with `elastic`, the most it grows to.
    pub nnodes: usize,
    pub node_rank: usize,
    /// `--nnodes MIN:MAX`: the node range and the rendezvous wait (None: exactly `nnodes`).
    pub elastic: Option<Elastic>,
    pub master_addr: String,
    pub master_port: u16,
    pub max_restarts: usize,
    /// Arguments of the worker command (after the executable).
    pub worker_args: Vec<String>,
    /// Rank 0's standard output passes through without the `[rank 0]` prefix (a benchmark's
    /// JSON line, which a script parses).
    pub rank0_stdout_plain: bool,
    /// The job secret the store and every rank prove (`launch::secret::for_launcher`); handed to
    /// the workers in their environment, never on their command line.
    pub secret: JobSecret,
    /// How long the nodes' launchers wait for each other (`[comm] init_timeout_seconds`).
    pub init_timeout: Duration,
    /// `titan train --replan`: the layout of each generation's world size, as overrides appended
    /// to the workers' (node 0 asks, the other nodes read its answer from the store).
    pub replan: Option<Replan>,
}

/// The overrides that lay a job out over a world of ranks (`titan plan`'s best layout).
#[derive(Clone)]
pub struct Replan(pub Arc<dyn Fn(usize) -> Result<Vec<String>> + Send + Sync>);

impl std::fmt::Debug for Replan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Replan(titan plan)")
    }
}

impl LaunchOptions {
    /// `nproc` ranks on this host alone (any free store port), running `worker_args`; rank 0's
    /// standard output passes through unprefixed (a benchmark's one JSON line).
    pub fn local(nproc: usize, worker_args: Vec<String>) -> Self {
        LaunchOptions {
            nproc,
            nnodes: 1,
            node_rank: 0,
            elastic: None,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            max_restarts: 0,
            worker_args,
            rank0_stdout_plain: true,
            secret: JobSecret::generate(),
            init_timeout: Duration::from_secs(300),
            replan: None,
        }
    }
}

struct Worker {
    rank: usize,
    child: Child,
    last_err: Arc<Mutex<Vec<String>>>,
}

/// Copies a worker's output lines to the launcher's, prefixed with the rank, whatever bytes they
/// hold (invalid UTF-8 is shown replaced, never a reason to stop reading and leave the worker
/// blocked on a full pipe).
fn pump(
    stream: impl std::io::Read + Send + 'static,
    rank: usize,
    to_stderr: bool,
    plain: bool,
    keep: Option<Arc<Mutex<Vec<String>>>>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut bytes = Vec::new();
        loop {
            bytes.clear();
            match reader.read_until(b'\n', &mut bytes) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let line = String::from_utf8_lossy(&bytes);
            let line = line.trim_end_matches(['\n', '\r']).to_string();
            match (to_stderr, plain) {
                (true, _) => errln!("[rank {rank}] {line}"),
                (false, true) => outln!("{line}"),
                (false, false) => outln!("[rank {rank}] {line}"),
            }
            if let Some(k) = &keep {
                let mut k = k.lock().unwrap_or_else(|e| e.into_inner());
                k.push(line);
                if k.len() > 5 {
                    k.remove(0);
                }
            }
        }
    });
}

/// This launch's id (its workers' sockets folder is named by it): the launcher's pid and start
/// time, so two launches that share a job secret never share or remove each other's sockets.
fn spawn_run_id() -> String {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        format!("{:x}{:05x}", std::process::id(), nanos & 0xfffff)
    })
    .clone()
}

/// A worker of this launcher: dies with it (the parent-death signal, set in the child before
/// `exec`, and a check that the launcher did not die before that), output piped.
fn worker_command(exe: &std::path::Path) -> Command {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(exe);
    cmd.env(super::orphan::LAUNCHER_PID_ENV, launcher.to_string());
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// SIGINT or SIGTERM reached the launcher (set by signal-hook; the launcher then stops its
/// workers the same way a failure does, and exits). A second one, while the launcher is still
/// waiting (for other nodes, say), ends it at once.
fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, flag.clone())
            .context("cannot install the launcher's signal handler")?;
        signal_hook::flag::register(signal, flag.clone())
            .context("cannot install the launcher's signal handler")?;
    }
    Ok(flag)
}

pub fn launch(o: &LaunchOptions) -> Result<()> {
    if o.nproc == 0 || o.nnodes == 0 || o.node_rank >= o.nnodes {
        bail!(
            "--nproc {} --nnodes {} --node-rank {}: need nproc ≥ 1 and node-rank < nnodes",
            o.nproc,
            o.nnodes,
            o.node_rank
        );
    }
    let exe =
        std::env::current_exe().context("cannot find the titan executable to start workers")?;
    // Node 0 hosts the store; the others connect to it. Port 0 picks a free port (single node).
    let store = if o.node_rank == 0 {
        // Multi-node: the given address only, not every interface.
        Some(StoreServer::start(
            &format!("{}:{}", o.master_addr, o.master_port),
            &o.secret,
        )?)
    } else {
        None
    };
    let port = store.as_ref().map_or(o.master_port, |s| s.addr.port());
    if (o.nnodes > 1 || o.elastic.is_some()) && o.master_port == 0 {
        bail!("--master-port 0 (any free port) only works on a single node; give every node the same port");
    }
    let interrupted = interrupt_flag()?;
    let outcome = run_generations(o, &exe, port, &interrupted);
    // The job's Unix sockets folder (empty once every rank closed its sockets).
    let folder = crate::comm::conn::job_socket_path(&o.secret.job_id(), Some(&spawn_run_id()));
    let _ = std::fs::remove_dir_all(folder);
    outcome
}

/// Where the workers of one generation find the store and who they are.
struct Spawn<'a> {
    o: &'a LaunchOptions,
    exe: &'a std::path::Path,
    port: u16,
    world: usize,
    node_rank: usize,
    /// Overrides appended to the workers' for this generation (its planned layout).
    layout: Vec<String>,
}

/// Starts the workers, restarting them all up to `max_restarts` times after a failure (or, when
/// elastic, to regroup with a node that waits to join). With several nodes every node's launcher
/// starts each generation together: all of them (`agree_on_generation`), or those the elastic
/// rendezvous admits (`rendezvous::Elastic::join`).
fn run_generations(
    o: &LaunchOptions,
    exe: &std::path::Path,
    port: u16,
    interrupted: &AtomicBool,
) -> Result<()> {
    let nodes = match o.nnodes > 1 || o.elastic.is_some() {
        false => None,
        true => Some(StoreClient::connect(
            &format!("{}:{port}", o.master_addr),
            &o.secret,
            o.init_timeout,
        )?),
    };
    let mut generation = 0;
    let mut previous_world = None;
    // The generation this node first ran: its restarts count from there (an elastic node that
    // arrives mid-run joins the job's generation, whatever its number).
    let mut first: Option<usize> = None;
    let last = |first: Option<usize>| first.map_or(usize::MAX, |f| f + o.max_restarts);
    while generation <= last(first) {
        let m = match (&nodes, &o.elastic) {
            (Some(store), Some(elastic)) => {
                elastic.join(store, generation, o.node_rank == 0, last(first))?
            }
            (Some(store), None) => {
                agree_on_generation(store, generation, o)?;
                static_membership(o, generation)
            }
            (None, _) => static_membership(o, generation),
        };
        generation = m.generation;
        let first_generation = *first.get_or_insert(generation);
        let limit = first_generation + o.max_restarts;
        let world = o.nproc * m.nodes;
        if let Some(before) = previous_world.filter(|&w| w != world) {
            errln!("titan launcher: generation {generation}: the job goes from {before} to {world} ranks ({} node(s)); this node is node {}; the workers resume from the latest checkpoint", m.nodes, m.node_rank);
        }
        previous_world = Some(world);
        if interrupted.load(Ordering::SeqCst) {
            bail!("titan launcher: interrupted (SIGINT or SIGTERM) before generation {generation} started");
        }
        let layout = planned_layout(o, nodes.as_ref(), generation, world, m.node_rank)?;
        let spawn = Spawn {
            o,
            exe,
            port,
            world,
            node_rank: m.node_rank,
            layout,
        };
        let mut workers = start_workers(&spawn, generation)?;
        // With no restart left a waiting node is not worth stopping the job for.
        let waiting = || match (&nodes, &o.elastic) {
            (Some(store), Some(elastic)) if generation < limit => {
                elastic.someone_waits(store, generation, m.nodes)
            }
            _ => false,
        };
        let msg = match supervise(&mut workers, interrupted, &waiting) {
            Outcome::Done => return Ok(()),
            Outcome::Interrupted => {
                bail!("titan launcher: interrupted (SIGINT or SIGTERM); all {world} ranks stopped")
            }
            Outcome::Regroup => format!("a node waits to join the {world}-rank job: regrouping"),
            Outcome::Failed(failures) => {
                std::thread::sleep(Duration::from_millis(200)); // let the output pumps drain
                failure_message(&workers, &failures)
            }
        };
        if generation >= limit {
            bail!("{msg}");
        }
        errln!(
            "titan launcher: {msg}\ntitan launcher: restarting all {world} ranks (restart {} of {})",
            generation - first_generation + 1,
            o.max_restarts
        );
        generation += 1;
    }
    bail!(
        "titan launcher: no restart left (--max-restarts {})",
        o.max_restarts
    )
}

/// A fixed-size job's membership: every node, at its `--node-rank`.
fn static_membership(o: &LaunchOptions, generation: usize) -> Membership {
    Membership {
        generation,
        nodes: o.nnodes,
        node_rank: o.node_rank,
    }
}

/// Every node's launcher starts generation `g` together (a barrier on the job's store), so the
/// ranks of all nodes agree on which restart they are in: their groups' names carry it.
fn agree_on_generation(store: &StoreClient, g: usize, o: &LaunchOptions) -> Result<()> {
    store
        .barrier(&format!("launch/generation-{g}"), o.nnodes)
        .with_context(|| {
            format!(
                "node {}: not every node's launcher started generation {g} (restart {g} of {}); every node must run with the same --max-restarts, and a node whose launcher stopped ends the job (a job whose nodes may be restarted runs with --nnodes {n}:{n}, whose rendezvous lets a restarted node back in)",
                o.node_rank, o.max_restarts, n = o.nnodes
            )
        })
}

/// With `replan`, the layout of this generation's `world`: node 0 plans it and leaves it in the
/// store, where the other nodes read it, so every node's workers run the same layout.
fn planned_layout(
    o: &LaunchOptions,
    store: Option<&StoreClient>,
    generation: usize,
    world: usize,
    node_rank: usize,
) -> Result<Vec<String>> {
    let Some(Replan(plan)) = &o.replan else {
        return Ok(Vec::new());
    };
    let key = format!("launch/layout-g{generation}");
    let layout = match (store, node_rank) {
        (Some(store), r) if r > 0 => {
            let bytes = store.get_within(&key, o.init_timeout).with_context(|| {
                format!("node {r}: node 0 did not publish generation {generation}'s planned layout")
            })?;
            serde_json::from_slice::<Vec<String>>(&bytes).with_context(|| {
                format!(
                    "node {r}: generation {generation}'s planned layout is not a list of overrides"
                )
            })?
        }
        (store, _) => {
            let layout = plan(world)
                .with_context(|| format!("titan launcher: planning the layout of {world} ranks"))?;
            if let Some(store) = store {
                store.set(&key, &serde_json::to_vec(&layout)?)?;
            }
            layout
        }
    };
    errln!(
        "titan launcher: generation {generation}: {world} ranks laid out by titan plan: {}",
        layout.join(" ")
    );
    Ok(layout)
}

/// This node's workers of `generation`, their output pumped.
fn start_workers(sp: &Spawn, generation: usize) -> Result<Vec<Worker>> {
    let o = sp.o;
    let mut workers = Vec::new();
    for local in 0..o.nproc {
        let rank = sp.node_rank * o.nproc + local;
        let mut child = worker_command(sp.exe)
            .args(&o.worker_args)
            .args(&sp.layout)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", sp.world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", o.nproc.to_string())
            .env("MASTER_ADDR", &o.master_addr)
            .env("MASTER_PORT", sp.port.to_string())
            .env("TITAN_STORE_PORT", sp.port.to_string())
            .env("TITAN_STORE_HOSTED", "1")
            .env("TITAN_GENERATION", generation.to_string())
            .env(RUN_ID_ENV, spawn_run_id())
            .env(SECRET_ENV, o.secret.to_hex())
            .env_remove(SECRET_FILE_ENV)
            .spawn()
            .with_context(|| format!("cannot start rank {rank}"))?;
        let last_err = Arc::new(Mutex::new(Vec::new()));
        let plain = o.rank0_stdout_plain && rank == 0;
        pump(
            child.stdout.take().expect("piped"),
            rank,
            false,
            plain,
            None,
        );
        pump(
            child.stderr.take().expect("piped"),
            rank,
            true,
            false,
            Some(last_err.clone()),
        );
        workers.push(Worker {
            rank,
            child,
            last_err,
        });
    }
    Ok(workers)
}

/// Each failed rank with its exit status and last error lines.
fn failure_message(workers: &[Worker], failures: &[(usize, String)]) -> String {
    let last_lines = |rank: usize| {
        workers
            .iter()
            .find(|w| w.rank == rank)
            .map(|w| {
                w.last_err
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .join("\n")
            })
            .unwrap_or_default()
    };
    failures
        .iter()
        .map(|(rank, code)| {
            format!(
                "rank {rank} failed ({code}); last error output:\n{}",
                last_lines(*rank)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How long a rank may take to write its flight recorder dump after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops every worker still running: SIGTERM first (a rank with the flight recorder on writes its
/// dump and exits), SIGKILL for any still there after `STOP_GRACE`.
fn stop_all(workers: &mut [Worker]) {
    for w in workers.iter_mut() {
        if let Ok(None) = w.child.try_wait() {
            // SAFETY: kill(2) on the pid of a child this process has not reaped yet.
            unsafe { libc::kill(w.child.id() as libc::pid_t, libc::SIGTERM) };
        }
    }
    let deadline = std::time::Instant::now() + STOP_GRACE;
    while std::time::Instant::now() < deadline
        && workers
            .iter_mut()
            .any(|w| matches!(w.child.try_wait(), Ok(None)))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for w in workers.iter_mut() {
        let _ = w.child.kill();
        let _ = w.child.wait();
    }
}

/// How a generation of workers ended.
enum Outcome {
    Done,
    /// Every rank found failed in the pass that saw the first failure (rank, exit status).
    Failed(Vec<(usize, String)>),
    /// The launcher was told to stop (SIGINT, SIGTERM): its workers were stopped.
    Interrupted,
    /// A node waits to join (elastic): the workers were stopped to regroup with it.
    Regroup,
}

/// Waits for every worker; at the first failure stops the others and returns every rank found
/// failed in that pass, ranks killed by a signal first: the rank that died is named before the
/// ranks that failed because it did. A signal to the launcher stops them all.
fn supervise(
    workers: &mut [Worker],
    interrupted: &AtomicBool,
    waiting: &dyn Fn() -> bool,
) -> Outcome {
    let mut done = vec![false; workers.len()];
    let mut next_look = std::time::Instant::now();
    loop {
        if interrupted.load(Ordering::SeqCst) {
            stop_all(workers);
            return Outcome::Interrupted;
        }
        // A node waiting to join is looked for four times a second (a store round trip).
        if std::time::Instant::now() >= next_look {
            next_look += Duration::from_millis(250);
            if waiting() {
                stop_all(workers);
                return Outcome::Regroup;
            }
        }
        let mut failed = Vec::new();
        for (i, w) in workers.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            if let Ok(Some(status)) = w.child.try_wait() {
                done[i] = true;
                if !status.success() {
                    failed.push((status.code().is_some(), w.rank, status.to_string()));
                }
            }
        }
        if !failed.is_empty() {
            stop_all(workers);
            failed.sort();
            return Outcome::Failed(failed.into_iter().map(|(_, r, s)| (r, s)).collect());
        }
        if done.iter().all(|d| *d) {
            return Outcome::Done;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
