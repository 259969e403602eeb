//! Training against PyTorch: a tiny Llama made by transformers (the tiny config's shapes), trained
//! by titan (imported from it) and by PyTorch's AdamW (`scripts/hf_train_parity.py`) on the same
//! token stream, 2 sequences of 64 a step; both curves.

use std::path::Path;

use super::{losses, metric, train};

/// Makes the model at `out`: Llama, dim 64, 2 layers, 4/2 heads, FFN 256, vocabulary 300, seed 0.
pub fn make_llama(py: &str, out: &Path) {
    let make = r#"
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)
"#;
    python(py, &["-c", make, out.to_str().unwrap()]);
}

/// Runs `py` with `args`, which must succeed; its standard output, trimmed.
pub fn python(py: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(py).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One comparison: titan reads its data as `titan_data` says (block-causally with
/// `document_start`, else causally); PyTorch reads the uint32 stream `tokens` (with `targets`, a
/// uint8 file: 0 where a token is no target), documents starting at `document_start`.
pub struct Comparison<'a> {
    pub dir: &'a Path,
    /// A Python script writing the model's HF folder at `sys.argv[1]` (None: `make_llama`'s).
    pub make: Option<&'a str>,
    pub steps: &'a str,
    pub titan_data: &'a [&'a str],
    pub tokens: &'a Path,
    pub targets: Option<&'a Path>,
    pub document_start: Option<&'a str>,
    /// More for titan (e.g. `--config FILE`) and for the script (e.g. `--param-groups JSON`).
    pub titan_extra: &'a [&'a str],
    pub python_extra: &'a [&'a str],
}

/// `(step, value)` per step.
pub type Curve = Vec<(u64, f64)>;

/// Per-step losses and gradient norms: titan's, then PyTorch's.
pub struct Curves {
    pub titan: (Curve, Curve),
    pub pytorch: (Curve, Curve),
}

impl Curves {
    /// The largest relative loss difference over the steps.
    pub fn worst_loss_difference(&self) -> f64 {
        assert_eq!(self.titan.0.len(), self.pytorch.0.len(), "steps");
        self.titan
            .0
            .iter()
            .zip(&self.pytorch.0)
            .map(|((_, a), (_, b))| (a - b).abs() / b.abs())
            .fold(0.0, f64::max)
    }
}

pub fn train_both(py: &str, c: &Comparison) -> Curves {
    let hf = c.dir.join("hf");
    match c.make {
        Some(script) => drop(python(py, &["-c", script, hf.to_str().unwrap()])),
        None => make_llama(py, &hf),
    }
    let mask = match c.document_start {
        Some(_) => "block_causal",
        None => "causal",
    };
    let (batch, seq, lr, warmup) = ("2", "64", "3e-3", "2");
    let dump = c.dir.join("titan");
    let run = [
        "--model.attn_mask_type",
        mask,
        "--training.steps",
        c.steps,
        "--training.local_batch_size",
        batch,
        "--training.seq_len",
        seq,
        "--optimizer.lr",
        lr,
        "--lr_scheduler.warmup_steps",
        warmup,
        "--checkpoint.initial_load_path",
        hf.to_str().unwrap(),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.enable",
        "false",
    ];
    let o = train(
        &dump,
        &[],
        &[&run[..], c.titan_data, c.titan_extra].concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/hf_train_parity.py");
    let mut args = vec![
        script,
        hf.to_str().unwrap(),
        "--tokens",
        c.tokens.to_str().unwrap(),
        "--batch",
        batch,
        "--seq",
        seq,
        "--steps",
        c.steps,
        "--lr",
        lr,
        "--warmup",
        warmup,
    ];
    if let Some(start) = c.document_start {
        args.extend(["--document-start", start]);
    }
    if let Some(t) = c.targets {
        args.extend(["--targets", t.to_str().unwrap()]);
    }
    args.extend(c.python_extra);
    let reference: Vec<serde_json::Value> = serde_json::from_str(&python(py, &args)).unwrap();
    let curve = |key: &str| -> Curve {
        reference
            .iter()
            .map(|r| (r["step"].as_u64().unwrap(), r[key].as_f64().unwrap()))
            .collect()
    };
    Curves {
        titan: (losses(&dump), metric(&dump, "grad_norm")),
        pytorch: (curve("loss"), curve("grad_norm")),
    }
}
