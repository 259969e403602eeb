//! The rendezvous store: a small TCP key-value server (hosted by the launcher or rank 0) through
//! which ranks find each other. Operations: set, get (waits for the key), add (atomic counter),
//! wait and barrier, each with a timeout whose error names the key and the store.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The server side; it runs on background threads until the process exits.
pub struct StoreServer {
    pub addr: SocketAddr,
}

impl StoreServer {
    /// Listens on `bind` (use port 0 for any free port).
    pub fn start(bind: &str) -> Result<Self> {
        let listener = TcpListener::bind(bind).with_context(|| {
            format!("rendezvous store cannot listen on {bind} (is the port in use?)")
        })?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        std::thread::Builder::new()
            .name("titan-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let table = table.clone();
                    let _ = std::thread::Builder::new()
                        .name("titan-store-conn".into())
                        .spawn(move || serve(stream, &table));
                }
            })?;
        Ok(StoreServer { addr })
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

fn serve(mut s: TcpStream, table: &Table) {
    let _ = s.set_nodelay(true);
    loop {
        let mut op = [0u8; 1];
        if s.read_exact(&mut op).is_err() {
            return;
        }
        let Ok(key_len) = read_u64(&mut s) else {
            return;
        };
        let Ok(key) = read_exact_vec(&mut s, key_len as usize) else {
            return;
        };
        let key = String::from_utf8_lossy(&key).into_owned();
        let Ok(val_len) = read_u64(&mut s) else {
            return;
        };
        let Ok(val) = read_exact_vec(&mut s, val_len as usize) else {
            return;
        };
        let reply: Vec<u8> = match op[0] {
            OP_SET => {
                table
                    .values
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, val);
                table.changed.notify_all();
                Vec::new()
            }
            OP_GET => {
                // `val` carries the timeout in milliseconds; an empty reply with flag 0 means timed out.
                let ms = u64::from_le_bytes(
                    val.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .unwrap_or([0; 8]),
                );
                let deadline = Instant::now() + Duration::from_millis(ms);
                let mut values = table.values.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(v) = values.get(&key) {
                        let mut r = vec![1u8];
                        r.extend_from_slice(v);
                        break r;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break vec![0u8];
                    }
                    values = table
                        .changed
                        .wait_timeout(values, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            OP_ADD => {
                let delta = i64::from_le_bytes(
                    val.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .unwrap_or([0; 8]),
                );
                let mut values = table.values.lock().unwrap_or_else(|e| e.into_inner());
                let cur = values
                    .get(&key)
                    .and_then(|v| v.get(..8))
                    .and_then(|b| b.try_into().ok())
                    .map(i64::from_le_bytes)
                    .unwrap_or(0);
                let new = cur + delta;
                values.insert(key, new.to_le_bytes().to_vec());
                table.changed.notify_all();
                new.to_le_bytes().to_vec()
            }
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

/// A connection to the store.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    addr: String,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr`, retrying until `timeout` (the store may start after this rank).
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => bail!(
                    "cannot reach the rendezvous store at {addr} within {:.0?}: {e}",
                    timeout
                ),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream.set_nodelay(true)?;
        Ok(StoreClient {
            stream: Mutex::new(stream),
            addr: addr.to_string(),
            timeout,
        })
    }

    fn request(&self, op: u8, key: &str, val: &[u8], io_timeout: Duration) -> Result<Vec<u8>> {
        let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        s.set_read_timeout(Some(io_timeout))?;
        let mut msg = vec![op];
        msg.extend_from_slice(&(key.len() as u64).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(&(val.len() as u64).to_le_bytes());
        msg.extend_from_slice(val);
        s.write_all(&msg).with_context(|| {
            format!(
                "rendezvous store {}: cannot send request for `{key}`",
                self.addr
            )
        })?;
        let n = read_u64(&mut s).with_context(|| {
            format!("rendezvous store {} did not answer for `{key}`", self.addr)
        })?;
        Ok(read_exact_vec(&mut s, n as usize)?)
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
        if n as usize == world {
            self.set(&format!("barrier/{name}/done"), b"1")?;
        }
        self.get(&format!("barrier/{name}/done")).map_err(|_| {
            let arrived = self.add(&count_key, 0).unwrap_or(-1);
            anyhow!(
                "barrier `{name}`: only {arrived} of {world} ranks arrived within {:.0?}",
                self.timeout
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_barrier() {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let addr = server.addr.to_string();
        let t = Duration::from_secs(5);
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let c = StoreClient::connect(&addr, t).unwrap();
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
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let c = StoreClient::connect(&server.addr.to_string(), Duration::from_millis(300)).unwrap();
        let e = c.get("addr/7").unwrap_err().to_string();
        assert!(e.contains("addr/7") && e.contains("not set"), "{e}");
        let e = c.barrier("b", 3).unwrap_err().to_string();
        assert!(e.contains("1 of 3"), "{e}");
    }

    #[test]
    fn port_in_use_is_a_clear_error() {
        let server = StoreServer::start("127.0.0.1:0").unwrap();
        let e = StoreServer::start(&server.addr.to_string())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("port in use"), "{e}");
    }
}
