//! Named parameter sets: the model's weights, its gradients and the optimizer's moments all use this
//! one layout (same names, same order), so checkpoints, clipping and the optimizer walk them together.

use crate::backend::Backend;

use super::activation_checkpoint::{AcMode, ActivationDtype, ActivationPlan};
use super::args::ModelArgs;
use super::decoder::mla::MlaArgs;
use super::lora_args::{self as lora, LoraIds};
use super::moe::{MoeBiasIds, MoeIds};
use super::projection::BlockProjection;

/// The routed expert whose weight `name` is (`layers.N.moe.experts.E.…`); None for any other.
pub fn expert_of(name: &str) -> Option<usize> {
    let rest = name.split_once(".moe.experts.")?.1;
    rest.split('.').next()?.parse().ok()
}

/// Canonical (TorchTitan) names and shapes of a model's parameters, in storage order (Qwen3's
/// QK-norm weights after each block's `wo`; a mixture-of-experts block's router, then each
/// expert's and the shared experts' projections, in place of the feed-forward's; a MoE model's
/// dense blocks keep the feed-forward's; with LoRA each adapted weight followed by its adapter).
pub fn param_specs(args: &ModelArgs) -> Vec<(String, Vec<usize>)> {
    let specs = base_param_specs(args);
    match &args.lora {
        Some(l) => lora::with_adapters(specs, l),
        None => specs,
    }
}

/// `param_specs` without LoRA's adapters.
fn base_param_specs(args: &ModelArgs) -> Vec<(String, Vec<usize>)> {
    let (d, f) = (args.dim, args.ffn_hidden);
    let mut specs = vec![(
        "tok_embeddings.weight".to_string(),
        vec![args.vocab_size, d],
    )];
    for l in 0..args.n_layers {
        let p = format!("layers.{l}");
        specs.push((format!("{p}.attention_norm.weight"), vec![d]));
        match &args.mla {
            None => push_gqa(&mut specs, &p, args),
            Some(mla) => push_mla(&mut specs, &p, args, mla),
        }
        if args.attention_sinks {
            specs.push((format!("{p}.attention.sinks"), vec![args.n_heads]));
        }
        specs.push((format!("{p}.ffn_norm.weight"), vec![d]));
        match args.moe_at(l) {
            None => push_swiglu(&mut specs, &format!("{p}.feed_forward"), f, d),
            Some(moe) => {
                let experts = moe.router.num_experts;
                specs.push((format!("{p}.moe.router.gate.weight"), vec![experts, d]));
                if moe.linear_biases {
                    specs.push((format!("{p}.moe.router.gate.bias"), vec![experts]));
                }
                for e in 0..experts {
                    let expert = format!("{p}.moe.experts.{e}");
                    push_swiglu(&mut specs, &expert, moe.hidden, d);
                    if moe.linear_biases {
                        push_swiglu_biases(&mut specs, &expert, moe.hidden, d);
                    }
                }
                if let Some(hs) = moe.shared_hidden {
                    push_swiglu(&mut specs, &format!("{p}.moe.shared_experts"), hs, d);
                }
            }
        }
    }
    specs.push(("norm.weight".to_string(), vec![d]));
    if !args.tied_embeddings {
        specs.push(("output.weight".to_string(), vec![args.vocab_size, d]));
    }
    specs
}

/// Grouped-query attention's projections (and Qwen3's QK-norm weights) of block `p`.
fn push_gqa(specs: &mut Vec<(String, Vec<usize>)>, p: &str, args: &ModelArgs) {
    let (d, hd) = (args.dim, args.head_dim());
    let (q, kv) = (args.n_heads * hd, args.n_kv_heads * hd);
    for (name, shape) in [
        ("wq", [q, d]),
        ("wk", [kv, d]),
        ("wv", [kv, d]),
        ("wo", [d, q]),
    ] {
        specs.push((format!("{p}.attention.{name}.weight"), shape.to_vec()));
        if args.attention_bias {
            specs.push((format!("{p}.attention.{name}.bias"), vec![shape[0]]));
        }
    }
    if args.qk_norm {
        specs.push((format!("{p}.attention.q_norm.weight"), vec![hd]));
        specs.push((format!("{p}.attention.k_norm.weight"), vec![hd]));
    }
}

/// Multi-head latent attention's projections and latent norms of block `p` (TorchTitan's
/// DeepSeek-V3 names): `wq`, or `wq_a`, `q_norm`, `wq_b`; then `wkv_a`, `kv_norm`, `wkv_b`, `wo`.
fn push_mla(specs: &mut Vec<(String, Vec<usize>)>, p: &str, args: &ModelArgs, mla: &MlaArgs) {
    let (d, h) = (args.dim, args.n_heads);
    let q = h * mla.qk_head_dim();
    let a = format!("{p}.attention");
    match mla.q_lora_rank {
        None => specs.push((format!("{a}.wq.weight"), vec![q, d])),
        Some(r) => {
            specs.push((format!("{a}.wq_a.weight"), vec![r, d]));
            specs.push((format!("{a}.q_norm.weight"), vec![r]));
            specs.push((format!("{a}.wq_b.weight"), vec![q, r]));
        }
    }
    let r = mla.kv_lora_rank;
    specs.push((format!("{a}.wkv_a.weight"), vec![mla.kv_a_dim(), d]));
    specs.push((format!("{a}.kv_norm.weight"), vec![r]));
    specs.push((
        format!("{a}.wkv_b.weight"),
        vec![h * mla.kv_b_head_dim(), r],
    ));
    specs.push((format!("{a}.wo.weight"), vec![d, h * mla.v_head_dim]));
}

/// A SwiGLU feed-forward's `w1`, `w2`, `w3` under `prefix`.
fn push_swiglu(specs: &mut Vec<(String, Vec<usize>)>, prefix: &str, hidden: usize, dim: usize) {
    specs.push((format!("{prefix}.w1.weight"), vec![hidden, dim]));
    specs.push((format!("{prefix}.w2.weight"), vec![dim, hidden]));
    specs.push((format!("{prefix}.w3.weight"), vec![hidden, dim]));
}

/// A SwiGLU's biases (gpt-oss's experts) under `prefix`, after its weights.
fn push_swiglu_biases(
    specs: &mut Vec<(String, Vec<usize>)>,
    prefix: &str,
    hidden: usize,
    dim: usize,
) {
    specs.push((format!("{prefix}.w1.bias"), vec![hidden]));
    specs.push((format!("{prefix}.w2.bias"), vec![dim]));
    specs.push((format!("{prefix}.w3.bias"), vec![hidden]));
}

/// How a parameter splits over the tensor-parallel ranks (Megatron's plan, TorchTitan's
/// `parallelize`): column-parallel projections (wq, wk, wv, w1, w3, the output) and the
/// vocabulary-parallel embedding split their rows (`[out, in]`: output features, or vocabulary
/// entries); row-parallel ones (wo, w2) split their columns (input features); the norms'
/// weights are replicated. Multi-head latent attention splits its heads: the up-projections
/// (`wq`/`wq_b`, `wkv_b`) by rows and `wo` by columns; its latent down-projections (`wq_a`,
/// `wkv_a`) and their norms are replicated, every rank computing the latents of all tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpSharding {
    Rows,
    Columns,
    Replicated,
}

impl TpSharding {
    /// The split of parameter `name` (a canonical name of `param_specs`).
    pub fn of(name: &str) -> Self {
        // LoRA's adapters as TorchTitan's `_lora_adapter_sharding`: a column-parallel linear's
        // `B` splits its rows as the weight does and its `A` is whole; a row-parallel linear's
        // `A` splits its columns and its `B` is whole.
        if let Some(base) = lora::base_of(name) {
            return match (name.ends_with(lora::LORA_A), Self::of(&base)) {
                (true, TpSharding::Columns) => TpSharding::Columns,
                (false, TpSharding::Rows) => TpSharding::Rows,
                _ => TpSharding::Replicated,
            };
        }
        let column_parallel = [
            "tok_embeddings.weight",
            "output.weight",
            ".attention.wq.weight",
            ".attention.wk.weight",
            ".attention.wv.weight",
            // A column-parallel projection's bias splits with its output features (a
            // row-parallel one's is whole on every rank).
            ".attention.wq.bias",
            ".attention.wk.bias",
            ".attention.wv.bias",
            ".attention.wq_b.weight",
            ".attention.wkv_b.weight",
            // One logit per head: split with the heads.
            ".attention.sinks",
            ".feed_forward.w1.weight",
            ".feed_forward.w3.weight",
            ".moe.shared_experts.w1.weight",
            ".moe.shared_experts.w3.weight",
        ];
        if column_parallel.iter().any(|s| name.ends_with(s)) {
            TpSharding::Rows
        } else if name.ends_with(".attention.wo.weight")
            || name.ends_with(".feed_forward.w2.weight")
            || name.ends_with(".moe.shared_experts.w2.weight")
        {
            TpSharding::Columns
        } else {
            TpSharding::Replicated
        }
    }

    /// The shape of one rank's part of a `[rows, cols]` (or 1-D) tensor of shape `shape`.
    pub fn local_shape(self, shape: &[usize], tp: usize) -> Vec<usize> {
        let mut s = shape.to_vec();
        match self {
            TpSharding::Rows => s[0] /= tp,
            TpSharding::Columns => s[1] /= tp,
            TpSharding::Replicated => {}
        }
        s
    }

    /// Rank `rank`'s part of the full row-major `values` of shape `shape`.
    pub fn cut(self, values: &[f32], shape: &[usize], tp: usize, rank: usize) -> Vec<f32> {
        match self {
            TpSharding::Replicated => values.to_vec(),
            TpSharding::Rows => {
                let part = values.len() / tp;
                values[rank * part..(rank + 1) * part].to_vec()
            }
            TpSharding::Columns => {
                let (cols, local) = (shape[1], shape[1] / tp);
                values
                    .chunks(cols)
                    .flat_map(|row| &row[rank * local..(rank + 1) * local])
                    .copied()
                    .collect()
            }
        }
    }

    /// The full values of a tensor of shape `shape` from every rank's part, in rank order (a
    /// replicated tensor is rank 0's).
    pub fn join(self, parts: &[Vec<f32>], shape: &[usize]) -> Vec<f32> {
        match self {
            TpSharding::Replicated => parts[0].clone(),
            TpSharding::Rows => parts.concat(),
            TpSharding::Columns => {
                let (rows, local) = (shape[0], shape[1] / parts.len());
                let mut out = Vec::with_capacity(rows * shape[1]);
                for r in 0..rows {
                    for p in parts {
                        out.extend_from_slice(&p[r * local..(r + 1) * local]);
                    }
                }
                out
            }
        }
    }
}

/// `param_specs` with each tensor's shape as one of `tp` tensor-parallel ranks holds it.
pub fn local_param_specs(args: &ModelArgs, tp: usize) -> Vec<(String, Vec<usize>)> {
    param_specs(args)
        .into_iter()
        .map(|(name, shape)| {
            let local = TpSharding::of(&name).local_shape(&shape, tp);
            (name, local)
        })
        .collect()
}

/// Index of each parameter of one block inside a `ParamSet`.
#[derive(Debug, Clone)]
pub struct LayerIds {
    pub attention_norm: usize,
    pub attention: AttentionIds,
    pub wo: usize,
    pub ffn_norm: usize,
    pub ffn: FeedForwardIds,
    /// The attention sinks' logits, one per head (gpt-oss; None without).
    pub sinks: Option<usize>,
    /// Each projection's LoRA adapter (by `BlockProjection::index`; None where not adapted).
    pub lora: [Option<LoraIds>; BlockProjection::ALL.len()],
    /// Each projection's bias (by `BlockProjection::index`; None where it has none).
    pub biases: [Option<usize>; BlockProjection::ALL.len()],
}

/// A block's attention projections before `wo`.
#[derive(Debug, Clone)]
pub enum AttentionIds {
    /// Grouped-query attention (Llama, Qwen3).
    Gqa(GqaIds),
    /// Multi-head latent attention (DeepSeek-V3).
    Mla(MlaIds),
}

/// Grouped-query attention's projections, with QK-norm's weights (Qwen3).
#[derive(Debug, Clone, Copy)]
pub struct GqaIds {
    pub wq: usize,
    pub wk: usize,
    pub wv: usize,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
}

/// Multi-head latent attention's parameters (`model::decoder::mla`).
#[derive(Debug, Clone)]
pub struct MlaIds {
    pub query: MlaQueryIds,
    pub wkv_a: usize,
    pub kv_norm: usize,
    pub wkv_b: usize,
}

/// MLA's queries: projected directly, or through a normed low-rank latent.
#[derive(Debug, Clone)]
pub enum MlaQueryIds {
    Direct {
        wq: usize,
    },
    Latent {
        wq_a: usize,
        q_norm: usize,
        wq_b: usize,
    },
}

impl MlaIds {
    /// The weight of MLA's projection `p` before `wo` (None when it has none).
    pub fn projection(&self, p: BlockProjection) -> Option<usize> {
        match (p, &self.query) {
            (BlockProjection::Wq, MlaQueryIds::Direct { wq }) => Some(*wq),
            (BlockProjection::WqA, MlaQueryIds::Latent { wq_a, .. }) => Some(*wq_a),
            (BlockProjection::WqB, MlaQueryIds::Latent { wq_b, .. }) => Some(*wq_b),
            (BlockProjection::WkvA, _) => Some(self.wkv_a),
            (BlockProjection::WkvB, _) => Some(self.wkv_b),
            _ => None,
        }
    }
}

impl AttentionIds {
    /// The parameter indices, in storage order.
    pub fn all(&self) -> Vec<usize> {
        match self {
            AttentionIds::Gqa(g) => [Some(g.wq), Some(g.wk), Some(g.wv), g.q_norm, g.k_norm]
                .into_iter()
                .flatten()
                .collect(),
            AttentionIds::Mla(m) => {
                let mut ids = match m.query {
                    MlaQueryIds::Direct { wq } => vec![wq],
                    MlaQueryIds::Latent { wq_a, q_norm, wq_b } => vec![wq_a, q_norm, wq_b],
                };
                ids.extend([m.wkv_a, m.kv_norm, m.wkv_b]);
                ids
            }
        }
    }
}

/// A block's feed-forward: one SwiGLU, or a mixture of experts.
#[derive(Debug, Clone)]
pub enum FeedForwardIds {
    Dense { w1: usize, w2: usize, w3: usize },
    Moe(MoeIds),
}

impl FeedForwardIds {
    /// The block's SwiGLU `[w1, w2, w3]`: the dense feed-forward, or a mixture of experts'
    /// shared experts (None without).
    pub fn swiglu(&self) -> Option<[usize; 3]> {
        match self {
            FeedForwardIds::Dense { w1, w2, w3 } => Some([*w1, *w2, *w3]),
            FeedForwardIds::Moe(moe) => moe.shared,
        }
    }
}

impl LayerIds {
    /// The weight of the block's projection `p` (None when it has none).
    pub fn projection(&self, p: BlockProjection) -> Option<usize> {
        use BlockProjection::*;
        let swiglu = self.ffn.swiglu();
        match (p, &self.attention) {
            (Wo, _) => Some(self.wo),
            (W1, _) => swiglu.map(|f| f[0]),
            (W2, _) => swiglu.map(|f| f[1]),
            (W3, _) => swiglu.map(|f| f[2]),
            (Wq, AttentionIds::Gqa(g)) => Some(g.wq),
            (Wk, AttentionIds::Gqa(g)) => Some(g.wk),
            (Wv, AttentionIds::Gqa(g)) => Some(g.wv),
            (_, AttentionIds::Gqa(_)) => None,
            (_, AttentionIds::Mla(m)) => m.projection(p),
        }
    }

    /// The adapter of the block's projection `p` (None without).
    pub fn adapter(&self, p: BlockProjection) -> Option<LoraIds> {
        self.lora[p.index()]
    }

    /// The bias of the block's projection `p` (None without).
    pub fn bias(&self, p: BlockProjection) -> Option<usize> {
        self.biases[p.index()]
    }

    /// The block's parameter indices, in storage order.
    pub fn all(&self) -> Vec<usize> {
        let mut ids = vec![self.attention_norm];
        ids.extend(self.lora.iter().flatten().flat_map(|l| [l.a, l.b]));
        ids.extend(self.biases.iter().flatten());
        ids.extend(self.attention.all());
        ids.extend(self.sinks);
        ids.extend([self.wo, self.ffn_norm]);
        match &self.ffn {
            FeedForwardIds::Dense { w1, w2, w3 } => ids.extend([*w1, *w2, *w3]),
            FeedForwardIds::Moe(moe) => {
                ids.push(moe.router);
                ids.extend(moe.experts.iter().flatten());
                ids.extend(moe.shared.iter().flatten());
                if let Some(b) = &moe.biases {
                    ids.push(b.router);
                    ids.extend(b.experts.iter().flatten());
                }
            }
        }
        // A block's parameters are consecutive in storage: sorted, they are in its order.
        ids.sort_unstable();
        ids
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
    /// Each parameter's index, looked up by its name in `param_specs`.
    pub fn new(args: &ModelArgs) -> Self {
        let specs = param_specs(args);
        let at: std::collections::HashMap<&str, usize> = specs
            .iter()
            .enumerate()
            .map(|(i, (name, _))| (name.as_str(), i))
            .collect();
        let id = |name: String| -> usize {
            *at.get(name.as_str())
                .unwrap_or_else(|| panic!("no parameter `{name}` in the model's specs"))
        };
        let swiglu = |prefix: &str| {
            [
                id(format!("{prefix}.w1.weight")),
                id(format!("{prefix}.w2.weight")),
                id(format!("{prefix}.w3.weight")),
            ]
        };
        let layers = (0..args.n_layers)
            .map(|l| {
                let p = format!("layers.{l}");
                let ffn = match args.moe_at(l) {
                    None => {
                        let [w1, w2, w3] = swiglu(&format!("{p}.feed_forward"));
                        FeedForwardIds::Dense { w1, w2, w3 }
                    }
                    Some(moe) => FeedForwardIds::Moe(MoeIds {
                        router: id(format!("{p}.moe.router.gate.weight")),
                        experts: (0..moe.router.num_experts)
                            .map(|e| swiglu(&format!("{p}.moe.experts.{e}")))
                            .collect(),
                        shared: moe
                            .shared_hidden
                            .map(|_| swiglu(&format!("{p}.moe.shared_experts"))),
                        biases: moe.linear_biases.then(|| MoeBiasIds {
                            router: id(format!("{p}.moe.router.gate.bias")),
                            experts: (0..moe.router.num_experts)
                                .map(|e| {
                                    let x = format!("{p}.moe.experts.{e}");
                                    ["w1", "w2", "w3"].map(|w| id(format!("{x}.{w}.bias")))
                                })
                                .collect(),
                        }),
                    }),
                };
                let mut layer = LayerIds {
                    attention_norm: id(format!("{p}.attention_norm.weight")),
                    attention: attention_ids(args, &p, &id),
                    wo: id(format!("{p}.attention.wo.weight")),
                    ffn_norm: id(format!("{p}.ffn_norm.weight")),
                    ffn,
                    sinks: args
                        .attention_sinks
                        .then(|| id(format!("{p}.attention.sinks"))),
                    lora: [None; BlockProjection::ALL.len()],
                    biases: [None; BlockProjection::ALL.len()],
                };
                layer.biases = BlockProjection::ALL.map(|proj| {
                    let weight = &specs[layer.projection(proj)?].0;
                    let stem = weight.strip_suffix(".weight")?;
                    at.get(format!("{stem}.bias").as_str()).copied()
                });
                layer.lora = BlockProjection::ALL.map(|proj| {
                    let weight = &specs[layer.projection(proj)?].0;
                    let stem = weight.strip_suffix(".weight")?;
                    Some(LoraIds {
                        a: *at.get(format!("{stem}{}", lora::LORA_A).as_str())?,
                        b: *at.get(format!("{stem}{}", lora::LORA_B).as_str())?,
                    })
                });
                layer
            })
            .collect();
        let norm = id("norm.weight".to_string());
        ParamIds {
            tok_embeddings: 0,
            layers,
            norm,
            output: if args.tied_embeddings {
                0
            } else {
                id("output.weight".to_string())
            },
        }
    }
}

/// Block `p`'s attention parameters, looked up by name with `id`.
fn attention_ids(args: &ModelArgs, p: &str, id: &impl Fn(String) -> usize) -> AttentionIds {
    let a = |name: &str| id(format!("{p}.attention.{name}.weight"));
    match &args.mla {
        None => AttentionIds::Gqa(GqaIds {
            wq: a("wq"),
            wk: a("wk"),
            wv: a("wv"),
            q_norm: args.qk_norm.then(|| a("q_norm")),
            k_norm: args.qk_norm.then(|| a("k_norm")),
        }),
        Some(mla) => AttentionIds::Mla(MlaIds {
            query: match mla.q_lora_rank {
                None => MlaQueryIds::Direct { wq: a("wq") },
                Some(_) => MlaQueryIds::Latent {
                    wq_a: a("wq_a"),
                    q_norm: a("q_norm"),
                    wq_b: a("wq_b"),
                },
            },
            wkv_a: a("wkv_a"),
            kv_norm: a("kv_norm"),
            wkv_b: a("wkv_b"),
        }),
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

    /// What the blocks keep under `ac`, stored (with the residual stream between them) in bf16
    /// when they compute in bf16, as PyTorch's bf16 mixed precision stores its activations.
    pub fn activation_plan(self, ac: AcMode, n_layers: usize) -> ActivationPlan {
        let dtype = match self {
            ParamDtype::Float32 => ActivationDtype::Float32,
            ParamDtype::BFloat16 => ActivationDtype::BFloat16,
        };
        ac.plan(n_layers).with_dtype(dtype)
    }
}

/// The dtype gradients are reduced in across the data-parallel ranks (`[training]
/// mixed_precision_reduce`, FSDP2's `reduce_dtype`): `BFloat16` rounds each rank's gradient to
/// bf16 before FSDP's reduce-scatter or DDP's all-reduce and the reduced sum to bf16 after it
/// (the sum itself accumulates in f32, as a reduction accumulating in f32 does); the result goes
/// into the f32 gradients either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceDtype {
    Float32,
    BFloat16,
}

impl ReduceDtype {
    /// From `mixed_precision_reduce` (validated with the config: `float32` or `bfloat16`).
    pub fn from_config(name: &str) -> Self {
        if name == "bfloat16" {
            ReduceDtype::BFloat16
        } else {
            ReduceDtype::Float32
        }
    }

    /// TorchTitan's name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceDtype::Float32 => "float32",
            ReduceDtype::BFloat16 => "bfloat16",
        }
    }

    /// Rounds `bufs` to bf16 when reductions are in bf16.
    pub fn round<'a, B: Backend>(self, be: &B, bufs: impl IntoIterator<Item = &'a mut B::Buf>)
    where
        B::Buf: 'a,
    {
        if self == ReduceDtype::BFloat16 {
            bufs.into_iter().for_each(|b| be.round_to_bf16(b));
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
    /// Frees every tensor whose name `keep` rejects (a pipeline rank keeps its stages' tensors;
    /// the others stay in the set, empty, so indices keep their meaning).
    pub fn keep_only(&mut self, backend: &B, keep: impl Fn(&str) -> bool) {
        for (name, buf) in self.names.iter().zip(self.bufs.iter_mut()) {
            if !keep(name) {
                *buf = backend.zeros(0);
            }
        }
    }

    /// Zeros for the tensors `keep` accepts; the others empty (a frozen weight's gradient and
    /// moments: never allocated, so a LoRA run does not hold the base model's sizes even briefly).
    pub fn zeros_where(
        backend: &B,
        specs: &[(String, Vec<usize>)],
        keep: impl Fn(&str) -> bool,
    ) -> Self {
        let mut set = Self::unallocated(backend, specs);
        for ((name, shape), buf) in specs.iter().zip(set.bufs.iter_mut()) {
            if keep(name) {
                *buf = backend.zeros(shape.iter().product());
            }
        }
        set
    }

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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_parts_cut_and_join_back() {
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let shape = [4, 6];
        for sharding in [
            TpSharding::Rows,
            TpSharding::Columns,
            TpSharding::Replicated,
        ] {
            let parts: Vec<Vec<f32>> = (0..2)
                .map(|r| sharding.cut(&values, &shape, 2, r))
                .collect();
            let local: usize = sharding.local_shape(&shape, 2).iter().product();
            assert!(parts.iter().all(|p| p.len() == local), "{sharding:?}");
            assert_eq!(sharding.join(&parts, &shape), values, "{sharding:?}");
        }
        // Columns: rank 1 owns the last three columns of every row.
        assert_eq!(
            TpSharding::Columns.cut(&values, &shape, 2, 1)[..3],
            [3.0, 4.0, 5.0]
        );
    }

    #[test]
    fn megatron_plan_of_the_llama_parameters() {
        assert_eq!(
            TpSharding::of("layers.3.attention.wk.weight"),
            TpSharding::Rows
        );
        assert_eq!(
            TpSharding::of("layers.0.attention.wo.weight"),
            TpSharding::Columns
        );
        assert_eq!(
            TpSharding::of("layers.0.feed_forward.w2.weight"),
            TpSharding::Columns
        );
        assert_eq!(
            TpSharding::of("layers.0.ffn_norm.weight"),
            TpSharding::Replicated
        );
        assert_eq!(TpSharding::of("norm.weight"), TpSharding::Replicated);
        assert_eq!(TpSharding::of("output.weight"), TpSharding::Rows);
        assert_eq!(TpSharding::of("tok_embeddings.weight"), TpSharding::Rows);
    }
}
