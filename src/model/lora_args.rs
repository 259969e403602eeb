//! LoRA's settings as the model sees them (`LoraArgs`, from `[lora]`): which linears get adapters,
//! the adapters' names and shapes among the parameters, which tensors train, and how a fresh
//! adapter starts. The adapters' computation is `lora`'s.

use serde::{Deserialize, Serialize};

/// The names of the linears LoRA can adapt (`[lora] target_modules`): every block projection
/// (attention's, the feed-forward's and a mixture of experts' shared experts'). The routed
/// experts (grouped 3-D weights), the router and the output projection are not adapted.
pub const ADAPTABLE: [&str; 11] = [
    "wq", "wk", "wv", "wo", "w1", "w2", "w3", "wq_a", "wq_b", "wkv_a", "wkv_b",
];

/// `[lora]` as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraArgs {
    pub rank: usize,
    pub alpha: f64,
    /// The adapted linears' last name segments; empty: every adaptable linear.
    #[serde(default)]
    pub target_modules: Vec<String>,
}

/// Suffixes of an adapter's two factors.
pub const LORA_A: &str = ".lora_a.weight";
pub const LORA_B: &str = ".lora_b.weight";

/// Whether `name` is an adapter's factor (the only tensors a LoRA run trains).
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(LORA_A) || name.ends_with(LORA_B)
}

/// Whether a model with `lora` (None: none) trains tensor `name`: every tensor without LoRA,
/// only the adapters with it.
pub fn trainable(lora: Option<&LoraArgs>, name: &str) -> bool {
    lora.is_none() || is_adapter(name)
}

/// The weight an adapter factor `name` belongs to (`….wq.lora_a.weight` → `….wq.weight`).
pub fn base_of(name: &str) -> Option<String> {
    let stem = name
        .strip_suffix(LORA_A)
        .or_else(|| name.strip_suffix(LORA_B))?;
    Some(format!("{stem}.weight"))
}

impl LoraArgs {
    /// `alpha / rank`, the adapter's output scale.
    pub fn scale(&self) -> f32 {
        (self.alpha / self.rank as f64) as f32
    }

    /// Whether the weight `name` (a canonical parameter name) gets an adapter.
    pub fn adapts(&self, name: &str) -> bool {
        let Some(stem) = name.strip_suffix(".weight") else {
            return false;
        };
        let Some(segment) = stem.rsplit('.').next() else {
            return false;
        };
        let adaptable = ADAPTABLE.contains(&segment)
            && stem.starts_with("layers.")
            && !stem.contains(".moe.experts.");
        adaptable
            && (self.target_modules.is_empty() || self.target_modules.iter().any(|t| t == segment))
    }
}

/// `specs` with each adapted weight followed by its two factors (`A` `[rank, in]`, `B`
/// `[out, rank]`), so a block's tensors stay consecutive.
pub fn with_adapters(
    specs: Vec<(String, Vec<usize>)>,
    lora: &LoraArgs,
) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::with_capacity(specs.len());
    for (name, shape) in specs {
        let adapted = lora.adapts(&name);
        out.push((name.clone(), shape.clone()));
        if adapted {
            let stem = name.strip_suffix(".weight").expect("an adapted weight");
            out.push((format!("{stem}{LORA_A}"), vec![lora.rank, shape[1]]));
            out.push((format!("{stem}{LORA_B}"), vec![shape[0], lora.rank]));
        }
    }
    out
}

/// The initial values of adapter factor `name` of `numel` values (`rank` rows for `A`): `A`
/// Kaiming-uniform as `nn.Linear`'s default (`a = √5`: bound `1/√in`), `B` zeros, so a fresh
/// adapter leaves the model's function unchanged.
pub fn init_adapter(name: &str, numel: usize, rank: usize, rng: &mut impl rand::Rng) -> Vec<f32> {
    if name.ends_with(LORA_B) {
        return vec![0.0; numel];
    }
    let fan_in = numel / rank.max(1);
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..numel)
        .map(|_| rng.gen_range(-bound..bound) as f32)
        .collect()
}

/// Parameter indices of one adapter's factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraIds {
    pub a: usize,
    pub b: usize,
}
