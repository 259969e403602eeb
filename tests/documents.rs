//! Packed documents (`[model] attn_mask_type = "block_causal"`): training equals transformers fed
//! per-document `position_ids` and a block-diagonal causal mask, step for step with AdamW; every
//! layout built so far equals one process; sequences of one document train exactly as causal
//! attention does; what is not built yet is refused by name.

mod common;

use std::path::Path;

use common::pytorch_training::{train_both, Comparison};
use common::{
    assert_layout_matches_one_process, assert_parity, bits, hf_python, losses, train, Layout,
    FSDP_TP_PP,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BLOCK_CAUSAL: &[&str] = &["--model.attn_mask_type", "block_causal"];

/// Today's default is block-causal; plain causal attention over the whole window is asked for.
const CAUSAL: &[&str] = &["--model.attn_mask_type", "causal"];

/// Longer sequences than the tiny config's, so that every window holds several documents of the
/// synthetic corpus.
const SEQ64: &[&str] = &["--training.seq_len", "64"];

/// A uint32 token shard of `n` ids: documents of 3 to 40 tokens, each starting with id 1, the
/// rest drawn from 2..300.
fn write_documents(path: &Path, n: usize, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let len = rng.gen_range(3..=40);
        ids.push(1u32);
        ids.extend((1..len).map(|_| rng.gen_range(2..300u32)));
    }
    ids.truncate(n);
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// A tiny Llama made by transformers (the tiny config's shapes: titan's debug model at dim 64),
/// imported into titan and trained 20 steps block-causally on
/// packed documents, against the same model trained by PyTorch's AdamW with `position_ids` that
/// restart per document and a block-diagonal causal mask: every step's loss within 1e-5 and
/// gradient norm within 1e-4 (fp32).
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn block_causal_training_equals_transformers_on_packed_documents() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("documents.bin");
    write_documents(&shard, 4000, 3);
    let data = [
        &common::token_shard(&shard)[..],
        &["--training.document_start_id", "1"],
    ]
    .concat();
    let comparison = Comparison {
        dir: dir.path(),
        steps: "20",
        titan_data: &data,
        tokens: &shard,
        targets: None,
        make: None,
        document_start: Some("1"),
        titan_extra: &[],
        python_extra: &[],
    };
    let curves = train_both(&py, &comparison);
    assert_eq!(curves.titan.0.len(), 20);
    let worst = curves.worst_loss_difference();
    eprintln!(
        "block-causal vs transformers: largest relative loss difference over 20 steps {worst:.2e}"
    );
    assert_parity(
        &curves.pytorch.0,
        &curves.titan.0,
        "block-causal loss vs transformers",
    );
    for ((step, hf), (_, ours)) in curves.pytorch.1.iter().zip(&curves.titan.1) {
        assert!(
            (hf - ours).abs() <= 1e-4 * hf.abs(),
            "step {step}: grad norm transformers {hf}, titan {ours}"
        );
    }
}

/// Block-causal attention changes the curve where sequences hold several documents (the synthetic
/// corpus at seq 64, from step 3 on), and changes nothing where each is one document (token shards without
/// `document_start_id`): there the run is causal attention's bit for bit.
#[test]
fn documents_change_the_curve_only_where_sequences_hold_several() {
    let run = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let o = train(
            dir.path(),
            &[],
            &[&["--training.steps", "4"], SEQ64, extra].concat(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        losses(dir.path())
    };
    let causal = run(CAUSAL);
    let blocks = run(BLOCK_CAUSAL);
    assert_eq!(
        bits(&blocks),
        bits(&run(&[])),
        "block_causal is the default"
    );
    assert_eq!(causal.len(), blocks.len());
    assert_ne!(
        bits(&causal),
        bits(&blocks),
        "block-causal equals causal on packed documents"
    );
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("documents.bin");
    write_documents(&shard, 2000, 4);
    let shards = common::token_shard(&shard);
    let one_document_each = run(&[&shards[..], BLOCK_CAUSAL].concat());
    assert_eq!(
        bits(&one_document_each),
        bits(&run(&[&shards[..], CAUSAL].concat()))
    );
}

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// FSDP, TP (sequence parallel, loss parallel), a 1F1B pipeline of 4 microbatches and context
/// parallelism (both rotations; head-tail chunks of 16, documents crossing them), against one
/// process over 6 steps.
#[test]
fn block_causal_layouts_match_one_process() {
    let single = [
        &["--training.steps", "6", "--training.local_batch_size", "4"],
        SEQ64,
        BLOCK_CAUSAL,
    ]
    .concat();
    let cp: [Layout; 2] = [
        (
            "CP 2 (allgather)",
            &["--parallelism.context_parallel_degree", "2"],
            "context parallel",
        ),
        (
            "CP 2 (alltoall)",
            &[
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.context_parallel_rotate_method",
                "alltoall",
            ],
            "context parallel",
        ),
    ];
    for (what, parallel, says) in FSDP_TP_PP.into_iter().chain(cp) {
        assert_layout_matches_one_process(what, &single, &nproc("2"), parallel, says);
    }
}

/// The other block features with documents: Qwen3-MoE's experts split over EP 2 with full
/// activation checkpointing (the recomputed forward masks as the first did), and DeepSeek-V3's
/// multi-head latent attention (its rotated key and query parts at per-document positions) under
/// FSDP 2, each against one process.
#[test]
fn block_causal_with_experts_checkpointing_and_latent_attention_matches_one_process() {
    let moe = [
        "--model.name",
        "qwen3",
        "--model.flavor",
        "debugmodel_moe",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "4",
        "--activation_checkpoint.mode",
        "full",
    ];
    let single = [&["--training.steps", "6"], SEQ64, BLOCK_CAUSAL, &moe].concat();
    let ep = [
        "--parallelism.expert_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    assert_layout_matches_one_process(
        "EP 2 (MoE, AC full)",
        &single,
        &nproc("2"),
        &ep,
        "rank 0 of",
    );
    let mla = [common::TINY_DEEPSEEK, &["--training.local_batch_size", "4"]].concat();
    let single = [&["--training.steps", "6"], SEQ64, BLOCK_CAUSAL, &mla].concat();
    let fsdp = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    assert_layout_matches_one_process("FSDP 2 (MLA)", &single, &nproc("2"), &fsdp, "FSDP");
}

/// Records of 5 to 60 characters, one JSON object a line.
fn write_short_records(path: &Path) {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let words = [
        "the", "packed", "document", "sees", "only", "itself", "and", "nothing", "else",
    ];
    let lines: String = (0..400)
        .map(|i| {
            let n = rng.gen_range(1..=10);
            let text: Vec<&str> = (0..n)
                .map(|_| words[rng.gen_range(0..words.len())])
                .collect();
            format!("{{\"text\": \"{i} {}\"}}\n", text.join(" "))
        })
        .collect();
    std::fs::write(path, lines).unwrap();
}

/// First-fit packing (whole documents, padding whose targets count for nothing) under FSDP, TP
/// and a 1F1B pipeline against one process over 6 steps, block-causally.
#[test]
fn first_fit_packing_layouts_match_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let records = dir.path().join("records.jsonl");
    write_short_records(&records);
    let data = [
        "--training.dataset",
        "jsonl",
        "--training.dataset_path",
        records.to_str().unwrap(),
        "--training.packing",
        "first_fit",
    ];
    let single = [
        &["--training.steps", "6", "--training.local_batch_size", "4"],
        SEQ64,
        BLOCK_CAUSAL,
        &data,
    ]
    .concat();
    for (what, parallel, says) in FSDP_TP_PP {
        let what = format!("first_fit, {what}");
        assert_layout_matches_one_process(&what, &single, &nproc("2"), parallel, says);
    }
}

/// Bad document settings are refused by name: an unknown mask or packing; first-fit packing of
/// token shards (no documents to keep whole); a document start outside the vocabulary.
#[test]
fn bad_document_settings_are_refused_by_name() {
    let refused = |extra: &[&str], says: &str| {
        let dir = tempfile::tempdir().unwrap();
        let o = train(
            dir.path(),
            &[],
            &[&["--training.steps", "1"], extra].concat(),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(says),
            "{extra:?}: {err}"
        );
    };
    refused(
        &["--model.attn_mask_type", "sliding"],
        "attn_mask_type = `sliding` is not known",
    );
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("documents.bin");
    write_documents(&shard, 500, 5);
    let shards = [
        &common::token_shard(&shard)[..],
        &["--training.document_start_id", "300"],
    ]
    .concat();
    let first_fit = ["--training.packing", "first_fit"];
    refused(&[&shards[..4], &first_fit].concat(), "first_fit");
    refused(&["--training.packing", "best_fit"], "packing = `best_fit`");
    refused(&[&shards[..], BLOCK_CAUSAL].concat(), "document_start_id");
}
