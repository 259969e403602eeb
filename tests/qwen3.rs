//! Qwen3 (QK-norm, a head width of its own) and Qwen3-MoE under the parallel layouts, real
//! processes through the launcher: per-step loss and gradient norm within 1e-5 of one process. The
//! layouts need nothing of their own for it: QK-norm's weights are replicated over
//! tensor-parallel ranks (their gradients summed like the other norms') and sharded like any
//! tensor elsewhere; a mixture of experts is per token, so FSDP, CP and PP carry it unchanged
//! (expert parallelism and TP with experts: `tests/expert_parallel.rs`).

mod common;

use common::{assert_layout_matches_one_process, bits, quiet, tiny_config};

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

const QWEN3_MOE: &[&str] = &[
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--training.steps",
    "8",
];

#[test]
fn qwen3_moe_matches_one_process_under_fsdp_cp_and_pp() {
    let check = |what: &str, extra: &[&str], n: &'static str, parallel: &[&str]| {
        let single = [QWEN3_MOE, extra].concat();
        assert_layout_matches_one_process(what, &single, &nproc(n), parallel, "rank 0 of");
    };
    check(
        "Qwen3-MoE FSDP 2",
        &["--training.global_batch_size", "4"],
        "2",
        &[],
    );
    check(
        "Qwen3-MoE CP 2",
        &[],
        "2",
        &["--parallelism.context_parallel_degree", "2"],
    );
    check(
        "Qwen3-MoE PP 2",
        &[],
        "2",
        &["--parallelism.pipeline_parallel_degree", "2"],
    );
}

#[test]
fn qwen3_moe_learns_and_reports_expert_load() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 40);
    cfg.model.name = "qwen3".into();
    cfg.model.flavor = "debugmodel_moe".into();
    cfg.checkpoint.enable = false;
    cfg.optimizer.lr = 3e-3;
    let s = titan::train::train(&cfg, &quiet()).unwrap();
    let (first, last) = (s.losses[0].1, s.losses.last().unwrap().1);
    assert!(last < 0.6 * first, "qwen3 MoE: loss {first} -> {last}");
    // Each step's expert load: every block routes each of the 2 × 32 tokens to 2 experts.
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let step: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    let load = step["moe_expert_load"].as_array().unwrap();
    assert_eq!(load.len(), 2);
    for block in load {
        let tokens: u64 = block["tokens_per_expert"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .sum();
        assert_eq!(tokens, 2 * 32 * 2, "{block}");
        assert!(block["max_over_mean"].as_f64().unwrap() >= 1.0);
    }
}

/// Auxiliary-loss-free load balancing: the expert bias moves after every step with the job's
/// loads (so FSDP ranks move it alike and match one process), is saved in the checkpoint, and a
/// resumed run continues bit for bit.
#[test]
fn expert_bias_moves_is_saved_and_resumes_bit_for_bit() {
    let biased = ["--model.load_balance_coeff", "0.01"];
    assert_layout_matches_one_process(
        "Qwen3-MoE FSDP 2 with the expert bias",
        &[QWEN3_MOE, &biased, &["--training.global_batch_size", "4"]].concat(),
        &nproc("2"),
        &[],
        "rank 0 of",
    );
    let moe = |dir: &std::path::Path| {
        let mut cfg = tiny_config(dir, 10);
        cfg.model.name = "qwen3".into();
        cfg.model.flavor = "debugmodel_moe".into();
        cfg.model.load_balance_coeff = Some(0.01);
        cfg
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = titan::train::train(&moe(a.path()), &quiet())
        .unwrap()
        .losses;
    let stop_at_5 = titan::train::RunOptions {
        quiet: true,
        stop_after: Some(5),
    };
    titan::train::train(&moe(b.path()), &stop_at_5).unwrap();
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(b.path().join("checkpoint/step-5/state.json")).unwrap(),
    )
    .unwrap();
    let bias = state["expert_bias"].as_array().expect("the bias is saved");
    assert_eq!(bias.len(), 2);
    assert!(
        bias.iter()
            .flat_map(|l| l.as_array().unwrap())
            .any(|x| x.as_f64().unwrap() != 0.0),
        "the bias moved: {bias:?}"
    );
    let resumed = titan::train::train(&moe(b.path()), &quiet())
        .unwrap()
        .losses;
    assert_eq!(bits(&straight[5..]), bits(&resumed));
}
