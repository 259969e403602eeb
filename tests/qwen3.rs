//! Qwen3 (QK-norm, a head width of its own) under the parallel layouts, real processes through the
//! launcher: per-step loss and gradient norm within 1e-5 of one process. The layouts need nothing
//! of their own for it: QK-norm's weights are replicated over tensor-parallel ranks (their
//! gradients summed like the other norms') and sharded like any tensor elsewhere.

mod common;

use common::assert_layout_matches_one_process;

const QWEN3: &[&str] = &[
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel",
    "--training.steps",
    "8",
];

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

#[test]
fn qwen3_matches_one_process_under_tp_fsdp_cp_and_pp() {
    let check = |what: &str, extra: &[&str], n: &'static str, parallel: &[&str]| {
        let single = [QWEN3, extra].concat();
        assert_layout_matches_one_process(what, &single, &nproc(n), parallel, "rank 0 of");
    };
    check(
        "Qwen3 TP 2",
        &[],
        "2",
        &["--parallelism.tensor_parallel_degree", "2"],
    );
    check(
        "Qwen3 FSDP 2 × CP 2",
        &["--training.global_batch_size", "4"],
        "4",
        &[
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
        ],
    );
    check(
        "Qwen3 PP 2 (ZBV)",
        &[],
        "2",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
        ],
    );
}
