//! The job secret and the mutual challenge-response every store and peer connection opens with.
//!
//! The launcher draws 32 random bytes per job and hands them to its workers in the environment
//! (`TITAN_JOB_SECRET`, hex; never on the command line, which other users can read in `ps`).
//! Multi-node and torchrun/SLURM jobs give every node the same secret through that variable or a
//! file of mode 0600 (`--job-secret-file`, `TITAN_JOB_SECRET_FILE`).
//!
//! A connection proves both ends hold the secret before anything else crosses it:
//!
//! ```text
//! client → server   MAGIC, client nonce (32 bytes), claimed id (u64: the rank, or STORE_CLIENT)
//! server → client   server nonce (32 bytes), HMAC(secret, "server" | channel | nonces | id)
//! client → server   HMAC(secret, "client" | channel | nonces | id)
//! server → client   one byte: 1 (accepted)
//! ```
//!
//! The channel names what the connection is for (the store, or one process group and its
//! generation), so a response seen on one channel is worthless on another; fresh nonces on both
//! sides make every response single-use; the two roles' MACs differ in their label, so a server
//! cannot be made to answer for a client. MACs are HMAC-SHA256 (`hmac`, `sha2`) compared in
//! constant time (`Mac::verify_slice`). Traffic after the handshake is not encrypted: see
//! docs/security.md for what this protects and what it does not.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// The environment variable a worker reads its job's secret from (64 hex digits).
pub const SECRET_ENV: &str = "TITAN_JOB_SECRET";
/// The environment variable naming a file that holds the secret (mode 0600).
pub const SECRET_FILE_ENV: &str = "TITAN_JOB_SECRET_FILE";
/// The claimed id of a store client (a store connection is not a rank's).
pub const STORE_CLIENT: u64 = u64::MAX;

const MAGIC: &[u8; 8] = b"TITANAU1";
const NONCE: usize = 32;
const TAG: usize = 32;

/// The 32 bytes every connection of one job proves it holds.
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret([u8; 32]);

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl JobSecret {
    /// A fresh secret from the operating system's random source.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        JobSecret(bytes)
    }

    /// The well-known all-zero secret of `[comm] insecure_no_auth = true`: the handshake still
    /// runs (one code path), but it proves nothing.
    pub fn insecure() -> Self {
        JobSecret([0; 32])
    }

    pub fn is_insecure(&self) -> bool {
        self.0 == [0; 32]
    }

    /// 64 hex digits (what `TITAN_JOB_SECRET` holds).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits; `what` names the source in the error.
    pub fn from_hex(text: &str, what: &str) -> Result<Self> {
        let text = text.trim();
        if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!(
                "{what}: a job secret is 64 hex digits (32 bytes), got {} characters",
                text.len()
            );
        }
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("checked hex digits");
        }
        Ok(JobSecret(bytes))
    }

    /// Reads a secret file: 64 hex digits, readable by its owner alone (mode 0600 or stricter).
    pub fn from_file(path: &Path) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)
            .with_context(|| format!("job secret file {}", path.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            bail!(
                "job secret file {}: mode {mode:o} lets other users read it; run `chmod 600 {}`",
                path.display(),
                path.display()
            );
        }
        if meta.len() > 1024 {
            bail!(
                "job secret file {}: {} bytes, expected 64 hex digits",
                path.display(),
                meta.len()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("job secret file {}", path.display()))?;
        Self::from_hex(&text, &format!("job secret file {}", path.display()))
    }

    /// The secret this process was given: `TITAN_JOB_SECRET`, else the file named by
    /// `TITAN_JOB_SECRET_FILE`; None when neither is set.
    pub fn from_env() -> Result<Option<Self>> {
        if let Some(hex) = std::env::var(SECRET_ENV).ok().filter(|v| !v.is_empty()) {
            return Self::from_hex(&hex, SECRET_ENV).map(Some);
        }
        match std::env::var(SECRET_FILE_ENV)
            .ok()
            .filter(|v| !v.is_empty())
        {
            Some(path) => Self::from_file(Path::new(&path)).map(Some),
            None => Ok(None),
        }
    }

    /// A name for this job's store keys, derived from the secret (two jobs with different
    /// secrets never share a key even on one store).
    pub fn job_id(&self) -> String {
        let tag = self.tag(&[b"job id"]);
        tag[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    fn tag(&self, parts: &[&[u8]]) -> [u8; TAG] {
        let mut mac = self.mac();
        for p in parts {
            mac.update(&(p.len() as u64).to_le_bytes());
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut mac = self.mac();
        for p in parts {
            mac.update(&(p.len() as u64).to_le_bytes());
            mac.update(p);
        }
        mac.verify_slice(tag).is_ok()
    }
}

/// A stream whose reads can be given a timeout: the handshake bounds its whole exchange, not
/// each read (a peer sending one byte every few seconds cannot stretch it).
pub trait TimedStream: Read + Write {
    fn set_read_timeout_to(&mut self, timeout: Duration) -> std::io::Result<()>;
}

impl TimedStream for std::net::TcpStream {
    fn set_read_timeout_to(&mut self, timeout: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

impl TimedStream for std::os::unix::net::UnixStream {
    fn set_read_timeout_to(&mut self, timeout: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(timeout))
    }
}

/// Fills `buf` by `deadline`, whatever pace the bytes arrive at.
fn read_by(s: &mut impl TimedStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout_to(left)?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// The client's side: proves the secret for `channel` as `id` and checks the server does too,
/// by `deadline` (the stream's write timeout bounds each write).
pub fn client_handshake(
    s: &mut impl TimedStream,
    secret: &JobSecret,
    channel: &str,
    id: u64,
    deadline: Instant,
) -> Result<()> {
    let mine = nonce();
    let mut hello = Vec::with_capacity(MAGIC.len() + NONCE + 8);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&mine);
    hello.extend_from_slice(&id.to_le_bytes());
    s.write_all(&hello).context("sending the handshake")?;
    let mut reply = [0u8; NONCE + TAG];
    read_by(s, &mut reply, deadline)
        .context("no handshake answer (is the other end a titan process of this job?)")?;
    let (theirs, server_tag) = reply.split_at(NONCE);
    let id_bytes = id.to_le_bytes();
    let parts = |role: &'static [u8]| [role, channel.as_bytes(), &mine[..], theirs, &id_bytes[..]];
    if !secret.verify(&parts(b"server"), server_tag) {
        bail!("the other end does not hold this job's secret (another job, or not titan; every process of a job needs the same job secret: TITAN_JOB_SECRET or --job-secret-file)");
    }
    s.write_all(&secret.tag(&parts(b"client")))
        .context("sending the handshake response")?;
    let mut ok = [0u8; 1];
    read_by(s, &mut ok, deadline).context("the other end refused this job's secret")?;
    match ok[0] {
        1 => Ok(()),
        _ => Err(anyhow!("the other end refused the handshake")),
    }
}

/// The server's side: checks the client holds the secret for `channel` and returns the id it
/// claimed (bound into its MAC), by `deadline` (the stream's write timeout bounds each write).
pub fn server_handshake(
    s: &mut impl TimedStream,
    secret: &JobSecret,
    channel: &str,
    deadline: Instant,
) -> Result<u64> {
    let mut hello = [0u8; 8 + NONCE + 8];
    read_by(s, &mut hello, deadline).context("no handshake")?;
    if &hello[..8] != MAGIC {
        bail!("not a titan handshake");
    }
    let theirs = &hello[8..8 + NONCE];
    let id_bytes: [u8; 8] = hello[8 + NONCE..].try_into().expect("8 bytes");
    let mine = nonce();
    let parts = |role: &'static [u8]| [role, channel.as_bytes(), theirs, &mine[..], &id_bytes[..]];
    let mut reply = Vec::with_capacity(NONCE + TAG);
    reply.extend_from_slice(&mine);
    reply.extend_from_slice(&secret.tag(&parts(b"server")));
    s.write_all(&reply).context("answering the handshake")?;
    let mut client_tag = [0u8; TAG];
    read_by(s, &mut client_tag, deadline).context("no handshake response")?;
    if !secret.verify(&parts(b"client"), &client_tag) {
        bail!("the client does not hold this job's secret");
    }
    s.write_all(&[1]).context("accepting the handshake")?;
    Ok(u64::from_le_bytes(id_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair(
        client_secret: JobSecret,
        server_secret: JobSecret,
        client_channel: &'static str,
    ) -> (Result<()>, Result<u64>) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let server = std::thread::spawn(move || {
            server_handshake(&mut b, &server_secret, "group/x-g0", deadline)
        });
        let client = client_handshake(&mut a, &client_secret, client_channel, 3, deadline);
        drop(a);
        (client, server.join().unwrap())
    }

    #[test]
    fn both_ends_with_the_secret_agree_on_the_claimed_id() {
        let secret = JobSecret::generate();
        let (c, s) = pair(secret.clone(), secret, "group/x-g0");
        c.unwrap();
        assert_eq!(s.unwrap(), 3);
    }

    #[test]
    fn a_wrong_secret_or_channel_is_refused_on_both_sides() {
        let (c, s) = pair(JobSecret::generate(), JobSecret::generate(), "group/x-g0");
        assert!(c.is_err() && s.is_err());
        let secret = JobSecret::generate();
        let (c, s) = pair(secret.clone(), secret, "group/x-g1");
        assert!(c.is_err() && s.is_err());
    }

    #[test]
    fn secrets_parse_from_hex_and_files_of_mode_0600_only() {
        let secret = JobSecret::generate();
        assert_eq!(JobSecret::from_hex(&secret.to_hex(), "t").unwrap(), secret);
        assert!(JobSecret::from_hex("abc", "t").is_err());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, secret.to_hex()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = JobSecret::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(JobSecret::from_file(&path).unwrap(), secret);
        assert_eq!(format!("{secret:?}"), "JobSecret(<redacted>)");
    }

    #[test]
    fn a_slow_drip_cannot_stretch_the_handshake_past_its_deadline() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let dripper = std::thread::spawn(move || {
            // One byte of a hello every 100 ms: each read alone would be in time.
            for &byte in MAGIC.iter().chain([0u8; 40].iter()) {
                if a.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let t0 = Instant::now();
        let deadline = t0 + std::time::Duration::from_millis(500);
        let r = server_handshake(&mut b, &JobSecret::generate(), "store", deadline);
        assert!(r.is_err());
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            t0.elapsed()
        );
        drop(b);
        dripper.join().unwrap();
    }
}
