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

use common::family_layouts::{self, bf16_layouts_match, pipeline_schedules, trains_as_pytorch};
use common::hf_models::{llama4_two_blocks, LLAMA4_SHAPES};
use common::hf_python;

/// TorchTitan's debug model with the shapes of a test (`LLAMA4_SHAPES` over `common::TINY_ARGS`,
/// which every run here starts from), 10 steps.
fn llama4() -> Vec<&'static str> {
    [
        LLAMA4_SHAPES,
        &["--model.flavor", "debugmodel", "--training.steps", "10"],
    ]
    .concat()
}

fn check(what: &str, n: &'static str, extra: &[&str], parallel: &[&str]) {
    family_layouts::check(&llama4(), what, n, extra, parallel);
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
        "Llama 4 DDP 2, selective AC of every other block",
        "2",
        &[
            &global[..],
            &[
                "--activation_checkpoint.mode",
                "selective",
                "--activation_checkpoint.selective_ac_option",
                "2",
            ],
        ]
        .concat(),
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
    let schedules = [
        "GPipe",
        "1F1B",
        "InterleavedZeroBubble",
        "DualPipeV",
        "LoopedBFS",
    ];
    pipeline_schedules(&llama4(), "Llama 4", &schedules);
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

/// bf16 mixed precision: TP 2 and FSDP 2 × EP 2 against one process in bf16 within 1e-3.
#[test]
fn llama4_in_bf16_matches_one_process_in_bf16() {
    bf16_layouts_match(&llama4(), "Llama 4");
}

/// A Llama 4 made by transformers (`LLAMA4_SHAPES`; the attention's weights ×4 so that the
/// temperatures and norms move the logits), trained 20 steps by titan (imported; no expert bias,
/// as transformers has none) and by PyTorch's AdamW on the same tokens: every step's loss and
/// gradient norm within 1e-5.
#[test]
fn llama4_trains_as_pytorch_trains_it() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = llama4_two_blocks("        if \"self_attn\" in name:\n            p.mul_(4.0)");
    trains_as_pytorch(
        &py,
        &make,
        &[LLAMA4_SHAPES, &["--model.load_balance_coeff", "0"]].concat(),
        "Llama 4",
    );
}
