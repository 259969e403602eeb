//! Parity with Hugging Face `transformers`: an exported checkpoint loaded by `LlamaForCausalLM` or
//! `Qwen3ForCausalLM` gives the same loss (and logits) as titan on the same tokens, and a Qwen3
//! model made by transformers imports, generates greedily and exports back like transformers. Needs a Python with torch and
//! transformers: `TITAN_HF_PYTHON` names it (default `python3`). Those packages are never a
//! dependency of titan: without them the test says SKIPPED and passes, except in CI (`CI` set),
//! where a missing reference fails it (`common::reference_missing`).

mod common;

use std::process::Command;

use common::{hf_python, quiet, tiny_config};
use titan::backend::cpu::rope::RopeScaling;
use titan::backend::cpu::CpuBackend;
use titan::checkpoint;
use titan::model::{Decoder, KvCache, Workspace};

/// Runs `py` with `args`, which must succeed; its standard output.
fn python_output(py: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new(py).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs the Python `script` with `args`, which must succeed; its standard output, trimmed.
fn run_python(py: &str, script: &str, args: &[&str]) -> String {
    let out = python_output(py, &[&["-c", script][..], args].concat());
    String::from_utf8_lossy(&out).trim().to_string()
}

#[test]
fn exported_debug_shape_matches_transformers() {
    parity(|_| {});
}

#[test]
fn exported_llama32_shape_with_rope_scaling_and_tied_embeddings_matches_transformers() {
    // Llama 3.2 1B's layout (tied embeddings, RoPE scaling factor 32, FFN multiplier) at tiny width.
    parity(|c| c.model.flavor = "1B".into());
}

#[test]
fn exported_qwen3_shape_matches_transformers() {
    // QK-norm, and 4 heads of 64 while dim / heads is 16.
    parity(|c| {
        c.model.name = "qwen3".into();
        c.model.flavor = "debugmodel".into();
    });
}

#[test]
fn exported_qwen3_moe_shape_matches_transformers() {
    // 8 experts, 2 per token, renormalised softmax weights.
    parity(|c| {
        c.model.name = "qwen3".into();
        c.model.flavor = "debugmodel_moe".into();
    });
}

/// A Qwen3 model transformers made (tied embeddings, heads of 32 over dim 64): imported into titan,
/// its loss and 12 greedy tokens are transformers'; exported back, transformers gives the same.
#[test]
fn qwen3_made_by_transformers_imports_generates_and_exports_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
torch.manual_seed(0)
model = Qwen3ForCausalLM(cfg)
# Larger QK-norm weights than the ones they start at, so a wrong layout would show.
with torch.no_grad():
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
        layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| assert!(args.qk_norm && args.tied_embeddings && args.head_dim() == 32),
    );
}

/// YaRN, as transformers computes it: a Qwen3 model with `rope_type = "yarn"` (factor 4 over 64
/// original positions, its attention factor 0.1·ln 4 + 1 on every cos and sin), and a Llama model
/// with DeepSeek's `mscale`/`mscale_all_dim` and non-default betas, untruncated: imported, loss and
/// greedy tokens equal transformers', exported back the same.
#[test]
fn yarn_models_made_by_transformers_import_generate_and_export_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64})
torch.manual_seed(0)
Qwen3ForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            let Some(RopeScaling::Yarn(y)) = args.rope_scaling else {
                panic!("not YaRN: {:?}", args.rope_scaling)
            };
            assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 64));
            assert!((y.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        },
    );
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=320,
                  rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 5.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 16.0,
                                   "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                                   "truncate": False})
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            let Some(RopeScaling::Yarn(y)) = args.rope_scaling else {
                panic!("not YaRN: {:?}", args.rope_scaling)
            };
            assert!(!y.truncate && y.beta_fast == 16.0 && y.mscale == Some(0.707));
            assert!(y.attention_factor() < 1.0);
        },
    );
}

/// Mistral, a family of a kind titan computes (Llama's block with a sliding window on every
/// block, one folder): made by transformers with a window of 6 keys, shorter than the 24-token
/// sequences and the 20 positions of generation, imported: loss and greedy tokens equal
/// transformers', and exported back the same.
#[test]
fn mistral_with_a_sliding_window_made_by_transformers_imports_generates_and_exports_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import MistralConfig, MistralForCausalLM
cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=128,
                    rms_norm_eps=1e-5, sliding_window=6, tie_word_embeddings=False)
torch.manual_seed(0)
MistralForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            let window = titan::model::args::SlidingWindow { size: 6, period: 1 };
            assert_eq!(args.sliding_window, Some(window));
        },
    );
}

/// gpt-oss (attention sinks and biases, a window on every other block, experts with biases and
/// the clamped SwiGLU, YaRN without truncation): made by transformers with a window of 6 keys,
/// a clamp limit the gate and up values cross, and every bias and sink drawn away from zero;
/// imported (the fused experts sliced per expert), loss and greedy tokens equal transformers',
/// and exported back (fused again) the same.
#[test]
fn gpt_oss_made_by_transformers_imports_generates_and_exports_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import GptOssConfig, GptOssForCausalLM
cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=128,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.1,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4},
                   tie_word_embeddings=False)
torch.manual_seed(0)
model = GptOssForCausalLM(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("bias") or name.endswith("sinks"):
            p.normal_(0.0, 0.5)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            let window = titan::model::args::SlidingWindow { size: 6, period: 2 };
            assert_eq!(args.sliding_window, Some(window));
            assert!(args.attention_sinks && args.attention_bias);
            let moe = args.moe.as_ref().unwrap();
            assert!(moe.linear_biases && moe.load_balance_coeff.is_none());
        },
    );
}

/// Llama 4 text (4 blocks: block 3 without RoPE, its queries temperature-tuned from position 3 on
/// (floor scale 4); chunks of 6 positions with the L2 QK-norm on the others; experts (2 a token,
/// here) beside a shared one in blocks 1 and 3, dense SwiGLUs of their own width in 0 and 2;
/// Scout's Llama 3 RoPE scaling): made by transformers, imported (the fused experts sliced per
/// expert), loss and greedy tokens equal transformers', and exported back the same.
#[test]
fn llama4_made_by_transformers_imports_generates_and_exports_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import Llama4TextConfig, Llama4ForCausalLM
cfg = Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=300, max_position_embeddings=128, num_local_experts=4,
                       num_experts_per_tok=2, interleave_moe_layer_step=2, no_rope_layer_interval=4,
                       attention_chunk_size=6, floor_scale=4, attn_scale=0.5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8},
                       tie_word_embeddings=False)
torch.manual_seed(0)
model = Llama4ForCausalLM(cfg)
with torch.no_grad():
    for name, p in model.named_parameters():
        # Attention far from uniform, so that temperatures and norms move the logits.
        if "self_attn" in name:
            p.mul_(10.0)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            assert_eq!(args.every_n_layers_nope, Some(4));
            assert_eq!(args.attention_chunk_size, Some(6));
            assert!(args.l2_qk_norm && args.rope_at(2) && !args.rope_at(3));
            let t = args.attention_temperature.unwrap();
            assert_eq!((t.floor_scale, t.scale), (4, 0.5));
            let moe = args.moe.as_ref().unwrap();
            assert!(moe.score_before_experts && moe.load_balance_coeff.is_none());
            assert_eq!((moe.sparse_step, moe.shared_hidden), (2, Some(32)));
            assert_eq!(args.ffn_hidden, 96);
        },
    );
}

/// Meta publishes Llama 4 as `Llama4ForConditionalGeneration` (`model_type` "llama4": a vision
/// tower, a projector and the text model under `language_model.`): such a folder imports as its
/// text model, the same shapes and every parameter bit for bit as the `Llama4ForCausalLM`
/// transformers saves of it, the vision tensors skipped.
#[test]
fn a_multimodal_llama4_imports_its_text_model() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = r#"
import sys, torch
from transformers import Llama4Config, Llama4ForConditionalGeneration
text = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
            max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=6, tie_word_embeddings=False)
vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
              projector_output_dim=64)
torch.manual_seed(0)
model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision))
model.save_pretrained(sys.argv[1], safe_serialization=True)
model.language_model.save_pretrained(sys.argv[2], safe_serialization=True)
"#;
    let dir = tempfile::tempdir().unwrap();
    let (both, text) = (dir.path().join("multimodal"), dir.path().join("text"));
    run_python(&py, make, &[both.to_str().unwrap(), text.to_str().unwrap()]);
    let (from_both, from_text) = (
        checkpoint::hf::read_hf(&both).unwrap(),
        checkpoint::hf::read_hf(&text).unwrap(),
    );
    assert_eq!(from_both.args, from_text.args);
    assert_eq!(from_both.params.names, from_text.params.names);
    for (i, name) in from_text.params.names.iter().enumerate() {
        let (a, b) = (&from_both.params.bufs[i], &from_text.params.bufs[i]);
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same && a.len() == b.len(), "{name} differs");
    }
}

/// Qwen3-MoE with dense blocks: `mlp_only_layers = [0]` (a leading dense block, DeepSeek's
/// `first_k_dense_replace` 1) and `decoder_sparse_step = 2` (experts in every second block), each
/// with a dense width of its own: imported, loss and greedy tokens equal transformers', and back.
#[test]
fn qwen3_moe_with_dense_blocks_made_by_transformers_imports_generates_and_exports_back() {
    for (dense, step) in [("[0]", "1"), ("[]", "2")] {
        let make = format!(
            r#"
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     mlp_only_layers={dense}, decoder_sparse_step={step},
                     tie_word_embeddings=False,
                     rope_parameters={{"rope_type": "default", "rope_theta": 1000000.0}})
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg)
with torch.no_grad():
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.weight.normal_(0.0, 0.5)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#
        );
        round_trip_made_by_transformers(&make, |args| {
            let moe = args.moe.expect("a mixture of experts");
            let experts: Vec<usize> = (0..4).filter(|&l| args.moe_at(l).is_some()).collect();
            let want = if step == "2" {
                vec![1, 3]
            } else {
                vec![1, 2, 3]
            };
            assert_eq!(experts, want, "{moe:?}");
            assert_eq!(args.swiglu_hidden_at(0), 96);
        });
    }
}

/// An FP8 release (`quantization_config` fp8, e4m3 weights with `weight_scale_inv` per block, as
/// DeepSeek-V3's and Qwen3's FP8 checkpoints; blocks of 32×32 here so the tiny matrices hold
/// several, some partial): imported, every weight equals, bit for bit, the import of the same
/// model saved dequantised in f32 by torch (`e4m3.float() * scale_inv`), whose loss is
/// transformers'.
#[test]
fn an_fp8_release_imports_dequantised_bit_for_bit() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = r#"
import sys, json, torch
from safetensors.torch import save_file, load_file
from transformers import Qwen3Config, Qwen3ForCausalLM
fp8_dir, ref_dir = sys.argv[1], sys.argv[2]
cfg = Qwen3Config(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
torch.manual_seed(0)
model = Qwen3ForCausalLM(cfg)
B = 32
quantized = {}
with torch.no_grad():
    for name, p in model.named_parameters():
        if not name.endswith("proj.weight"):
            continue
        rows, cols = p.shape
        br, bc = -(-rows // B), -(-cols // B)
        scale = torch.zeros(br, bc)
        q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(br):
            for j in range(bc):
                blk = p[i*B:(i+1)*B, j*B:(j+1)*B]
                s = blk.abs().max() / 448.0
                scale[i, j] = s
                q[i*B:(i+1)*B, j*B:(j+1)*B] = (blk / s).to(torch.float8_e4m3fn)
        quantized[name] = (q, scale)
        full_scale = scale.repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
        p.copy_(q.to(torch.float32) * full_scale)
model.save_pretrained(ref_dir, safe_serialization=True)
model.save_pretrained(fp8_dir, safe_serialization=True)
import glob, os
for f in glob.glob(os.path.join(fp8_dir, "*.safetensors")):
    tensors = load_file(f)
    for name, (q, scale) in quantized.items():
        if name in tensors:
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale
    save_file(tensors, f, metadata={"format": "pt"})
c = json.load(open(os.path.join(fp8_dir, "config.json")))
c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [B, B]}
json.dump(c, open(os.path.join(fp8_dir, "config.json"), "w"))
"#;
    let dir = tempfile::tempdir().unwrap();
    let (fp8, reference) = (dir.path().join("fp8"), dir.path().join("reference"));
    run_python(
        &py,
        make,
        &[fp8.to_str().unwrap(), reference.to_str().unwrap()],
    );
    let (m_fp8, m_ref) = (
        checkpoint::hf::read_hf(&fp8).unwrap(),
        checkpoint::hf::read_hf(&reference).unwrap(),
    );
    assert_eq!(m_fp8.args, m_ref.args);
    let (p_fp8, p_ref) = (m_fp8.params, m_ref.params);
    for (i, name) in p_ref.names.iter().enumerate() {
        let same = p_fp8.bufs[i]
            .iter()
            .zip(&p_ref.bufs[i])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{name}: the FP8 import differs from the dequantised one"
        );
    }
    // The reference is an ordinary model: titan's loss on it is transformers'.
    let (batch, seq) = (2, 24);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i as u32 * 37 + 11) % 300)
        .collect();
    let be = CpuBackend::new();
    let model = Decoder::new(&be, m_fp8.args.clone(), seq).unwrap();
    let mut ws = Workspace::new(&be, &m_fp8.args, batch, seq);
    let loss = model.loss(&be, &p_fp8, &mut ws, &tokens).unwrap();
    let titan_loss = loss.sum / loss.count as f64;
    let hf_loss = transformers_run(&py, &reference, &tokens, seq)["loss"]
        .as_f64()
        .unwrap();
    assert!(
        (hf_loss - titan_loss).abs() < 1e-5 * titan_loss.abs().max(1.0),
        "titan {titan_loss} vs transformers {hf_loss}"
    );
    // Another quantisation method is refused, naming the key.
    let c = std::fs::read_to_string(fp8.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&c).unwrap();
    v["quantization_config"]["quant_method"] = "gptq".into();
    std::fs::write(fp8.join("config.json"), v.to_string()).unwrap();
    let e = match checkpoint::hf::read_hf(&fp8) {
        Ok(_) => panic!("a gptq config was imported"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("quant_method") && e.contains("gptq"), "{e}");
}

/// The same for a Qwen3-MoE model (8 experts, 2 per token, renormalised; per-expert tensors as the
/// published checkpoints store them).
#[test]
fn qwen3_moe_made_by_transformers_imports_generates_and_exports_back() {
    round_trip_made_by_transformers(
        r#"
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
                     num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg)
# A router with a spread, so tokens choose different experts.
with torch.no_grad():
    for layer in model.model.layers:
        layer.mlp.gate.weight.normal_(0.0, 0.5)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#,
        |args| {
            let moe = args.moe.expect("a mixture of experts");
            assert_eq!(
                (moe.router.num_experts, moe.router.top_k, moe.hidden),
                (8, 2, 32)
            );
            assert!(moe.router.norm_topk_prob);
        },
    );
}

/// DeepSeek-V3 made by transformers (`DeepseekV3ForCausalLM`): multi-head latent attention with
/// queries projected directly and through a latent, default RoPE and YaRN (whose mscale scales
/// the softmax), rotated parts interleaved and in halves, a leading dense block, shared experts,
/// group-limited sigmoid routing with a non-zero routing bias: imported, loss and greedy tokens
/// equal transformers', and back.
#[test]
fn deepseek_v3_made_by_transformers_imports_generates_and_exports_back() {
    let rope = [
        r#"{"rope_type": "default", "rope_theta": 10000.0}"#,
        r#"{"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 0.7}"#,
    ];
    // The third rotates halves (`rope_interleave = False`): its rotated rows are permuted on import.
    for (q_lora, rope, interleave) in [
        ("None", rope[0], "True"),
        ("24", rope[1], "True"),
        ("None", rope[0], "False"),
    ] {
        let make = format!(
            r#"
import sys, torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
cfg = DeepseekV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                       vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
                       q_lora_rank={q_lora}, kv_lora_rank=16, qk_nope_head_dim=12,
                       qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                       num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                       routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
                       tie_word_embeddings=False, rope_parameters={rope},
                       rope_interleave={interleave})
torch.manual_seed(0)
model = DeepseekV3ForCausalLM(cfg)
with torch.no_grad():
    for layer in model.model.layers[1:]:
        layer.mlp.gate.weight.normal_(0.0, 0.5)
        layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
model.save_pretrained(sys.argv[1], safe_serialization=True)
"#
        );
        round_trip_made_by_transformers(&make, |args| {
            let (mla, moe) = (args.mla.expect("MLA"), args.moe.expect("experts"));
            assert_eq!(mla.q_lora_rank, (q_lora != "None").then_some(24));
            assert_eq!(
                (mla.kv_lora_rank, mla.v_head_dim, args.head_dim()),
                (16, 16, 20)
            );
            assert_eq!((moe.first_dense_layers, moe.shared_hidden), (1, Some(32)));
            assert_eq!(moe.router.groups, Some((4, 2)));
        });
    }
}

/// Makes an HF model with the Python `make` (its folder as argument), imports it, checks the
/// imported shapes with `expect`, and compares titan's loss and 12 greedy tokens with
/// transformers' on the folder it made and on titan's export of the import.
fn round_trip_made_by_transformers(make: &str, expect: impl Fn(&titan::model::ModelArgs)) {
    let Some(py) = hf_python() else {
        return;
    };
    let greedy = r#"
import sys, json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
model.generation_config.eos_token_id = None
ids = torch.tensor([[int(t) for t in sys.argv[2].split(",")]])
out = model.generate(ids, max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]),
                     do_sample=False, pad_token_id=0)
print(json.dumps(out[0, ids.shape[1]:].tolist()))
"#;
    let run = |script: &str, args: &[&str]| run_python(&py, script, args);
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    run(make, &[hf.to_str().unwrap()]);
    let ckpt = dir.path().join("titan");
    checkpoint::hf::import(&hf, &ckpt).unwrap();
    let be = CpuBackend::new();
    let (args, params) = checkpoint::load_weights(&be, &ckpt).unwrap();
    expect(&args);
    let state =
        checkpoint::read_state(&checkpoint::resolve_checkpoint_dir(&ckpt).unwrap()).unwrap();
    let (batch, seq) = (2, 24);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i as u32 * 37 + 11) % 300)
        .collect();
    let mut model = Decoder::new(&be, args.clone(), seq).unwrap();
    // DeepSeek-V3's routing bias travels in the checkpoint's state, not among the weights.
    if let Some(bias) = &state.expert_bias {
        model.set_expert_bias(&be, bias).unwrap();
    }
    let mut ws = Workspace::new(&be, &args, batch, seq);
    let loss = model.loss(&be, &params, &mut ws, &tokens).unwrap();
    let titan_loss = loss.sum / loss.count as f64;
    // Greedy continuation of the first 8 tokens, with titan's KV cache.
    let prompt = &tokens[..8];
    let titan_ids = common::greedy_ids(&be, &model, &params, prompt, 12);
    let prompt_arg = prompt
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let exported = dir.path().join("hf_again");
    checkpoint::hf::export(&ckpt, &exported, titan::tensor::DType::F32).unwrap();
    for (what, folder) in [
        ("made by transformers", &hf),
        ("exported by titan", &exported),
    ] {
        let hf_loss = transformers_run(&py, folder, &tokens, seq)["loss"]
            .as_f64()
            .unwrap();
        assert!(
            (hf_loss - titan_loss).abs() < 1e-5 * titan_loss.abs().max(1.0),
            "{what}: titan {titan_loss} vs transformers {hf_loss}"
        );
        let ids: Vec<u32> =
            serde_json::from_str(&run(greedy, &[folder.to_str().unwrap(), &prompt_arg, "12"]))
                .unwrap();
        assert_eq!(ids, titan_ids, "{what}: greedy ids");
    }
}

#[allow(clippy::disallowed_macros)] // libtest captures eprintln!, not titan's errln!
fn parity(adjust: impl Fn(&mut titan::config::Config)) {
    let Some(py) = hf_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tiny_config(dir.path(), 8);
    cfg.optimizer.lr = 3e-3;
    adjust(&mut cfg);
    train(&cfg);
    let hf = dir.path().join("hf");
    checkpoint::hf::export(&cfg.checkpoint_folder(), &hf, titan::tensor::DType::F32).unwrap();

    let (batch, seq) = (2, 24);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i as u32 * 37 + 11) % 258)
        .collect();
    let be = CpuBackend::new();
    let (args, params) = checkpoint::load_weights(&be, &cfg.checkpoint_folder()).unwrap();
    let model = Decoder::new(&be, args.clone(), seq).unwrap();
    let mut ws = Workspace::new(&be, &args, batch, seq);
    let loss = model.loss(&be, &params, &mut ws, &tokens).unwrap();
    let titan_loss = loss.sum / loss.count as f64;
    let mut cache = KvCache::new(&be, &args, seq);
    let titan_logits = model
        .forward_cached(&be, &params, &mut cache, &tokens[..seq])
        .unwrap();

    let v = transformers_run(&py, &hf, &tokens, seq);
    let hf_loss = v["loss"].as_f64().unwrap();
    assert!(
        (hf_loss - titan_loss).abs() < 1e-5 * titan_loss.abs().max(1.0),
        "titan {titan_loss} vs transformers {hf_loss}"
    );
    let hf_logits: Vec<f64> = v["last_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let worst = titan_logits
        .iter()
        .zip(&hf_logits)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "largest logit difference {worst}");
    eprintln!("transformers parity: loss titan {titan_loss:.7} vs HF {hf_loss:.7}, max logit diff {worst:.2e}");
}

fn train(cfg: &titan::config::Config) {
    titan::train::train(cfg, &quiet()).unwrap();
}

/// A model `transformers` itself wrote (its current config form: RoPE in `rope_parameters`),
/// imported into titan, gives transformers' loss: plain RoPE with theta 500000, and Llama 3
/// scaling.
#[test]
fn imported_transformers_model_with_rope_parameters_matches() {
    let Some(py) = hf_python() else {
        return;
    };
    let make = r#"
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, kind = sys.argv[1], sys.argv[2]
rope = {"rope_type": "default", "rope_theta": 500000.0}
if kind == "llama3":
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=rope)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
"#;
    for kind in ["plain", "llama3"] {
        let dir = tempfile::tempdir().unwrap();
        let hf = dir.path().join("hf");
        run_python(&py, make, &[hf.to_str().unwrap(), kind]);
        let ckpt = dir.path().join("titan");
        checkpoint::hf::import(&hf, &ckpt).unwrap();
        let (batch, seq) = (2, 24);
        let tokens: Vec<u32> = (0..batch * (seq + 1))
            .map(|i| (i as u32 * 37 + 11) % 300)
            .collect();
        let be = CpuBackend::new();
        let (args, params) = checkpoint::load_weights(&be, &ckpt).unwrap();
        assert_eq!(args.rope_theta, 500000.0, "{kind}");
        assert_eq!(args.rope_scaling.is_some(), kind == "llama3");
        let model = Decoder::new(&be, args.clone(), seq).unwrap();
        let mut ws = Workspace::new(&be, &args, batch, seq);
        let loss = model.loss(&be, &params, &mut ws, &tokens).unwrap();
        let titan_loss = loss.sum / loss.count as f64;
        let hf_loss = transformers_run(&py, &hf, &tokens, seq)["loss"]
            .as_f64()
            .unwrap();
        assert!(
            (hf_loss - titan_loss).abs() < 1e-5 * titan_loss.abs().max(1.0),
            "{kind}: titan {titan_loss} vs transformers {hf_loss}"
        );
    }
}

/// `scripts/hf_parity.py` on the HF folder `hf` and `tokens` (rows of `seq + 1`): its JSON
/// (`loss`, `last_logits`).
fn transformers_run(
    py: &str,
    hf: &std::path::Path,
    tokens: &[u32],
    seq: usize,
) -> serde_json::Value {
    let rows = common::rows_arg(tokens, seq);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hf_parity.py");
    let out = python_output(py, &[script, hf.to_str().unwrap(), "--tokens", &rows]);
    serde_json::from_slice(&out).unwrap()
}
