//! Whole-model gradient check on a tiny Llama and a tiny Qwen3 (QK-norm, a head width that is not
//! dim / heads), with mixtures of experts, latent attention and LoRA's adapters: the analytic
//! gradient of every parameter tensor against central differences of the loss, along that
//! tensor's gradient and along a random mix.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan::backend::cpu::CpuBackend;
use titan::backend::Backend;
use titan::model::args::AttentionTemperature;
use titan::model::{init_params, Decoder, ModelArgs, ParamSet, Workspace};

fn tiny_args(tied: bool) -> ModelArgs {
    llama_args(tied)
}

fn llama_args(tied: bool) -> ModelArgs {
    ModelArgs {
        dim: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        vocab_size: 23,
        ffn_hidden: 40,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_seq_len: 64,
        tied_embeddings: tied,
        attention_head_dim: None,
        qk_norm: false,
        moe: None,
        mla: None,
        lora: None,
        attention_sinks: false,
        sliding_window: None,
        attention_bias: false,
        every_n_layers_nope: None,
        attention_chunk_size: None,
        l2_qk_norm: false,
        attention_temperature: None,
    }
}

/// Qwen3's block: QK-norm, and heads 6 wide while dim / heads is 4.
fn qwen3_args(tied: bool) -> ModelArgs {
    ModelArgs {
        attention_head_dim: Some(6),
        qk_norm: true,
        norm_eps: 1e-6,
        ..llama_args(tied)
    }
}

fn check(tied: bool) {
    check_model(tiny_args(tied), tied)
}

fn check_model(args: ModelArgs, tied: bool) {
    // QK-norm curves the loss along wq and wk: a step of 1e-2 left 2% truncation error. A
    // mixture of experts needs a step small enough that no token changes its experts.
    let eps = if args.moe.is_some() { 1e-3 } else { 3e-3 };
    check_model_with(args, tied, eps)
}

fn check_model_with(args: ModelArgs, tied: bool, eps: f64) {
    let be = CpuBackend::new();
    let (batch, seq) = (2, 9);
    let model = Decoder::new(&be, args.clone(), seq).unwrap();
    let mut params = init_params(&be, &args, 3);
    // Larger weights than the init so every path carries a visible gradient.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for b in params.bufs.iter_mut() {
        for v in b.iter_mut() {
            *v += (rng.gen::<f32>() - 0.5) * 0.3;
        }
    }
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.gen_range(0..args.vocab_size as u32))
        .collect();
    let mut ws = Workspace::new(&be, &args, batch, seq);
    let mut grads = ParamSet::zeros(&be, &model.param_specs());
    let n_targets = (batch * seq) as f64;
    let loss = model
        .forward_backward(
            &be,
            &params,
            &mut grads,
            &mut ws,
            &tokens,
            1.0 / n_targets as f32,
        )
        .unwrap();
    assert!(loss.sum.is_finite());
    // With the MoE auxiliary loss the objective is the language model's loss plus it (which only
    // a backward reports): the finite differences run whole steps on a scratch gradient set.
    let aux = args.moe.and_then(|m| m.aux_loss_coef).is_some();
    ws.take_expert_stats(&be);
    let mut scratch = ParamSet::zeros(&be, &model.param_specs());
    let mut loss_at = |params: &ParamSet<CpuBackend>| {
        if !aux {
            return model.loss(&be, params, &mut ws, &tokens).unwrap().sum / n_targets;
        }
        let lm = model
            .forward_backward(&be, params, &mut scratch, &mut ws, &tokens, 1.0)
            .unwrap()
            .sum;
        let stats = ws.take_expert_stats(&be).expect("a mixture of experts");
        lm / n_targets + stats.aux_loss.expect("an auxiliary loss")
    };
    for i in 0..params.len() {
        let g = &grads.bufs[i];
        let gnorm = be.sum_squares(g).sqrt();
        assert!(gnorm > 0.0, "{}: zero gradient", params.names[i]);
        // Direction 1: the gradient itself (expects |g|); direction 2: gradient plus noise (expects g·d).
        let noise: Vec<f32> = (0..g.len()).map(|_| rng.gen::<f32>() - 0.5).collect();
        let mixed: Vec<f32> = g
            .iter()
            .zip(&noise)
            .map(|(a, b)| a / gnorm as f32 + b * 0.5 / (g.len() as f32).sqrt())
            .collect();
        for dir in [
            g.iter().map(|v| v / gnorm as f32).collect::<Vec<f32>>(),
            mixed,
        ] {
            let dn = dir.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            let expected: f64 = g
                .iter()
                .zip(&dir)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                / dn;
            let orig = params.bufs[i].clone();
            params.bufs[i] = orig
                .iter()
                .zip(&dir)
                .map(|(p, d)| p + (eps / dn) as f32 * d)
                .collect();
            let up = loss_at(&params);
            params.bufs[i] = orig
                .iter()
                .zip(&dir)
                .map(|(p, d)| p - (eps / dn) as f32 * d)
                .collect();
            let down = loss_at(&params);
            params.bufs[i] = orig;
            let numeric = (up - down) / (2.0 * eps);
            let err = (numeric - expected).abs();
            assert!(
                err < 2e-2 * expected.abs().max(1e-2) + 2e-4,
                "{} (tied={tied}): analytic {expected} numeric {numeric}",
                params.names[i]
            );
        }
    }
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    check(false);
}

#[test]
fn whole_model_gradient_with_tied_embeddings() {
    check(true);
}

/// LoRA's adapters (rank 3, scale 2) on every block projection, their `B` made non-zero: the
/// adapters' gradients and their share of every input gradient (which the base weights' and
/// embeddings' gradients below them read).
#[test]
fn lora_whole_model_gradient_matches_finite_differences() {
    let lora = titan::model::lora::LoraArgs {
        rank: 3,
        alpha: 6.0,
        target_modules: Vec::new(),
    };
    check_model(
        ModelArgs {
            lora: Some(lora),
            ..qwen3_args(false)
        },
        false,
    );
}

#[test]
fn qwen3_whole_model_gradient_matches_finite_differences() {
    check_model(qwen3_args(false), false);
    check_model(qwen3_args(true), true);
}

/// Qwen3-MoE's block: 4 experts of width 12, 2 per token, softmax renormalised; and a sigmoid
/// router with shared experts.
#[test]
fn moe_whole_model_gradient_matches_finite_differences() {
    use titan::model::moe::router::{RouterArgs, ScoreFunc};
    use titan::model::moe::MoeArgs;
    let router = RouterArgs {
        num_experts: 4,
        top_k: 2,
        score_func: ScoreFunc::Softmax,
        norm_topk_prob: true,
        route_scale: 1.0,
        groups: None,
    };
    let moe = MoeArgs {
        hidden: 12,
        shared_hidden: None,
        router,
        load_balance_coeff: None,
        aux_loss_coef: None,
        first_dense_layers: 0,
        sparse_step: 1,
        linear_biases: false,
        activation: Default::default(),
        score_before_experts: false,
    };
    check_model(
        ModelArgs {
            moe: Some(moe),
            ..qwen3_args(false)
        },
        false,
    );
    let sigmoid = MoeArgs {
        shared_hidden: Some(8),
        router: RouterArgs {
            score_func: ScoreFunc::Sigmoid,
            norm_topk_prob: false,
            route_scale: 2.0,
            ..router
        },
        ..moe
    };
    check_model(
        ModelArgs {
            moe: Some(sigmoid),
            ..qwen3_args(true)
        },
        true,
    );
    // The sequence-wise auxiliary loss (large, so its share of each gradient is visible), over
    // both score functions.
    for m in [moe, sigmoid] {
        check_model(
            ModelArgs {
                moe: Some(MoeArgs {
                    aux_loss_coef: Some(0.5),
                    first_dense_layers: 0,
                    sparse_step: 1,
                    linear_biases: false,
                    activation: Default::default(),
                    score_before_experts: false,
                    ..m
                }),
                ..qwen3_args(false)
            },
            false,
        );
    }
}

/// Token ids enter the model through `load_tokens` (training, validation) and `forward_cached`
/// (generation): one outside the vocabulary is an error naming the id, its position and the
/// vocabulary, before any kernel sees it (issue 27, item 7).
#[test]
fn a_token_id_outside_the_vocabulary_is_an_error_before_any_kernel() {
    let be = CpuBackend::new();
    let args = llama_args(false);
    let (batch, seq) = (2, 5);
    let model = Decoder::new(&be, args.clone(), seq).unwrap();
    let params = init_params(&be, &args, 3);
    let mut ws = Workspace::new(&be, &args, batch, seq);
    let mut grads = ParamSet::zeros(&be, &model.param_specs());
    let mut tokens: Vec<u32> = (0..batch * (seq + 1)).map(|i| i as u32 % 23).collect();
    tokens[seq + 1 + 4] = 23;
    let e = model
        .forward_backward(&be, &params, &mut grads, &mut ws, &tokens, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token id 23 at position 10 (row 1, column 4)") && e.contains("of 23 ids"),
        "{e}"
    );
    assert!(grads.bufs.iter().all(|g| g.iter().all(|&x| x == 0.0)));
    let mut cache = titan::model::KvCache::new(&be, &args, 8);
    let e = model
        .forward_cached(&be, &params, &mut cache, &[1, u32::MAX])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("token id {} at position 1", u32::MAX)),
        "{e}"
    );
}

/// DeepSeek-V3's multi-head latent attention: queries projected directly with a value head
/// narrower than the query/key head; and through a query latent with a value head wider than
/// it (the queries and keys padded) under YaRN, whose mscale scales the softmax.
/// gpt-oss's attention: sinks in every block (a learned logit per head in each softmax's
/// denominator) and a sliding window of 4 keys on every other block; sinks on MLA's padded heads
/// too.
#[test]
fn attention_sinks_and_sliding_windows_whole_model_gradient() {
    let window = Some(titan::model::args::SlidingWindow { size: 4, period: 2 });
    let gpt_oss_like = ModelArgs {
        attention_sinks: true,
        sliding_window: window,
        ..llama_args(false)
    };
    check_model(gpt_oss_like.clone(), false);
    let mla = titan::model::decoder::mla::MlaArgs {
        q_lora_rank: None,
        kv_lora_rank: 6,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 4,
        v_head_dim: 6,
    };
    let with_mla = ModelArgs {
        n_kv_heads: 4,
        mla: Some(mla),
        ..gpt_oss_like
    };
    check_model(with_mla, false);
}

/// gpt-oss's block, shrunk: biases on the attention's projections, sinks, a window on every
/// other block, YaRN, and experts with biases and the clamped SwiGLU (a limit of 1, which some
/// gate and up values cross; the finite differences stay on one side of it).
#[test]
fn gpt_oss_whole_model_gradient_matches_finite_differences() {
    let mut args = titan::model::families::gpt_oss::flavors::gpt_oss(16, 2, 4, 23);
    (args.n_heads, args.n_kv_heads, args.attention_head_dim) = (4, 2, Some(6));
    args.max_seq_len = 64;
    args.sliding_window.as_mut().unwrap().size = 4;
    let moe = args.moe.as_mut().unwrap();
    (moe.hidden, moe.router.top_k, moe.load_balance_coeff) = (5, 2, None);
    moe.activation = titan::model::moe::activation::ExpertActivation::ClampedSwiglu {
        alpha: 1.702,
        limit: 1.0,
    };
    check_model(args, false);
}

/// The summed loss of `args`' model, initialised with seed 3, on 2 fixed sequences of 9 tokens.
fn fixed_loss(args: ModelArgs) -> f64 {
    let be = CpuBackend::new();
    let (batch, seq) = (2, 9);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|i| (i * 7 % 23) as u32)
        .collect();
    let model = Decoder::new(&be, args.clone(), seq).unwrap();
    let params = init_params(&be, &args, 3);
    let mut ws = Workspace::new(&be, &args, batch, seq);
    model.loss(&be, &params, &mut ws, &tokens).unwrap().sum
}

/// The window masks: a window as long as the sequence changes nothing, a shorter one changes the
/// loss of the blocks it is on; a sink changes it too.
#[test]
fn a_sliding_window_and_sinks_change_the_model_only_as_they_should() {
    use titan::model::args::SlidingWindow;
    let (loss, seq) = (fixed_loss, 9);
    let plain = loss(llama_args(false));
    let window = |size| ModelArgs {
        sliding_window: Some(SlidingWindow { size, period: 2 }),
        ..llama_args(false)
    };
    assert_eq!(loss(window(seq)), plain);
    assert_ne!(loss(window(3)), plain);
    let sinks = ModelArgs {
        attention_sinks: true,
        ..llama_args(false)
    };
    assert_ne!(loss(sinks), plain);
}

/// Llama 4's attention block features: NoPE blocks (block 1 of 2 rotates nothing) and chunked
/// attention of 4 positions on the blocks with RoPE, over sequences of 9.
#[test]
fn nope_blocks_and_chunked_attention_whole_model_gradient() {
    let args = ModelArgs {
        every_n_layers_nope: Some(2),
        attention_chunk_size: Some(4),
        ..llama_args(false)
    };
    check_model(args, false);
}

/// The rest of Llama 4's attention: the weightless QK-norm after RoPE on the RoPE block and
/// temperature tuning on the NoPE block, its floor scale 2 so that the 9 positions take factors
/// from 1 to 1 + ln 6 / 2 (Llama 4's 8192 would leave them all 1).
#[test]
fn l2_qk_norm_and_attention_temperature_whole_model_gradient() {
    check_model(llama4_attention(2), false);
}

/// Llama 4's attention over 2 blocks: block 1 NoPE with temperature tuning of `floor_scale`,
/// block 0 chunked (4) with the L2 QK-norm.
fn llama4_attention(floor_scale: usize) -> ModelArgs {
    ModelArgs {
        every_n_layers_nope: Some(2),
        attention_chunk_size: Some(4),
        l2_qk_norm: true,
        attention_temperature: Some(AttentionTemperature {
            floor_scale,
            scale: 0.5,
        }),
        ..llama_args(false)
    }
}

/// Temperature tuning changes nothing while every position is below its floor scale, and the
/// loss when some are not; the L2 norm changes the loss.
#[test]
fn temperature_tuning_and_the_l2_norm_change_the_model_only_as_they_should() {
    let loss = fixed_loss;
    let high = loss(llama4_attention(10));
    let none = ModelArgs {
        attention_temperature: None,
        ..llama4_attention(2)
    };
    assert_eq!(high, loss(none.clone()));
    assert_ne!(loss(llama4_attention(2)), high);
    let unnormed = ModelArgs {
        l2_qk_norm: false,
        ..none
    };
    assert_ne!(loss(unnormed), high);
}

/// NoPE and chunks change the model only as they should: a chunk as long as the sequence changes
/// nothing, a shorter one changes the loss; with every block NoPE, chunks (on the RoPE blocks
/// only) and RoPE's θ change nothing; one NoPE block changes the loss.
#[test]
fn nope_blocks_and_chunks_change_the_model_only_as_they_should() {
    let (loss, seq) = (fixed_loss, 9);
    let plain = loss(llama_args(false));
    let with = |nope: Option<usize>, chunk: Option<usize>, theta: f64| ModelArgs {
        every_n_layers_nope: nope,
        attention_chunk_size: chunk,
        rope_theta: theta,
        ..llama_args(false)
    };
    assert_eq!(loss(with(None, Some(seq), 10000.0)), plain);
    assert_ne!(loss(with(None, Some(4), 10000.0)), plain);
    assert_ne!(loss(with(Some(2), None, 10000.0)), plain);
    let all_nope = loss(with(Some(1), None, 10000.0));
    assert_eq!(loss(with(Some(1), Some(4), 10000.0)), all_nope);
    assert_eq!(loss(with(Some(1), None, 500.0)), all_nope);
}

/// Generation with a KV cache in Llama 4's blocks: the last logits of 11 tokens fed at once equal
/// those of 5 fed and then 6 one at a time (each new position masked to its chunk of 4 and its
/// queries' temperature found from its offset in the cache), and differ from the unchunked
/// model's.
#[test]
fn a_kv_cache_keeps_each_position_to_its_chunk() {
    let be = CpuBackend::new();
    let args = llama4_attention(3);
    let tokens: Vec<u32> = (0..11).map(|i| (i * 5 % 23) as u32).collect();
    let last_logits = |args: &ModelArgs, first: usize| {
        let model = Decoder::new(&be, args.clone(), 16).unwrap();
        let params = init_params(&be, args, 3);
        let mut cache = titan::model::KvCache::new(&be, args, 16);
        let mut logits = model
            .forward_cached(&be, &params, &mut cache, &tokens[..first])
            .unwrap();
        for t in &tokens[first..] {
            logits = model
                .forward_cached(&be, &params, &mut cache, &[*t])
                .unwrap();
        }
        logits
    };
    let (whole, stepped) = (last_logits(&args, 11), last_logits(&args, 5));
    let worst = whole
        .iter()
        .zip(&stepped)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "cached generation differs by {worst}");
    let unchunked = ModelArgs {
        attention_chunk_size: None,
        ..args
    };
    assert_ne!(last_logits(&unchunked, 11), whole);
}

#[test]
fn mla_whole_model_gradient_matches_finite_differences() {
    use titan::backend::cpu::rope::{RopeScaling, YarnScaling};
    use titan::model::decoder::mla::MlaArgs;
    let direct = MlaArgs {
        q_lora_rank: None,
        kv_lora_rank: 6,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 4,
        v_head_dim: 6,
    };
    let mla_args = |mla| ModelArgs {
        n_kv_heads: 4,
        mla: Some(mla),
        ..llama_args(false)
    };
    check_model(mla_args(direct), false);
    let latent = MlaArgs {
        q_lora_rank: Some(10),
        qk_nope_head_dim: 2,
        v_head_dim: 8,
        ..direct
    };
    let yarn = RopeScaling::Yarn(YarnScaling {
        factor: 4.0,
        original_max_position_embeddings: 4,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: None,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
    });
    check_model(
        ModelArgs {
            rope_scaling: Some(yarn),
            ..mla_args(latent)
        },
        true,
    );
}
