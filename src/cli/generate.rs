//! `titan generate`: sampling from a checkpoint with a KV cache (greedy at temperature 0, otherwise
//! temperature + top-k sampling from a seeded generator).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::checkpoint;
use crate::data::load_tokenizer;
use crate::model::{Decoder, KvCache};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A `step-N/` folder, a checkpoint folder, or a job's dump folder (latest checkpoint).
    #[arg(long)]
    pub checkpoint: PathBuf,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 100)]
    pub max_new_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokenizer file; defaults to the one recorded in the checkpoint.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Print one JSON object (prompt_ids, generated_ids, text) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// cpu, cuda (GPU 0, fp32 GEMMs) or auto (CUDA when a GPU and its libraries are found).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

/// Index of the next token from `logits`.
pub fn sample(logits: &[f32], temperature: f64, top_k: usize, rng: &mut ChaCha8Rng) -> u32 {
    if temperature <= 0.0 {
        return logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as u32;
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut r = rng.gen::<f64>() * total;
    for (w, &i) in weights.iter().zip(&order) {
        r -= w;
        if r <= 0.0 {
            return i as u32;
        }
    }
    order[order.len() - 1] as u32
}

pub fn run(a: &GenerateArgs) -> Result<()> {
    let cuda = match a.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        "auto" => crate::backend::cuda::libs::cuda_usable(),
        other => bail!("--device `{other}` is not known (accepted: cpu, cuda, auto)"),
    };
    if cuda {
        let be = crate::backend::cuda::CudaBackend::new(
            0,
            crate::backend::cuda::GemmPrecision::Float32,
        )?;
        generate_on(&be, a)
    } else {
        generate_on(&CpuBackend::new(), a)
    }
}

fn generate_on<B: Backend>(be: &B, a: &GenerateArgs) -> Result<()> {
    let dir = checkpoint::resolve_checkpoint_dir(&a.checkpoint)?;
    let state = checkpoint::read_state(&dir)?;
    let (args, params) = checkpoint::load_weights(be, &dir)?;
    let tokenizer = load_tokenizer(a.tokenizer.as_deref().unwrap_or(&state.tokenizer_path))?;
    let mut prompt_ids = vec![tokenizer.bos_id()];
    prompt_ids.extend(tokenizer.encode(&a.prompt)?);
    let capacity = prompt_ids.len() + a.max_new_tokens;
    if capacity > args.max_seq_len {
        bail!(
            "prompt + max_new_tokens = {capacity} exceeds the model's {} positions",
            args.max_seq_len
        );
    }
    let mut model = Decoder::new(be, args.clone(), capacity)?;
    // A mixture of experts routes with the bias its training left (auxiliary-loss-free load
    // balancing; a Hugging Face DeepSeek-V3's routing bias once imported).
    if let Some(bias) = &state.expert_bias {
        model.set_expert_bias(be, bias)?;
    }
    let mut cache = KvCache::new(be, &args, capacity);
    let mut rng = ChaCha8Rng::seed_from_u64(a.seed);
    let mut logits = model.forward_cached(be, &params, &mut cache, &prompt_ids)?;
    let mut generated = Vec::new();
    if !a.json {
        out!("{}", a.prompt);
    }
    let mut printed = 0;
    for _ in 0..a.max_new_tokens {
        let next = sample(&logits, a.temperature, a.top_k, &mut rng);
        if next == tokenizer.eos_id() {
            break;
        }
        generated.push(next);
        if !a.json {
            // Decode the whole continuation so multi-byte characters print once complete.
            let text = tokenizer.decode(&generated)?;
            if text.len() > printed && !text.ends_with('\u{FFFD}') {
                out!("{}", &text[printed..]);
                printed = text.len();
                std::io::stdout().flush()?;
            }
        }
        if cache.len >= capacity {
            break;
        }
        logits = model.forward_cached(be, &params, &mut cache, &[next])?;
    }
    let text = tokenizer.decode(&generated)?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({ "prompt_ids": prompt_ids, "generated_ids": generated, "text": text })
        );
    } else {
        if text.len() > printed {
            out!("{}", &text[printed..]);
        }
        outln!();
    }
    Ok(())
}
