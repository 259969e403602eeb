//! Property-based fuzzing of every reader of outside input (issue 27, item 8), on stable Rust with
//! `proptest`: the rendezvous store's wire protocol, the peer handshake, the checkpoint reader
//! (`state.json`, the shard index, safetensors files), the HF `config.json` reader, the TOML config,
//! the text/JSONL/Parquet data readers, pipeline schedule CSVs, `tokenizer.json` and pre-tokenized
//! `.bin` shards, and the direct-read collectives' phase messages. Each target starts from a valid seed (the text ones in
//! `tests/fuzz_corpus/`, the binary ones written at start) and feeds mutations of it: structural
//! edits (a JSON or TOML value replaced by an extreme one, a key removed), byte edits (flips,
//! inserts, deletions, truncation, splices of troublesome tokens) and plain random bytes.
//!
//! The property is always the same: the reader returns (`Ok` or an `Err`), it never panics, aborts
//! or hangs (every case runs under a deadline), and a server keeps serving. Case counts are small
//! so the suite runs in CI; `PROPTEST_CASES=100000 cargo test --release --test fuzz` runs longer
//! (docs/fuzzing.md). A failing case is shrunk and saved in `tests/fuzz.proptest-regressions`,
//! which is kept in the repository and replayed first by every later run.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, OnceLock};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, FileFailurePersistence};
use serde_json::Value;
use titan::backend::cpu::CpuBackend;
use titan::checkpoint::{self, integrity::sha256_hex, TrainState};
use titan::comm::auth::{client_handshake, server_handshake, JobSecret, STORE_CLIENT};
use titan::comm::store::{StoreClient, StoreServer};
use titan::config::Config;
use titan::data::documents::{DocumentSource, JsonlSource, TextSource};
use titan::data::parquet::ParquetSource;
use titan::data::{ByteTokenizer, DataLoader, LoaderState};
use titan::model::{ModelArgs, ParamSet};
use titan::parallel::pipeline::schedule::Schedule;

/// The seed corpus of the text formats.
const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz_corpus");
/// How long one case may take before it counts as a hang.
const CASE_DEADLINE: Duration = Duration::from_secs(20);

/// `default` cases, or `PROPTEST_CASES` when set; failures persisted beside this file.
fn runner(default: u32) -> RunnerConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    RunnerConfig {
        cases,
        max_shrink_iters: 512,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..RunnerConfig::default()
    }
}

fn corpus(name: &str) -> Vec<u8> {
    std::fs::read(Path::new(CORPUS).join(name)).unwrap()
}

/// Runs `f` on its own thread and fails the case if it does not return within `CASE_DEADLINE`
/// (a hang). A panic inside `f` fails the case with its message.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(CASE_DEADLINE) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: no answer within {CASE_DEADLINE:?} (a hang)")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match handle.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the case returned without sending"),
        },
    }
}

// ------------------------------------------------------------------ mutations

/// Tokens that break parsers and size arithmetic, spliced into text formats.
const TOKENS: &[&str] = &[
    "0",
    "-1",
    "1",
    "65536",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775809",
    "1e308",
    "1e999",
    "nan",
    "inf",
    "null",
    "\"\"",
    "\"../../x\"",
    "[]",
    "{}",
    "[[",
    "]]",
    "\"",
    "\\",
    "\\ud800",
    "=",
    "\n",
    "\r\n",
    "\u{0}",
    "\u{feff}",
];

/// JSON values that a reader must refuse or survive in place of any other.
fn extreme_json(i: usize) -> Value {
    let all = [
        "0",
        "-1",
        "1",
        "2",
        "3",
        "255",
        "65537",
        "4294967296",
        "9007199254740993",
        "18446744073709551615",
        "-9223372036854775808",
        "1e308",
        "-1e308",
        "0.5",
        "null",
        "true",
        "\"\"",
        "\"../../etc/passwd\"",
        "\"model.safetensors\"",
        "[]",
        "{}",
        "[0]",
        "[18446744073709551615, 2]",
        "[1099511627776, 1099511627776]",
        "{\"shape\": [4294967296, 4294967296], \"shard_len\": 1}",
    ];
    serde_json::from_str(all[i % all.len()]).unwrap()
}

#[derive(Debug, Clone)]
enum ByteEdit {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
    Token(usize, usize),
    Duplicate(usize, usize),
}

#[derive(Debug, Clone)]
enum TreeEdit {
    /// Replace the value at the `n`-th path with extreme value `m`.
    Set(usize, usize),
    /// Remove the `n`-th path (from its object or array).
    Remove(usize),
}

/// How a case derives its input from the seed.
#[derive(Debug, Clone)]
enum Mutation {
    Tree(Vec<TreeEdit>),
    Bytes(Vec<ByteEdit>),
    Random(Vec<u8>),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        4 => (any::<usize>(), 1..=255u8).prop_map(|(i, x)| ByteEdit::Flip(i, x)),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| ByteEdit::Insert(i, b)),
        1 => (any::<usize>(), 1..64usize).prop_map(|(i, n)| ByteEdit::Delete(i, n)),
        1 => any::<usize>().prop_map(ByteEdit::Truncate),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, t)| ByteEdit::Token(i, t)),
        1 => (any::<usize>(), 1..256usize).prop_map(|(i, n)| ByteEdit::Duplicate(i, n)),
    ]
}

fn tree_edit() -> impl Strategy<Value = TreeEdit> {
    prop_oneof![
        4 => (any::<usize>(), any::<usize>()).prop_map(|(p, v)| TreeEdit::Set(p, v)),
        1 => any::<usize>().prop_map(TreeEdit::Remove),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => proptest::collection::vec(tree_edit(), 1..4).prop_map(Mutation::Tree),
        4 => proptest::collection::vec(byte_edit(), 1..6).prop_map(Mutation::Bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..512).prop_map(Mutation::Random),
    ]
}

/// Byte edits only (for binary seeds, which have no tree): mostly one flipped bit, which keeps
/// the file's framing and reaches the decoder's inner loops.
fn byte_mutation() -> impl Strategy<Value = Mutation> {
    let bit = (any::<usize>(), 0..8u32).prop_map(|(i, b)| vec![ByteEdit::Flip(i, 1 << b)]);
    prop_oneof![
        6 => bit.prop_map(Mutation::Bytes),
        3 => proptest::collection::vec(byte_edit(), 1..6).prop_map(Mutation::Bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..512).prop_map(Mutation::Random),
    ]
}

fn apply_bytes(seed: &[u8], edits: &[ByteEdit]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for e in edits {
        let at = |i: usize, b: &Vec<u8>| i % (b.len() + 1);
        match e {
            ByteEdit::Flip(i, x) if !b.is_empty() => {
                let i = i % b.len();
                b[i] ^= x;
            }
            ByteEdit::Flip(..) => {}
            ByteEdit::Insert(i, bytes) => {
                let i = at(*i, &b);
                b.splice(i..i, bytes.iter().copied());
            }
            ByteEdit::Delete(i, n) => {
                let i = at(*i, &b);
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            ByteEdit::Truncate(i) => b.truncate(at(*i, &b)),
            ByteEdit::Token(i, t) => {
                let i = at(*i, &b);
                let tok = TOKENS[t % TOKENS.len()].as_bytes();
                b.splice(i..i, tok.iter().copied());
            }
            ByteEdit::Duplicate(i, n) => {
                let i = at(*i, &b);
                let end = (i + n).min(b.len());
                let piece = b[i..end].to_vec();
                b.splice(i..i, piece);
            }
        }
    }
    b
}

/// JSON pointers of every value in `v` (the root included).
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = k.replace('~', "~0").replace('/', "~1");
                pointers(x, format!("{at}/{key}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate().take(16) {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
    out.push(at);
}

fn apply_tree(v: &mut Value, edits: &[TreeEdit]) {
    for e in edits {
        let mut all = Vec::new();
        pointers(v, String::new(), &mut all);
        let (n, value) = match e {
            TreeEdit::Set(n, m) => (*n, Some(extreme_json(*m))),
            TreeEdit::Remove(n) => (*n, None),
        };
        let path = &all[n % all.len()];
        match value {
            Some(x) => *v.pointer_mut(path).expect("listed") = x,
            None => {
                let (parent, last) = path.rsplit_once('/').unwrap_or(("", ""));
                match v.pointer_mut(parent) {
                    Some(Value::Object(m)) => {
                        m.remove(&last.replace("~1", "/").replace("~0", "~"));
                    }
                    Some(Value::Array(a)) => {
                        if let Ok(i) = last.parse::<usize>() {
                            if i < a.len() {
                                a.remove(i);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// The bytes of a JSON seed after `m`.
fn mutate_json(seed: &[u8], m: &Mutation) -> Vec<u8> {
    match m {
        Mutation::Tree(edits) => {
            let mut v: Value = serde_json::from_slice(seed).unwrap();
            apply_tree(&mut v, edits);
            serde_json::to_vec_pretty(&v).unwrap()
        }
        Mutation::Bytes(edits) => apply_bytes(seed, edits),
        Mutation::Random(bytes) => bytes.clone(),
    }
}

/// The bytes of a TOML seed after `m` (tree edits through JSON; a value TOML cannot hold, such
/// as null, leaves the key out).
fn mutate_toml(seed: &[u8], m: &Mutation) -> Vec<u8> {
    match m {
        Mutation::Tree(edits) => {
            let table: toml::Table = toml::from_str(std::str::from_utf8(seed).unwrap()).unwrap();
            let mut v = serde_json::to_value(table).unwrap();
            apply_tree(&mut v, edits);
            match toml::to_string(&v) {
                Ok(text) => text.into_bytes(),
                Err(_) => seed.to_vec(),
            }
        }
        Mutation::Bytes(edits) => apply_bytes(seed, edits),
        Mutation::Random(bytes) => bytes.clone(),
    }
}

/// The bytes of a binary seed after `m` (a tree edit, meaningless here, flips one bit).
fn mutate_bytes(seed: &[u8], m: &Mutation) -> Vec<u8> {
    match m {
        Mutation::Tree(edits) => {
            let flips: Vec<ByteEdit> = edits
                .iter()
                .map(|e| match e {
                    TreeEdit::Set(n, m) => ByteEdit::Flip(*n, 1 << (m % 8)),
                    TreeEdit::Remove(n) => ByteEdit::Flip(*n, 0x80),
                })
                .collect();
            apply_bytes(seed, &flips)
        }
        Mutation::Bytes(edits) => apply_bytes(seed, edits),
        Mutation::Random(bytes) => bytes.clone(),
    }
}

// ------------------------------------------------------------------ the store protocol

struct Store {
    addr: String,
    secret: JobSecret,
}

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| serve(JobSecret::generate()))
}

/// A store server on loopback for the rest of the run, proving `secret`.
fn serve(secret: JobSecret) -> Store {
    let server = StoreServer::start("127.0.0.1:0", &secret).unwrap();
    Store {
        addr: server.addr.to_string(),
        secret,
    }
}

/// What a fuzzed connection sends: raw bytes, or a request-shaped frame with chosen lengths.
#[derive(Debug, Clone)]
enum Frame {
    Raw(Vec<u8>),
    Request {
        op: u8,
        key_len: u64,
        key: Vec<u8>,
        val_len: u64,
        val: Vec<u8>,
    },
}

fn length() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..64u64,
        Just(4096),
        Just(4097),
        Just(1 << 20),
        Just((1 << 20) + 1),
        Just(1 << 40),
        any::<u64>()
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    let bytes = || proptest::collection::vec(any::<u8>(), 0..80);
    prop_oneof![
        bytes().prop_map(Frame::Raw),
        (0..6u8, length(), bytes(), length(), bytes()).prop_map(
            |(op, key_len, key, val_len, val)| Frame::Request {
                op,
                key_len,
                key,
                val_len,
                val,
            }
        ),
    ]
}

fn frame_bytes(frames: &[Frame]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        match f {
            Frame::Raw(b) => out.extend_from_slice(b),
            Frame::Request {
                op,
                key_len,
                key,
                val_len,
                val,
            } => {
                out.push(*op);
                out.extend_from_slice(&key_len.to_le_bytes());
                out.extend_from_slice(key);
                out.extend_from_slice(&val_len.to_le_bytes());
                out.extend_from_slice(val);
            }
        }
    }
    out
}

/// Sends `bytes` to the store (after a real handshake when `authenticated`), closes, then checks a
/// legitimate client still sets and gets a key.
fn store_case(authenticated: bool, bytes: Vec<u8>, case: u64) {
    let s = store();
    let mut conn = TcpStream::connect(&s.addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    conn.set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    if authenticated {
        client_handshake(
            &mut conn,
            &s.secret,
            "store",
            STORE_CLIENT,
            std::time::Instant::now() + Duration::from_secs(5),
        )
        .unwrap();
    }
    // The server may close first (a refused length): a failed write is fine.
    let _ = conn.write_all(&bytes);
    let _ = conn.shutdown(std::net::Shutdown::Write);
    drop(conn);
    let client = StoreClient::connect(&s.addr, &s.secret, Duration::from_secs(5)).unwrap();
    let key = format!("fuzz/{case}");
    client.set(&key, &case.to_le_bytes()).unwrap();
    assert_eq!(client.get(&key).unwrap(), case.to_le_bytes());
}

proptest! {
    #![proptest_config(runner(96))]

    /// Garbage frames, before and after a handshake: the store keeps serving a legitimate client.
    #[test]
    fn store_protocol_survives_garbage_frames(
        authenticated in any::<bool>(),
        frames in proptest::collection::vec(frame(), 1..4),
        case in any::<u64>(),
    ) {
        let bytes = frame_bytes(&frames);
        within("store", move || store_case(authenticated, bytes, case));
    }
}

// ------------------------------------------------------------------ the peer handshake

const AUTH_MAGIC: &[u8; 8] = b"TITANAU1";

/// A pair of connected Unix sockets, both with 2 s timeouts.
fn socket_pair() -> (UnixStream, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    }
    (a, b)
}

/// `bytes` written into one end, which is then closed for writing and drained.
fn feed(mut end: UnixStream, bytes: &[u8]) {
    let _ = end.write_all(bytes);
    let _ = end.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = end.read_to_end(&mut sink);
}

fn handshake_bytes() -> impl Strategy<Value = Vec<u8>> {
    let tail = || proptest::collection::vec(any::<u8>(), 0..200);
    prop_oneof![
        tail(),
        tail().prop_map(|t| [AUTH_MAGIC.as_slice(), &t].concat()),
    ]
}

proptest! {
    #![proptest_config(runner(128))]

    /// Random bytes into either side of the handshake: an error, never a panic or a hang.
    #[test]
    fn peer_handshake_refuses_garbage(bytes in handshake_bytes(), as_server in any::<bool>()) {
        let result = within("handshake", move || {
            let secret = JobSecret::generate();
            let (a, mut b) = socket_pair();
            let feeder = std::thread::spawn(move || feed(a, &bytes));
            let r = if as_server {
                server_handshake(&mut b, &secret, "group/fuzz-g0", std::time::Instant::now() + Duration::from_secs(2)).map(|_| ())
            } else {
                client_handshake(&mut b, &secret, "group/fuzz-g0", 1, std::time::Instant::now() + Duration::from_secs(2))
            };
            drop(b);
            feeder.join().unwrap();
            r
        });
        prop_assert!(result.is_err());
    }
}

/// Random bytes, or headers of random index and length, on the socket data path after a
/// handshake (`comm::frame`): a message of the expected length is read or an error returned,
/// never a panic, a hang or an allocation the header asked for.
fn frame_stream() -> impl Strategy<Value = Vec<u8>> {
    let header = (
        any::<u64>(),
        length(),
        proptest::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(index, len, body)| {
            [index.to_le_bytes().as_slice(), &len.to_le_bytes(), &body].concat()
        });
    prop_oneof![proptest::collection::vec(any::<u8>(), 0..200), header]
}

proptest! {
    #![proptest_config(runner(128))]

    #[test]
    fn framed_links_refuse_garbage(bytes in frame_stream(), expected in 0usize..64) {
        let got = within("frame", move || {
            let (a, b) = socket_pair();
            let feeder = std::thread::spawn(move || feed(a, &bytes));
            let mut reader = titan::comm::frame::FramedReader::new(titan::comm::conn::Conn::Unix(b));
            let mut buf = vec![0u8; expected];
            let r = reader.recv(&mut buf).map(|_| buf.len());
            drop(reader);
            feeder.join().unwrap();
            r.ok()
        });
        // A message is accepted only when its header says index 0 and exactly this length.
        if let Some(len) = got {
            prop_assert_eq!(len, expected);
        }
    }
}

// ------------------------------------------------------------------ direct-read phase messages

/// Floats in the fuzzed all-reduce.
const PHASE_LEN: usize = 64;
/// Real, readable memory for a fuzzed phase message to point at.
static PEER_FLOATS: [f32; PHASE_LEN] = [0.5; PHASE_LEN];

/// The store of the phase-message cases, with a fixed secret so their Unix sockets share one
/// private folder from run to run.
fn phase_store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| serve(JobSecret::from_hex(&"c1".repeat(32), "fuzz secret").unwrap()))
}

/// What a peer may send where a direct-read collective expects its 32-byte phase message
/// (collective number, phase, address, length): each word right or wrong, the address anywhere
/// (0, unmapped, the top of memory where an offset overflows, real memory), or a message of
/// another length.
fn phase_message() -> impl Strategy<Value = Vec<u8>> {
    fn word(right: u64) -> impl Strategy<Value = u64> {
        // Mostly right, so that the address behind a well-formed header gets read.
        prop_oneof![6 => Just(right), 1 => Just(right + 1), 1 => Just(u64::MAX), 1 => any::<u64>()]
    }
    let real = PEER_FLOATS.as_ptr() as u64;
    let address = prop_oneof![
        2 => Just(real),
        1 => Just(0u64),
        2 => Just(u64::MAX - 3),
        1 => Just(1u64 << 47),
        1 => any::<u64>()
    ];
    let message =
        (word(0), word(0), address, word(PHASE_LEN as u64)).prop_map(|(seq, phase, addr, len)| {
            [seq, phase, addr, len]
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect()
        });
    prop_oneof![
        3 => message,
        1 => proptest::collection::vec(any::<u8>(), 0..16).prop_map(|b| [b.as_slice(), &[0; 4]].concat()),
    ]
}

/// The direct-read collectives a fuzzed phase message can meet.
const PHASE_OPS: [&str; 3] = ["all_reduce", "all_gather", "reduce_scatter"];

/// Rank `real` runs collective `op` by direct reads while the other rank (this test) sends
/// `message` where its first phase message belongs, then leaves. The real rank's answer.
fn collective_against(
    message: Vec<u8>,
    case: u64,
    op: &'static str,
    real: usize,
) -> anyhow::Result<()> {
    use titan::comm::group::{ProcessGroup, ReduceOp, TcpGroup};
    let s = phase_store();
    let name = format!("phase-fuzz-{}-{case}", std::process::id());
    let join = |rank: usize| {
        let (addr, secret, name) = (s.addr.clone(), s.secret.clone(), name.clone());
        move || {
            let store = StoreClient::connect(&addr, &secret, Duration::from_secs(5)).unwrap();
            let t = Duration::from_secs(2);
            TcpGroup::connect(
                &store,
                &name,
                rank,
                2,
                "127.0.0.1",
                Duration::from_secs(10),
                t,
            )
            .unwrap()
        }
    };
    let peer = std::thread::spawn({
        let connect = join(1 - real);
        move || {
            let g = connect();
            // Whole floats: the socket path carries f32s (the zeros pad a ragged tail).
            let floats: Vec<f32> = message
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let _ = g.send(&floats, real);
        }
    });
    let g = join(real)();
    assert!(
        g.uses_cross_memory_attach(),
        "this machine refuses direct reads between threads of one process"
    );
    let input = vec![1.0f32; PHASE_LEN];
    let result = match op {
        "all_reduce" => g.all_reduce(&mut input.clone(), ReduceOp::Sum),
        "all_gather" => g.all_gather(&input[..PHASE_LEN / 2], &mut [0.0; PHASE_LEN]),
        _ => g.reduce_scatter(&input, &mut [0.0; PHASE_LEN / 2], ReduceOp::Sum),
    };
    peer.join().unwrap();
    result
}

proptest! {
    #![proptest_config(runner(64))]

    /// Garbage where a direct-read collective's phase message belongs (`comm::group`): an error
    /// naming the collective and the peer, never a panic (an address whose offsets overflow
    /// included), a hang or a read of the wrong length.
    #[test]
    fn direct_read_phase_messages_refuse_garbage(
        message in phase_message(),
        op in proptest::sample::select(PHASE_OPS.to_vec()),
        real in 0usize..2,
    ) {
        static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let case = CASE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let result = within("phase message", move || {
            collective_against(message, case, op, real).map_err(|e| format!("{e:#}"))
        });
        // Every case ends in an error: the peer leaves after its first message.
        let e = result.unwrap_err();
        let peer = format!("rank {}", 1 - real);
        prop_assert!(e.contains(&format!("{op} on group")) && e.contains(&peer), "{}", e);
    }
}

// ------------------------------------------------------------------ checkpoints

/// A micro model: a checkpoint of it is a few tens of KiB.
fn micro_args() -> ModelArgs {
    ModelArgs {
        dim: 16,
        n_layers: 1,
        n_heads: 2,
        n_kv_heads: 1,
        vocab_size: 260,
        ffn_hidden: 32,
        max_seq_len: 64,
        ..titan::model::families::llama3::flavor("debugmodel").unwrap()
    }
}

/// Seeds written once: a single-file checkpoint, its sharded twin, an HF export and a Parquet file.
struct Seeds {
    _dir: tempfile::TempDir,
    single: PathBuf,
    sharded: PathBuf,
    hf: PathBuf,
    parquet: Vec<u8>,
}

fn seeds() -> &'static Seeds {
    static SEEDS: OnceLock<Seeds> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let single = write_micro_checkpoint(&dir.path().join("single"));
        let sharded = copy_dir(&single, &dir.path().join("sharded"));
        make_sharded(&sharded);
        let hf = dir.path().join("hf");
        checkpoint::hf::export(&single, &hf, titan::tensor::DType::F32).unwrap();
        let parquet_path = dir.path().join("seed.parquet");
        let texts: Vec<String> = (0..12).map(|i| format!("parquet row {i} ✓")).collect();
        titan::data::parquet::write_text_parquet(&parquet_path, &texts).unwrap();
        Seeds {
            parquet: std::fs::read(&parquet_path).unwrap(),
            _dir: dir,
            single,
            sharded,
            hf,
        }
    })
}

fn write_micro_checkpoint(folder: &Path) -> PathBuf {
    let be = CpuBackend::new();
    let args = micro_args();
    let specs = titan::model::params::param_specs(&args);
    let mut params = ParamSet::zeros(&be, &specs);
    for (i, buf) in params.bufs.iter_mut().enumerate() {
        for (j, x) in buf.iter_mut().enumerate() {
            *x = ((i * 31 + j) % 17) as f32 * 0.01;
        }
    }
    let moments = ParamSet::zeros(&be, &specs);
    let state = TrainState {
        format_version: checkpoint::FORMAT_VERSION,
        step: 1,
        model_args: args,
        seed: 7,
        data: LoaderState {
            epoch: 0,
            consumed: 2,
            buffer: vec![1, 2, 3, 256],
        },
        tokenizer_path: String::new(),
        sharding: None,
        files: Default::default(),
        expert_bias: None,
        optimizer: None,
    };
    checkpoint::save(&be, folder, &params, &moments, &moments, state, 0).unwrap()
}

fn copy_dir(dir: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to.to_path_buf()
}

/// Rewrites `dir/state.json` with a matching `state.json.sha256` (a crafted checkpoint).
fn write_state(dir: &Path, text: &[u8]) {
    std::fs::write(dir.join("state.json"), text).unwrap();
    let line = format!("{}  state.json\n", sha256_hex(text));
    std::fs::write(dir.join("state.json.sha256"), line).unwrap();
}

fn read_state_value(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("state.json")).unwrap()).unwrap()
}

/// The single-file checkpoint `dir` as a sharded one of one writer (an FSDP save of one rank).
fn make_sharded(dir: &Path) {
    let mut files = serde_json::Map::new();
    let mut tensors = serde_json::Map::new();
    for kind in ["model", "optimizer"] {
        let whole = dir.join(format!("{kind}.safetensors"));
        let flat: Vec<(String, titan::tensor::Tensor)> = checkpoint::st::read_file(&whole)
            .unwrap()
            .into_iter()
            .map(|(n, t)| {
                if kind == "model" {
                    let spec = serde_json::json!({"shape": t.shape, "shard_len": t.numel()});
                    tensors.insert(n.clone(), spec);
                }
                let v = t.to_f32_vec();
                (n, titan::tensor::Tensor::from_f32(vec![v.len()], v))
            })
            .collect();
        let bytes = checkpoint::st::to_bytes(&flat, None).unwrap();
        let name = format!("{kind}-rank0.safetensors");
        std::fs::write(dir.join(&name), &bytes).unwrap();
        std::fs::remove_file(whole).unwrap();
        let check = serde_json::json!({"bytes": bytes.len(), "crc32": crc32fast::hash(&bytes)});
        files.insert(name, check);
    }
    let mut state = read_state_value(dir);
    state["files"] = Value::Object(files);
    state["sharding"] = serde_json::json!({"shards": 1, "tp_parts": 1, "tensors": tensors});
    write_state(dir, &serde_json::to_vec_pretty(&state).unwrap());
}

/// Which file of a checkpoint a case mutates.
#[derive(Debug, Clone, Copy)]
enum CheckpointFile {
    /// `state.json` (with a matching SHA-256 when `resign`).
    State { sharded: bool, resign: bool },
    /// A safetensors file, with `state.json`'s size and CRC32 updated to match.
    Tensors { sharded: bool, optimizer: bool },
}

fn checkpoint_file() -> impl Strategy<Value = CheckpointFile> {
    prop_oneof![
        3 => (any::<bool>(), prop::bool::weighted(0.85))
            .prop_map(|(sharded, resign)| CheckpointFile::State { sharded, resign }),
        2 => (any::<bool>(), any::<bool>())
            .prop_map(|(sharded, optimizer)| CheckpointFile::Tensors { sharded, optimizer }),
    ]
}

/// A copy of the seed checkpoint with `file` mutated by `m`.
fn mutated_checkpoint(to: &Path, file: CheckpointFile, m: &Mutation) -> PathBuf {
    let s = seeds();
    let sharded = match file {
        CheckpointFile::State { sharded, .. } | CheckpointFile::Tensors { sharded, .. } => sharded,
    };
    let dir = copy_dir(if sharded { &s.sharded } else { &s.single }, to);
    match file {
        CheckpointFile::State { resign, .. } => {
            let text = mutate_json(&std::fs::read(dir.join("state.json")).unwrap(), m);
            if resign {
                write_state(&dir, &text);
            } else {
                std::fs::write(dir.join("state.json"), text).unwrap();
            }
        }
        CheckpointFile::Tensors { optimizer, .. } => {
            let kind = if optimizer { "optimizer" } else { "model" };
            let name = if sharded {
                format!("{kind}-rank0.safetensors")
            } else {
                format!("{kind}.safetensors")
            };
            let bytes = mutate_bytes(&std::fs::read(dir.join(&name)).unwrap(), m);
            std::fs::write(dir.join(&name), &bytes).unwrap();
            let mut state = read_state_value(&dir);
            state["files"][&name] =
                serde_json::json!({"bytes": bytes.len(), "crc32": crc32fast::hash(&bytes)});
            write_state(&dir, &serde_json::to_vec_pretty(&state).unwrap());
        }
    }
    dir
}

/// Every way titan reads a checkpoint folder, each allowed to fail but not to panic.
fn read_checkpoint_every_way(dir: &Path) {
    let be = CpuBackend::new();
    let args = micro_args();
    if let Ok(state) = checkpoint::read_state(dir) {
        let cfg = Config::load(None, &[]).unwrap();
        let mut loader =
            DataLoader::from_config(&cfg, Box::new(ByteTokenizer), args.vocab_size, 0, 1).unwrap();
        let _ = loader.restore(state.data);
    }
    let _ = checkpoint::load_weights(&be, dir);
    let _ = checkpoint::HostCheckpoint::read(dir, &args);
}

proptest! {
    #![proptest_config(runner(160))]

    /// Mutated `state.json` (single-file and sharded index) and safetensors files: every reader
    /// returns, `Ok` or `Err`.
    #[test]
    fn checkpoint_reader_survives_mutated_files(file in checkpoint_file(), m in mutation()) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = mutated_checkpoint(&tmp.path().join("step-1"), file, &m);
        within("checkpoint", move || read_checkpoint_every_way(&dir));
    }
}

// ------------------------------------------------------------------ HF config.json

proptest! {
    #![proptest_config(runner(256))]

    /// Mutated HF `config.json` values straight into the reader of model arguments.
    #[test]
    fn hf_config_reader_survives_mutated_configs(m in mutation()) {
        let text = mutate_json(&corpus("config.json"), &m);
        if let Ok(v) = serde_json::from_slice::<Value>(&text) {
            let _ = within("hf config", move || {
                checkpoint::hf::args_from_hf_config(&v, Path::new("config.json")).map(|_| ())
            });
        }
    }
}

proptest! {
    #![proptest_config(runner(64))]

    /// Mutated `config.json` in an exported HF folder, read whole (as `convert hf-import`).
    #[test]
    fn hf_import_survives_mutated_configs(m in mutation()) {
        let tmp = tempfile::tempdir().unwrap();
        let hf = copy_dir(&seeds().hf, &tmp.path().join("hf"));
        let text = mutate_json(&std::fs::read(hf.join("config.json")).unwrap(), &m);
        std::fs::write(hf.join("config.json"), text).unwrap();
        let _ = within("hf import", move || checkpoint::hf::read_hf(&hf).map(|_| ()));
    }
}

// ------------------------------------------------------------------ the TOML config

proptest! {
    #![proptest_config(runner(256))]

    /// Mutated TOML through the config loader (and the model arguments it names).
    #[test]
    fn toml_config_loader_survives_mutated_files(m in mutation()) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("job.toml");
        std::fs::write(&path, mutate_toml(&corpus("config.toml"), &m)).unwrap();
        within("config", move || {
            if let Ok(cfg) = Config::load(Some(&path), &[]) {
                let _ = cfg.model_args();
            }
        });
    }

    /// Random `--section.key value` overrides on top of the built-in defaults.
    #[test]
    fn toml_overrides_survive_random_values(
        key in prop::sample::select(vec![
            "training.seq_len", "training.local_batch_size", "model.vocab_size", "model.dim",
            "model.n_heads", "parallelism.tensor_parallel_degree", "optimizer.lr",
            "checkpoint.interval", "model.rope_theta", "nope.nothing", "training",
        ]),
        value in prop::sample::select(TOKENS.to_vec()),
    ) {
        let args = vec![format!("--{key}"), value.to_string()];
        within("overrides", move || {
            if let Ok(cfg) = Config::load(None, &args) {
                let _ = cfg.model_args();
            }
        });
    }
}

// ------------------------------------------------------------------ data files

/// Reads up to `limit` documents of `source`, stopping at the first error.
fn drain(mut source: impl DocumentSource, limit: usize) {
    for _ in 0..limit {
        match source.next_document() {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
    }
}

/// A training loader over `path` (batches of 2 windows of 8 tokens) run for a few batches.
fn load_batches(dataset: &str, path: &Path) {
    let mut cfg = Config::load(None, &[]).unwrap();
    cfg.training.dataset = dataset.into();
    cfg.training.dataset_path = path.display().to_string();
    cfg.training.local_batch_size = 2;
    cfg.training.seq_len = 8;
    if let Ok(mut loader) = DataLoader::from_config(&cfg, Box::new(ByteTokenizer), 258, 0, 1) {
        for _ in 0..4 {
            if loader.next_batch().is_err() {
                return;
            }
        }
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

proptest! {
    #![proptest_config(runner(192))]

    /// Mutated JSONL (plain or gzipped, the gzip stream itself sometimes mutated) and text files.
    #[test]
    fn jsonl_and_text_readers_survive_mutated_files(
        m in mutation(),
        form in 0..4u8,
        gz_edits in proptest::collection::vec(byte_edit(), 0..3),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let (seed, name) = if form == 3 { ("data.txt", "x.txt") } else { ("data.jsonl", "x.jsonl") };
        let mut bytes = mutate_bytes(&corpus(seed), &m);
        let name = if form == 2 {
            bytes = apply_bytes(&gzip(&bytes), &gz_edits);
            "x.jsonl.gz"
        } else {
            name
        };
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        within("jsonl/text", move || {
            if form == 3 {
                drain(TextSource::open(&path).unwrap(), 64);
                load_batches("text", &path);
            } else {
                drain(JsonlSource::open(&path).unwrap(), 64);
                load_batches("jsonl", &path);
            }
        });
    }
}

proptest! {
    #![proptest_config(runner(512))]

    /// Mutated Parquet files: the decoder's errors and panics are errors naming the file.
    #[test]
    fn parquet_reader_survives_mutated_files(m in byte_mutation()) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("x.parquet");
        std::fs::write(&path, mutate_bytes(&seeds().parquet, &m)).unwrap();
        within("parquet", move || {
            match ParquetSource::open(&path) {
                Ok(source) => drain(source, 64),
                Err(e) => assert!(format!("{e:#}").contains("x.parquet"), "{e:#}"),
            }
            load_batches("parquet", &path);
        });
    }
}

// ------------------------------------------------------------------ schedules, tokenizers, shards

/// PyTorch's DualPipeV dump: overlap cells, reduction and transfer cells.
const SCHEDULE_SEED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/dualpipev_pp2_mb4.csv"
);

proptest! {
    #![proptest_config(runner(512))]

    /// Mutated pipeline schedule CSVs: an error, or a schedule that passed its own checks.
    #[test]
    fn pipeline_csv_reader_survives_mutated_files(m in mutation()) {
        let bytes = mutate_bytes(&std::fs::read(SCHEDULE_SEED).unwrap(), &m);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        within("pipeline csv", move || {
            if let Ok(s) = Schedule::from_csv(&text, "x.csv") {
                s.check().unwrap();
                let _ = s.unit_bubble();
            }
        });
    }
}

/// Stage and microbatch numbers far beyond the file's actions are refused at once, never sized.
#[test]
fn pipeline_csv_with_huge_numbers_is_refused_at_once() {
    for text in [
        "0F0,0B0,0F999999999999,0B999999999999\n",
        "0F0,0B0\n18446744073709551615F0,18446744073709551615B0\n",
        "0F18446744073709551615\n",
    ] {
        let t = text.to_string();
        let e = within("huge csv", move || {
            Schedule::from_csv(&t, "x.csv").map(|_| ())
        });
        assert!(e.is_err(), "{text}");
    }
}

/// A byte-level BPE `tokenizer.json` trained on the text seed (the `tokenizers` crate's format).
fn tokenizer_seed() -> &'static [u8] {
    static SEED: OnceLock<Vec<u8>> = OnceLock::new();
    SEED.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("tokenizer.json");
        titan::data::bpe::train_bpe(&Path::new(CORPUS).join("data.txt"), 300, &out).unwrap();
        std::fs::read(out).unwrap()
    })
}

proptest! {
    #![proptest_config(runner(128))]

    /// Mutated `tokenizer.json` files: an error naming the file, or a tokenizer that encodes.
    #[test]
    fn tokenizer_json_reader_survives_mutated_files(m in mutation()) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("tokenizer.json");
        std::fs::write(&path, mutate_json(tokenizer_seed(), &m)).unwrap();
        within("tokenizer.json", move || {
            match titan::data::load_tokenizer(path.to_str().unwrap()) {
                Ok(t) => {
                    let _ = t.encode("the cat sat ✓");
                }
                Err(e) => assert!(format!("{e:#}").contains("tokenizer"), "{e:#}"),
            }
        });
    }

    /// Mutated pre-tokenized `.bin` shards (uint16 and uint32): the loader's errors name the
    /// shard (odd lengths, ids outside the vocabulary), never a panic.
    #[test]
    fn token_shards_survive_mutated_files(m in byte_mutation(), wide in any::<bool>()) {
        let tmp = tempfile::tempdir().unwrap();
        let seed: Vec<u8> = (0u32..200)
            .flat_map(|t| if wide { t.to_le_bytes().to_vec() } else { (t as u16).to_le_bytes().to_vec() })
            .collect();
        std::fs::write(tmp.path().join("00.bin"), mutate_bytes(&seed, &m)).unwrap();
        let dir = tmp.path().to_path_buf();
        within("token shards", move || {
            load_batches(if wide { "tokens_u32" } else { "tokens_u16" }, &dir);
        });
    }
}

/// The seeds themselves are valid: every target starts from an input its reader accepts.
#[test]
fn fuzz_seeds_are_valid() {
    let s = seeds();
    checkpoint::read_state(&s.single).unwrap();
    checkpoint::HostCheckpoint::read(&s.sharded, &micro_args()).unwrap();
    checkpoint::hf::read_hf(&s.hf).unwrap();
    let hf: Value = serde_json::from_slice(&corpus("config.json")).unwrap();
    checkpoint::hf::args_from_hf_config(&hf, Path::new("config.json")).unwrap();
    let cfg = Config::load(Some(&Path::new(CORPUS).join("config.toml")), &[]).unwrap();
    cfg.model_args().unwrap();
    let mut jsonl = JsonlSource::open(&Path::new(CORPUS).join("data.jsonl")).unwrap();
    assert!(jsonl.next_document().unwrap().is_some());
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("seed.parquet");
    std::fs::write(&p, &s.parquet).unwrap();
    let mut parquet = ParquetSource::open(&p).unwrap();
    assert_eq!(parquet.next_document().unwrap().unwrap(), "parquet row 0 ✓");
    let csv = std::fs::read_to_string(SCHEDULE_SEED).unwrap();
    Schedule::from_csv(&csv, "seed.csv").unwrap();
    let tok = tmp.path().join("tokenizer.json");
    std::fs::write(&tok, tokenizer_seed()).unwrap();
    titan::data::load_tokenizer(tok.to_str().unwrap()).unwrap();
}
