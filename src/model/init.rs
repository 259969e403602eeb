//! Weight initialization the way TorchTitan's Llama 3 does it: embeddings N(0, 1), projections
//! truncated normal with std 0.02, output projections of each block (wo, w2, w3) depth-scaled to
//! 0.02/√(2·(layer+1)), the final projection with std dim^-½ cut at ±3σ, norms at one, linear
//! biases at zero; LoRA's adapters as `lora::init_adapter` says.
//! Each parameter draws from its own stream keyed by seed and name, so layouts that shard or reorder
//! parameters initialise identically.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::args::ModelArgs;

fn stream(seed: u64, name: &str) -> ChaCha8Rng {
    // FNV-1a of the name: stable across platforms and Rust versions.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ChaCha8Rng::seed_from_u64(seed ^ h)
}

fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box-Muller; u1 in (0, 1] keeps the log finite.
    let u1: f64 = 1.0 - rng.gen::<f64>();
    let u2: f64 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Normal(0, std) redrawn until it falls inside [lo, hi] (PyTorch's `trunc_normal_` bounds are absolute).
fn truncated_normal(rng: &mut ChaCha8Rng, std: f64, lo: f64, hi: f64) -> f32 {
    loop {
        let x = standard_normal(rng) * std;
        if x >= lo && x <= hi {
            return x as f32;
        }
    }
}

/// Initial value of one parameter, by canonical name.
pub fn init_param(args: &ModelArgs, name: &str, numel: usize, seed: u64) -> Vec<f32> {
    let mut rng = stream(seed, name);
    if super::lora::is_adapter(name) {
        let rank = args.lora.as_ref().map_or(1, |l| l.rank);
        return super::lora::init_adapter(name, numel, rank, &mut rng);
    }
    if name.ends_with("norm.weight") {
        return vec![1.0; numel];
    }
    if name.ends_with(".bias") {
        // Linear biases (gpt-oss) start at zero, as PyTorch's models initialise them.
        return vec![0.0; numel];
    }
    if name == "tok_embeddings.weight" {
        if args.tied_embeddings {
            // Shared with the output projection: use the output's scale so initial logits stay O(1).
            let std = (args.dim as f64).powf(-0.5);
            return (0..numel)
                .map(|_| truncated_normal(&mut rng, std, -3.0 * std, 3.0 * std))
                .collect();
        }
        return (0..numel)
            .map(|_| standard_normal(&mut rng) as f32)
            .collect();
    }
    if name == "output.weight" {
        let std = (args.dim as f64).powf(-0.5);
        return (0..numel)
            .map(|_| truncated_normal(&mut rng, std, -3.0 * std, 3.0 * std))
            .collect();
    }
    let layer: usize = name
        .split('.')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let depth_scaled =
        name.ends_with("wo.weight") || name.ends_with("w2.weight") || name.ends_with("w3.weight");
    let std = if depth_scaled {
        0.02 / (2.0 * (layer as f64 + 1.0)).sqrt()
    } else {
        0.02
    };
    (0..numel)
        .map(|_| truncated_normal(&mut rng, std, -2.0, 2.0))
        .collect()
}
