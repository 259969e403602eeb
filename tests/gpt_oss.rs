//! gpt-oss (attention sinks and biases, a sliding window on every other block, experts with
//! biases and the clamped SwiGLU): the debug model, shrunk, under the parallel layouts against
//! one process (per-step loss and gradient norm within 1e-5), and a tiny gpt-oss made by
//! transformers trained by titan and by PyTorch's AdamW, curves within 1e-5. What the layouts
//! needed of their own: the q/k/v biases and the sinks split with their heads under TP, `wo`'s
//! bias whole on every rank (its gradient summed like the norms'); the experts' biases travel with
//! their experts (EP) and the rest is per token (FSDP, CP, PP carry it unchanged).
//! Import and export against transformers: `tests/hf_transformers.rs`.

mod common;

use common::family_layouts::{self, bf16_layouts_match, pipeline_schedules, trains_as_pytorch};
use common::hf_models::{gpt_oss_two_blocks, GPT_OSS_SHAPES};
use common::hf_python;

/// TorchTitan's debug model with the shapes of a test (`GPT_OSS_SHAPES` over
/// `common::TINY_ARGS`, which every run here starts from), a window of 8 keys on block 0 (the
/// data's sequences are longer), 10 steps.
fn gpt_oss() -> Vec<&'static str> {
    let rest = [
        "--model.flavor",
        "debugmodel",
        "--model.sliding_window_size",
        "8",
        "--training.steps",
        "10",
    ];
    [GPT_OSS_SHAPES, &rest].concat()
}

/// The transformers gpt-oss' shapes (`gpt_oss_two_blocks`: windows of 6), without an expert
/// bias (transformers has none).
const GPT_OSS_HF: [&str; 4] = [
    "--model.sliding_window_size",
    "6",
    "--model.load_balance_coeff",
    "0",
];

fn check(what: &str, n: &'static str, extra: &[&str], parallel: &[&str]) {
    family_layouts::check(&gpt_oss(), what, n, extra, parallel);
}

#[test]
fn gpt_oss_matches_one_process_under_tp_and_async_tp() {
    let tp2 = ["--parallelism.tensor_parallel_degree", "2"];
    check("gpt-oss TP 2", "2", &[], &tp2);
    let async_tp = [
        &tp2[..],
        &["--parallelism.enable_async_tensor_parallel", "true"],
    ]
    .concat();
    check("gpt-oss async TP 2", "2", &[], &async_tp);
    check(
        "gpt-oss TP 2, per-op AC, float8 linears",
        "2",
        &[
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--model.converters",
            "quantize.linear.float8",
        ],
        &tp2,
    );
}

#[test]
fn gpt_oss_matches_one_process_under_ddp_hsdp_and_interleaved_pp() {
    let global = ["--training.global_batch_size", "4"];
    check(
        "gpt-oss DDP 2, selective AC of every other block",
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
        "gpt-oss HSDP 2 × 2, EP 2",
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
        "gpt-oss PP 2 (Interleaved 1F1B, 2 stages a rank)",
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
fn gpt_oss_matches_one_process_under_ep_fsdp_cp_and_pp() {
    let global = ["--training.global_batch_size", "4"];
    check(
        "gpt-oss FSDP 2 × EP 2",
        "2",
        &global,
        &["--parallelism.expert_parallel_degree", "2"],
    );
    check(
        "gpt-oss CP 2 (windows across the ranks' rows)",
        "2",
        &[],
        &["--parallelism.context_parallel_degree", "2"],
    );
    check(
        "gpt-oss PP 2 (ZBV: weight gradients deferred), full AC",
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
fn gpt_oss_matches_one_process_under_every_pipeline_schedule_and_float8_experts() {
    let schedules = [
        "GPipe",
        "1F1B",
        "InterleavedZeroBubble",
        "DualPipeV",
        "LoopedBFS",
    ];
    pipeline_schedules(&gpt_oss(), "gpt-oss", &schedules);
    check(
        "gpt-oss EP 2, float8 experts",
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
fn gpt_oss_in_bf16_matches_one_process_in_bf16() {
    bf16_layouts_match(&gpt_oss(), "gpt-oss");
}

/// A gpt-oss made by transformers (`GPT_OSS_SHAPES`, windows of 6 keys on block 0 over
/// sequences of 64, the experts' gate and up weights scaled ×30 so that their values cross the
/// clamp of 7 (6% of the gate values, 15-22% of the up values),
/// biases and sinks away from zero), trained 20 steps by titan (imported; no expert bias, as
/// transformers has none) and by PyTorch's AdamW on the same tokens: every step's loss and
/// gradient norm within 1e-5.
#[test]
fn gpt_oss_trains_as_pytorch_trains_it() {
    let Some(py) = hf_python() else {
        return;
    };
    let make =
        gpt_oss_two_blocks("        if name.endswith(\"gate_up_proj\"):\n            p.mul_(30.0)");
    trains_as_pytorch(
        &py,
        &make,
        &[GPT_OSS_SHAPES, &GPT_OSS_HF].concat(),
        "gpt-oss",
    );
}

/// An MXFP4 release (gpt-oss's published form: each block's fused experts as FP4 codes and E8M0
/// exponents, `quantization_config.quant_method = "mxfp4"`) imports as the model whose experts
/// transformers' `convert_moe_packed_tensors` dequantises: every parameter bit for bit.
#[test]
fn an_mxfp4_release_imports_as_transformers_dequantises_it() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = r#"
import sys, json, glob, os, torch
from safetensors.torch import save_file, load_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
mx_dir, ref_dir = sys.argv[1], sys.argv[2]
cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=6, tie_word_embeddings=False)
torch.manual_seed(0)
model = GptOssForCausalLM(cfg)
packed = {}
with torch.no_grad():
    for name, p in model.named_parameters():
        if not (name.endswith("gate_up_proj") or name.endswith("down_proj")):
            continue
        experts, cols, rows = p.shape  # stored [experts, in, out]; packed per output row
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8)
        scales = torch.randint(120, 130, (experts, rows, cols // 32), dtype=torch.uint8)
        packed[name] = (blocks, scales)
        # Dequantised and transposed to the [experts, in, out] the model keeps.
        p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
model.save_pretrained(ref_dir, safe_serialization=True)
model.save_pretrained(mx_dir, safe_serialization=True)
for f in glob.glob(os.path.join(mx_dir, "*.safetensors")):
    tensors = load_file(f)
    for name, (blocks, scales) in packed.items():
        if name in tensors:
            del tensors[name]
            tensors[name + "_blocks"] = blocks
            tensors[name + "_scales"] = scales
    save_file(tensors, f, metadata={"format": "pt"})
c = json.load(open(os.path.join(mx_dir, "config.json")))
c["quantization_config"] = {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]}
json.dump(c, open(os.path.join(mx_dir, "config.json"), "w"))
"#;
    let dir = tempfile::tempdir().unwrap();
    let (mx, reference) = (dir.path().join("mxfp4"), dir.path().join("reference"));
    let out = std::process::Command::new(&py)
        .args([
            "-c",
            make,
            mx.to_str().unwrap(),
            reference.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (m_mx, m_ref) = (
        titan::checkpoint::hf::read_hf(&mx).unwrap(),
        titan::checkpoint::hf::read_hf(&reference).unwrap(),
    );
    assert_eq!(m_mx.args, m_ref.args);
    let mut experts = 0;
    for (i, name) in m_ref.params.names.iter().enumerate() {
        let (a, b) = (&m_mx.params.bufs[i], &m_ref.params.bufs[i]);
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "{name}: the MXFP4 import differs from transformers' dequantisation"
        );
        experts += usize::from(name.contains(".moe.experts.") && name.ends_with("weight"));
    }
    assert_eq!(experts, 2 * 4 * 3, "every expert weight compared");
}
