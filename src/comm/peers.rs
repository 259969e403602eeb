//! Connecting a group's ranks pairwise, each link authenticated: a rank publishes its listening
//! address in the store, connects to every lower rank and accepts every higher one, and both ends
//! of every link prove the job secret for this group (`auth.rs`; the connecting rank's number is
//! bound into its proof). Whatever else reaches the listening socket (a port scanner, a silent
//! connection, a process of another job) is dropped after at most `HANDSHAKE_TIMEOUT` on its own
//! thread while accepting goes on: it can neither join the group nor fail it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::auth::{client_handshake, server_handshake, JobSecret};
use super::conn::{Conn, Listener};
use super::store::{StoreClient, HANDSHAKE_TIMEOUT};

/// Where and how a rank joins a group.
pub struct PeerSetup<'a> {
    pub store: &'a StoreClient,
    pub name: &'a str,
    pub rank: usize,
    pub size: usize,
    /// This rank's address peers connect to (loopback: a Unix socket).
    pub host: &'a str,
    pub init_timeout: Duration,
}

/// The handshake's channel for group `name` (its generation is part of the name).
fn channel(name: &str) -> String {
    format!("group/{name}")
}

/// A connection to every other rank of the group (None at this rank's own index), and whether
/// this rank listened on a Unix socket (every rank on this host).
pub fn connect_peers(p: &PeerSetup) -> Result<(Vec<Option<Conn>>, bool)> {
    let (name, rank, size) = (p.name, p.rank, p.size);
    let job_id = p.store.secret().job_id();
    let (listener, my_addr) = Listener::bind(p.host, &job_id, name, rank)
        .with_context(|| format!("group `{name}` rank {rank}: cannot listen on {}", p.host))?;
    p.store
        .set(&format!("group/{name}/addr/{rank}"), my_addr.as_bytes())?;
    let deadline = Instant::now() + p.init_timeout;
    let mut peers: Vec<Option<Conn>> = (0..size).map(|_| None).collect();
    for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
        *slot = Some(connect_down(p, peer, deadline)?);
    }
    accept_up(p, &listener, &mut peers, deadline)?;
    Ok((peers, my_addr.starts_with("unix:")))
}

/// The link to lower rank `peer`: its published address, connected and authenticated.
fn connect_down(p: &PeerSetup, peer: usize, deadline: Instant) -> Result<Conn> {
    let (name, rank) = (p.name, p.rank);
    let left = deadline.saturating_duration_since(Instant::now());
    let addr = p
        .store
        .get_within(&format!("group/{name}/addr/{peer}"), left)
        .map_err(|_| {
            anyhow!(
                "group `{name}` rank {rank}: rank {peer} never arrived within {:.0?}",
                p.init_timeout
            )
        })?;
    let addr = String::from_utf8_lossy(&addr).into_owned();
    let mut s = Conn::connect(&addr).with_context(|| {
        format!("group `{name}` rank {rank}: cannot connect to rank {peer} at {addr}")
    })?;
    // The peer (whose address came from the authenticated store) may be busy with other
    // handshakes: wait for it up to the group's deadline, not just one handshake's time.
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(HANDSHAKE_TIMEOUT);
    s.set_timeouts(wait, wait)?;
    s.check_same_user()
        .with_context(|| format!("group `{name}` rank {rank}: rank {peer} at {addr}"))?;
    let by = Instant::now() + wait;
    client_handshake(&mut s, p.store.secret(), &channel(name), rank as u64, by).with_context(
        || {
            format!(
            "group `{name}` rank {rank}: the link to rank {peer} at {addr} failed its handshake"
        )
        },
    )?;
    Ok(s)
}

/// Accepts the higher ranks until each has a link or the deadline passes. Each connection proves
/// the secret on its own thread; one that fails, stalls or claims a rank it cannot be is dropped.
fn accept_up(
    p: &PeerSetup,
    listener: &Listener,
    peers: &mut [Option<Conn>],
    deadline: Instant,
) -> Result<()> {
    let (name, rank, size) = (p.name, p.rank, p.size);
    let (done, proven) = mpsc::channel::<(usize, Conn)>();
    let pending = Arc::new(AtomicUsize::new(0));
    let mut missing = size - 1 - rank;
    while missing > 0 {
        while let Ok((peer, conn)) = proven.try_recv() {
            if peer > rank && peer < size && peers[peer].is_none() {
                peers[peer] = Some(conn);
                missing -= 1;
            }
        }
        if missing == 0 {
            break;
        }
        // Checked on every pass: a flood of connections must not keep the deadline from coming.
        if Instant::now() >= deadline {
            let absent: Vec<usize> = (rank + 1..size).filter(|&r| peers[r].is_none()).collect();
            bail!(
                "group `{name}` rank {rank}: ranks {absent:?} never connected within {:.0?}",
                p.init_timeout
            );
        }
        // At most MAX_PENDING handshakes at once (a flood cannot start a thread each); later
        // connections wait in the listen backlog until one ends, within HANDSHAKE_TIMEOUT.
        if pending.load(Ordering::SeqCst) >= MAX_PENDING {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        match listener.accept() {
            Ok(conn) => {
                let auth = Handshake {
                    secret: p.store.secret().clone(),
                    channel: channel(name),
                    done: done.clone(),
                    pending: pending.clone(),
                };
                auth.run_in_background(conn);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            // A connection reset before it was accepted, or out of descriptors: go on.
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    Ok(())
}

/// Handshakes running at once while a group forms; later connections wait in the listen backlog.
const MAX_PENDING: usize = 64;

/// The server side of one accepted connection's handshake.
struct Handshake {
    secret: JobSecret,
    channel: String,
    done: mpsc::Sender<(usize, Conn)>,
    pending: Arc<AtomicUsize>,
}

impl Handshake {
    /// Runs on its own thread and hands a proven link over; counted in `pending` meanwhile.
    fn run_in_background(self, mut conn: Conn) {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let pending = self.pending.clone();
        let spawned = std::thread::Builder::new()
            .name("titan-peer-auth".into())
            .spawn(move || {
                let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
                let ready = conn.set_timeouts(HANDSHAKE_TIMEOUT, HANDSHAKE_TIMEOUT);
                if ready.and_then(|_| conn.check_same_user()).is_ok() {
                    let proven = server_handshake(&mut conn, &self.secret, &self.channel, deadline);
                    if let Ok(peer) = proven {
                        let _ = self.done.send((peer as usize, conn));
                    }
                }
                self.pending.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            pending.fetch_sub(1, Ordering::SeqCst);
        }
    }
}
