//! Supervised fine-tuning on chat data (`[training] dataset = "chat"`): rows render token for
//! token as transformers' `apply_chat_template` renders them with the tokenizer's own template (a
//! Llama 3 `tokenizer_config.json` with a small tokenizer made for the test), the assistant's
//! tokens are those transformers' rendering adds for each assistant turn, and training equals
//! PyTorch's with the prompt's labels at -100 (`cross_entropy(ignore_index=-100)`), step for step.

mod common;

use std::path::Path;

use common::pytorch_training::{python, train_both, Comparison};
use common::{assert_parity, hf_python, losses, titan_bin, train};

/// Meta-Llama-3-8B-Instruct's chat template.
const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// Writes a byte-level BPE tokenizer with Llama 3's special tokens and a `tokenizer_config.json`
/// carrying Llama 3's template into `dir`.
fn make_tokenizer(py: &str, dir: &Path) {
    let script = r#"
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
out, template = sys.argv[1], sys.argv[2]
specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
corpus = ["hello there, how are you today?", "the assistant answers questions about packing",
          "documents are packed whole into samples", "what is the capital of france? paris."] * 50
tok.train_from_iterator(corpus, trainer)
tok.save(f"{out}/tokenizer.json")
json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
           "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template},
          open(f"{out}/tokenizer_config.json", "w"))
"#;
    python(py, &["-c", script, dir.to_str().unwrap(), LLAMA3_TEMPLATE]);
}

/// Chat rows: single and multi-turn, a system turn, a prompt/response pair.
fn write_rows(path: &Path) {
    let questions = [
        "how are you today?",
        "what is the capital of france?",
        "are documents packed whole?",
    ];
    let answers = ["hello there, fine.", "paris.", "yes, into samples."];
    let mut lines = String::new();
    for i in 0..60 {
        let (q, a) = (questions[i % 3], answers[i % 3]);
        let row = match i % 3 {
            0 => serde_json::json!({"messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]}),
            1 => serde_json::json!({"messages": [
                {"role": "system", "content": "answer questions about packing"},
                {"role": "user", "content": q}, {"role": "assistant", "content": a},
                {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "the assistant answers."}]}),
            _ => serde_json::json!({"prompt": q, "response": a}),
        };
        lines.push_str(&format!("{row}\n"));
    }
    std::fs::write(path, lines).unwrap();
}

/// transformers' rendering of each row and its assistant tokens: for each assistant turn, the
/// tokens its rendering adds to the conversation before it (rendered with the generation prompt).
const TRANSFORMERS_RENDERING: &str = r#"
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
for line in open(sys.argv[2]):
    row = json.loads(line)
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                       {"role": "assistant", "content": row["response"]}]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        through = tok.apply_chat_template(messages[:i + 1], tokenize=True, return_dict=True)["input_ids"]
        assert ids[:len(through)] == through and through[:len(before)] == before
        for t in range(len(before), len(through)):
            mask[t] = 1
    print(json.dumps({"ids": ids, "assistant_mask": mask}))
"#;

#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn chat_rows_render_as_transformers_and_train_as_pytorch_with_the_prompt_ignored() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let tok_dir = dir.path().join("tokenizer");
    std::fs::create_dir(&tok_dir).unwrap();
    make_tokenizer(&py, &tok_dir);
    let rows = dir.path().join("chat.jsonl");
    write_rows(&rows);

    // titan's rendering, token for token transformers'.
    let out = std::process::Command::new(titan_bin())
        .args(["tokenizer", "chat", "--json", "--tokenizer"])
        .arg(&tok_dir)
        .arg("--input")
        .arg(&rows)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let theirs: Vec<serde_json::Value> = python(
        &py,
        &[
            "-c",
            TRANSFORMERS_RENDERING,
            tok_dir.to_str().unwrap(),
            rows.to_str().unwrap(),
        ],
    )
    .lines()
    .map(|l| serde_json::from_str(l).unwrap())
    .collect();
    assert_eq!(ours.len(), 60);
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a["ids"], b["ids"], "row {i}: ids");
        assert_eq!(
            a["assistant_mask"], b["assistant_mask"],
            "row {i}: assistant mask"
        );
    }

    // The stream training reads (the rows' tokens one after another) and which are targets.
    let ids: Vec<u32> = ours
        .iter()
        .flat_map(|r| {
            r["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
        })
        .collect();
    let counts: Vec<u8> = ours
        .iter()
        .flat_map(|r| {
            r["assistant_mask"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_u64().unwrap() as u8)
        })
        .collect();
    let tokens = dir.path().join("tokens.bin");
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&tokens, bytes).unwrap();
    let targets = dir.path().join("targets.bin");
    std::fs::write(&targets, &counts).unwrap();

    let tokenizer = tok_dir.join("tokenizer.json");
    let data = [
        "--model.tokenizer_path",
        tokenizer.to_str().unwrap(),
        "--training.dataset",
        "chat",
        "--training.dataset_path",
        rows.to_str().unwrap(),
    ];
    let bos = ids[0].to_string();
    let comparison = Comparison {
        dir: dir.path(),
        steps: "10",
        titan_data: &data,
        tokens: &tokens,
        targets: Some(&targets),
        make: None,
        document_start: Some(&bos),
        titan_extra: &[],
        python_extra: &[],
    };
    let curves = train_both(&py, &comparison);
    assert_eq!(curves.titan.0.len(), 10);
    assert_parity(&curves.pytorch.0, &curves.titan.0, "SFT loss vs PyTorch");
    let worst = curves.worst_loss_difference();
    eprintln!("SFT vs PyTorch (ignore_index=-100): largest relative loss difference {worst:.2e}");
}

/// A tokenizer made by `titan tokenizer train`, with Llama 3's template beside it (no Python).
fn titan_tokenizer(dir: &Path) -> std::path::PathBuf {
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "hello there, how are you today?\n".repeat(20)).unwrap();
    let file = dir.join("tokenizer.json");
    let o = std::process::Command::new(titan_bin())
        .args(["tokenizer", "train", "--vocab-size", "280", "--input"])
        .arg(&corpus)
        .arg("--output")
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let config =
        serde_json::json!({"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    file
}

/// Bad chat data is an error naming the file and line (or the template's file); a chat dataset
/// without a tokenizer names the key.
#[test]
fn bad_chat_rows_are_refused_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = titan_tokenizer(dir.path());
    let refused = |rows: &str, extra: &[&str], says: &[&str]| {
        let data = dir.path().join("rows.jsonl");
        std::fs::write(&data, rows).unwrap();
        let dump = tempfile::tempdir().unwrap();
        let base = [
            "--training.dataset",
            "chat",
            "--training.dataset_path",
            data.to_str().unwrap(),
            "--model.tokenizer_path",
            tokenizer.to_str().unwrap(),
            "--training.steps",
            "1",
        ];
        let o = train(dump.path(), &[], &[&base[..], extra].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{rows}: trained");
        for s in says {
            assert!(err.contains(s), "{rows}: {err}");
        }
    };
    let ok = r#"{"prompt": "hi", "response": "hello"}"#;
    let user_only = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    // After a good row and a blank line; sequences of 256 need more than the first row.
    let long = ["--training.seq_len", "256"];
    refused(
        &format!("{ok}\n\n{user_only}\n"),
        &long,
        &["rows.jsonl:3", "no assistant turn"],
    );
    let robot = r#"{"messages": [{"role": "robot", "content": "hi"}]}"#;
    refused(
        &format!("{robot}\n"),
        &[],
        &["rows.jsonl:1", "unknown role `robot`"],
    );
    refused("{\"text\": 1}\n", &[], &["rows.jsonl:1", "`messages`"]);
    refused(ok, &["--model.tokenizer_path", ""], &["tokenizer_path"]);
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({"chat_template": "{{ raise_exception('system turns only') }}"})
            .to_string(),
    )
    .unwrap();
    refused(ok, &[], &["tokenizer_config.json", "system turns only"]);
}

/// Chat rows in Parquet (`prompt` and `response` columns) train bit for bit as the same rows in
/// JSONL do.
#[test]
fn parquet_chat_rows_train_as_jsonl_rows_do() {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = titan_tokenizer(dir.path());
    let pairs: Vec<(String, String)> = (0..40)
        .map(|i| (format!("how are you {i}?"), format!("hello there, {i}.")))
        .collect();
    let jsonl = dir.path().join("rows.jsonl");
    let lines: String = pairs
        .iter()
        .map(|(p, r)| format!("{}\n", serde_json::json!({"prompt": p, "response": r})))
        .collect();
    std::fs::write(&jsonl, lines).unwrap();
    let parquet = dir.path().join("rows.parquet");
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message schema { REQUIRED BYTE_ARRAY prompt (UTF8); REQUIRED BYTE_ARRAY response (UTF8); }",
        )
        .unwrap(),
    );
    let file = std::fs::File::create(&parquet).unwrap();
    let props = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for column in [0, 1] {
        let values: Vec<ByteArray> = pairs
            .iter()
            .map(|p| {
                ByteArray::from(if column == 0 {
                    p.0.as_str()
                } else {
                    p.1.as_str()
                })
            })
            .collect();
        let mut col = group.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
    let run = |data: &Path| {
        let dump = tempfile::tempdir().unwrap();
        let args = [
            "--training.dataset",
            "chat",
            "--training.dataset_path",
            data.to_str().unwrap(),
            "--model.tokenizer_path",
            tokenizer.to_str().unwrap(),
            "--training.steps",
            "3",
        ];
        let o = train(dump.path(), &[], &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        common::bits(&losses(dump.path()))
    };
    assert_eq!(run(&parquet), run(&jsonl));
}
