//! LoRA (`[model] converters = ["lora"]`): training equals a PyTorch reference of LoRA linears
//! (`scripts/hf_train_parity.py --lora-adapters`) step for step, the base weights stay bit for
//! bit what they were, the optimizer holds only the adapters' state, every layout equals one
//! process, a Hugging Face export of a LoRA run (the adapters merged) computes and generates as
//! titan does, and bad settings are refused by name.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::hf_models::{gpt_oss_two_blocks, llama4_two_blocks, GPT_OSS_SHAPES, LLAMA4_SHAPES};
use common::pytorch_training::{make_llama, python};
use common::{
    assert_layout_matches_one_process, hf_python, losses, metric, train, Layout, FSDP_TP_PP,
};
use titan::backend::cpu::CpuBackend;
use titan::checkpoint;

/// LoRA on every block projection, rank 4, alpha 8 (scale 2).
const LORA: &[&str] = &[
    "--model.converters",
    "lora",
    "--lora.rank",
    "4",
    "--lora.alpha",
    "8",
];

/// AdamW's epsilon in the PyTorch comparison: above the first steps' tiniest gradients, whose
/// updates (m/√v ≈ ±1 whatever their size) would otherwise turn rounding into visible steps.
const EPS: &str = "1e-6";

/// Every tensor of the checkpoint at `dir`, by name.
fn weights(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let (_, params) = checkpoint::load_weights(&CpuBackend::new(), dir).unwrap();
    params.names.into_iter().zip(params.bufs).collect()
}

fn run(dump: &Path, args: &[&str]) {
    let o = train(dump, &[], args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A tiny Llama made by transformers, imported, one LoRA step (so both adapter factors are
/// non-zero), then 3 more steps from that checkpoint against PyTorch training LoRA linears
/// written in the script from the same adapters: every loss and gradient norm within 1e-6, the
/// adapters within 1e-6 after one step (1e-5 after three); the base weights bit for bit the
/// imported ones, and the optimizer's state only the adapters'.
#[test]
#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn lora_training_equals_a_pytorch_reference_and_leaves_the_base_untouched() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    make_llama(&py, &hf);
    let shard = dir.path().join("tokens.bin");
    common::write_random_tokens(&shard, 3000, 5);
    let (batch, seq, lr, warmup, steps) = ("2", "64", "3e-3", "2", "3");
    let data = common::token_shard(&shard);
    let common = [
        "--training.local_batch_size",
        batch,
        "--training.seq_len",
        seq,
        "--optimizer.lr",
        lr,
        "--lr_scheduler.warmup_steps",
        warmup,
        "--optimizer.eps",
        EPS,
        "--checkpoint.enable",
        "true",
    ];
    let first = dir.path().join("first");
    let from_hf = [
        "--training.steps",
        "1",
        "--checkpoint.interval",
        "1",
        "--checkpoint.initial_load_path",
        hf.to_str().unwrap(),
        "--checkpoint.initial_load_in_hf",
        "true",
    ];
    run(&first, &[&data[..], &common, LORA, &from_hf].concat());
    let start = first.join("checkpoint/step-1");
    let second = dir.path().join("second");
    let from_first = [
        "--training.steps",
        steps,
        "--checkpoint.interval",
        "1",
        "--checkpoint.initial_load_path",
        start.to_str().unwrap(),
    ];
    run(&second, &[&data[..], &common, LORA, &from_first].concat());

    // PyTorch from the same step-1 checkpoint: one step, then all three.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hf_train_parity.py");
    let adapters = start.join("model.safetensors");
    let pytorch = |steps: &str| {
        let out = dir.path().join(format!("adapters{steps}.json"));
        let curves: Vec<serde_json::Value> = serde_json::from_str(&python(
            &py,
            &[
                script,
                hf.to_str().unwrap(),
                "--tokens",
                shard.to_str().unwrap(),
                "--batch",
                batch,
                "--seq",
                seq,
                "--steps",
                steps,
                "--lr",
                lr,
                "--warmup",
                warmup,
                "--lora-adapters",
                adapters.to_str().unwrap(),
                "--eps",
                EPS,
                "--lora-alpha",
                "8",
                "--lora-out",
                out.to_str().unwrap(),
            ],
        ))
        .unwrap();
        let adapters: BTreeMap<String, Vec<f32>> =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        (curves, adapters)
    };
    let (reference, at_end) = pytorch(steps);
    let curve =
        |key: &str| -> Vec<f64> { reference.iter().map(|r| r[key].as_f64().unwrap()).collect() };
    let titan_losses: Vec<f64> = losses(&second).iter().map(|&(_, l)| l).collect();
    let titan_norms: Vec<f64> = metric(&second, "grad_norm")
        .iter()
        .map(|&(_, g)| g)
        .collect();
    let relative = |a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs())
            .fold(0.0, f64::max)
    };
    let (loss_diff, norm_diff) = (
        relative(&titan_losses, &curve("loss")),
        relative(&titan_norms, &curve("grad_norm")),
    );
    eprintln!(
        "LoRA vs PyTorch over {steps} steps: loss {loss_diff:.2e}, grad norm {norm_diff:.2e}"
    );
    assert!(
        loss_diff <= 1e-6,
        "losses {titan_losses:?} vs {:?}",
        curve("loss")
    );
    assert!(
        norm_diff <= 1e-6,
        "norms {titan_norms:?} vs {:?}",
        curve("grad_norm")
    );
    let worst = |titan: &BTreeMap<String, Vec<f32>>, torch: &BTreeMap<String, Vec<f32>>| {
        let mut worst = 0.0f32;
        for (name, expect) in torch {
            let got = &titan[name];
            assert_eq!(got.len(), expect.len(), "{name}");
            for (g, e) in got.iter().zip(expect) {
                worst = worst.max((g - e).abs());
            }
        }
        worst
    };
    let after_one = weights(&second.join("checkpoint/step-1"));
    let one = worst(&after_one, &pytorch("1").1);
    let after = weights(&second.join(format!("checkpoint/step-{steps}")));
    let all = worst(&after, &at_end);
    eprintln!("LoRA vs PyTorch: adapters within {one:.2e} after one step, {all:.2e} after {steps}");
    assert!(one <= 1e-6, "adapters differ by {one} after one step");
    // AdamW's first steps divide by small second moments, which magnifies rounding.
    assert!(all <= 1e-5, "adapters differ by {all} after {steps} steps");
    let reference = at_end;
    let before = weights(&start);
    // 2 layers × 7 projections, two factors each.
    assert_eq!(reference.len(), 28);
    let base: Vec<&String> = after.keys().filter(|n| !n.contains(".lora_")).collect();
    assert_eq!(base.len(), before.len() - 28);
    for name in base {
        assert_eq!(
            after[name].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            before[name].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{name} changed: the base must stay frozen"
        );
    }
    let moments = checkpoint::st::read_file(
        &second.join(format!("checkpoint/step-{steps}/optimizer.safetensors")),
    )
    .unwrap();
    assert_eq!(
        moments.len(),
        2 * 28,
        "AdamW's state: two moments per adapter factor"
    );
    assert!(moments.iter().all(|(n, _)| n.contains(".lora_")));
}

/// LoRA under FSDP 2, DDP 2, TP 2 (the adapters split as TorchTitan's adapter sharding) with and
/// without async TP, a 1F1B pipeline of 2 stages and a zero-bubble one (the adapters' weight
/// gradients deferred to the W actions), each against one process over 4 steps.
#[test]
fn lora_layouts_match_one_process() {
    let single = [
        &[
            "--training.steps",
            "4",
            "--training.local_batch_size",
            "4",
            "--optimizer.lr",
            "1e-2",
        ],
        LORA,
    ]
    .concat();
    let more: [Layout; 3] = [
        (
            "DDP 2",
            &[
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
                "--training.local_batch_size",
                "2",
            ],
            "DDP",
        ),
        (
            "TP 2 (async)",
            &[
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_async_tensor_parallel",
                "true",
            ],
            "tensor parallel",
        ),
        (
            "PP 2 (ZBVZeroBubble)",
            &[
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_microbatch_size",
                "1",
            ],
            "pipeline: ",
        ),
    ];
    let layouts = FSDP_TP_PP.into_iter().chain(more);
    let nproc = ["--nproc", "2", "--master-port", "0"];
    for (what, parallel, says) in layouts {
        assert_layout_matches_one_process(what, &single, &nproc, parallel, says);
    }
}

/// LoRA with the other block features: Qwen3-MoE's shared-less experts frozen and split over EP 2
/// with full activation checkpointing, DeepSeek-V3's latent attention (its replicated latent
/// projections adapted too) under TP 2, float8 base linears (rowwise) under FSDP 2, and context
/// parallelism, each against one process.
#[test]
fn lora_composes_with_experts_latent_attention_float8_and_context_parallel() {
    let nproc = ["--nproc", "2", "--master-port", "0"];
    let steps = ["--training.steps", "4", "--optimizer.lr", "1e-2"];
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
    let ep = [
        "--parallelism.expert_parallel_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    let single = [&steps[..], LORA, &moe].concat();
    assert_layout_matches_one_process("EP 2 (MoE, AC full)", &single, &nproc, &ep, "rank 0 of");
    let mla = common::TINY_DEEPSEEK;
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    let single = [&steps[..], LORA, mla].concat();
    assert_layout_matches_one_process("TP 2 (MLA)", &single, &nproc, &tp, "tensor parallel");
    let float8 = [
        "--model.converters",
        "lora,quantize.linear.float8",
        "--lora.rank",
        "4",
        "--training.local_batch_size",
        "4",
    ];
    let fsdp = [
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "2",
    ];
    let single = [&steps[..], &float8].concat();
    assert_layout_matches_one_process("FSDP 2 (float8 base)", &single, &nproc, &fsdp, "FSDP");
    let cp = ["--parallelism.context_parallel_degree", "2"];
    let single = [&steps[..], LORA].concat();
    assert_layout_matches_one_process("CP 2", &single, &nproc, &cp, "context parallel");
}

/// Two rows of 25 token ids below `vocab`, and titan's mean loss on them with the checkpoint at
/// `step` as it is (a LoRA model: the adapters apart from their weights), with the model.
fn titan_loss_on_rows(
    step: &Path,
    vocab: u32,
) -> (
    Vec<u32>,
    f64,
    titan::model::Decoder<CpuBackend>,
    titan::model::ParamSet<CpuBackend>,
) {
    let be = CpuBackend::new();
    let (args, params) = checkpoint::load_weights(&be, step).unwrap();
    assert!(args.lora.is_some());
    let (batch, seq) = (2, ROW_SEQ);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i as u32 * 37 + 11) % vocab)
        .collect();
    let model = titan::model::Decoder::new(&be, args.clone(), seq).unwrap();
    let mut ws = titan::model::Workspace::new(&be, &args, batch, seq);
    let loss = model.loss(&be, &params, &mut ws, &tokens).unwrap();
    (tokens, loss.sum / loss.count as f64, model, params)
}

/// The sequence length of `titan_loss_on_rows`' rows.
const ROW_SEQ: usize = 24;

/// A LoRA run exported to Hugging Face (`convert hf-export`, the adapters merged into their
/// weights) computes the loss titan computes with the adapters apart, within 1e-5, and
/// transformers' greedy generation picks titan's tokens.
#[test]
fn a_lora_run_exports_merged_weights_that_transformers_runs_as_titan_does() {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let lr = ["--optimizer.lr", "3e-2", "--training.steps", "5"];
    run(
        dir.path(),
        &[&lr[..], LORA, &["--checkpoint.enable", "true"]].concat(),
    );
    let step = dir.path().join("checkpoint/step-5");
    let hf = dir.path().join("hf");
    let o = std::process::Command::new(common::titan_bin())
        .args(["convert", "hf-export"])
        .args([&step, &hf])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let names: Vec<String> = checkpoint::st::read_file(&hf.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names.iter().all(|n| !n.contains("lora")), "{names:?}");

    let (tokens, titan_loss, model, params) = titan_loss_on_rows(&step, 258);
    let titan_ids = common::greedy_ids(&CpuBackend::new(), &model, &params, &tokens[..8], 10);
    let script = r#"
import sys, json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
model.generation_config.eos_token_id = None
rows = torch.tensor([[int(t) for t in r.split(",")] for r in sys.argv[2].split(";")])
with torch.no_grad():
    logits = model(input_ids=rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
prompt = rows[:1, :8]
out = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
print(json.dumps({"loss": loss.item(), "ids": out[0, 8:].tolist()}))
"#;
    let rows = common::rows_arg(&tokens, ROW_SEQ);
    let out: serde_json::Value =
        serde_json::from_str(&python(&py, &["-c", script, hf.to_str().unwrap(), &rows])).unwrap();
    let hf_loss = out["loss"].as_f64().unwrap();
    assert!(
        (hf_loss - titan_loss).abs() <= 1e-5 * titan_loss,
        "titan {titan_loss} vs transformers {hf_loss}"
    );
    let hf_ids: Vec<u32> = serde_json::from_value(out["ids"].clone()).unwrap();
    assert_eq!(hf_ids, titan_ids, "greedy generation");
}

/// A LoRA run's adapters exported in PEFT's format (`convert peft-export`) load with
/// `peft.PeftModel.from_pretrained` on the transformers model the run started from and compute
/// titan's loss within 1e-5 (and not the base model's).
#[test]
fn a_lora_runs_adapters_load_in_peft_on_their_base_model() {
    let Some(py) = common::python_importing("torch, transformers, peft", "the PEFT check") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    make_llama(&py, &hf);
    let step = train_lora_from(&hf, dir.path(), &[]);
    assert_peft_loads_as_titan_computes(&py, &hf, &step, dir.path());
}

/// Trains 4 LoRA steps (`LORA`) from the HF model at `hf` with `shapes` (its titan `[model]`
/// keys) into `dir/run`; the step-4 checkpoint.
pub fn train_lora_from(hf: &Path, dir: &Path, shapes: &[&str]) -> std::path::PathBuf {
    let run_args = [
        "--training.steps",
        "4",
        "--optimizer.lr",
        "3e-2",
        "--checkpoint.enable",
        "true",
        "--checkpoint.initial_load_path",
        hf.to_str().unwrap(),
        "--checkpoint.initial_load_in_hf",
        "true",
    ];
    let dump = dir.join("run");
    run(&dump, &[shapes, &run_args[..], LORA].concat());
    dump.join("checkpoint/step-4")
}

/// The LoRA checkpoint `step`, exported in PEFT's format into `dir/peft`, loads with
/// `peft.PeftModel.from_pretrained` on its base model `hf` and computes titan's loss within 1e-5
/// (and not the base model's).
pub fn assert_peft_loads_as_titan_computes(py: &str, hf: &Path, step: &Path, dir: &Path) {
    let peft = dir.join("peft");
    let o = std::process::Command::new(common::titan_bin())
        .args(["convert", "peft-export"])
        .args([step, &peft])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let (tokens, titan_loss, ..) = titan_loss_on_rows(step, 300);
    let script = r#"
import sys, json, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
rows = torch.tensor([[int(t) for t in r.split(",")] for r in sys.argv[3].split(";")])
def loss(model):
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
before = loss(base)
adapted = PeftModel.from_pretrained(base, sys.argv[2])
print(json.dumps({"base": before, "adapted": loss(adapted)}))
"#;
    let rows = common::rows_arg(&tokens, ROW_SEQ);
    let out: serde_json::Value = serde_json::from_str(&python(
        py,
        &[
            "-c",
            script,
            hf.to_str().unwrap(),
            peft.to_str().unwrap(),
            &rows,
        ],
    ))
    .unwrap();
    let (base, adapted) = (
        out["base"].as_f64().unwrap(),
        out["adapted"].as_f64().unwrap(),
    );
    assert!(
        (adapted - titan_loss).abs() <= 1e-5 * titan_loss,
        "titan {titan_loss} vs PEFT {adapted}"
    );
    assert!(
        (base - titan_loss).abs() > 1e-3 * titan_loss,
        "the adapters changed nothing: base {base}, titan {titan_loss}"
    );
}

/// The same for a Llama 4 (`LLAMA4_SHAPES`: NoPE and temperatures, chunks and the L2 norm,
/// dense blocks and experts beside a shared expert): its adapters on the attention,
/// the dense SwiGLUs and the shared experts (`feed_forward.shared_expert.*`; the routed experts
/// are not adapted) load in PEFT on the transformers Llama 4 as titan computes them.
#[test]
fn a_llama4_lora_runs_adapters_load_in_peft() {
    let Some(py) = common::python_importing("torch, transformers, peft", "the PEFT check") else {
        return;
    };
    let make = llama4_two_blocks("");
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    python(&py, &["-c", &make, hf.to_str().unwrap()]);
    let shapes = [LLAMA4_SHAPES, &["--model.load_balance_coeff", "0"]].concat();
    let step = train_lora_from(&hf, dir.path(), &shapes);
    assert_peft_loads_as_titan_computes(&py, &hf, &step, dir.path());
}

/// The same for a gpt-oss (`GPT_OSS_SHAPES`, a window of 6; biases and sinks away from
/// zero): its adapters on the attention's projections (which have biases; the routed experts
/// and the router are not adapted) load in PEFT on the transformers gpt-oss as titan computes them.
#[test]
fn a_gpt_oss_lora_runs_adapters_load_in_peft() {
    let Some(py) = common::python_importing("torch, transformers, peft", "the PEFT check") else {
        return;
    };
    let make = gpt_oss_two_blocks("");
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    python(&py, &["-c", &make, hf.to_str().unwrap()]);
    let window_and_bias = [
        "--model.sliding_window_size",
        "6",
        "--model.load_balance_coeff",
        "0",
    ];
    let shapes = [GPT_OSS_SHAPES, &window_and_bias].concat();
    let step = train_lora_from(&hf, dir.path(), &shapes);
    assert_peft_loads_as_titan_computes(&py, &hf, &step, dir.path());
}

/// A LoRA run stopped after step 2 and resumed from its checkpoint, in one process and under
/// FSDP 2 (the adapters' moment shards, no moments of the frozen base), ends with the straight
/// run's losses, bit for bit.
#[test]
fn a_lora_run_resumes_bit_for_bit() {
    let steps = |n: &'static str| {
        [
            &[
                "--training.steps",
                n,
                "--checkpoint.enable",
                "true",
                "--checkpoint.interval",
                "2",
                "--optimizer.lr",
                "1e-2",
                "--training.local_batch_size",
                "2",
                // A constant learning rate: the schedule does not depend on the run's length.
                "--lr_scheduler.warmup_steps",
                "0",
                "--lr_scheduler.decay_ratio",
                "0",
            ][..],
            LORA,
        ]
        .concat()
    };
    let fsdp: &[&str] = &["--nproc", "2", "--master-port", "0"];
    for launcher in [&[][..], fsdp] {
        let (straight, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for (dir, n) in [(&straight, "4"), (&resumed, "2"), (&resumed, "4")] {
            let o = train(dir.path(), launcher, &steps(n));
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let tail = |d: &Path| common::bits(&losses(d)[2..]);
        assert_eq!(losses(resumed.path()).len(), 4);
        assert_eq!(tail(straight.path()), tail(resumed.path()), "{launcher:?}");
    }
}

/// Settings LoRA cannot run are refused naming the key; a resumed run must keep its adapters.
#[test]
fn bad_lora_settings_are_refused_by_name() {
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
    let lora = ["--model.converters", "lora"];
    refused(
        &[&lora[..], &["--lora.rank", "0"]].concat(),
        "[lora] rank = 0",
    );
    refused(
        &[&lora[..], &["--lora.target_modules", "wq,q_proj"]].concat(),
        "`q_proj` is not a linear's name",
    );
    refused(
        &[&lora[..], &["--lora.target_modules", "output"]].concat(),
        "`output` is not adapted yet",
    );
    refused(
        &[&lora[..], &["--lora.target_modules", "wkv_a"]].concat(),
        "`wkv_a` names no linear of this model",
    );
    refused(&["--lora.rank", "16"], "add --model.converters lora");

    // A checkpoint written with rank 4 does not resume at rank 8.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"];
    run(
        dir.path(),
        &[&["--training.steps", "1"], LORA, &ckpt].concat(),
    );
    let o = train(
        dir.path(),
        &[],
        &[
            &["--training.steps", "2", "--model.converters", "lora"],
            &ckpt[..],
        ]
        .concat(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("saved with LoRA adapters"),
        "{err}"
    );
}
