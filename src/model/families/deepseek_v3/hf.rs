//! DeepSeek-V3 in Hugging Face `transformers`' `DeepseekV3ForCausalLM` form, both ways: its
//! `config.json` (`model_type` "deepseek_v3"), its tensor names, the routing bias
//! (`mlp.gate.e_score_correction_bias`, which titan keeps as the experts' load-balancing bias
//! beside the weights) and RoPE's layout.
//!
//! DeepSeek's checkpoints store the rotated part of each query and key head in interleaved pairs
//! (`rope_interleave`, true in every release), titan's own layout: no permutation. A config with
//! `rope_interleave = false` rotates halves, and its rotated rows are permuted on import. titan
//! exports interleaved. The release's multi-token-prediction layer (`model.layers.<n_layers>.*`,
//! `num_nextn_predict_layers`) is not part of the main model: import skips it and says so; export
//! writes none.
//!
//! transformers' DeepSeek-V3 router is sigmoid with group-limited top-k (one group: no limit); a
//! titan model with softmax scores (TorchTitan's small DeepSeek flavors) has no such HF model, and
//! export refuses it, naming why.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::model::decoder::mla::MlaArgs;
use crate::model::families::hf_fields::{merge, norm_eps, tied_embeddings};
use crate::model::families::hf_rope::{hf_rope_fields, rope_from_hf};
use crate::model::families::llama_form::interleaved_row;
use crate::model::families::{hf_names, HfShapes, HfTensors, RopeRows};
use crate::model::moe::router::{RouterArgs, ScoreFunc};
use crate::model::moe::MoeArgs;
use crate::model::ModelArgs;
use crate::tensor::Tensor;

/// titan's MLA parameter names' HF counterparts (the rest is Llama's, `hf_names`).
const MLA_NAMES: &[(&str, &str)] = &[
    ("attention.wq_a.", "self_attn.q_a_proj."),
    ("attention.q_norm.", "self_attn.q_a_layernorm."),
    ("attention.wq_b.", "self_attn.q_b_proj."),
    ("attention.wkv_a.", "self_attn.kv_a_proj_with_mqa."),
    ("attention.kv_norm.", "self_attn.kv_a_layernorm."),
    ("attention.wkv_b.", "self_attn.kv_b_proj."),
];

/// titan name → HF name: MLA's attention has names of its own.
pub fn hf_name(name: &str) -> String {
    let mut name = name.to_string();
    for (titan, hf) in MLA_NAMES {
        name = name.replace(titan, hf);
    }
    hf_names::hf_name(&name)
}

/// The routing bias's HF name in block `l`.
pub fn bias_name(l: usize) -> String {
    format!("model.layers.{l}.mlp.gate.e_score_correction_bias")
}

/// A size field of `cfg` (`default` when absent or null).
fn size(cfg: &Value, key: &str, default: Option<usize>, file: &Path) -> Result<usize> {
    match (cfg.get(key).filter(|v| !v.is_null()), default) {
        (None, Some(d)) => Ok(d),
        (None, None) => bail!("{}: `{key}` is missing", file.display()),
        (Some(v), _) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&v| v <= 1 << 24)
            .ok_or_else(|| {
                anyhow!(
                    "{}: `{key}` = {v} is not a size from 0 to 2^24",
                    file.display()
                )
            }),
    }
}

/// An optional size: None when absent or null.
fn optional_size(cfg: &Value, key: &str, file: &Path) -> Result<Option<usize>> {
    match cfg.get(key).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(_) => size(cfg, key, None, file).map(Some),
    }
}

/// The mixture of experts of a DeepSeek-V3 config: sigmoid scores, the routing bias (titan's
/// load-balancing bias, stepped by TorchTitan's default 10⁻³ when trained), groups, scale.
fn moe_from_deepseek(cfg: &Value, file: &Path) -> Result<MoeArgs> {
    let hidden = size(cfg, "moe_intermediate_size", None, file)?;
    let experts = match optional_size(cfg, "n_routed_experts", file)? {
        Some(e) => e,
        None => size(cfg, "num_local_experts", None, file)?,
    };
    let shared = size(cfg, "n_shared_experts", Some(0), file)?;
    let groups = match (
        optional_size(cfg, "n_group", file)?,
        optional_size(cfg, "topk_group", file)?,
    ) {
        (None | Some(1), _) => None,
        (Some(g), Some(k)) => Some((g, k)),
        (Some(g), None) => bail!("{}: n_group = {g} without topk_group", file.display()),
    };
    let scale = match cfg.get("routed_scaling_factor").filter(|v| !v.is_null()) {
        None => 1.0,
        Some(v) => v.as_f64().filter(|s| s.is_finite()).ok_or_else(|| {
            anyhow!(
                "{}: routed_scaling_factor = {v} is not a number",
                file.display()
            )
        })? as f32,
    };
    Ok(MoeArgs {
        hidden,
        shared_hidden: (shared > 0).then(|| shared * hidden),
        router: RouterArgs {
            num_experts: experts,
            top_k: size(cfg, "num_experts_per_tok", None, file)?,
            score_func: ScoreFunc::Sigmoid,
            norm_topk_prob: cfg
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            route_scale: scale,
            groups,
        },
        load_balance_coeff: Some(1e-3),
        aux_loss_coef: None,
        first_dense_layers: size(cfg, "first_k_dense_replace", Some(0), file)?,
        sparse_step: 1,
        linear_biases: false,
        activation: Default::default(),
        score_before_experts: false,
    })
}

/// Model shapes from a DeepSeek-V3 `config.json`, and how its RoPE rows are laid out; not yet
/// validated.
pub fn args_from_deepseek_config(cfg: &Value, file: &Path) -> Result<HfShapes> {
    let n_heads = size(cfg, "num_attention_heads", None, file)?;
    let kv_heads = size(cfg, "num_key_value_heads", Some(n_heads), file)?;
    if kv_heads != n_heads {
        bail!("{}: num_key_value_heads = {kv_heads} differs from num_attention_heads = {n_heads}; DeepSeek-V3's attention has a key and value per head", file.display());
    }
    let mla = MlaArgs {
        q_lora_rank: optional_size(cfg, "q_lora_rank", file)?.filter(|&r| r > 0),
        kv_lora_rank: size(cfg, "kv_lora_rank", None, file)?,
        qk_nope_head_dim: size(cfg, "qk_nope_head_dim", None, file)?,
        qk_rope_head_dim: size(cfg, "qk_rope_head_dim", None, file)?,
        v_head_dim: size(cfg, "v_head_dim", None, file)?,
    };
    let (rope_theta, rope_scaling) = rope_from_hf(cfg, file)?;
    let moe = moe_from_deepseek(cfg, file)?;
    let n_layers = size(cfg, "num_hidden_layers", None, file)?;
    if moe.first_dense_layers >= n_layers {
        bail!("{}: first_k_dense_replace = {} leaves none of the {n_layers} blocks a mixture of experts (titan's DeepSeek-V3 has experts)", file.display(), moe.first_dense_layers);
    }
    let args = ModelArgs {
        dim: size(cfg, "hidden_size", None, file)?,
        n_layers,
        n_heads,
        n_kv_heads: n_heads,
        vocab_size: size(cfg, "vocab_size", None, file)?,
        ffn_hidden: size(cfg, "intermediate_size", None, file)?,
        norm_eps: norm_eps(cfg),
        rope_theta,
        rope_scaling,
        max_seq_len: size(cfg, "max_position_embeddings", Some(4096), file)?.max(1),
        tied_embeddings: tied_embeddings(cfg),
        attention_head_dim: None,
        qk_norm: false,
        moe: Some(moe),
        mla: Some(mla),
        lora: None,
        attention_sinks: false,
        sliding_window: None,
        attention_bias: false,
        every_n_layers_nope: None,
        attention_chunk_size: None,
        l2_qk_norm: false,
        attention_temperature: None,
    };
    let interleaved = cfg
        .get("rope_interleave")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    Ok(HfShapes {
        args,
        rope_rows: match interleaved {
            true => RopeRows::Interleaved,
            false => RopeRows::Halves,
        },
    })
}

/// The `config.json` of a titan DeepSeek-V3 model, or why transformers has none for it.
pub fn deepseek_config(args: &ModelArgs) -> Result<Value> {
    let (Some(mla), Some(moe)) = (&args.mla, &args.moe) else {
        bail!("multi-head latent attention without a mixture of experts has no Hugging Face model type titan exports to (DeepSeek-V3 has both)");
    };
    let r = &moe.router;
    if r.score_func != ScoreFunc::Sigmoid {
        bail!("this DeepSeek model routes with softmax scores; transformers' DeepSeek-V3 routes with sigmoid scores (TorchTitan's 671B flavor does; debugmodel, 16B and 236B do not), so it has no Hugging Face model to export to");
    }
    let shared = moe.shared_hidden.unwrap_or(0);
    if !shared.is_multiple_of(moe.hidden) || moe.sparse_step != 1 {
        bail!("this mixture of experts (shared experts {shared} wide over experts {} wide, experts every {} blocks) is not DeepSeek-V3's: its shared experts are whole experts, in every block after the dense ones", moe.hidden, moe.sparse_step);
    }
    let (groups, limited) = r.groups.unwrap_or((1, 1));
    let mut config = json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "moe_intermediate_size": moe.hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "n_shared_experts": shared / moe.hidden,
        "n_routed_experts": r.num_experts,
        "routed_scaling_factor": r.route_scale,
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "n_group": groups,
        "topk_group": limited,
        "num_experts_per_tok": r.top_k,
        "first_k_dense_replace": moe.first_dense_layers,
        "norm_topk_prob": r.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tied_embeddings,
        "rope_interleave": true,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0,
    });
    merge(
        &mut config,
        hf_rope_fields(args.rope_theta, args.rope_scaling.as_ref()),
    );
    Ok(config)
}

/// Reorders the rotated rows of MLA's query and key projections from the halves layout
/// (`rope_interleave = false`) to titan's interleaved pairs: each query head's last
/// `qk_rope_head_dim` rows of `wq`/`wq_b`, and `wkv_a`'s last rows (the shared key). Other
/// tensors are returned unchanged.
pub fn interleave_rope_rows(name: &str, data: Vec<f32>, cols: usize, args: &ModelArgs) -> Vec<f32> {
    let Some(mla) = &args.mla else {
        return data;
    };
    let (r, qk) = (mla.qk_rope_head_dim, mla.qk_head_dim());
    let starts: Vec<usize> =
        if name.ends_with("attention.wq.weight") || name.ends_with("attention.wq_b.weight") {
            (0..args.n_heads)
                .map(|h| h * qk + mla.qk_nope_head_dim)
                .collect()
        } else if name.ends_with("attention.wkv_a.weight") {
            vec![mla.kv_lora_rank]
        } else {
            return data;
        };
    let mut out = data.clone();
    for start in starts {
        for j in 0..r {
            // Row j of the halves layout is row i of the interleaved one.
            let i = interleaved_row(j, r);
            let (dst, src) = (start + i, start + j);
            out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
        }
    }
    out
}

/// The blocks of the release's multi-token-prediction layer among `names` (those past the main
/// model's `n_layers`): how many tensors, for the import's log line.
pub fn extra_layer_tensors(tensors: &HfTensors, n_layers: usize) -> usize {
    tensors
        .keys()
        .filter(|n| {
            n.strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|l| l.parse::<usize>().ok())
                .is_some_and(|l| l >= n_layers)
        })
        .count()
}

/// DeepSeek-V3's routing bias of every mixture-of-experts block, in f32 as transformers keeps it
/// (zeros where the checkpoint has none).
pub fn routing_bias_tensors(args: &ModelArgs, bias: Option<&[Vec<f32>]>) -> Vec<(String, Tensor)> {
    let experts = args.moe.map_or(0, |m| m.router.num_experts);
    (0..args.n_layers)
        .filter(|&l| args.moe_at(l).is_some())
        .map(|l| {
            let values = bias
                .and_then(|b| b.get(l))
                .cloned()
                .unwrap_or_else(|| vec![0.0; experts]);
            let name = bias_name(l);
            (name, Tensor::from_f32(vec![experts], values))
        })
        .collect()
}

/// DeepSeek-V3's routing bias of each block, from `mlp.gate.e_score_correction_bias` (zeros where
/// a checkpoint has none, as transformers initialises it); None for other models.
pub fn routing_bias(args: &ModelArgs, by_name: &HfTensors) -> Result<Option<Vec<Vec<f32>>>> {
    let (Some(_), Some(moe)) = (&args.mla, &args.moe) else {
        return Ok(None);
    };
    let experts = moe.router.num_experts;
    let mut bias = vec![vec![0.0; experts]; args.n_layers];
    for (l, b) in bias.iter_mut().enumerate() {
        let name = bias_name(l);
        let Some((t, file)) = by_name.get(&name) else {
            continue;
        };
        if t.shape != [experts] || args.moe_at(l).is_none() {
            bail!(
                "{}: `{name}` has shape {:?}; block {l} has {} routed experts",
                file.display(),
                t.shape,
                if args.moe_at(l).is_some() { experts } else { 0 }
            );
        }
        *b = t.to_f32_vec();
    }
    Ok(Some(bias))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Value {
        let mut c = json!({
            "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300, "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    #[test]
    fn a_deepseek_config_round_trips_and_what_titan_cannot_compute_is_refused_by_name() {
        let file = Path::new("config.json");
        let HfShapes { args, rope_rows } =
            args_from_deepseek_config(&config(json!({})), file).unwrap();
        assert_eq!(rope_rows, RopeRows::Interleaved);
        let moe = args.moe.unwrap();
        assert_eq!(
            (moe.shared_hidden, moe.router.groups, moe.first_dense_layers),
            (Some(32), None, 1)
        );
        let back = args_from_deepseek_config(&deepseek_config(&args).unwrap(), file).unwrap();
        assert!(back.args.same_model(&args));
        for (extra, key) in [
            (json!({"num_key_value_heads": 2}), "num_key_value_heads"),
            (json!({"n_group": 4, "topk_group": null}), "n_group"),
            (
                json!({"routed_scaling_factor": "x"}),
                "routed_scaling_factor",
            ),
            (json!({"first_k_dense_replace": 2}), "first_k_dense_replace"),
            (json!({"kv_lora_rank": -1}), "kv_lora_rank"),
        ] {
            let e = args_from_deepseek_config(&config(extra), file)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        // transformers' DeepSeek-V3 routes with sigmoid scores: a softmax-routed model has none.
        let mut softmax = args;
        softmax.moe.as_mut().unwrap().router.score_func = ScoreFunc::Softmax;
        assert!(deepseek_config(&softmax)
            .unwrap_err()
            .to_string()
            .contains("sigmoid"));
    }

    #[test]
    fn rotated_rows_in_halves_are_interleaved_on_import() {
        let file = Path::new("config.json");
        let args = args_from_deepseek_config(&config(json!({})), file)
            .unwrap()
            .args;
        // wq: 4 heads of 8 unrotated + 8 rotated rows, one column holding each row's number.
        let rows: Vec<f32> = (0..4 * 16).map(|r| r as f32).collect();
        let out = interleave_rope_rows("layers.0.attention.wq.weight", rows.clone(), 1, &args);
        for h in 0..4 {
            let head = &out[h * 16..(h + 1) * 16];
            let want_rope: Vec<f32> = [0, 4, 1, 5, 2, 6, 3, 7]
                .iter()
                .map(|&j| (h * 16 + 8 + j) as f32)
                .collect();
            assert_eq!(&head[..8], &rows[h * 16..h * 16 + 8], "unrotated rows stay");
            assert_eq!(&head[8..], &want_rope[..], "head {h}");
        }
        // wkv_a: the latent's 16 rows stay, the shared key's 8 are interleaved.
        let kv: Vec<f32> = (0..24).map(|r| r as f32).collect();
        let out = interleave_rope_rows("layers.0.attention.wkv_a.weight", kv, 1, &args);
        assert_eq!(
            &out[16..],
            &[16.0, 20.0, 17.0, 21.0, 18.0, 22.0, 19.0, 23.0]
        );
        let other = interleave_rope_rows("layers.0.attention.wo.weight", vec![1.0, 2.0], 1, &args);
        assert_eq!(other, vec![1.0, 2.0]);
    }
}
