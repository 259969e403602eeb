//! Collectives of the TCP process group with real sockets (one thread per rank here; the launcher
//! will run them as processes): results against a direct computation, uneven sizes, and failures
//! that end in errors naming the peer instead of hangs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use titan::comm::auth::JobSecret;
use titan::comm::group::{ProcessGroup, ReduceOp, TcpGroup};
use titan::comm::store::{StoreClient, StoreServer};

fn run_ranks<T: Send + 'static>(
    world: usize,
    op_timeout: Duration,
    f: impl Fn(TcpGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    run_ranks_on("127.0.0.1", world, op_timeout, f)
}

/// The job secret of every store and rank these tests start: a fixed one, so their Unix sockets
/// share one private folder from run to run instead of leaving a new one each time.
fn job_secret() -> JobSecret {
    JobSecret::from_hex(&"c0".repeat(32), "test secret").unwrap()
}

/// `127.0.0.1` selects Unix sockets; any other address (here 127.0.0.2, still loopback) TCP.
fn run_ranks_on<T: Send + 'static>(
    host: &'static str,
    world: usize,
    op_timeout: Duration,
    f: impl Fn(TcpGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let server = StoreServer::start("127.0.0.1:0", &job_secret()).unwrap();
    let addr = server.addr.to_string();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (addr, f) = (addr.clone(), f.clone());
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect(&addr, &job_secret(), Duration::from_secs(10)).unwrap();
                let g = TcpGroup::connect(
                    &store,
                    "test",
                    rank,
                    world,
                    host,
                    Duration::from_secs(10),
                    op_timeout,
                )
                .unwrap();
                f(g)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn data(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7) % 23) as f32 - 11.0)
        .collect()
}

#[test]
fn collectives_match_direct_computation_with_cross_memory_reads() {
    check_collectives(true);
}

#[test]
fn collectives_match_direct_computation_over_sockets() {
    check_collectives(false);
}

/// Every collective against a direct computation, for 1 to 4 ranks on Unix sockets, with the
/// direct-read path (used whenever this machine allows it) or forced onto the sockets.
fn check_collectives(direct_reads: bool) {
    let readable = titan::comm::cma::can_read(
        std::process::id() as i32,
        titan::comm::cma::probe_address(),
        titan::comm::cma::probe_value(),
    );
    for world in [1, 2, 3, 4] {
        let len = 100_000 + world; // not divisible by the world size; several read blocks
        let results = run_ranks(world, Duration::from_secs(10), move |mut g| {
            if direct_reads {
                assert_eq!(g.uses_cross_memory_attach(), world > 1 && readable);
            } else {
                g.disable_cross_memory_attach();
            }
            let r = g.rank();
            let mut sum = data(r, len);
            g.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
            let mut avg = data(r, len);
            g.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
            let mut max = data(r, len);
            g.all_reduce(&mut max, ReduceOp::Max).unwrap();
            let mut gathered = vec![0.0; 5 * world];
            g.all_gather(&data(r, 5), &mut gathered).unwrap();
            let mut scattered = vec![0.0; 20_000];
            g.reduce_scatter(&data(r, 20_000 * world), &mut scattered, ReduceOp::Sum)
                .unwrap();
            let mut bcast = if r == world - 1 {
                data(99, 17)
            } else {
                vec![0.0; 17]
            };
            g.broadcast(&mut bcast, world - 1).unwrap();
            // all_to_all with uneven splits: rank r sends p+1 values to rank p.
            let send_counts: Vec<usize> = (0..world).map(|p| p + 1).collect();
            let input: Vec<f32> = (0..world)
                .flat_map(|p| vec![(r * 10 + p) as f32; p + 1])
                .collect();
            let recv_counts = vec![r + 1; world];
            let mut output = vec![0.0; (r + 1) * world];
            g.all_to_all(&input, &send_counts, &mut output, &recv_counts)
                .unwrap();
            g.barrier().unwrap();
            (r, sum, avg, max, gathered, scattered, bcast, output)
        });
        let ranks: Vec<Vec<f32>> = (0..world).map(|r| data(r, len)).collect();
        for (r, sum, avg, max, gathered, scattered, bcast, output) in results {
            for i in 0..len {
                let s: f32 = ranks.iter().map(|d| d[i]).sum();
                assert_eq!(sum[i], s, "world {world} rank {r} sum[{i}]");
                assert!((avg[i] - s / world as f32).abs() < 1e-5);
                assert_eq!(max[i], ranks.iter().map(|d| d[i]).fold(f32::MIN, f32::max));
            }
            let want_gather: Vec<f32> = (0..world).flat_map(|p| data(p, 5)).collect();
            assert_eq!(gathered, want_gather);
            let inputs: Vec<Vec<f32>> = (0..world).map(|p| data(p, 20_000 * world)).collect();
            let want_scatter: Vec<f32> = (0..20_000)
                .map(|i| inputs.iter().map(|d| d[r * 20_000 + i]).sum())
                .collect();
            assert_eq!(scattered, want_scatter);
            assert_eq!(bcast, data(99, 17));
            let want_a2a: Vec<f32> = (0..world)
                .flat_map(|p| vec![(p * 10 + r) as f32; r + 1])
                .collect();
            assert_eq!(output, want_a2a, "world {world} rank {r} all_to_all");
        }
    }
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let server = StoreServer::start("127.0.0.1:0", &job_secret()).unwrap();
    let addr = server.addr.to_string();
    // Ranks 0 and 2 of 3 come; rank 1 never does.
    let handles: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let store =
                    StoreClient::connect(&addr, &job_secret(), Duration::from_secs(5)).unwrap();
                TcpGroup::connect(
                    &store,
                    "g",
                    rank,
                    3,
                    "127.0.0.1",
                    Duration::from_millis(800),
                    Duration::from_secs(1),
                )
                .err()
                .map(|e| e.to_string())
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap().expect("joining without rank 1 must fail");
        assert!(
            e.contains("1") && (e.contains("never") || e.contains("not set")),
            "{e}"
        );
    }
}

#[test]
fn a_dead_peer_makes_the_others_fail_fast_naming_it() {
    let t0 = Instant::now();
    let results = run_ranks(3, Duration::from_secs(20), |g| {
        if g.rank() == 1 {
            drop(g); // "killed": its sockets close
            return None;
        }
        let mut buf = vec![1.0f32; 1 << 16];
        Some(
            g.all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
        )
    });
    for e in results.into_iter().flatten() {
        assert!(
            e.contains("all_reduce") && e.contains("group `test`"),
            "{e}"
        );
        assert!(e.contains("peer rank"), "{e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let results = run_ranks(2, Duration::from_millis(500), |g| {
        if g.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500)); // alive but never joins the collective
            return None;
        }
        let mut buf = vec![1.0f32; 8];
        Some(
            g.all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
        )
    });
    let e = results[0].clone().unwrap();
    assert!(
        e.contains("peer rank 1") && e.contains("did not answer"),
        "{e}"
    );
}

#[test]
fn tcp_transport_all_reduce_and_dead_peer() {
    let sums = run_ranks_on("127.0.0.2", 3, Duration::from_secs(10), |g| {
        let mut v = data(g.rank(), 777);
        g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        v
    });
    let want: Vec<f32> = (0..777)
        .map(|i| (0..3).map(|r| data(r, 777)[i]).sum())
        .collect();
    for s in sums {
        assert_eq!(s, want);
    }
    let errs = run_ranks_on("127.0.0.2", 2, Duration::from_secs(10), |g| {
        if g.rank() == 1 {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut buf = vec![1.0f32; 1 << 16];
        Some(
            g.all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
        )
    });
    let e = errs[0].clone().unwrap();
    assert!(e.contains("peer rank 1"), "{e}");
}

#[test]
fn ranks_that_disagree_on_a_collective_fail_and_the_group_stays_failed() {
    let results = run_ranks(2, Duration::from_secs(5), |g| {
        if !g.uses_cross_memory_attach() {
            return None; // the check below is about the direct-read path
        }
        let mut buf = vec![1.0f32; 10 + 2 * g.rank()];
        let first = g
            .all_reduce(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        let mut again = vec![1.0f32; 4];
        let second = g
            .all_reduce(&mut again, ReduceOp::Sum)
            .map_err(|e| e.to_string());
        Some((first, second))
    });
    for r in results.into_iter().flatten() {
        let (first, second) = r;
        let e = first.expect_err("lengths 10 and 12 must not reduce");
        assert!(e.contains("out of step") && e.contains("peer rank"), "{e}");
        let e = second.expect_err("a failed group must refuse");
        assert!(e.contains("failed in an earlier operation"), "{e}");
    }
}

/// An outsider at a rank's listening socket: silent, sending garbage, or claiming to be rank 1
/// without the secret. None of them joins or fails the group, and the ranks' all-reduce is exact.
fn outsiders_neither_join_nor_fail_the_group(host: &'static str) {
    let server = StoreServer::start("127.0.0.1:0", &job_secret()).unwrap();
    let addr = server.addr.to_string();
    let group = format!("outsiders-{host}");
    let rank = |r: usize| {
        let (addr, group) = (addr.clone(), group.clone());
        std::thread::spawn(move || {
            let store =
                StoreClient::connect(&addr, &job_secret(), Duration::from_secs(10)).unwrap();
            let g = TcpGroup::connect(
                &store,
                &group,
                r,
                2,
                host,
                Duration::from_secs(20),
                Duration::from_secs(20),
            )
            .unwrap();
            let mut v = vec![r as f32 + 1.0; 1000];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            v
        })
    };
    let rank0 = rank(0);
    // The outsiders find rank 0's address (here through the store; an attacker would guess it).
    let store = StoreClient::connect(&addr, &job_secret(), Duration::from_secs(10)).unwrap();
    let published =
        String::from_utf8(store.get(&format!("group/{group}/addr/0")).unwrap()).unwrap();
    let mut outsiders = Vec::new();
    for attempt in 0..3 {
        let mut c = titan::comm::conn::Conn::connect(&published).unwrap();
        c.set_timeouts(Duration::from_secs(10), Duration::from_secs(10))
            .unwrap();
        match attempt {
            0 => {} // silent
            1 => {
                use std::io::Write;
                let _ = c.write_all(&[0xee; 256]);
            }
            _ => {
                let wrong = JobSecret::generate();
                let name = format!("group/{group}");
                let e = titan::comm::auth::client_handshake(
                    &mut c,
                    &wrong,
                    &name,
                    1,
                    Instant::now() + Duration::from_secs(10),
                );
                assert!(e.is_err(), "a wrong secret was accepted");
            }
        }
        outsiders.push(c);
    }
    let rank1 = rank(1);
    assert_eq!(rank0.join().unwrap(), vec![3.0; 1000]);
    assert_eq!(rank1.join().unwrap(), vec![3.0; 1000]);
}

#[test]
fn outsiders_neither_join_nor_fail_a_group_over_unix_sockets() {
    outsiders_neither_join_nor_fail_the_group("127.0.0.1");
}

#[test]
fn outsiders_neither_join_nor_fail_a_group_over_tcp() {
    outsiders_neither_join_nor_fail_the_group("127.0.0.2");
}

/// A flood of silent connections at a rank's socket (more than it handshakes with at once): the
/// real peer waits its turn in the listen backlog and the group still forms, exactly.
#[test]
fn a_flood_of_silent_connections_delays_but_does_not_fail_a_group() {
    let server = StoreServer::start("127.0.0.1:0", &job_secret()).unwrap();
    let addr = server.addr.to_string();
    let rank = |r: usize| {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let store =
                StoreClient::connect(&addr, &job_secret(), Duration::from_secs(10)).unwrap();
            let t = Duration::from_secs(40);
            let g = TcpGroup::connect(&store, "flood", r, 2, "127.0.0.1", t, t).unwrap();
            let mut v = vec![r as f32 + 1.0; 100];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            v
        })
    };
    let rank0 = rank(0);
    let store = StoreClient::connect(&addr, &job_secret(), Duration::from_secs(10)).unwrap();
    let published = String::from_utf8(store.get("group/flood/addr/0").unwrap()).unwrap();
    let flood: Vec<_> = (0..100)
        .filter_map(|_| titan::comm::conn::Conn::connect(&published).ok())
        .collect();
    assert!(
        flood.len() > 64,
        "only {} connections got through",
        flood.len()
    );
    let rank1 = rank(1);
    assert_eq!(rank0.join().unwrap(), vec![3.0; 100]);
    assert_eq!(rank1.join().unwrap(), vec![3.0; 100]);
}
