//! Llama 4 text (NoPE blocks with temperature-tuned queries, chunked attention with the L2
//! QK-norm on the others, dense blocks between expert blocks whose top-1 sigmoid score scales the
//! expert's input beside a shared expert): the debug model, shrunk, under the parallel layouts
//! against one process (per-step loss and gradient norm within 1e-5), and a tiny Llama 4 made by
//! transformers trained by titan and by PyTorch's AdamW, curves within 1e-5. The layouts needed
//! nothing of their own: the norms are per head (TP splits whole heads), the temperatures per row
//! from its global position (CP's shards), the chunks are masks (`positions.rs`), and the routed
//! and shared experts are those every MoE model has.
//! Import and export against transformers: `tests/hf_transformers.rs`.

mod common;

use common::pytorch_training::{train_both, Comparison};
use common::{assert_layout_matches_one_process, hf_python};

/// TorchTitan's debug model with the shapes of a test: `common::TINY_ARGS` (which every run
/// here starts from) gives dim 64, 2 blocks, 4 query and 2 key/value heads and a vocabulary of
/// 300; here block 1 without RoPE (temperature-tuned from position 3 on: floor scale 4), chunks
/// of 8 positions on block 0, experts in block 1 (4 of 32, a shared one of 32) and a dense
/// SwiGLU in block 0, 8 steps.
const LLAMA4: &[&str] = &[
    "--model.name",
    "llama4",
    "--model.flavor",
    "debugmodel",
    "--model.moe_hidden",
    "32",
    "--model.moe_shared_hidden",
    "32",
    "--model.num_experts",
    "4",
    "--model.every_n_layers_nope",
    "2",
    "--model.attention_chunk_size",
    "8",
    "--model.floor_scale",
    "4",
    "--model.attn_scale",
    "0.5",
    "--training.steps",
    "8",
];

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

fn check(what: &str, n: &'static str, extra: &[&str], parallel: &[&str]) {
    let single = [LLAMA4, extra].concat();
    assert_layout_matches_one_process(what, &single, &nproc(n), parallel, "rank 0 of");
}

#[test]
fn llama4_matches_one_process_under_tp_and_async_tp() {
    let tp2 = ["--parallelism.tensor_parallel_degree", "2"];
    check("Llama 4 TP 2", "2", &[], &tp2);
    let async_tp = [
        &tp2[..],
        &["--parallelism.enable_async_tensor_parallel", "true"],
    ]
    .concat();
    check("Llama 4 async TP 2", "2", &[], &async_tp);
    check(
        "Llama 4 TP 2, per-op AC, float8 linears",
        "2",
        &[
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--model.converters",
            "quantize.linear.float8",
            // With 0.5 one value of step 3, 1 ulp apart between the layouts (TP sums in another
            // order), rounds to neighbouring float8 values and the curves part by the float8
            // step (2e-5 by step 8); 0.3, 0.4, 0.6 and 0.7 stay within 3e-8 all 8 steps.
            "--model.attn_scale",
            "0.4",
        ],
        &tp2,
    );
}

#[test]
fn llama4_matches_one_process_under_ddp_hsdp_and_interleaved_pp() {
    let global = ["--training.global_batch_size", "4"];
    check(
        "Llama 4 DDP 2",
        "2",
        &global,
        &["--parallelism.data_parallel_replicate_degree", "2"],
    );
    check(
        "Llama 4 HSDP 2 × 2, EP 2",
        "4",
        &["--training.global_batch_size", "8"],
        &[
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "2",
        ],
    );
    check(
        "Llama 4 PP 2 (Interleaved 1F1B, 2 stages a rank)",
        "2",
        &["--model.n_layers", "4"],
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
    );
}

#[test]
fn llama4_matches_one_process_under_ep_fsdp_cp_and_pp() {
    let global = ["--training.global_batch_size", "4"];
    check(
        "Llama 4 FSDP 2 × EP 2",
        "2",
        &global,
        &["--parallelism.expert_parallel_degree", "2"],
    );
    check(
        "Llama 4 CP 2 (chunks and temperatures at the shards' global positions)",
        "2",
        &[],
        &["--parallelism.context_parallel_degree", "2"],
    );
    check(
        "Llama 4 PP 2 (ZBV: weight gradients deferred), full AC",
        "2",
        &["--activation_checkpoint.mode", "full"],
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
        ],
    );
}

/// Every pipeline schedule (4 blocks, 2 a rank where the schedule runs two stages a rank), and
/// the routed experts' GEMMs in float8 under EP.
#[test]
fn llama4_matches_one_process_under_every_pipeline_schedule_and_float8_experts() {
    for schedule in [
        "GPipe",
        "1F1B",
        "InterleavedZeroBubble",
        "DualPipeV",
        "LoopedBFS",
    ] {
        check(
            &format!("Llama 4 PP 2 ({schedule})"),
            "2",
            &["--model.n_layers", "4"],
            &[
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            ],
        );
    }
    check(
        "Llama 4 EP 2, float8 experts",
        "2",
        &[
            "--training.global_batch_size",
            "4",
            "--model.converters",
            "quantize.grouped_mm.float8",
        ],
        &["--parallelism.expert_parallel_degree", "2"],
    );
}

/// bf16 mixed precision: TP 2 and FSDP 2 × EP 2 against one process in bf16, loss and gradient
/// norm within 1e-3 (the layouts differ where an f32 sum's order moves a value across a bf16
/// rounding boundary, as `tests/bf16.rs` says of the other models).
#[test]
fn llama4_in_bf16_matches_one_process_in_bf16() {
    let bf16 = ["--training.mixed_precision_param", "bfloat16"];
    // (what, for both runs, for the parallel one)
    let cases: [(&str, &[&str], &[&str]); 2] = [
        ("TP 2", &[], &["--parallelism.tensor_parallel_degree", "2"]),
        (
            "FSDP 2 × EP 2",
            &["--training.global_batch_size", "4"],
            &["--parallelism.expert_parallel_degree", "2"],
        ),
    ];
    for (what, both, parallel) in cases {
        let (one, many) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let single = [LLAMA4, &bf16[..], both].concat();
        let o = common::train(one.path(), &[], &single);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let o = common::train(many.path(), &nproc("2"), &[&single[..], parallel].concat());
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        for key in ["loss", "grad_norm"] {
            let (a, b) = (
                common::metric(one.path(), key),
                common::metric(many.path(), key),
            );
            assert_eq!(a.len(), b.len(), "{what}: steps");
            for ((step, x), (_, y)) in a.iter().zip(&b) {
                let rel = (x - y).abs() / x.abs();
                assert!(rel <= 1e-3, "{what} {key}, step {step}: {x} vs {y}");
            }
        }
    }
}

/// A Llama 4 made by transformers (`LLAMA4`'s shapes; the attention's weights ×4 so that the
/// temperatures and norms move the logits), trained 20 steps by titan (imported; no expert bias,
/// as transformers has none) and by PyTorch's AdamW on the same tokens: every step's loss and
/// gradient norm within 1e-5.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn llama4_trains_as_pytorch_trains_it() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = r#"
import sys, torch
from transformers import Llama4TextConfig, Llama4ForCausalLM
cfg = Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=300, max_position_embeddings=256, num_local_experts=4,
                       num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                       attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192},
                       tie_word_embeddings=False)
torch.manual_seed(0)
model = Llama4ForCausalLM(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "self_attn" in name:
            p.mul_(4.0)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#;
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("tokens.bin");
    common::write_random_tokens(&shard, 4000, 5);
    let data = common::token_shard(&shard);
    let curves = train_both(
        &py,
        &Comparison {
            dir: dir.path(),
            make: Some(make),
            steps: "20",
            titan_data: &data,
            tokens: &shard,
            targets: None,
            document_start: None,
            titan_extra: &[
                // The shapes, not the steps.
                &LLAMA4[..LLAMA4.len() - 2],
                &["--model.load_balance_coeff", "0"],
            ]
            .concat(),
            python_extra: &[],
        },
    );
    let worst = curves.worst_loss_difference();
    let ((_, titan_norm), (_, torch_norm)) = (&curves.titan, &curves.pytorch);
    let worst_norm = titan_norm
        .iter()
        .zip(torch_norm)
        .map(|((_, a), (_, b))| (a - b).abs() / b.abs())
        .fold(0.0, f64::max);
    eprintln!(
        "Llama 4 vs PyTorch, 20 steps: loss within {worst:.2e}, grad norm within {worst_norm:.2e}"
    );
    assert!(
        worst <= 1e-5,
        "{:?} vs {:?}",
        curves.titan.0,
        curves.pytorch.0
    );
    assert!(worst_norm <= 1e-5, "{titan_norm:?} vs {torch_norm:?}");
}
