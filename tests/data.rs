//! Every dataset format trains and resumes exactly; malformed data fails with the file and line.

mod common;

use std::io::Write;
use std::path::Path;

use common::{quiet, tiny_config};
use titan::config::Config;
use titan::data::{ByteTokenizer, DataLoader};
use titan::train::train;

fn write_text(dir: &Path) -> String {
    let p = dir.join("corpus.txt");
    let text: String = (0..60)
        .map(|i| format!("line {i}: the quick brown fox jumps over the lazy dog\n\n"))
        .collect();
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

fn jsonl_lines() -> String {
    (0..60)
        .map(|i| format!("{{\"text\": \"record {i} says hello to the world\", \"id\": {i}}}\n"))
        .collect()
}

fn write_jsonl(dir: &Path) -> String {
    let p = dir.join("c4.jsonl");
    std::fs::write(&p, jsonl_lines()).unwrap();
    p.display().to_string()
}

fn write_jsonl_gz(dir: &Path) -> String {
    let sub = dir.join("shards");
    std::fs::create_dir_all(&sub).unwrap();
    for shard in 0..2 {
        let f = std::fs::File::create(sub.join(format!("part-{shard}.jsonl.gz"))).unwrap();
        let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::default());
        gz.write_all(jsonl_lines().as_bytes()).unwrap();
        gz.finish().unwrap();
    }
    sub.display().to_string()
}

fn write_tokens(dir: &Path, bytes_per_token: usize) -> String {
    let sub = dir.join(format!("tokens{bytes_per_token}"));
    std::fs::create_dir_all(&sub).unwrap();
    for shard in 0..2u32 {
        let ids: Vec<u8> = (0..1000u32)
            .flat_map(|i| {
                let id = (i * 7 + shard) % 250;
                if bytes_per_token == 2 {
                    (id as u16).to_le_bytes().to_vec()
                } else {
                    id.to_le_bytes().to_vec()
                }
            })
            .collect();
        std::fs::write(sub.join(format!("shard-{shard}.bin")), ids).unwrap();
    }
    sub.display().to_string()
}

fn write_parquet(dir: &Path) -> String {
    let sub = dir.join("parquet");
    std::fs::create_dir_all(&sub).unwrap();
    for shard in 0..2 {
        let texts: Vec<String> = (0..40)
            .map(|i| format!("parquet row {i} of shard {shard} reads well"))
            .collect();
        titan::data::parquet::write_text_parquet(
            &sub.join(format!("train-{shard}.parquet")),
            &texts,
        )
        .unwrap();
    }
    sub.display().to_string()
}

fn config_for(dump: &Path, dataset: &str, path: &str) -> Config {
    let mut c = tiny_config(dump, 3);
    c.training.dataset = dataset.into();
    c.training.dataset_path = path.into();
    c.checkpoint.enable = false;
    c
}

fn all_formats(dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("synthetic", String::new()),
        ("text", write_text(dir)),
        ("jsonl", write_jsonl(dir)),
        ("jsonl", write_jsonl_gz(dir)),
        ("parquet", write_parquet(dir)),
        ("tokens_u16", write_tokens(dir, 2)),
        ("tokens_u32", write_tokens(dir, 4)),
    ]
}

#[test]
fn every_format_trains() {
    let data = tempfile::tempdir().unwrap();
    for (kind, path) in all_formats(data.path()) {
        let dump = tempfile::tempdir().unwrap();
        let s = train(&config_for(dump.path(), kind, &path), &quiet())
            .unwrap_or_else(|e| panic!("{kind} {path}: {e:#}"));
        assert_eq!(s.losses.len(), 3, "{kind}");
        assert!(s.losses.iter().all(|(_, l)| l.is_finite()));
    }
}

/// Every format under each packing that takes it (first-fit packs documents: not token shards),
/// with sequences of 128 so that first-fit fits two documents of the small files in each.
fn formats_and_packings(dir: &Path) -> Vec<(&'static str, String, &'static str)> {
    all_formats(dir)
        .into_iter()
        .flat_map(|(kind, path)| {
            let packings: &[&str] = match kind.starts_with("tokens") {
                true => &["concat_then_split"],
                false => &["concat_then_split", "first_fit"],
            };
            packings.iter().map(move |&p| (kind, path.clone(), p))
        })
        .collect()
}

fn packed_config(dump: &Path, kind: &str, path: &str, packing: &str) -> Config {
    let mut c = config_for(dump, kind, path);
    c.training.packing = packing.into();
    c.training.seq_len = 128;
    c
}

#[test]
fn every_format_resumes_its_exact_position_across_epochs() {
    let data = tempfile::tempdir().unwrap();
    for (kind, path, packing) in formats_and_packings(data.path()) {
        let dump = tempfile::tempdir().unwrap();
        let cfg = packed_config(dump.path(), kind, &path, packing);
        let kind = &*format!("{kind} ({packing})");
        let make = || DataLoader::from_config(&cfg, Box::new(ByteTokenizer), 300, 0, 1).unwrap();
        let mut straight = make();
        // Enough batches to wrap the small files into a second epoch.
        let all: Vec<Vec<u32>> = (0..80).map(|_| straight.next_batch().unwrap()).collect();
        for cut in [1, 7, 50] {
            let mut first = make();
            for b in &all[..cut] {
                assert_eq!(&first.next_batch().unwrap(), b, "{kind}");
            }
            let state =
                serde_json::from_str(&serde_json::to_string(&first.state()).unwrap()).unwrap();
            let mut resumed = make();
            resumed.restore(state).unwrap();
            for (i, b) in all[cut..cut + 10].iter().enumerate() {
                assert_eq!(
                    &resumed.next_batch().unwrap(),
                    b,
                    "{kind}: batch {} after resuming at {cut}",
                    cut + i
                );
            }
        }
    }
}

#[test]
fn data_parallel_ranks_split_the_same_global_batches() {
    let data = tempfile::tempdir().unwrap();
    for (kind, path, packing) in formats_and_packings(data.path()) {
        let dump = tempfile::tempdir().unwrap();
        let mut one = packed_config(dump.path(), kind, &path, packing);
        let kind = &*format!("{kind} ({packing})");
        one.training.local_batch_size = 4;
        let mut two = one.clone();
        two.training.local_batch_size = 2;
        let mut single = DataLoader::from_config(&one, Box::new(ByteTokenizer), 300, 0, 1).unwrap();
        let mut r0 = DataLoader::from_config(&two, Box::new(ByteTokenizer), 300, 0, 2).unwrap();
        let mut r1 = DataLoader::from_config(&two, Box::new(ByteTokenizer), 300, 1, 2).unwrap();
        for step in 0..30 {
            let mut joined = r0.next_batch().unwrap();
            joined.extend(r1.next_batch().unwrap());
            assert_eq!(joined, single.next_batch().unwrap(), "{kind}: step {step}");
            assert_eq!(
                r0.state(),
                r1.state(),
                "{kind}: ranks agree on the stream position"
            );
            assert_eq!(r0.state(), single.state(), "{kind}: so does one process");
        }
    }
}

/// First-fit packing: every sample is whole `[BOS] doc [EOS]` documents (the BOS marked as the
/// document's start) then ignored padding, and
/// the samples hold each document read exactly once (the one waiting for the next batch aside).
#[test]
fn first_fit_packs_whole_documents_and_pads_the_rest() {
    use titan::backend::IGNORE_INDEX;
    use titan::model::token_marks::DOCUMENT_START;
    // Each document's BOS is marked as its start.
    let (bos, eos) = (ByteTokenizer::BOS | DOCUMENT_START, ByteTokenizer::EOS);
    let data = tempfile::tempdir().unwrap();
    let dump = tempfile::tempdir().unwrap();
    let path = write_jsonl(data.path());
    let cfg = packed_config(dump.path(), "jsonl", &path, "first_fit");
    let mut loader = DataLoader::from_config(&cfg, Box::new(ByteTokenizer), 300, 0, 1).unwrap();
    let mut documents = 0;
    for _ in 0..5 {
        let batch = loader.next_batch().unwrap();
        for row in batch.chunks(129) {
            let used = row.iter().position(|&t| t == IGNORE_INDEX).unwrap_or(129);
            assert!(row[used..].iter().all(|&t| t == IGNORE_INDEX), "{row:?}");
            assert_eq!(row[0], bos, "{row:?}");
            let docs = row[..used].split_inclusive(|&t| t == eos);
            for doc in docs {
                assert!(doc[0] == bos && *doc.last().unwrap() == eos, "{row:?}");
                assert_eq!(doc.iter().filter(|&&t| t == bos).count(), 1, "{row:?}");
                documents += 1;
            }
        }
    }
    let waiting = usize::from(!loader.state().buffer.is_empty());
    assert_eq!(documents + waiting, loader.state().consumed as usize);
}

fn train_err(dump: &Path, kind: &str, path: &str) -> String {
    format!(
        "{:#}",
        train(&config_for(dump, kind, path), &quiet()).unwrap_err()
    )
}

#[test]
fn malformed_jsonl_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.jsonl");
    std::fs::write(
        &p,
        "{\"text\": \"ok\"}\n{\"text\": \"ok too\"}\n{\"text\": broken}\n",
    )
    .unwrap();
    let e = train_err(dir.path(), "jsonl", &p.display().to_string());
    assert!(e.contains("bad.jsonl:3") && e.contains("JSON"), "{e}");
    std::fs::write(&p, "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n").unwrap();
    let e = train_err(dir.path(), "jsonl", &p.display().to_string());
    assert!(e.contains("bad.jsonl:2") && e.contains("`text`"), "{e}");
}

#[test]
fn truncated_gzip_is_reported_with_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_jsonl_gz(dir.path());
    let f = Path::new(&path).join("part-1.jsonl.gz");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let mut cfg = config_for(dir.path(), "jsonl", &path);
    cfg.training.steps = 60;
    let e = format!("{:#}", train(&cfg, &quiet()).unwrap_err());
    assert!(e.contains("part-1.jsonl.gz"), "{e}");
}

#[test]
fn missing_and_empty_data_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let e = train_err(dir.path(), "text", "/nonexistent/corpus.txt");
    assert!(
        e.contains("/nonexistent/corpus.txt") && e.contains("does not exist"),
        "{e}"
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = train_err(dir.path(), "jsonl", &empty.display().to_string());
    assert!(
        e.contains("holds no data files") && e.contains(".jsonl"),
        "{e}"
    );
    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, "\n\n").unwrap();
    let e = train_err(dir.path(), "text", &blank.display().to_string());
    assert!(e.contains("no documents"), "{e}");
}

#[test]
fn bad_token_shards_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let odd = dir.path().join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("a.bin"), [1u8, 2, 3]).unwrap();
    let e = train_err(dir.path(), "tokens_u16", &odd.display().to_string());
    assert!(
        e.contains("a.bin") && e.contains("not a multiple of 2"),
        "{e}"
    );
    let big = dir.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(
        big.join("b.bin"),
        (0..200u16)
            .flat_map(|i| (if i == 40 { 5000 } else { i }).to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let e = train_err(dir.path(), "tokens_u16", &big.display().to_string());
    assert!(
        e.contains("b.bin") && e.contains("5000") && e.contains("vocabulary"),
        "{e}"
    );
}

#[test]
fn parquet_without_a_text_column_or_not_parquet_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("notes.parquet");
    std::fs::write(&bad, "this is not parquet").unwrap();
    let e = train_err(dir.path(), "parquet", &bad.display().to_string());
    assert!(e.contains("notes.parquet") && e.contains("Parquet"), "{e}");
    let p = dir.path().join("other.parquet");
    {
        use parquet::data_type::Int64Type;
        use std::sync::Arc;
        let schema = Arc::new(
            parquet::schema::parser::parse_message_type("message schema { REQUIRED INT64 id; }")
                .unwrap(),
        );
        let f = std::fs::File::create(&p).unwrap();
        let mut w = parquet::file::writer::SerializedFileWriter::new(f, schema, Default::default())
            .unwrap();
        let mut g = w.next_row_group().unwrap();
        let mut c = g.next_column().unwrap().unwrap();
        c.typed::<Int64Type>()
            .write_batch(&[1, 2], None, None)
            .unwrap();
        c.close().unwrap();
        g.close().unwrap();
        w.close().unwrap();
    }
    let e = train_err(dir.path(), "parquet", &p.display().to_string());
    assert!(
        e.contains("other.parquet") && e.contains("no column `text`") && e.contains("id"),
        "{e}"
    );
}

// ---- issue 27, item 7: bounded lines, caught decoder panics, resumed buffers checked

/// The first error of a loader over `path` (batches of 2 windows of 33 tokens).
fn loader_err(dir: &Path, kind: &str, path: &Path) -> String {
    let cfg = config_for(dir, kind, &path.display().to_string());
    let mut loader = match DataLoader::from_config(&cfg, Box::new(ByteTokenizer), 300, 0, 1) {
        Ok(l) => l,
        Err(e) => return format!("{e:#}"),
    };
    for _ in 0..16 {
        if let Err(e) = loader.next_batch() {
            return format!("{e:#}");
        }
    }
    panic!("{} was read without an error", path.display());
}

#[test]
fn a_line_over_the_cap_is_an_error_naming_file_and_line() {
    use titan::data::files::MAX_LINE_BYTES;
    let dir = tempfile::tempdir().unwrap();
    let long = "x".repeat(MAX_LINE_BYTES + 1);
    let txt = dir.path().join("long.txt");
    std::fs::write(&txt, format!("a short first line\n{long}\nthird\n")).unwrap();
    let e = loader_err(dir.path(), "text", &txt);
    assert!(
        e.contains("long.txt:2") && e.contains("longer than 16777216 bytes"),
        "{e}"
    );
    // A gzipped JSONL file whose third line never ends (64 MiB inflated from about 64 KiB):
    // refused after reading at most the cap, never held whole.
    let gz = dir.path().join("bomb.jsonl.gz");
    let f = std::fs::File::create(&gz).unwrap();
    let mut enc = flate2::write::GzEncoder::new(f, flate2::Compression::best());
    enc.write_all(b"{\"text\": \"one\"}\n{\"text\": \"two\"}\n{\"text\": \"")
        .unwrap();
    let chunk = vec![b'y'; 1 << 20];
    for _ in 0..64 {
        enc.write_all(&chunk).unwrap();
    }
    enc.finish().unwrap();
    let e = loader_err(dir.path(), "jsonl", &gz);
    assert!(
        e.contains("bomb.jsonl.gz:3") && e.contains("MAX_LINE_BYTES"),
        "{e}"
    );
    // Exactly the cap (with a CRLF ending) is still a line.
    let edge = dir.path().join("edge.txt");
    std::fs::write(&edge, format!("{}\r\n", &long[1..])).unwrap();
    let mut source = titan::data::documents::TextSource::open(&edge).unwrap();
    use titan::data::documents::DocumentSource;
    assert_eq!(
        source.next_document().unwrap().unwrap().len(),
        MAX_LINE_BYTES
    );
}

#[test]
fn a_panicking_parquet_decoder_is_an_error_naming_the_file() {
    // Single-bit corruptions of a valid file: the `parquet` crate panics on some of them (slice
    // bounds in its bit reader, "column start and length should not be negative", ...), which
    // used to take the rank down. Each must now be an error naming the file.
    let dir = tempfile::tempdir().unwrap();
    let seed_path = dir.path().join("seed.parquet");
    let texts: Vec<String> = (0..12).map(|i| format!("parquet row {i}")).collect();
    titan::data::parquet::write_text_parquet(&seed_path, &texts).unwrap();
    let seed = std::fs::read(&seed_path).unwrap();
    let path = dir.path().join("corrupt.parquet");
    let mut caught = 0;
    for i in 0..seed.len() {
        for bit in [0x01u8, 0x80] {
            let mut bytes = seed.clone();
            bytes[i] ^= bit;
            std::fs::write(&path, &bytes).unwrap();
            let mut source = match titan::data::parquet::ParquetSource::open(&path) {
                Ok(s) => s,
                Err(e) => {
                    assert!(format!("{e:#}").contains("corrupt.parquet"), "{e:#}");
                    continue;
                }
            };
            use titan::data::documents::DocumentSource;
            for _ in 0..texts.len() + 1 {
                match source.next_document() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        let e = format!("{e:#}");
                        assert!(e.contains("corrupt.parquet"), "{e}");
                        caught += e.contains("the Parquet decoder failed") as usize;
                        break;
                    }
                }
            }
        }
    }
    assert!(caught > 0, "no corruption made the decoder panic");
}

#[test]
fn a_resumed_buffer_outside_the_vocabulary_is_an_error_naming_the_field() {
    use titan::checkpoint::integrity::sha256_hex;
    let dump = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dump.path(), 5);
    train(&cfg, &quiet()).unwrap();
    let step = cfg.checkpoint_folder().join("step-5");
    let path = step.join("state.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    state["data"]["buffer"] = serde_json::json!([1, 2, 3, 5000]);
    let text = serde_json::to_string_pretty(&state).unwrap();
    std::fs::write(&path, &text).unwrap();
    let sha = format!("{}  state.json\n", sha256_hex(text.as_bytes()));
    std::fs::write(step.join("state.json.sha256"), sha).unwrap();
    cfg.training.steps = 10;
    let e = format!("{:#}", train(&cfg, &quiet()).unwrap_err());
    assert!(
        e.contains("state.json")
            && e.contains("checkpoint field `data.buffer`[3] is token id 5000")
            && e.contains("vocabulary of 300"),
        "{e}"
    );
}
