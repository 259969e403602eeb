//! Shared helpers for integration tests: a tiny model config, runs of the `titan` binary, the
//! parity check between curves, and what a test does when a reference it needs is missing.
#![allow(dead_code)]

pub mod family_layouts;
pub mod hf_models;
pub mod pytorch_training;

use std::path::Path;
use std::process::Command;

use titan::config::Config;

/// Overrides that shrink the debug model to a tiny Llama (dim 64, 2 layers, GQA 4/2 heads, vocab 300).
pub const TINY_ARGS: &[&str] = &[
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.vocab_size",
    "300",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "32",
    "--lr_scheduler.warmup_steps",
    "3",
    "--checkpoint.interval",
    "5",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.log_freq",
    "1",
];

/// The tiny DeepSeek-V3 (with `TINY_ARGS`: dim 64, 2 blocks of which the first dense, 4 heads)
/// with small latents: queries through a latent of 24, key/value latent 16, heads 8 + 8 rotated
/// for queries and keys, 12 for values.
pub const TINY_DEEPSEEK: &[&str] = &[
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "debugmodel",
    "--model.q_lora_rank",
    "24",
    "--model.kv_lora_rank",
    "16",
    "--model.qk_nope_head_dim",
    "8",
    "--model.qk_rope_head_dim",
    "8",
    "--model.v_head_dim",
    "12",
];

/// A layout to check: its name, its overrides, and what its run prints.
pub type Layout = (&'static str, &'static [&'static str], &'static str);

/// FSDP 2 (the same global batch: 2 sequences a rank), TP 2, and a 1F1B pipeline of 2 stages
/// with microbatches of one sequence.
pub const FSDP_TP_PP: [Layout; 3] = [
    (
        "FSDP 2",
        // The same global batch: 2 sequences a rank.
        &[
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--training.local_batch_size",
            "2",
        ],
        "FSDP",
    ),
    (
        "TP 2",
        &["--parallelism.tensor_parallel_degree", "2"],
        "tensor parallel",
    ),
    (
        "PP 2 (1F1B)",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
        ],
        "pipeline: ",
    ),
];

/// A uint32 token shard at `path`: `n` ids drawn from 0..300 (the tiny models' vocabulary).
pub fn write_random_tokens(path: &Path, n: usize, seed: u64) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| rng.gen_range(0..300u32).to_le_bytes())
        .collect();
    std::fs::write(path, bytes).unwrap();
}

/// The overrides that train on the uint32 token shard at `path`.
pub fn token_shard(path: &Path) -> [&str; 4] {
    [
        "--training.dataset",
        "tokens_u32",
        "--training.dataset_path",
        path.to_str().unwrap(),
    ]
}

/// Token rows of `seq + 1` ids as a command-line argument: ids joined by `,`, rows by `;`
/// (`scripts/hf_parity.py --tokens`, and the tests' inline scripts).
pub fn rows_arg(tokens: &[u32], seq: usize) -> String {
    tokens
        .chunks(seq + 1)
        .map(|r| {
            r.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect::<Vec<_>>()
        .join(";")
}

/// Greedy decoding of `new` tokens after `prompt` with titan's KV cache.
pub fn greedy_ids<B: titan::backend::Backend>(
    be: &B,
    model: &titan::model::Decoder<B>,
    params: &titan::model::ParamSet<B>,
    prompt: &[u32],
    new: usize,
) -> Vec<u32> {
    let mut cache = titan::model::KvCache::new(be, &model.args, prompt.len() + new);
    let mut logits = model
        .forward_cached(be, params, &mut cache, prompt)
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..new {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        ids.push(next);
        logits = model
            .forward_cached(be, params, &mut cache, &[next])
            .unwrap();
    }
    ids
}

/// A tiny Llama (dim 64, 2 layers, GQA 4/2 heads, vocab 300 > the byte tokenizer's 258) on the
/// synthetic corpus: fast enough for many runs per test.
pub fn tiny_config(dump: &Path, steps: u64) -> Config {
    let args: Vec<String> = TINY_ARGS.iter().map(|s| s.to_string()).collect();
    let mut c = Config::load(None, &args).unwrap();
    c.training.steps = steps;
    c.job.dump_folder = dump.display().to_string();
    c
}

pub fn quiet() -> titan::train::RunOptions {
    titan::train::RunOptions {
        quiet: true,
        stop_after: None,
    }
}

pub fn bits(losses: &[(u64, f64)]) -> Vec<(u64, u64)> {
    losses.iter().map(|&(s, l)| (s, l.to_bits())).collect()
}

/// Path of the built `titan` binary (integration tests get it from Cargo).
/// A port free on this host now (for a store the test's ranks meet at).
pub fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

pub fn titan_bin() -> &'static str {
    env!("CARGO_BIN_EXE_titan")
}

// ---- multi-process runs through the launcher (`titan train --nproc N`)

/// Per-step losses of a run's `metrics.jsonl`.
pub fn losses(dump: &std::path::Path) -> Vec<(u64, f64)> {
    metric(dump, "loss")
}

/// `(step, value)` of one key of every line of `metrics.jsonl` that has it (step lines, or
/// validation lines).
pub fn metric(dump: &std::path::Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(dump.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64().unwrap(), v.get(key)?.as_f64().unwrap()))
        })
        .collect()
}

pub fn train(dump: &std::path::Path, launcher: &[&str], extra: &[&str]) -> std::process::Output {
    train_env(dump, launcher, extra, &[])
}

/// `titan train` with `launcher` options, into `dump`, with the config overrides `overrides`.
pub fn train_command(dump: &std::path::Path, launcher: &[&str], overrides: &[&str]) -> Command {
    let mut cmd = Command::new(titan_bin());
    cmd.arg("train")
        .args(launcher)
        .args(["--job.dump_folder", dump.to_str().unwrap()])
        .args(overrides);
    cmd
}

pub fn train_env(
    dump: &std::path::Path,
    launcher: &[&str],
    extra: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut cmd = train_command(dump, launcher, &[TINY_ARGS, extra].concat());
    cmd.env("RAYON_NUM_THREADS", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Validation every 2 of 4 steps, 2 batches each (overrides).
pub const VALIDATE_TWICE: &[&str] = &[
    "--training.steps",
    "4",
    "--validation.enable",
    "true",
    "--validation.freq",
    "2",
    "--validation.steps",
    "2",
];

/// The two validation losses of `VALIDATE_TWICE` (applied last) with `single` in one process and
/// with `parallel` through `launcher` agree within 1e-5.
pub fn assert_validation_matches(
    single: &[&str],
    launcher: &[&str],
    parallel: &[&str],
    what: &str,
) {
    let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(one.path(), &[], &[single, VALIDATE_TWICE].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = train(many.path(), launcher, &[parallel, VALIDATE_TWICE].concat());
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v = metric(one.path(), "validation_loss");
    assert_eq!(v.len(), 2);
    assert_parity(&v, &metric(many.path(), "validation_loss"), what);
}

/// Per-step values of a parallel run within 1e-5 (relative) of one process's. Both curves must
/// have points and the same steps: two empty curves, or curves over other steps, are no parity.
pub fn assert_parity(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert!(
        !a.is_empty() && !b.is_empty(),
        "{what}: an empty curve (one process {} points, parallel {})",
        a.len(),
        b.len()
    );
    let steps = |c: &[(u64, f64)]| c.iter().map(|&(s, _)| s).collect::<Vec<_>>();
    assert_eq!(steps(a), steps(b), "{what}: the curves' steps differ");
    for ((s, x), (_, y)) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs(),
            "{what}, step {s}: one process {x}, parallel {y}"
        );
    }
}

/// Trains `single` in one process, then with `launcher` and the `parallel` overrides added, checks
/// that the parallel run's output says `says` (its layout) and that both loss and gradient-norm
/// curves agree within 1e-5.
pub fn assert_layout_matches_one_process(
    what: &str,
    single: &[&str],
    launcher: &[&str],
    parallel: &[&str],
    says: &str,
) {
    let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train(one.path(), &[], single);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = train(many.path(), launcher, &[single, parallel].concat());
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(says), "{what}: {out}");
    assert_parity(&losses(one.path()), &losses(many.path()), what);
    assert_parity(
        &metric(one.path(), "grad_norm"),
        &metric(many.path(), "grad_norm"),
        &format!("{what} (grad norm)"),
    );
}

// ---- references outside titan (Python packages, compilers)

/// Whether the tests run in CI: the `CI` variable is set (`.ci/run` exports `CI=true`).
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// A reference a test compares against is missing (`what` says which, and how to provide it).
/// In CI that fails the test, so a check that did not run is a red build; elsewhere it prints
/// `SKIPPED: {what}` and the caller returns.
pub fn reference_missing(what: &str) {
    reference_missing_in(in_ci(), what);
}

/// `reference_missing` with `in_ci` given (for testing it without changing the environment).
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
pub fn reference_missing_in(in_ci: bool, what: &str) {
    assert!(
        !in_ci,
        "{what}; CI is set, so the missing reference fails the test instead of skipping it"
    );
    eprintln!("SKIPPED: {what}");
}

/// The Python with torch and transformers for the Hugging Face parity tests: `TITAN_HF_PYTHON`
/// (default `python3`). None, after `reference_missing` (a failure in CI), when it cannot import
/// them.
pub fn hf_python() -> Option<String> {
    python_importing("torch, transformers", "this parity check")
}

/// The Python with torch and torchao for the float8 parity tests: `TITAN_HF_PYTHON` (default
/// `python3`), which CI installs torchao into. None, after `reference_missing` (a failure in CI),
/// when it cannot import them.
pub fn torchao_python() -> Option<String> {
    python_importing("torch, torchao.float8", "the float8 parity check")
}

/// `TITAN_HF_PYTHON` (default `python3`) when it can import `modules`; else `reference_missing`
/// saying what it is for, and None.
pub fn python_importing(modules: &str, purpose: &str) -> Option<String> {
    let py = std::env::var("TITAN_HF_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        reference_missing(&format!(
            "no Python with {modules} at `{py}` (set TITAN_HF_PYTHON to run {purpose})"
        ));
    }
    ok.then_some(py)
}

/// A `titan plan` CPU calibration of this host, shared by the test binaries (measured once, by
/// the first that needs it; `titan plan` measures again only on another host).
#[allow(dead_code)]
pub fn plan_calibration() -> std::path::PathBuf {
    static ONCE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plan_cpu.json");
        let o = Command::new(titan_bin())
            .args(["plan", "--nproc", "1", "--json", "--top", "1"])
            .env("TITAN_PLAN_CALIBRATION", &path)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        path
    })
    .clone()
}
