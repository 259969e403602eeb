//! Named parameter sets: the model's weights, its gradients and the optimizer's moments all use this
//! one layout (same names, same order), so checkpoints, clipping and the optimizer walk them together.

use crate::backend::Backend;

use super::args::ModelArgs;

/// Canonical (TorchTitan) names and shapes of a Llama model's parameters, in storage order.
pub fn param_specs(args: &ModelArgs) -> Vec<(String, Vec<usize>)> {
    let (d, hd, f) = (args.dim, args.head_dim(), args.ffn_hidden);
    let mut specs = vec![(
        "tok_embeddings.weight".to_string(),
        vec![args.vocab_size, d],
    )];
    for l in 0..args.n_layers {
        let p = format!("layers.{l}");
        specs.push((format!("{p}.attention_norm.weight"), vec![d]));
        specs.push((
            format!("{p}.attention.wq.weight"),
            vec![args.n_heads * hd, d],
        ));
        specs.push((
            format!("{p}.attention.wk.weight"),
            vec![args.n_kv_heads * hd, d],
        ));
        specs.push((
            format!("{p}.attention.wv.weight"),
            vec![args.n_kv_heads * hd, d],
        ));
        specs.push((
            format!("{p}.attention.wo.weight"),
            vec![d, args.n_heads * hd],
        ));
        specs.push((format!("{p}.ffn_norm.weight"), vec![d]));
        specs.push((format!("{p}.feed_forward.w1.weight"), vec![f, d]));
        specs.push((format!("{p}.feed_forward.w2.weight"), vec![d, f]));
        specs.push((format!("{p}.feed_forward.w3.weight"), vec![f, d]));
    }
    specs.push(("norm.weight".to_string(), vec![d]));
    if !args.tied_embeddings {
        specs.push(("output.weight".to_string(), vec![args.vocab_size, d]));
    }
    specs
}

/// Index of each parameter of one block inside a `ParamSet`.
#[derive(Debug, Clone, Copy)]
pub struct LayerIds {
    pub attention_norm: usize,
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub wo: usize,
    pub ffn_norm: usize,
    pub w1: usize,
    pub w2: usize,
    pub w3: usize,
}

impl LayerIds {
    /// The block's parameter indices, in storage order.
    pub fn all(&self) -> [usize; 9] {
        [
            self.attention_norm,
            self.wq,
            self.wk,
            self.wv,
            self.wo,
            self.ffn_norm,
            self.w1,
            self.w2,
            self.w3,
        ]
    }
}

/// Where every parameter lives in the storage order of `param_specs`.
#[derive(Debug, Clone)]
pub struct ParamIds {
    pub tok_embeddings: usize,
    pub layers: Vec<LayerIds>,
    pub norm: usize,
    /// Equal to `tok_embeddings` when the embeddings are tied.
    pub output: usize,
}

impl ParamIds {
    pub fn new(args: &ModelArgs) -> Self {
        let layers = (0..args.n_layers)
            .map(|l| {
                let b = 1 + 9 * l;
                LayerIds {
                    attention_norm: b,
                    wq: b + 1,
                    wk: b + 2,
                    wv: b + 3,
                    wo: b + 4,
                    ffn_norm: b + 5,
                    w1: b + 6,
                    w2: b + 7,
                    w3: b + 8,
                }
            })
            .collect();
        let norm = 1 + 9 * args.n_layers;
        ParamIds {
            tok_embeddings: 0,
            layers,
            norm,
            output: if args.tied_embeddings { 0 } else { norm + 1 },
        }
    }
}

/// The precision the forward and backward see the parameters in (`[training]
/// mixed_precision_param`). Master weights, gradients, their reductions and the optimizer state are
/// fp32 either way; with `BFloat16` the compute copy is rounded to bf16 and FSDP all-gathers bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamDtype {
    Float32,
    BFloat16,
}

impl ParamDtype {
    /// From `mixed_precision_param`: `bfloat16` rounds the parameters; `float32` and `tfloat32`
    /// (a GEMM arithmetic, not a storage format) keep them fp32.
    pub fn from_config(name: &str) -> Self {
        if name == "bfloat16" {
            ParamDtype::BFloat16
        } else {
            ParamDtype::Float32
        }
    }
}

/// Buffers with names and shapes, one per parameter.
pub struct ParamSet<B: Backend> {
    pub names: Vec<String>,
    pub shapes: Vec<Vec<usize>>,
    pub bufs: Vec<B::Buf>,
}

impl<B: Backend> ParamSet<B> {
    pub fn zeros(backend: &B, specs: &[(String, Vec<usize>)]) -> Self {
        ParamSet {
            names: specs.iter().map(|(n, _)| n.clone()).collect(),
            shapes: specs.iter().map(|(_, s)| s.clone()).collect(),
            bufs: specs
                .iter()
                .map(|(_, s)| backend.zeros(s.iter().product()))
                .collect(),
        }
    }

    /// Names and shapes with no storage (empty buffers): FSDP's working sets, whose full tensors
    /// exist only while a stage needs them.
    pub fn unallocated(backend: &B, specs: &[(String, Vec<usize>)]) -> Self {
        ParamSet {
            names: specs.iter().map(|(n, _)| n.clone()).collect(),
            shapes: specs.iter().map(|(_, s)| s.clone()).collect(),
            bufs: specs.iter().map(|_| backend.zeros(0)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    pub fn numel(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    pub fn zero(&mut self, backend: &B) {
        backend.fill_all(&mut self.bufs, 0.0);
    }

    /// Makes this set (same shapes) the compute copy of `master`: copied, then rounded to bf16.
    pub fn refresh_bf16_copy(&mut self, backend: &B, master: &ParamSet<B>) {
        backend.copy_rounded_to_bf16_all(&mut self.bufs, &master.bufs);
    }
}
