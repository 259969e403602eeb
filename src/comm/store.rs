//! The rendezvous store: a small TCP key-value server (hosted by the launcher or rank 0) through
//! which ranks find each other. Operations: set, get (waits for the key), add (atomic counter),
//! wait and barrier, each with a timeout whose error names the key and the store.
//!
//! Only the job's own processes get in: every connection opens with the job secret's
//! challenge-response (`auth.rs`), and every key is prefixed with the job's id. The server is
//! bounded against anything else that reaches its port: a connection that does not finish the
//! handshake within `HANDSHAKE_TIMEOUT` is dropped (each connection has its own thread, so a
//! silent one stalls nobody, and the deadline bounds the whole exchange, not each read), at most
//! `MAX_HANDSHAKES` prove themselves at once (the rest wait in the listen backlog), keys are at
//! most `MAX_KEY` bytes and values `MAX_VALUE`, a request once begun must arrive within
//! `REQUEST_TIMEOUT` per read, counters refuse to overflow, and a failing `accept` backs off
//! instead of spinning.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::auth::{client_handshake, server_handshake, JobSecret, STORE_CLIENT};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;

/// The longest key a request may carry (bytes).
pub const MAX_KEY: usize = 4096;
/// The largest value (bytes): addresses, pids and NCCL ids are far smaller.
pub const MAX_VALUE: usize = 1 << 20;
/// Connections proving the secret at once; more wait in the listen backlog.
pub const MAX_HANDSHAKES: usize = 256;
/// How long a new connection has to prove the job secret.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the rest of a request may take once its first byte arrived.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The store's channel name in the handshake.
const CHANNEL: &str = "store";

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The server side; it runs on background threads until the process exits.
pub struct StoreServer {
    pub addr: SocketAddr,
    table: Arc<Table>,
}

impl StoreServer {
    /// Listens on `bind` (use port 0 for any free port); serves clients holding `secret`.
    pub fn start(bind: &str, secret: &JobSecret) -> Result<Self> {
        let listener = TcpListener::bind(bind).with_context(|| {
            format!("rendezvous store cannot listen on {bind} (is the port in use?)")
        })?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        let served = table.clone();
        let secret = secret.clone();
        let pending = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("titan-store".into())
            .spawn(move || loop {
                // At most MAX_HANDSHAKES connections prove the secret at once; later ones wait in
                // the listen backlog (closing them would turn the job's own ranks away too).
                if pending.load(Ordering::SeqCst) >= MAX_HANDSHAKES {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                let stream = match listener.accept() {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        // Out of descriptors or a reset connection: back off, never spin.
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                };
                pending.fetch_add(1, Ordering::SeqCst);
                let (table, secret, counted) = (served.clone(), secret.clone(), pending.clone());
                let spawned = std::thread::Builder::new()
                    .name("titan-store-conn".into())
                    .spawn(move || serve_authenticated(stream, &table, &secret, &counted));
                if spawned.is_err() {
                    pending.fetch_sub(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })?;
        Ok(StoreServer { addr, table })
    }

    /// Drops every key `keep` refuses (a server whose keys would otherwise grow without end,
    /// such as the lighthouse's rounds); clients waiting for a dropped key go on waiting.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut values = self.table.values.lock().unwrap_or_else(|e| e.into_inner());
        values.retain(|k, _| keep(k));
    }

    /// How many keys the store holds.
    pub fn len(&self) -> usize {
        let values = self.table.values.lock().unwrap_or_else(|e| e.into_inner());
        values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn read_exact_vec(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_u64(s: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A length read from the wire, refused above `max` before anything is allocated.
fn read_len(s: &mut TcpStream, max: usize) -> Option<usize> {
    let n = read_u64(s).ok()?;
    (n <= max as u64).then_some(n as usize)
}

/// Serves `s` once it proved the secret within `HANDSHAKE_TIMEOUT` (`pending` counts the
/// connections still proving it).
fn serve_authenticated(mut s: TcpStream, table: &Table, secret: &JobSecret, pending: &AtomicUsize) {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let proven = s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).is_ok()
        && server_handshake(&mut s, secret, CHANNEL, deadline).is_ok();
    pending.fetch_sub(1, Ordering::SeqCst);
    if !proven {
        return;
    }
    let _ = s.set_nodelay(true);
    serve(s, table);
}

/// One request: its operation, key and value. None: the connection ended, broke a bound or sent
/// something that is not a request (the connection is then closed).
fn read_request(s: &mut TcpStream) -> Option<(u8, String, Vec<u8>)> {
    // Waiting for the next request is unbounded (a rank keeps its connection for the job);
    // a request once begun must arrive whole in time.
    s.set_read_timeout(None).ok()?;
    let mut op = [0u8; 1];
    s.read_exact(&mut op).ok()?;
    s.set_read_timeout(Some(REQUEST_TIMEOUT)).ok()?;
    let key_len = read_len(s, MAX_KEY)?;
    let key = String::from_utf8(read_exact_vec(s, key_len).ok()?).ok()?;
    let val_len = read_len(s, MAX_VALUE)?;
    let val = read_exact_vec(s, val_len).ok()?;
    Some((op[0], key, val))
}

fn serve(mut s: TcpStream, table: &Table) {
    let _ = s.set_write_timeout(Some(REQUEST_TIMEOUT));
    while let Some((op, key, val)) = read_request(&mut s) {
        let reply = match op {
            OP_SET => {
                table
                    .values
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, val);
                table.changed.notify_all();
                Vec::new()
            }
            OP_GET => get(table, &key, &val),
            OP_ADD => match add(table, key, &val) {
                Some(v) => v.to_le_bytes().to_vec(),
                None => return,
            },
            _ => return,
        };
        if s.write_all(&(reply.len() as u64).to_le_bytes())
            .and_then(|_| s.write_all(&reply))
            .is_err()
        {
            return;
        }
    }
}

/// The value of `key` once some client set it: flag 1 then the value, or flag 0 when it was not
/// set within the timeout `val` carries (milliseconds, at most a day).
fn get(table: &Table, key: &str, val: &[u8]) -> Vec<u8> {
    let ms = val
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
        .min(86_400_000);
    let deadline = Instant::now() + Duration::from_millis(ms);
    let mut values = table.values.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(v) = values.get(key) {
            let mut r = vec![1u8];
            r.extend_from_slice(v);
            return r;
        }
        let now = Instant::now();
        if now >= deadline {
            return vec![0u8];
        }
        values = table
            .changed
            .wait_timeout(values, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Adds the delta `val` carries to the counter `key`; None when the sum would overflow.
fn add(table: &Table, key: String, val: &[u8]) -> Option<i64> {
    let delta = i64::from_le_bytes(val.get(..8)?.try_into().ok()?);
    let mut values = table.values.lock().unwrap_or_else(|e| e.into_inner());
    let cur = values
        .get(&key)
        .and_then(|v| v.get(..8))
        .and_then(|b| b.try_into().ok())
        .map(i64::from_le_bytes)
        .unwrap_or(0);
    let new = cur.checked_add(delta)?;
    values.insert(key, new.to_le_bytes().to_vec());
    table.changed.notify_all();
    Some(new)
}

/// A connection to the store.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    addr: String,
    timeout: Duration,
    secret: JobSecret,
    /// Every key this client names is `{job_id}/{key}` in the store.
    job_id: String,
}

impl StoreClient {
    /// Connects to `addr` and proves `secret`, retrying the connection until `timeout` (the store
    /// may start after this rank).
    pub fn connect(addr: &str, secret: &JobSecret, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut stream = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => bail!(
                    "cannot reach the rendezvous store at {addr} within {:.0?}: {e}",
                    timeout
                ),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
        // The store (its address is the job's own) may be busy proving other connections: wait
        // for it up to this connection's deadline.
        let by = deadline.max(Instant::now() + HANDSHAKE_TIMEOUT);
        client_handshake(&mut stream, secret, CHANNEL, STORE_CLIENT, by)
            .with_context(|| format!("rendezvous store at {addr}: handshake"))?;
        stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(StoreClient {
            stream: Mutex::new(stream),
            addr: addr.to_string(),
            timeout,
            secret: secret.clone(),
            job_id: secret.job_id(),
        })
    }

    /// A second connection to the same store with the same secret: for a thread that waits on
    /// keys while this connection serves others.
    pub fn reconnect(&self) -> Result<Self> {
        Self::connect(&self.addr, &self.secret, self.timeout)
    }

    /// The job secret this client proved (process groups prove it to each other too).
    pub fn secret(&self) -> &JobSecret {
        &self.secret
    }

    fn request(&self, op: u8, key: &str, val: &[u8], io_timeout: Duration) -> Result<Vec<u8>> {
        let key = format!("{}/{key}", self.job_id);
        if key.len() > MAX_KEY || val.len() > MAX_VALUE {
            bail!(
                "rendezvous store: key `{key}` ({} bytes) or its value ({} bytes) is over the store's limits ({MAX_KEY}, {MAX_VALUE}) (a titan bug)",
                key.len(),
                val.len()
            );
        }
        let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        s.set_read_timeout(Some(io_timeout))?;
        let mut msg = vec![op];
        msg.extend_from_slice(&(key.len() as u64).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(&(val.len() as u64).to_le_bytes());
        msg.extend_from_slice(val);
        let answer = s
            .write_all(&msg)
            .ok()
            .and_then(|_| read_len(&mut s, MAX_VALUE + 1))
            .and_then(|n| read_exact_vec(&mut s, n).ok());
        answer.ok_or_else(|| {
            // A late answer must not be read as the next request's: the connection is closed.
            let _ = s.shutdown(std::net::Shutdown::Both);
            anyhow!(
                "rendezvous store {}: no answer for `{key}` (the store is gone, or its answer was over the limit); this connection is closed",
                self.addr
            )
        })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(OP_SET, key, value, self.timeout)?;
        Ok(())
    }

    /// The value of `key`, waiting up to the store timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_within(key, self.timeout)
    }

    pub fn get_within(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = timeout.as_millis() as u64;
        let r = self.request(
            OP_GET,
            key,
            &ms.to_le_bytes(),
            timeout + Duration::from_secs(5),
        )?;
        match r.split_first() {
            Some((1, v)) => Ok(v.to_vec()),
            _ => Err(anyhow!(
                "rendezvous store {}: key `{key}` was not set within {:.0?}",
                self.addr,
                timeout
            )),
        }
    }

    /// Atomically adds `delta` to the counter `key` and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let r = self.request(OP_ADD, key, &delta.to_le_bytes(), self.timeout)?;
        Ok(i64::from_le_bytes(
            r.get(..8)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| anyhow!("bad store reply"))?,
        ))
    }

    /// Blocks until `world` ranks have entered barrier `name`; the error says how many arrived.
    pub fn barrier(&self, name: &str, world: usize) -> Result<()> {
        let count_key = format!("barrier/{name}/count");
        let n = self.add(&count_key, 1)?;
        if n as usize > world {
            bail!("barrier `{name}`: {n} arrivals for {world} ranks (one entered twice: a relaunched rank or node?)");
        }
        if n as usize == world {
            self.set(&format!("barrier/{name}/done"), b"1")?;
        }
        if let Err(e) = self.get(&format!("barrier/{name}/done")) {
            // The count says how many came, if the store still answers; else its own error.
            let arrived = self.add(&count_key, 0).map_err(|_| e)?;
            bail!(
                "barrier `{name}`: only {arrived} of {world} ranks arrived within {:.0?}",
                self.timeout
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_barrier() {
        let secret = JobSecret::generate();
        let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
        let addr = server.addr.to_string();
        let t = Duration::from_secs(5);
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let (addr, secret) = (addr.clone(), secret.clone());
                std::thread::spawn(move || {
                    let c = StoreClient::connect(&addr, &secret, t).unwrap();
                    c.set(&format!("addr/{r}"), format!("host-{r}").as_bytes())
                        .unwrap();
                    c.add("count", 1).unwrap();
                    c.barrier("start", 4).unwrap();
                    assert_eq!(c.add("count", 0).unwrap(), 4);
                    (0..4)
                        .map(|p| String::from_utf8(c.get(&format!("addr/{p}")).unwrap()).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            assert_eq!(
                h.join().unwrap(),
                vec!["host-0", "host-1", "host-2", "host-3"]
            );
        }
    }

    #[test]
    fn missing_key_and_missing_ranks_time_out_with_names() {
        let secret = JobSecret::generate();
        let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
        let c = StoreClient::connect(
            &server.addr.to_string(),
            &secret,
            Duration::from_millis(300),
        )
        .unwrap();
        let e = c.get("addr/7").unwrap_err().to_string();
        assert!(e.contains("addr/7") && e.contains("not set"), "{e}");
        let e = c.barrier("b", 3).unwrap_err().to_string();
        assert!(e.contains("1 of 3"), "{e}");
    }

    #[test]
    fn port_in_use_is_a_clear_error() {
        let secret = JobSecret::generate();
        let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
        let e = StoreServer::start(&server.addr.to_string(), &secret)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("port in use"), "{e}");
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// A raw request frame: op, key, value, each length as the wire has it.
    fn frame(op: u8, key_len: u64, key: &[u8], val_len: u64) -> Vec<u8> {
        let mut m = vec![op];
        m.extend_from_slice(&key_len.to_le_bytes());
        m.extend_from_slice(key);
        m.extend_from_slice(&val_len.to_le_bytes());
        m
    }

    #[test]
    fn an_outsider_without_the_secret_reads_and_writes_nothing() {
        let secret = JobSecret::generate();
        let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
        let addr = server.addr.to_string();
        let job = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
        job.set("group/dp/addr/0", b"unix:/tmp/rank0").unwrap();
        // Another secret: refused, naming the secret.
        let e = StoreClient::connect(&addr, &JobSecret::generate(), Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("job secret"), "{e:#}");
        // No handshake at all: a bare SET (under the job's own key name) changes nothing and
        // a bare GET gets no value back.
        let key = format!("{}/group/dp/addr/0", secret.job_id());
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut set = frame(OP_SET, key.len() as u64, key.as_bytes(), 4);
        set.extend_from_slice(b"evil");
        let _ = raw.write_all(&set);
        let _ = raw.write_all(&frame(OP_GET, key.len() as u64, key.as_bytes(), 8));
        let _ = raw.write_all(&1000u64.to_le_bytes());
        let mut answer = Vec::new();
        let _ = raw.read_to_end(&mut answer);
        assert!(
            !answer.windows(15).any(|w| w == b"unix:/tmp/rank0"),
            "the value leaked"
        );
        assert_eq!(job.get("group/dp/addr/0").unwrap(), b"unix:/tmp/rank0");
    }

    #[test]
    fn oversized_garbage_and_silent_connections_leave_the_store_serving() {
        let secret = JobSecret::generate();
        let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
        let addr = server.addr.to_string();
        // Silent connections, before and during the job's.
        let _silent: Vec<_> = (0..8).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        let job = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
        // Garbage instead of a handshake.
        let mut junk = TcpStream::connect(&addr).unwrap();
        let _ = junk.write_all(&[0xff; 4096]);
        // An authenticated connection sending a key length of 2^40: closed, nothing allocated.
        let mut big = TcpStream::connect(&addr).unwrap();
        big.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        client_handshake(&mut big, &secret, CHANNEL, STORE_CLIENT, soon()).unwrap();
        let _ = big.write_all(&frame(OP_SET, 1 << 40, b"", 0));
        let mut rest = Vec::new();
        let _ = big.read_to_end(&mut rest);
        assert!(rest.is_empty(), "an oversized request got an answer");
        // A counter cannot overflow.
        job.add("c", i64::MAX).unwrap();
        let mut ctr = TcpStream::connect(&addr).unwrap();
        ctr.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        client_handshake(&mut ctr, &secret, CHANNEL, STORE_CLIENT, soon()).unwrap();
        let key = format!("{}/c", secret.job_id());
        let mut add = frame(OP_ADD, key.len() as u64, key.as_bytes(), 8);
        add.extend_from_slice(&1i64.to_le_bytes());
        let _ = ctr.write_all(&add);
        let mut rest = Vec::new();
        let _ = ctr.read_to_end(&mut rest);
        assert!(rest.is_empty(), "an overflowing add got an answer");
        // The job's own client still works.
        job.set("k", b"v").unwrap();
        assert_eq!(job.get("k").unwrap(), b"v");
        assert_eq!(job.add("c", 0).unwrap(), i64::MAX);
    }
}
