//! The `titan` command as a user runs it: exit codes and messages for bad input, generation,
//! tokenizer training, a Llama 3-format tokenizer.json, and the benchmark.

mod common;

use std::process::{Command, Output};

use common::titan_bin;

fn titan(args: &[&str]) -> Output {
    Command::new(titan_bin())
        .args(args)
        .output()
        .expect("run titan")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn train_tiny(dump: &str, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--job.dump_folder", dump];
    args.extend_from_slice(common::TINY_ARGS);
    args.extend_from_slice(extra);
    titan(&args)
}

#[test]
fn a_405b_model_is_refused_before_allocating_with_the_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let o = titan(&[
        "train",
        "--model.flavor",
        "405B",
        "--job.dump_folder",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("405B") && e.contains("GiB") && e.contains("available"),
        "{e}"
    );
}

#[test]
fn config_errors_exit_non_zero_naming_the_key() {
    let o = titan(&["train", "--training.stepz", "3"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("stepz"), "{}", stderr(&o));
    let o = titan(&["train", "--config", "/nonexistent.toml"]);
    assert!(!o.status.success() && stderr(&o).contains("/nonexistent.toml"));
}

#[test]
fn shipped_configs_parse() {
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/configs")).unwrap() {
        let p = entry.unwrap().path();
        titan::config::Config::load(Some(&p), &[])
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
}

#[test]
fn tokenizer_vocab_larger_than_the_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().to_str().unwrap();
    let o = train_tiny(
        dump,
        &["--model.vocab_size", "200", "--training.steps", "1"],
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("258") && e.contains("200") && e.contains("vocab_size"),
        "{e}"
    );
}

#[test]
fn train_then_generate_greedy_is_deterministic_and_json_is_parseable() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().to_str().unwrap();
    let o = train_tiny(dump, &["--training.steps", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("step     4") && out.contains("saved checkpoint"),
        "{out}"
    );
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--checkpoint",
            dump,
            "--prompt",
            "The cat",
            "--max-new-tokens",
            "12",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = titan(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let (a, b) = (gen(&[]), gen(&[]));
    assert_eq!(a, b);
    assert_eq!(a["prompt_ids"][0], 256);
    assert!(a["text"].is_string() && a["generated_ids"].is_array());
    let sampled = gen(&["--temperature", "1.0", "--top-k", "5", "--seed", "3"]);
    assert!(sampled["generated_ids"].as_array().unwrap().len() <= 12);
}

#[test]
fn generate_without_a_checkpoint_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let o = titan(&[
        "generate",
        "--checkpoint",
        dir.path().to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no complete checkpoint"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn trained_tokenizer_loads_and_trains_a_model() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    let text: String = (0..200)
        .map(|i| titan::data::synthetic::synthetic_document(1, i) + "\n")
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let tok = dir.path().join("tok/tokenizer.json");
    let o = titan(&[
        "tokenizer",
        "train",
        "--input",
        corpus.to_str().unwrap(),
        "--vocab-size",
        "290",
        "--output",
        tok.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let t = titan::data::tokenizer::HfTokenizer::from_file(&tok).unwrap();
    use titan::data::Tokenizer;
    let ids = t.encode("the old man finds the river").unwrap();
    assert!(
        ids.len() < "the old man finds the river".len(),
        "BPE merged nothing: {ids:?}"
    );
    assert_eq!(t.decode(&ids).unwrap(), "the old man finds the river");
    let dump = dir.path().join("run");
    let o = train_tiny(
        dump.to_str().unwrap(),
        &[
            "--model.tokenizer_path",
            tok.to_str().unwrap(),
            "--training.steps",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// GPT-2's byte → printable character map, which byte-level BPE vocabularies use.
fn byte_level_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars = vec!['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        if let Some(pos) = printable.iter().position(|&p| p == b) {
            chars[b as usize] = char::from_u32(printable[pos]).unwrap();
        } else {
            chars[b as usize] = char::from_u32(256 + extra).unwrap();
            extra += 1;
        }
    }
    printable.clear();
    chars
}

#[test]
fn llama3_format_tokenizer_json_loads() {
    // The structure of Meta's Llama 3 tokenizer.json (Split with the lookahead regex, then
    // ByteLevel), with a small vocabulary instead of 128k entries.
    let chars = byte_level_chars();
    let mut vocab = serde_json::Map::new();
    for (i, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    vocab.insert("Ġt".into(), 256.into());
    vocab.insert("he".into(), 257.into());
    vocab.insert("Ġthe".into(), 258.into());
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 259, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 260, "content": "<|end_of_text|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": true, "vocab": vocab, "merges": ["Ġ t", "h e", "Ġt he"]}
    });
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer.json");
    std::fs::write(&p, serde_json::to_string(&json).unwrap()).unwrap();
    let t = titan::data::tokenizer::HfTokenizer::from_file(&p).unwrap();
    use titan::data::Tokenizer;
    assert_eq!((t.bos_id(), t.eos_id(), t.vocab_size()), (259, 260, 261));
    let ids = t.encode("I see the sea   \n").unwrap();
    assert!(ids.contains(&258), "{ids:?}");
    assert_eq!(t.decode(&ids).unwrap(), "I see the sea   \n");
}

#[test]
fn bench_prints_throughput() {
    let o = titan(&[
        "bench", "train", "--batch", "1", "--seq", "64", "--steps", "2", "--warmup", "1", "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0 && v["gflops"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_attention_times_both_directions_and_refuses_bad_heads() {
    let o = titan(&[
        "bench",
        "attention",
        "--batch",
        "1",
        "--seq",
        "96",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in [
        "forward_ms",
        "backward_ms",
        "forward_tflops",
        "backward_tflops",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    let o = titan(&["bench", "attention", "--heads", "6", "--kv-heads", "4"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--heads 6 must be a positive multiple of --kv-heads 4"));
}

/// Launcher flags may follow the `--section.key VALUE` overrides (and the other way round).
#[test]
fn flags_and_overrides_come_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["train", "--job.dump_folder", dir.path().to_str().unwrap()];
    args.extend_from_slice(common::TINY_ARGS);
    args.extend([
        "--training.steps",
        "2",
        "--nproc",
        "2",
        "--checkpoint.enable",
        "false",
        "--master-port",
        "0",
        "--quiet",
    ]);
    let o = std::process::Command::new(common::titan_bin())
        .args(&args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(common::losses(dir.path()).len(), 2);
}

/// `titan plot` draws one or several runs' curves as an SVG, validation loss included.
#[test]
fn plot_draws_runs_side_by_side() {
    let runs: Vec<tempfile::TempDir> = ["8e-4", "3e-3"]
        .iter()
        .map(|lr| {
            let dir = tempfile::tempdir().unwrap();
            let o = train_tiny(
                dir.path().to_str().unwrap(),
                &[
                    "--training.steps",
                    "4",
                    "--optimizer.lr",
                    lr,
                    "--validation.enable",
                    "true",
                    "--validation.freq",
                    "2",
                    "--validation.steps",
                    "1",
                ],
            );
            assert!(o.status.success(), "{}", stderr(&o));
            dir
        })
        .collect();
    let out = runs[0].path().join("both.svg");
    let o = titan(&[
        "plot",
        runs[0].path().join("metrics.jsonl").to_str().unwrap(),
        runs[1].path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // Loss, validation loss, grad norm and tokens/s for each of the two runs.
    assert_eq!(svg.matches("<polyline").count(), 8, "{svg}");
    assert_eq!(svg.matches("stroke-dasharray").count(), 2);
    let o = titan(&["plot", "/no/such/metrics.jsonl"]);
    assert!(!o.status.success() && stderr(&o).contains("/no/such/metrics.jsonl"));
}

#[test]
fn pipeline_show_prints_the_bubble_and_draws_the_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("1f1b.svg");
    let o = titan(&[
        "pipeline",
        "show",
        "--schedule",
        "1F1B",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // (p − 1) / (m + p − 1) = 3/11.
    assert!(out.contains("bubble fraction 0.273"), "{out}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.starts_with("<svg") && drawn.contains("3B7"),
        "{drawn}"
    );
    let bubble = |schedule: &str| -> f64 {
        let o = titan(&[
            "pipeline",
            "show",
            "--schedule",
            schedule,
            "--pp",
            "4",
            "--microbatches",
            "8",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.split("bubble fraction ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{out}"))
    };
    for zb in ["InterleavedZeroBubble", "ZBVZeroBubble"] {
        assert!(bubble(zb) < 0.273, "{zb}");
    }
    // A custom schedule from a CSV file, and one that deadlocks.
    let csv = dir.path().join("s.csv");
    std::fs::write(&csv, "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n").unwrap();
    let o = titan(&["pipeline", "show", "--csv", csv.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::write(&csv, "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n").unwrap();
    let o = titan(&["pipeline", "show", "--csv", csv.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("deadlocks"), "{}", stderr(&o));
}
