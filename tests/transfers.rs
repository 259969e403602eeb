//! The host↔device copy counter (`backend::transfers`) on the CPU backend, which counts the calls
//! a GPU would make copies for: each upload and download once, with its bytes; device-side
//! copies not at all. A dense model's forward and backward make none, and so does a
//! mixture-of-experts block (its expert load comes down once, when the step's statistics are
//! taken). Pipeline stage transfers and tensor
//! parallelism (its vocabulary-parallel loss included) copy through the host on the host road and
//! stay on the device on the device road.

mod common;

use titan::backend::cpu::CpuBackend;
use titan::backend::transfers::Transfers;
use titan::backend::Backend;
use titan::config::Config;
use titan::model::{init_params, Decoder, ModelArgs, ParamSet, Workspace};

#[test]
fn each_upload_and_download_is_one_copy_of_its_bytes() {
    let be = CpuBackend::new();
    let at = |copies, bytes| Transfers { copies, bytes };
    assert_eq!(be.transfers.read(), at(0, 0));
    let mut a = be.upload(&[1.0; 10]);
    assert_eq!(be.transfers.read(), at(1, 40));
    assert_eq!(be.download(&a), vec![1.0; 10]);
    assert_eq!(be.transfers.read(), at(2, 80));
    let b = be.upload_owned(vec![2.0; 5]);
    assert_eq!(be.download_owned(b), vec![2.0; 5]);
    assert_eq!(be.transfers.read(), at(4, 120));
    // Copies between device buffers stay on the device.
    let mut c = be.copied(&a);
    be.copy_from(&mut c, &a);
    be.fill(&mut a, 3.0);
    be.copy_into_at(&mut c, 2, &be.zeros(3));
    assert_eq!(be.transfers.read(), at(4, 120));
    assert_eq!(be.transfers.read().since(at(1, 40)), at(3, 80));
}

/// The model of `[model] name`/`flavor` at dim 64, 2 blocks.
fn args_of(name: &str, flavor: &str) -> ModelArgs {
    let flags = [
        "--model.name",
        name,
        "--model.flavor",
        flavor,
        "--model.dim",
        "64",
        "--model.n_layers",
        "2",
        "--model.vocab_size",
        "300",
    ];
    let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    Config::load(None, &flags).unwrap().model_args().unwrap()
}

/// Copies one whole forward and backward (loss included) of `args` makes, after a first step
/// that sizes what it keeps, and those of taking the expert statistics after it.
fn copies_of_a_step(args: &ModelArgs) -> (Transfers, Transfers) {
    let be = CpuBackend::new();
    let (batch, seq) = (2, 16);
    let model = Decoder::new(&be, args.clone(), seq).unwrap();
    let params = init_params(&be, args, 3);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i * 7 % 300) as u32)
        .collect();
    let mut ws = Workspace::new(&be, args, batch, seq);
    let mut grads = ParamSet::zeros(&be, &model.param_specs());
    let mut step = |ws: &mut Workspace<CpuBackend>| {
        model
            .forward_backward(&be, &params, &mut grads, ws, &tokens, 1.0)
            .unwrap()
    };
    step(&mut ws);
    ws.take_expert_stats(&be);
    let before = be.transfers.read();
    step(&mut ws);
    let after_step = be.transfers.read();
    ws.take_expert_stats(&be);
    (
        after_step.since(before),
        be.transfers.read().since(after_step),
    )
}

#[test]
fn neither_a_dense_step_nor_a_mixture_of_experts_makes_a_copy() {
    assert_eq!(
        copies_of_a_step(&args_of("llama3", "debugmodel")),
        Default::default()
    );
    // A MoE block's routing, dispatch order, grouped expert GEMMs, combine and the router's
    // backward stay on the device, and so do the expert bias (DeepSeek-V3's load balancing:
    // uploaded when it moves, after a step, not by the blocks) and the step's expert load, which
    // comes down once when taken: every block's counts, `[layers, experts]`.
    // gpt-oss's biased experts add their biases as grouped GEMMs of depth one, and its clamped
    // SwiGLU is a backend op.
    for (name, flavor, bias) in [
        ("qwen3", "debugmodel_moe", false),
        ("deepseek_v3", "debugmodel", true),
        ("gpt_oss", "debugmodel", true),
    ] {
        let moe = args_of(name, flavor);
        assert_eq!(
            moe.moe.is_some_and(|m| m.load_balance_coeff.is_some()),
            bias,
            "{name}"
        );
        let experts = moe.moe.map(|m| m.router.num_experts as u64).unwrap();
        let counts = Transfers {
            copies: 1,
            bytes: 4 * experts * moe.n_layers as u64,
        };
        assert_eq!(
            copies_of_a_step(&moe),
            (Transfers::default(), counts),
            "{name}"
        );
    }
    // The sequence-wise auxiliary loss's figures, balance and gradient stay on the device too;
    // each block's per-sequence losses come down with the counts, in the same copy.
    for name in ["qwen3", "deepseek_v3"] {
        let mut moe = args_of(
            name,
            if name == "qwen3" {
                "debugmodel_moe"
            } else {
                "debugmodel"
            },
        );
        moe.moe.as_mut().unwrap().aux_loss_coef = Some(0.01);
        let experts = moe.moe.map(|m| m.router.num_experts as u64).unwrap();
        let layers = moe.n_layers as u64;
        let moe_layers = (0..moe.n_layers)
            .filter(|&l| moe.moe_at(l).is_some())
            .count() as u64;
        // Two sequences per step: one `L_b` each per MoE block.
        let counts_and_losses = Transfers {
            copies: 1,
            bytes: 4 * (experts * layers + 2 * moe_layers),
        };
        assert_eq!(
            copies_of_a_step(&moe),
            (Transfers::default(), counts_and_losses),
            "{name} with the auxiliary loss"
        );
    }
}

/// Rank 0's host↔device copies and bytes per step (`titan bench train --json`) of a two-rank
/// `layout`, on the host road or on the device road (`TITAN_DEVICE_COLLECTIVES=host`).
fn copies_per_step(layout: &[&str], device_road: bool) -> (f64, f64) {
    let mut cmd = std::process::Command::new(common::titan_bin());
    cmd.args(["bench", "train", "--steps", "2", "--warmup", "1", "--json"])
        .args(["--threads", "1", "--nproc", "2"])
        .args(layout)
        .args(common::TINY_ARGS)
        .env_remove("TITAN_DEVICE_COLLECTIVES");
    if device_road {
        cmd.env("TITAN_DEVICE_COLLECTIVES", "host");
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let figure = |key: &str| {
        json[key]
            .as_f64()
            .unwrap_or_else(|| panic!("no {key}: {json}"))
    };
    (
        figure("host_device_copies_per_step"),
        figure("host_device_bytes_per_step"),
    )
}

#[test]
fn stage_transfers_the_vocabulary_parallel_loss_and_muon_stay_on_the_device_road() {
    // Rank 0 of two stages, two microbatches of one sequence: each one's activations down to the
    // host, the gradient that comes back up.
    let pp = ["--parallelism.pipeline_parallel_degree", "2"];
    let (copies, bytes) = copies_per_step(&pp, false);
    assert_eq!(copies, 4.0, "PP 2, host road");
    assert!(bytes > 0.0);
    assert_eq!(copies_per_step(&pp, true), (0.0, 0.0), "PP 2, device road");
    // TP 2 with loss parallel: the row collectives and the loss's row statistics go through the
    // host on the host road; on the device road nothing does (the logits never leave it).
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    assert!(copies_per_step(&tp, false).0 > 0.0, "TP 2, host road");
    assert_eq!(copies_per_step(&tp, true), (0.0, 0.0), "TP 2, device road");
    // The MoE auxiliary loss's per-sequence figures, summed over the sequence's CP or TP ranks:
    // on the device road over the groups' communicators, so the loss adds no copy to the step
    // (CP's own step makes two, with or without it).
    for degree in [
        "--parallelism.context_parallel_degree",
        "--parallelism.tensor_parallel_degree",
    ] {
        let moe = [
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel_moe",
            degree,
            "2",
        ];
        let aux = [&moe[..], &["--model.router_aux_loss_coef", "0.01"]].concat();
        assert_eq!(
            copies_per_step(&aux, true),
            copies_per_step(&moe, true),
            "{degree} 2, MoE with the auxiliary loss against without, device road"
        );
    }
    // Muon's exchange of whole matrices: packed on the device, the all-to-alls on the job group's.
    let muon = ["--optimizer.name", "Muon"];
    assert!(
        copies_per_step(&muon, false).0 > 0.0,
        "Muon FSDP 2, host road"
    );
    assert_eq!(
        copies_per_step(&muon, true),
        (0.0, 0.0),
        "Muon FSDP 2, device road"
    );
}
