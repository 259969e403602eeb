//! Expert parallelism (`[parallelism] expert_parallel_degree`), real processes through the
//! launcher on the tiny Qwen3-MoE (8 experts, top-2): per-step loss and gradient norm within 1e-5
//! of one process under EP alone and composed with FSDP, HSDP, TP, CP, PP, activation
//! checkpointing and the expert bias; checkpoints resharded across EP degrees; bad settings refused by name.

mod common;

use common::{
    assert_layout_matches_one_process, assert_parity, assert_validation_matches, losses, metric,
    train,
};

const MOE: &[&str] = &[
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--training.steps",
    "10",
];

/// Full activation checkpointing, and per-op selective.
const FULL_AND_OP_AC: [&[&str]; 2] = [
    &["--activation_checkpoint.mode", "full"],
    &[
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
];

fn nproc(n: &'static str) -> [&'static str; 4] {
    ["--nproc", n, "--master-port", "0"]
}

/// `parallel` (with `ep` as the EP degree) on `n` ranks against one process, both at the global
/// batch `global` and the extra settings `extra`.
fn check(what: &str, n: &'static str, global: &str, ep: &str, parallel: &[&str], extra: &[&str]) {
    let single = [MOE, &["--training.global_batch_size", global][..], extra].concat();
    let parallel = [&["--parallelism.expert_parallel_degree", ep][..], parallel].concat();
    assert_layout_matches_one_process(what, &single, &nproc(n), &parallel, "rank 0 of");
}

#[test]
fn ep_2_and_4_and_fsdp_2_with_ep_2_match_one_process() {
    check("EP 2", "2", "4", "2", &[], &[]);
    check("EP 4", "4", "8", "4", &[], &[]);
    // Four shard ranks, experts split two ways and each half FSDP-sharded over two ranks.
    check("FSDP 2 × EP 2", "4", "8", "2", &[], &[]);
}

#[test]
fn ep_composes_with_hsdp_cp_and_pp() {
    check(
        "HSDP 2 × EP 2",
        "4",
        "8",
        "2",
        &[
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        &[],
    );
    check(
        "CP 2 × EP 2",
        "2",
        "2",
        "2",
        &["--parallelism.context_parallel_degree", "2"],
        &[],
    );
    check(
        "PP 2 × FSDP 2 × EP 2",
        "4",
        "4",
        "2",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        &[],
    );
}

#[test]
fn tp_2_alone_and_with_ep_2_match_one_process() {
    // Each tensor-parallel rank routes its own sequence-parallel rows through experts it holds
    // whole; the expert bias moves by the loads summed over the TP ranks too.
    let bias = ["--model.load_balance_coeff", "0.01"];
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    check("TP 2 with the expert bias", "2", "2", "1", &tp, &bias);
    check(
        "TP 2 × EP 2 with the expert bias",
        "4",
        "4",
        "2",
        &tp,
        &bias,
    );
    // Shared experts are the block's SwiGLU: column- then row-parallel like a dense
    // feed-forward, and recomputed like one under activation checkpointing.
    for ac in FULL_AND_OP_AC {
        let shared = [&["--model.moe_shared_hidden", "32"][..], ac].concat();
        check(
            &format!("TP 2 × EP 2 with TP-sharded shared experts, {ac:?}"),
            "4",
            "4",
            "2",
            &tp,
            &shared,
        );
    }
}

/// A leading dense block (`n_dense_layers` 1: block 0 a 768-wide SwiGLU, block 1 the experts
/// with 32-wide shared experts), so the two kinds of feed-forward, with their activations and
/// scratch of different widths, meet in one model: EP, FSDP × EP, TP × EP under full and per-op
/// activation checkpointing, and PP × FSDP × EP equal one process.
#[test]
fn a_leading_dense_block_composes_with_every_layout() {
    let dense = [
        "--model.n_dense_layers",
        "1",
        "--model.moe_shared_hidden",
        "32",
        "--model.load_balance_coeff",
        "0.01",
    ];
    check("dense block 0, EP 2", "2", "4", "2", &[], &dense);
    check("dense block 0, FSDP 2 × EP 2", "4", "8", "2", &[], &dense);
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    for ac in FULL_AND_OP_AC {
        let extra = [&dense[..], ac].concat();
        check(
            &format!("dense block 0, TP 2 × EP 2, {ac:?}"),
            "4",
            "4",
            "2",
            &tp,
            &extra,
        );
    }
    let pp = [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ];
    check(
        "dense block 0, PP 2 × FSDP 2 × EP 2",
        "4",
        "4",
        "2",
        &pp,
        &dense,
    );
}

#[test]
fn ep_composes_with_full_ac_and_the_expert_bias() {
    // Full AC recomputes the experts (and their all-to-alls) before each block's backward; the
    // bias moves every rank's routing alike from the job's summed loads.
    check(
        "EP 2, full AC, load balancing",
        "2",
        "4",
        "2",
        &[],
        &[
            "--activation_checkpoint.mode",
            "full",
            "--model.load_balance_coeff",
            "0.01",
        ],
    );
}

/// The auxiliary loss is a mean over the step's sequences, so every layout reports it and
/// trains with it alike: loss, grad norm and `moe_aux_loss` against one process.
#[test]
fn the_auxiliary_loss_is_the_same_under_every_layout() {
    let aux = ["--model.router_aux_loss_coef", "0.01"];
    let one = tempfile::tempdir().unwrap();
    let single = |global: &'static str| {
        [MOE, &aux[..], &["--training.global_batch_size", global][..]].concat()
    };
    let o = train(one.path(), &[], &single("4"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reference = metric(one.path(), "moe_aux_loss");
    assert_eq!(reference.len(), 10);
    // Two blocks of coefficient 0.01: at least 0.02 (perfect balance), at most 0.02 · 8 / 2.
    assert!(
        reference.iter().all(|(_, a)| (0.02..=0.08).contains(a)),
        "{reference:?}"
    );
    for (what, n, parallel) in [
        (
            "EP 2",
            "2",
            vec!["--parallelism.expert_parallel_degree", "2"],
        ),
        (
            "TP 2 × EP 2",
            "4",
            vec![
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_parallel_degree",
                "2",
            ],
        ),
        (
            "CP 2 × EP 2 (4 sequences over 2 ranks each)",
            "4",
            vec![
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.expert_parallel_degree",
                "2",
            ],
        ),
        (
            "PP 2 (accumulation over micro-batches)",
            "2",
            vec!["--parallelism.pipeline_parallel_degree", "2"],
        ),
        (
            "TP 2 (one sequence per micro-batch, split over the TP ranks)",
            "2",
            vec!["--parallelism.tensor_parallel_degree", "2"],
        ),
    ] {
        let many = tempfile::tempdir().unwrap();
        let local = match what {
            _ if what.starts_with("PP") => "4",
            _ if what.starts_with("TP 2 (") => "1",
            _ => "2",
        };
        let args = [
            &single("4")[..],
            &parallel,
            &["--training.local_batch_size", local][..],
        ]
        .concat();
        let o = train(many.path(), &nproc(n), &args);
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_parity(&losses(one.path()), &losses(many.path()), what);
        for key in ["grad_norm", "moe_aux_loss"] {
            assert_parity(
                &metric(one.path(), key),
                &metric(many.path(), key),
                &format!("{what} ({key})"),
            );
        }
    }
}

#[test]
fn validation_under_ep_equals_one_process() {
    // Validation's forward sends its rows to the experts' ranks too. One process reads both
    // ranks' batches at once.
    let moe = [MOE, &["--training.global_batch_size", "4"][..]].concat();
    let whole = [
        "--training.local_batch_size",
        "4",
        "--validation.local_batch_size",
        "4",
    ];
    let ep = ["--parallelism.expert_parallel_degree", "2"];
    assert_validation_matches(
        &[&moe[..], &whole].concat(),
        &nproc("2"),
        &[&moe[..], &ep].concat(),
        "EP 2 validation",
    );
}

#[test]
fn ep_checkpoints_reshard_across_degrees() {
    let run = |dir: &std::path::Path, steps: &str, launcher: &[&str], parallel: &[&str]| {
        let args = [
            MOE,
            &[
                "--training.steps",
                steps,
                "--checkpoint.interval",
                "3",
                "--training.global_batch_size",
                "8",
            ][..],
            parallel,
        ]
        .concat();
        let o = train(dir, launcher, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let ep = |d: &'static str| vec!["--parallelism.expert_parallel_degree", d];
    // Steps 1-3 are the warm-up, the same whatever `steps` says; from there on every run is
    // 6 steps long, so the learning rate decays alike.
    let one = tempfile::tempdir().unwrap();
    run(one.path(), "6", &[], &[]);
    let reference = losses(one.path());
    for (what, first, first_ep, then, then_ep) in [
        ("EP 4 → EP 2", "4", "4", "2", "2"),
        // The same layout reads its own shards as saved.
        ("EP 2 → EP 2", "2", "2", "2", "2"),
        ("FSDP 2 × EP 2 → one process", "4", "2", "1", "1"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        run(dir.path(), "3", &nproc(first), &ep(first_ep));
        let launcher: &[&str] = if then == "1" { &[] } else { &nproc(then) };
        run(dir.path(), "6", launcher, &ep(then_ep));
        assert_parity(&reference, &losses(dir.path()), what);
    }
}

#[test]
fn bad_ep_settings_are_refused_naming_the_key() {
    let refused = |launcher: &[&str], extra: &[&str], says: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let o = train(
            dir.path(),
            launcher,
            &[&["--training.steps", "1"][..], extra].concat(),
        );
        assert!(!o.status.success(), "{extra:?} should be refused");
        let err = String::from_utf8_lossy(&o.stderr);
        for s in says {
            assert!(err.contains(s), "{extra:?}: {err}");
        }
    };
    let ep = |d: &'static str| [MOE, &["--parallelism.expert_parallel_degree", d][..]].concat();
    // 8 experts do not split 3 ways.
    refused(
        &nproc("3"),
        &ep("3"),
        &["expert_parallel_degree = 3", "8 experts"],
    );
    // EP 4 borrows 4 ranks of dp_shard × cp; a world of 2 has 2.
    refused(
        &nproc("2"),
        &ep("4"),
        &["expert_parallel_degree = 4", "must divide"],
    );
    refused(
        &[],
        &ep("2"),
        &["expert_parallel_degree = 2", "one process"],
    );
    // A dense model has no experts to split.
    refused(
        &nproc("2"),
        &["--parallelism.expert_parallel_degree", "2"],
        &["expert_parallel_degree = 2", "mixture-of-experts"],
    );
}
