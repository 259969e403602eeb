//! Optimizer settings beyond one AdamW for every tensor: `[[optimizer.param_groups]]` (the first
//! group whose pattern matches a parameter's name gives it its learning rate, weight decay and
//! betas) trains as PyTorch's AdamW with the same groups, `Adam` as `torch.optim.Adam`, `Muon` as
//! `torch.optim.Muon` beside AdamW, and a bad group, name or Muon key is refused by name.

mod common;

use common::pytorch_training::{train_both, Comparison};
use common::{hf_python, train};

/// Norms and embeddings without weight decay; the output head at its own learning rate and betas.
const GROUPS_TOML: &str = r#"
[[optimizer.param_groups]]
match = ["*norm*", "tok_embeddings.*"]
weight_decay = 0.0

[[optimizer.param_groups]]
match = ["output.*"]
lr = 1e-3
betas = [0.8, 0.9]
"#;

const GROUPS_JSON: &str = r#"[{"match": ["*norm*", "tok_embeddings.*"], "weight_decay": 0.0},
 {"match": ["output.*"], "lr": 1e-3, "betas": [0.8, 0.9]}]"#;

/// A tiny Llama made by transformers, imported, trained 10 steps with two parameter groups
/// against PyTorch's AdamW given the same groups, and with Adam against `torch.optim.Adam`:
/// every loss within 1e-5 (and neither the plain AdamW curve).
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn parameter_groups_and_adam_train_as_pytorchs() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("tokens.bin");
    common::write_random_tokens(&shard, 3000, 9);
    let config = dir.path().join("groups.toml");
    std::fs::write(
        &config,
        format!("{}{GROUPS_TOML}", titan::config::DEFAULT_CONFIG_TOML),
    )
    .unwrap();
    let data = [
        &common::token_shard(&shard)[..],
        &["--training.document_start_id", "1"],
    ]
    .concat();
    let compare = |titan_extra: &[&str], python_extra: &[&str], sub: &str| {
        let sub = dir.path().join(sub);
        std::fs::create_dir_all(&sub).unwrap();
        train_both(
            &py,
            &Comparison {
                dir: &sub,
                steps: "10",
                titan_data: &data,
                tokens: &shard,
                targets: None,
                make: None,
                document_start: Some("1"),
                titan_extra,
                python_extra,
            },
        )
    };
    let grouped = compare(
        &["--config", config.to_str().unwrap()],
        &["--param-groups", GROUPS_JSON],
        "grouped",
    );
    let worst = grouped.worst_loss_difference();
    eprintln!("parameter groups vs PyTorch over 10 steps: loss within {worst:.2e}");
    assert!(
        worst <= 1e-5,
        "{:?} vs {:?}",
        grouped.titan.0,
        grouped.pytorch.0
    );
    let plain = compare(&[], &[], "plain");
    assert_ne!(
        common::bits(&plain.titan.0),
        common::bits(&grouped.titan.0),
        "the groups changed nothing"
    );
    // Adam: the weight decay (0.1) as an L2 term of the gradient, as `torch.optim.Adam`.
    let adam = compare(
        &["--optimizer.name", "Adam"],
        &["--optimizer", "Adam"],
        "adam",
    );
    let worst = adam.worst_loss_difference();
    eprintln!("Adam vs PyTorch over 10 steps: loss within {worst:.2e}");
    assert!(worst <= 1e-5, "{:?} vs {:?}", adam.titan.0, adam.pytorch.0);
    assert_ne!(common::bits(&plain.titan.0), common::bits(&adam.titan.0));
    // bf16 optimizer state: AdamW's moments (and Muon's momentum) stored rounded to bf16, the
    // update in fp32, as PyTorch's optimizers with their state rounded after each step.
    for (name, titan_name) in [("AdamW", "AdamW"), ("Muon", "Muon")] {
        let muon_keys = r#"{"ns_dtype": "float32"}"#;
        let bf16 = compare(
            &[
                "--optimizer.name",
                titan_name,
                "--optimizer.state_dtype",
                "bfloat16",
                "--optimizer.ns_dtype",
                "float32",
            ],
            &[
                "--optimizer",
                name,
                "--state-dtype",
                "bfloat16",
                "--muon",
                muon_keys,
            ],
            &format!("{name}-bf16-state"),
        );
        let worst = bf16.worst_loss_difference();
        eprintln!("{name} with bf16 state vs PyTorch over 10 steps: loss within {worst:.2e}");
        assert!(worst <= 1e-5, "{:?} vs {:?}", bf16.titan.0, bf16.pytorch.0);
        if name == "AdamW" {
            assert_ne!(common::bits(&plain.titan.0), common::bits(&bf16.titan.0));
        }
    }
}

/// Muon on the blocks' matrices and AdamW (at `adamw_lr`) on the rest, against
/// `torch.optim.Muon` + `torch.optim.AdamW` over 20 steps: every `adjust_lr_fn` with the
/// Newton–Schulz iteration in float32 within 1e-5 of PyTorch's, and in bfloat16 (the default,
/// PyTorch's own precision) within the rounding of bf16 products.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn muon_trains_as_pytorchs() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("tokens.bin");
    common::write_random_tokens(&shard, 6000, 11);
    let data = [
        &common::token_shard(&shard)[..],
        &["--training.document_start_id", "1"],
    ]
    .concat();
    let mut curves = Vec::new();
    for (adjust, dtype, tolerance) in [
        ("original", "float32", 1e-5),
        ("match_rms_adamw", "float32", 1e-5),
        ("spectral_unclamped", "float32", 1e-5),
        ("original", "bfloat16", 2e-5),
    ] {
        let sub = dir.path().join(format!("{adjust}-{dtype}"));
        std::fs::create_dir_all(&sub).unwrap();
        let titan = [
            "--optimizer.name",
            "Muon",
            "--optimizer.adamw_lr",
            "1e-3",
            "--optimizer.adjust_lr_fn",
            adjust,
            "--optimizer.ns_dtype",
            dtype,
        ];
        let keys =
            format!(r#"{{"adamw_lr": 1e-3, "adjust_lr_fn": "{adjust}", "ns_dtype": "{dtype}"}}"#);
        let both = train_both(
            &py,
            &Comparison {
                dir: &sub,
                steps: "20",
                titan_data: &data,
                tokens: &shard,
                targets: None,
                make: None,
                document_start: Some("1"),
                titan_extra: &titan,
                python_extra: &["--optimizer", "Muon", "--muon", &keys],
            },
        );
        let worst = both.worst_loss_difference();
        eprintln!(
            "Muon ({adjust}, {dtype}) vs torch.optim.Muon over 20 steps: loss within {worst:.2e}"
        );
        assert!(
            worst <= tolerance,
            "{adjust} {dtype}: {:?} vs {:?}",
            both.titan.0,
            both.pytorch.0
        );
        curves.push(common::bits(&both.titan.0));
    }
    assert!(
        curves[0] != curves[1] && curves[0] != curves[2] && curves[0] != curves[3],
        "adjust_lr_fn or ns_dtype changed nothing"
    );
}

/// A group whose pattern matches no parameter, a group without patterns and one with a
/// learning rate that is not positive are refused naming the group.
#[test]
fn bad_parameter_groups_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let o = train(
        &dir.path().join("run"),
        &[],
        &["--training.steps", "1", "--optimizer.name", "SGD"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("[optimizer] name = `SGD` is not supported (accepted: AdamW, Adam"),
        "{err}"
    );
    for (groups, says) in [
        (
            "[[optimizer.param_groups]]\nmatch = [\"*.bias\"]\nweight_decay = 0.0\n",
            "[[optimizer.param_groups]] #1: match pattern `*.bias` matches no parameter",
        ),
        (
            "[[optimizer.param_groups]]\nmatch = []\n",
            "[[optimizer.param_groups]] #1: `match` names no pattern",
        ),
        (
            "[[optimizer.param_groups]]\nmatch = [\"*norm*\"]\n[[optimizer.param_groups]]\nmatch = [\"output.*\"]\nlr = -1.0\n",
            "[[optimizer.param_groups]] #2: lr must be a positive number",
        ),
    ] {
        let config = dir.path().join("bad.toml");
        std::fs::write(
            &config,
            format!("{}\n{groups}", titan::config::DEFAULT_CONFIG_TOML),
        )
        .unwrap();
        let o = train(
            &dir.path().join("run"),
            &[],
            &["--training.steps", "1", "--config", config.to_str().unwrap()],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{err}");
    }
}
