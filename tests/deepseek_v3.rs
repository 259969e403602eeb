//! DeepSeek-V3 (multi-head latent attention, shared experts after a dense block, the routing bias
//! stepped after every step) under the parallel layouts, real processes through the launcher:
//! per-step loss and gradient norm within 1e-5 of one process over 10 steps. Under TP the heads
//! split and the latents are computed whole on every rank (`model::decoder::mla`); under CP ring
//! attention reads the padded heads; EP moves the routed experts, the shared ones stay the
//! block's SwiGLU; PP (1F1B and DualPipeV) carries the block unchanged. The bias moves with the
//! job's load, so a layout that routed differently would drift from the one-process curve.

mod common;

use common::{assert_layout_matches_one_process, bits, quiet, tiny_config};

/// `common::TINY_DEEPSEEK`, 10 steps.
fn deepseek() -> Vec<&'static str> {
    [common::TINY_DEEPSEEK, &["--training.steps", "10"]].concat()
}

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

fn check(what: &str, extra: &[&str], n: &'static str, parallel: &[&str]) {
    let single = [&deepseek()[..], extra].concat();
    assert_layout_matches_one_process(what, &single, &nproc(n), parallel, "rank 0 of");
}

#[test]
fn deepseek_v3_matches_one_process_under_fsdp_tp_cp_and_ep() {
    let global = ["--training.global_batch_size", "4"];
    check("DeepSeek-V3 FSDP 2", &global, "2", &[]);
    check(
        "DeepSeek-V3 TP 2",
        &[],
        "2",
        &["--parallelism.tensor_parallel_degree", "2"],
    );
    check(
        "DeepSeek-V3 CP 2",
        &[],
        "2",
        &["--parallelism.context_parallel_degree", "2"],
    );
    check(
        "DeepSeek-V3 EP 2",
        &global,
        "2",
        &["--parallelism.expert_parallel_degree", "2"],
    );
}

/// Float8 (rowwise) under TP 2 equals one process that leaves MLA's latent down-projections in
/// high precision, as TP does by itself: their gradients are partial sums there (latents 32 and
/// 24 + 8 wide, heads 16 and 8 + 16: every other projection's features divide by 16).
#[test]
fn deepseek_v3_float8_under_tp_keeps_the_latent_down_projections_in_high_precision() {
    let float8 = [
        "--model.q_lora_rank",
        "32",
        "--model.kv_lora_rank",
        "24",
        "--model.v_head_dim",
        "16",
        "--model.converters",
        "quantize.linear.float8",
        "--quantize.linear.float8.filter_fqns",
        "output,wq_a,wkv_a",
    ];
    check(
        "DeepSeek-V3 float8 TP 2",
        &float8,
        "2",
        &[
            "--quantize.linear.float8.filter_fqns",
            "output",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    );
}

#[test]
fn deepseek_v3_matches_one_process_under_pp_and_a_3d_layout() {
    for schedule in ["1F1B", "DualPipeV"] {
        check(
            &format!("DeepSeek-V3 PP 2 ({schedule})"),
            &[],
            "2",
            &[
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                schedule,
            ],
        );
    }
    check(
        "DeepSeek-V3 PP 2 × FSDP 2 × TP 2",
        &["--training.global_batch_size", "4"],
        "8",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
    );
}

/// The debug flavor learns on the built-in corpus, a run stopped at step 5 resumes bit for bit
/// (weights, AdamW moments and the routing bias from the checkpoint), and activation
/// checkpointing changes no number.
#[test]
fn deepseek_v3_learns_and_resumes_bit_for_bit() {
    let tiny = |dir: &std::path::Path, steps| {
        let mut cfg = tiny_config(dir, steps);
        cfg.model.name = "deepseek_v3".into();
        cfg.model.kv_lora_rank = Some(16);
        cfg.model.qk_nope_head_dim = Some(8);
        cfg.model.qk_rope_head_dim = Some(8);
        cfg.model.v_head_dim = Some(12);
        cfg
    };
    let learn = tempfile::tempdir().unwrap();
    let mut cfg = tiny(learn.path(), 30);
    cfg.checkpoint.enable = false;
    cfg.optimizer.lr = 3e-3;
    let losses = titan::train::train(&cfg, &quiet()).unwrap().losses;
    let (first, last) = (losses[0].1, losses.last().unwrap().1);
    assert!(last < 0.6 * first, "deepseek_v3: loss {first} -> {last}");
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = titan::train::train(&tiny(a.path(), 10), &quiet())
        .unwrap()
        .losses;
    let stop_at_5 = titan::train::RunOptions {
        quiet: true,
        stop_after: Some(5),
    };
    titan::train::train(&tiny(b.path(), 10), &stop_at_5).unwrap();
    let resumed = titan::train::train(&tiny(b.path(), 10), &quiet())
        .unwrap()
        .losses;
    assert_eq!(bits(&straight[5..]), bits(&resumed));
    // Activation checkpointing recomputes MLA's latents and heads with the same kernels: the
    // same curve, bit for bit (full: the whole block again; op: the latents' norms only).
    for (mode, option) in [("full", "2"), ("selective", "op")] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = tiny(dir.path(), 10);
        cfg.checkpoint.enable = false;
        cfg.activation_checkpoint.mode = mode.into();
        cfg.activation_checkpoint.selective_ac_option = option.into();
        let losses = titan::train::train(&cfg, &quiet()).unwrap().losses;
        assert_eq!(
            bits(&straight),
            bits(&losses),
            "activation checkpointing {mode} {option}"
        );
    }
}

/// The routing bias moves after every step by the whole job's expert load, so every layout moves
/// it exactly as one process does: the final checkpoints' `expert_bias` are equal bit for bit
/// (and each step's metrics log its range per block).
#[test]
fn deepseek_v3_routing_bias_moves_alike_under_every_layout() {
    let bias = |launcher: &[&str], parallel: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let global = ["--training.global_batch_size", "4"];
        let o = common::train(
            dir.path(),
            launcher,
            &[&deepseek()[..], &global, parallel].concat(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let state = std::fs::read_to_string(dir.path().join("checkpoint/step-10/state.json"));
        let state: serde_json::Value = serde_json::from_str(&state.unwrap()).unwrap();
        let values: Vec<u64> = state["expert_bias"]
            .as_array()
            .expect("a routing bias")
            .iter()
            .flat_map(|block| block.as_array().unwrap().clone())
            .map(|x| (x.as_f64().unwrap() as f32).to_bits() as u64)
            .collect();
        assert!(values.iter().any(|&b| b != 0), "the bias moved");
        // The metrics log each MoE block's bias range after the step.
        let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let last: serde_json::Value =
            serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
        let block = &last["moe_expert_load"][0];
        assert!(
            block["bias_max"].as_f64() > block["bias_min"].as_f64(),
            "{block}"
        );
        values
    };
    let one = bias(&[], &[]);
    for (n, parallel) in [
        ("2", &[][..]),
        ("2", &["--parallelism.expert_parallel_degree", "2"][..]),
        ("2", &["--parallelism.tensor_parallel_degree", "2"][..]),
        ("2", &["--parallelism.pipeline_parallel_degree", "2"][..]),
    ] {
        let many = bias(&nproc(n), parallel);
        assert_eq!(one, many, "the routing bias under {parallel:?}");
    }
}

/// `titan generate` routes with the checkpoint's routing bias: its greedy tokens equal the
/// library's with the bias set (a large load-balancing step, so the bias changes the routing).
#[test]
fn generation_routes_with_the_checkpoints_routing_bias() {
    use titan::backend::cpu::CpuBackend;
    use titan::model::{Decoder, KvCache};
    let dir = tempfile::tempdir().unwrap();
    // An odd number of ±0.5 steps leaves every expert that was ever off the mean off zero.
    let biased = [
        "--model.load_balance_coeff",
        "0.5",
        "--training.steps",
        "5",
        "--optimizer.lr",
        "0.02",
    ];
    let o = common::train(dir.path(), &[], &[&deepseek()[..], &biased].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ckpt = dir.path().join("checkpoint/step-5");
    let o = std::process::Command::new(common::titan_bin())
        .args(["generate", "--checkpoint", ckpt.to_str().unwrap()])
        .args(["--prompt", "The cat", "--max-new-tokens", "8", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids = |key: &str| -> Vec<u32> {
        out[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt, generated) = (ids("prompt_ids"), ids("generated_ids"));
    let be = CpuBackend::new();
    let (args, params) = titan::checkpoint::load_weights(&be, &ckpt).unwrap();
    let state = titan::checkpoint::read_state(&ckpt).unwrap();
    let bias = state.expert_bias.expect("a routing bias");
    assert!(
        bias.iter().flatten().any(|b| b.abs() >= 0.5),
        "the bias moved far: {bias:?}"
    );
    let greedy = |with_bias: bool| {
        let capacity = prompt.len() + 8;
        let mut model = Decoder::new(&be, args.clone(), capacity).unwrap();
        if with_bias {
            model.set_expert_bias(&be, &bias).unwrap();
        }
        let mut cache = KvCache::new(&be, &args, capacity);
        let mut logits = model
            .forward_cached(&be, &params, &mut cache, &prompt)
            .unwrap();
        let mut out = Vec::new();
        for _ in 0..generated.len() {
            let next = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            out.push(next);
            logits = model
                .forward_cached(&be, &params, &mut cache, &[next])
                .unwrap();
        }
        out
    };
    assert_eq!(generated, greedy(true));
    assert_ne!(
        greedy(false),
        greedy(true),
        "the bias changes what is generated"
    );
}
