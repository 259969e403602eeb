//! Replica-group fault tolerance's quorum (torchft's lighthouse): which replica groups take part in
//! the next step. The lighthouse is a rendezvous store (`store.rs`, authenticated with the secret
//! every replica group shares) with a coordinator thread; each replica's ranks join numbered
//! rounds through it, and the coordinator closes each round with the replicas whose ranks have all
//! joined.
//!
//! A round closes once at least `min_replicas` replicas are complete and either every member of
//! the previous quorum is among them or `join_timeout` has passed since the minimum was reached:
//! a replica that stopped joining (dead, or hung past the timeout) is left out, and one that
//! arrives (restarted) is let in. The quorum's id changes exactly when its members do, so a replica
//! rebuilds its cross-replica groups only then. A rank that joined a round too late (it closed
//! without its replica) joins the next one.
//!
//! Keys (in the lighthouse's store): `ft/round` the open round; `ft/r{R}/n` the joins counted, each
//! join `ft/r{R}/j{I}` = `replica,rank,world,step`; `ft/r{R}/quorum` = `id;replica:step,…` once
//! closed. Every value read back is parsed with an error, never trusted. The keys of rounds more
//! than `ROUNDS_KEPT` behind the open one are dropped, so the store's memory stays bounded
//! however long the job runs (a rank that far behind has long timed out waiting).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::auth::JobSecret;
use super::store::{StoreClient, StoreServer};

/// How the lighthouse forms quorums.
#[derive(Debug, Clone, Copy)]
pub struct LighthouseOptions {
    /// Replicas a quorum needs at least.
    pub min_replicas: usize,
    /// How long a round waits, once it has the minimum, for the previous quorum's members.
    pub join_timeout: Duration,
}

/// Closed rounds whose keys the lighthouse keeps: a rank reads its round's quorum at most a
/// round or two after it closed (every live replica must have joined the next one first).
pub const ROUNDS_KEPT: u64 = 8;

/// A running lighthouse (its threads run until the process exits).
pub struct Lighthouse {
    pub addr: SocketAddr,
    store: Arc<StoreServer>,
}

impl Lighthouse {
    /// Serves the quorum on `bind` (port 0: any free one) for clients holding `secret`.
    pub fn start(bind: &str, secret: &JobSecret, options: LighthouseOptions) -> Result<Self> {
        if options.min_replicas == 0 {
            bail!("the lighthouse needs --min-replicas of at least 1");
        }
        let store = Arc::new(StoreServer::start(bind, secret)?);
        let addr = store.addr;
        let client = StoreClient::connect(&addr.to_string(), secret, Duration::from_secs(10))?;
        client.set("ft/round", b"0")?;
        let server = store.clone();
        std::thread::Builder::new()
            .name("lighthouse".into())
            .spawn(move || {
                if let Err(e) = coordinate(&client, &server, options) {
                    errln!("lighthouse: the coordinator stopped: {e:#}");
                }
            })?;
        Ok(Lighthouse { addr, store })
    }

    /// Keys in the lighthouse's store (bounded: `ROUNDS_KEPT`).
    pub fn keys(&self) -> usize {
        self.store.len()
    }
}

/// Drops the keys of rounds more than `ROUNDS_KEPT` before `round`.
fn drop_old_rounds(server: &StoreServer, round: u64) {
    let Some(oldest) = round.checked_sub(ROUNDS_KEPT) else {
        return;
    };
    // Keys reach the server prefixed with the job's id: `{job}/ft/r{R}/…`.
    server.retain(|key| {
        let r = key
            .split_once("/ft/r")
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|r| r.parse::<u64>().ok());
        r.is_none_or(|r| r >= oldest)
    });
}

/// One replica in a quorum: its id and the last step it committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub replica_id: usize,
    pub step: u64,
}

/// The replicas of one round, in replica-id order, and the quorum's id (it changes when the
/// members do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quorum {
    pub id: u64,
    pub members: Vec<Member>,
}

impl Quorum {
    /// This replica's place among the members.
    pub fn index_of(&self, replica_id: usize) -> Option<usize> {
        self.members.iter().position(|m| m.replica_id == replica_id)
    }

    /// The most advanced step of any member.
    pub fn max_step(&self) -> u64 {
        self.members.iter().map(|m| m.step).max().unwrap_or(0)
    }

    /// The member up-to-date members are copied from: the first at the most advanced step.
    pub fn source(&self) -> usize {
        let max = self.max_step();
        self.members.iter().position(|m| m.step == max).unwrap_or(0)
    }

    fn encode(&self) -> String {
        let members: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}:{}", m.replica_id, m.step))
            .collect();
        format!("{};{}", self.id, members.join(","))
    }

    fn decode(text: &str) -> Result<Self> {
        let bad = || anyhow!("lighthouse: malformed quorum `{text}`");
        let (id, rest) = text.split_once(';').ok_or_else(bad)?;
        let members = rest
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|m| {
                let (r, s) = m.split_once(':').ok_or_else(bad)?;
                Ok(Member {
                    replica_id: r.parse().map_err(|_| bad())?,
                    step: s.parse().map_err(|_| bad())?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Quorum {
            id: id.parse().map_err(|_| bad())?,
            members,
        })
    }
}

/// One rank's view of a join: `replica,rank,world,step`.
#[derive(Debug, Clone, Copy)]
struct Join {
    replica: usize,
    rank: usize,
    world: usize,
    step: u64,
}

fn parse_join(text: &str) -> Result<Join> {
    let f: Vec<&str> = text.split(',').collect();
    let num = |i: usize| -> Result<u64> {
        f.get(i)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("lighthouse: malformed join `{text}`"))
    };
    let (replica, rank, world, step) = (num(0)?, num(1)?, num(2)?, num(3)?);
    if rank >= world || world > 1 << 20 || replica > 1 << 20 {
        bail!("lighthouse: join `{text}` is out of range");
    }
    Ok(Join {
        replica: replica as usize,
        rank: rank as usize,
        world: world as usize,
        step,
    })
}

/// The coordinator's loop: one round after another, each closed as the module doc says.
fn coordinate(store: &StoreClient, server: &StoreServer, options: LighthouseOptions) -> Result<()> {
    let (mut previous, mut id): (Vec<usize>, u64) = (Vec::new(), 0);
    for round in 0u64.. {
        store.set("ft/round", round.to_string().as_bytes())?;
        drop_old_rounds(server, round);
        let members = close_round(store, round, &previous, options)?;
        let replicas: Vec<usize> = members.iter().map(|m| m.replica_id).collect();
        if replicas != previous {
            id += 1;
            // The log is best effort: a closed stdout must not stop the coordinator.
            let _ = writeln!(
                std::io::stdout(),
                "lighthouse: quorum {id} at round {round}: replicas {replicas:?} (was {previous:?})"
            );
        }
        let quorum = Quorum { id, members };
        store.set(&format!("ft/r{round}/quorum"), quorum.encode().as_bytes())?;
        previous = replicas;
    }
    Ok(())
}

/// Waits for round `round`'s joins until it can close; its members.
fn close_round(
    store: &StoreClient,
    round: u64,
    previous: &[usize],
    options: LighthouseOptions,
) -> Result<Vec<Member>> {
    let (mut joins, mut read): (Vec<Join>, usize) = (Vec::new(), 0);
    let mut minimum_since: Option<Instant> = None;
    loop {
        let n = store.add(&format!("ft/r{round}/n"), 0)?.max(0) as usize;
        for i in read..n {
            // A rank that died between counting itself and writing its join, or wrote garbage,
            // is left out (its replica is then incomplete), never the coordinator's end.
            let key = format!("ft/r{round}/j{i}");
            match store
                .get_within(&key, Duration::from_secs(2))
                .map(|v| parse_join(&String::from_utf8_lossy(&v)))
            {
                Ok(Ok(join)) => joins.push(join),
                Ok(Err(e)) => errln!("lighthouse: round {round}: {e:#}; ignored"),
                Err(_) => errln!(
                    "lighthouse: round {round}: join {i} was counted but never written; ignored"
                ),
            }
        }
        read = n;
        let complete = complete_replicas(&joins);
        if complete.len() >= options.min_replicas {
            let since = *minimum_since.get_or_insert_with(Instant::now);
            let all_back = previous.iter().all(|r| complete.contains_key(r));
            if all_back || since.elapsed() >= options.join_timeout {
                return Ok(complete
                    .into_iter()
                    .map(|(replica_id, step)| Member { replica_id, step })
                    .collect());
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The replicas all of whose ranks joined, with their step (the lowest any rank reported).
fn complete_replicas(joins: &[Join]) -> BTreeMap<usize, u64> {
    let mut ranks: BTreeMap<usize, (usize, Vec<bool>, u64)> = BTreeMap::new();
    for j in joins {
        let e = ranks
            .entry(j.replica)
            .or_insert_with(|| (j.world, vec![false; j.world], j.step));
        if e.0 == j.world {
            e.1[j.rank] = true;
            e.2 = e.2.min(j.step);
        }
    }
    ranks
        .into_iter()
        .filter(|(_, (_, seen, _))| seen.iter().all(|&s| s))
        .map(|(r, (_, _, step))| (r, step))
        .collect()
}

/// One rank's client of the lighthouse.
pub struct QuorumClient {
    store: StoreClient,
    replica_id: usize,
    rank: usize,
    world: usize,
    next_round: Option<u64>,
    timeout: Duration,
}

impl QuorumClient {
    /// Connects to the lighthouse at `addr` as rank `rank` of `world` of replica `replica_id`;
    /// `timeout` bounds the connection and each wait for a quorum (`quorum_timeout_seconds`).
    pub fn connect(
        addr: &str,
        secret: &JobSecret,
        (replica_id, rank, world): (usize, usize, usize),
        timeout: Duration,
    ) -> Result<Self> {
        let store = StoreClient::connect(addr, secret, timeout)
            .with_context(|| format!("[fault_tolerance] lighthouse {addr}"))?;
        Ok(QuorumClient {
            store,
            replica_id,
            rank,
            world,
            next_round: None,
            timeout,
        })
    }

    /// The round of the last quorum `join` returned.
    pub fn round(&self) -> u64 {
        self.next_round.map_or(0, |r| r.saturating_sub(1))
    }

    /// The lighthouse's store (the cross-replica groups meet through it).
    pub fn store(&self) -> &StoreClient {
        &self.store
    }

    /// Joins the next round having committed `step`, and returns the first quorum this replica is
    /// in.
    pub fn join(&mut self, step: u64) -> Result<Quorum> {
        loop {
            // The rounds before the open one are closed, and none of them can take this rank in:
            // a replica that fell behind (stalled, or rejoining) goes straight to the open one,
            // whose keys are there (older rounds' are dropped, `ROUNDS_KEPT`).
            let v = self.store.get_within("ft/round", self.timeout)?;
            let open: u64 = String::from_utf8_lossy(&v)
                .parse()
                .map_err(|_| anyhow!("lighthouse: malformed round number"))?;
            let round = self.next_round.map_or(open, |r| r.max(open));
            let slot = self.store.add(&format!("ft/r{round}/n"), 1)? - 1;
            let me = format!("{},{},{},{step}", self.replica_id, self.rank, self.world);
            self.store
                .set(&format!("ft/r{round}/j{slot}"), me.as_bytes())?;
            let v = self
                .store
                .get_within(&format!("ft/r{round}/quorum"), self.timeout)
                .with_context(|| format!("[fault_tolerance] no quorum formed within {:.0?} (quorum_timeout_seconds): are enough replica groups (the lighthouse's --min-replicas) and the lighthouse up?", self.timeout))?;
            let quorum = Quorum::decode(&String::from_utf8_lossy(&v))?;
            self.next_round = Some(round + 1);
            if quorum.index_of(self.replica_id).is_some() {
                return Ok(quorum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_round_trips_and_names_its_source() {
        let q = Quorum {
            id: 3,
            members: vec![
                Member {
                    replica_id: 0,
                    step: 4,
                },
                Member {
                    replica_id: 2,
                    step: 7,
                },
            ],
        };
        assert_eq!(Quorum::decode(&q.encode()).unwrap(), q);
        assert_eq!((q.max_step(), q.source(), q.index_of(2)), (7, 1, Some(1)));
        assert!(Quorum::decode("x;1:2").is_err());
        assert!(parse_join("0,2,2,5").is_err(), "rank beyond the world");
    }

    #[test]
    fn only_replicas_whose_every_rank_joined_are_complete() {
        let j = |replica, rank, step| Join {
            replica,
            rank,
            world: 2,
            step,
        };
        let joins = [j(0, 0, 5), j(1, 1, 3), j(0, 1, 5)];
        let complete = complete_replicas(&joins);
        assert_eq!(complete.into_iter().collect::<Vec<_>>(), vec![(0, 5)]);
    }

    #[test]
    fn garbage_and_joins_never_written_do_not_stop_the_lighthouse() {
        let secret = JobSecret::generate();
        let options = LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_millis(100),
        };
        let lh = Lighthouse::start("127.0.0.1:0", &secret, options).unwrap();
        let addr = lh.addr.to_string();
        let t = Duration::from_secs(10);
        // Round 0: one join counted and never written, one garbage, then a real one.
        let raw = StoreClient::connect(&addr, &secret, t).unwrap();
        raw.add("ft/r0/n", 1).unwrap();
        let slot = raw.add("ft/r0/n", 1).unwrap() - 1;
        raw.set(&format!("ft/r0/j{slot}"), b"9,9,1,x").unwrap();
        let mut a = QuorumClient::connect(&addr, &secret, (0, 0, 1), t).unwrap();
        let q = a.join(3).unwrap();
        assert_eq!(
            q.members,
            vec![Member {
                replica_id: 0,
                step: 3
            }]
        );
        // The coordinator goes on: the next round forms too.
        assert_eq!(a.join(4).unwrap().max_step(), 4);
    }

    #[test]
    fn the_lighthouse_keeps_the_recent_rounds_only() {
        let secret = JobSecret::generate();
        let options = LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_millis(200),
        };
        let lh = Lighthouse::start("127.0.0.1:0", &secret, options).unwrap();
        let t = Duration::from_secs(10);
        let mut a = QuorumClient::connect(&lh.addr.to_string(), &secret, (0, 0, 1), t).unwrap();
        let mut most = 0;
        for step in 0..100 {
            a.join(step).unwrap();
            most = most.max(lh.keys());
        }
        // Each round: its count, one join and its quorum, plus `ft/round`.
        let bound = (ROUNDS_KEPT as usize + 2) * 3 + 1;
        assert!(
            most <= bound,
            "{most} keys after 100 rounds (bound {bound})"
        );
        assert!(a.round() >= 99);
    }

    #[test]
    fn two_replicas_meet_and_a_missing_one_is_left_out_after_the_timeout() {
        let secret = JobSecret::generate();
        let options = LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_millis(200),
        };
        let lh = Lighthouse::start("127.0.0.1:0", &secret, options).unwrap();
        let addr = lh.addr.to_string();
        let t = Duration::from_secs(10);
        let mut a = QuorumClient::connect(&addr, &secret, (0, 0, 1), t).unwrap();
        let q1 = a.join(0).unwrap();
        assert_eq!(q1.members.len(), 1);
        let addr2 = addr.clone();
        let secret2 = secret.clone();
        let b = std::thread::spawn(move || {
            let mut b = QuorumClient::connect(&addr2, &secret2, (1, 0, 1), t).unwrap();
            b.join(0).unwrap()
        });
        // Replica 1 arrives: some round has both.
        let mut q = a.join(1).unwrap();
        while q.members.len() < 2 {
            q = a.join(1).unwrap();
        }
        let qb = b.join().unwrap();
        assert_eq!(q.members.len(), 2);
        assert_eq!(qb.max_step(), 1);
        assert_ne!(q.id, q1.id);
        // Replica 1 stops joining: after the timeout replica 0 goes on alone.
        let started = Instant::now();
        let alone = a.join(2).unwrap();
        assert_eq!(alone.members.len(), 1);
        assert!(started.elapsed() >= Duration::from_millis(150));
    }
}
