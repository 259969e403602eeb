//! Shared helpers for integration tests: a tiny model config and a temporary dump folder.
#![allow(dead_code)]

use std::path::Path;

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
pub fn titan_bin() -> &'static str {
    env!("CARGO_BIN_EXE_titan")
}
