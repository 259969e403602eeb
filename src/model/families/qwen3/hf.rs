//! Qwen3 and Qwen3-MoE in Hugging Face form: the Llama-shaped config with QK-norm and a head
//! width of its own (`llama_form`), and Qwen3-MoE's experts (`config.json` fields both ways;
//! experts one tensor each, as the published checkpoints store them).

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::model::families::hf_fields::{get_size, merge};
use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;

/// Qwen3-MoE's experts from its `config.json`: in block `l` when `l + 1` is a multiple of
/// `decoder_sparse_step` and `l` is not among `mlp_only_layers` (which titan takes as a prefix
/// `0..k` of dense blocks, DeepSeek's `first_k_dense_replace`; another set is refused, naming
/// it), softmax scores renormalised over the chosen when `norm_topk_prob`.
pub fn moe_from_hf(cfg: &Value, file: &Path) -> Result<MoeArgs> {
    let sparse_step = match cfg.get("decoder_sparse_step").filter(|v| !v.is_null()) {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(step) if (1..=1 << 12).contains(&step) => step as usize,
            _ => bail!(
                "{}: decoder_sparse_step = {v} is not a block count from 1 to 4096",
                file.display()
            ),
        },
    };
    let dense: Vec<u64> = match cfg.get("mlp_only_layers").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .ok_or_else(|| {
                anyhow!(
                    "{}: mlp_only_layers = {v} is not a list of block numbers",
                    file.display()
                )
            })?,
    };
    if dense.iter().enumerate().any(|(i, &l)| l != i as u64) {
        bail!(
            "{}: mlp_only_layers = {dense:?} is not supported: titan's dense blocks in a mixture-of-experts model are the leading ones (0, 1, …, k-1)",
            file.display()
        );
    }
    Ok(MoeArgs {
        hidden: get_size(cfg, "moe_intermediate_size", "moe.hidden", None, file)?,
        shared_hidden: None,
        load_balance_coeff: None,
        aux_loss_coef: None,
        first_dense_layers: dense.len(),
        sparse_step,
        linear_biases: false,
        activation: Default::default(),
        score_before_experts: false,
        router: RouterArgs {
            // Current transformers writes `num_local_experts`, earlier `num_experts`.
            num_experts: match cfg.get("num_local_experts").filter(|v| !v.is_null()) {
                Some(_) => get_size(cfg, "num_local_experts", "moe.num_experts", None, file)?,
                None => get_size(cfg, "num_experts", "moe.num_experts", None, file)?,
            },
            top_k: get_size(cfg, "num_experts_per_tok", "moe.num_experts", None, file)?,
            score_func: ScoreFunc::Softmax,
            norm_topk_prob: cfg
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            route_scale: 1.0,
            groups: None,
        },
    })
}

/// The mixture of experts Qwen3-MoE's config can say: softmax scores, scale 1, no groups, no shared
/// experts. Anything else has no `transformers` model to load it as.
pub fn check_exportable(args: &ModelArgs) -> Result<()> {
    let Some(moe) = &args.moe else {
        return Ok(());
    };
    let r = &moe.router;
    if r.score_func != ScoreFunc::Softmax
        || r.route_scale != 1.0
        || r.groups.is_some()
        || moe.shared_hidden.is_some()
        || moe.load_balance_coeff.is_some()
        || moe.linear_biases
        || !moe.activation.is_default()
        || !args.qk_norm
    {
        bail!("this mixture-of-experts model ({moe:?}) has no Hugging Face model type titan exports to: Qwen3-MoE needs QK-norm, softmax scores, route scale 1, no expert groups, no shared experts and no expert bias (load_balance_coeff)");
    }
    Ok(())
}

/// Qwen3-MoE's expert fields written into `config`. The leading dense blocks are
/// `mlp_only_layers`. The auxiliary loss is a training setting (and titan's is sequence-wise, not
/// transformers' batch-wise one): exported as off.
pub fn write_moe(config: &mut Value, moe: &MoeArgs) {
    let dense: Vec<usize> = (0..moe.first_dense_layers).collect();
    merge(
        config,
        json!({
            "num_experts": moe.router.num_experts,
            "num_experts_per_tok": moe.router.top_k,
            "moe_intermediate_size": moe.hidden,
            "norm_topk_prob": moe.router.norm_topk_prob,
            "decoder_sparse_step": moe.sparse_step,
            "mlp_only_layers": dense,
            "output_router_logits": false,
            "router_aux_loss_coef": 0.0,
        }),
    );
}
