//! TorchTitan's `quantize.linear.float8` model converter: which of the model's linears compute in
//! float8, and the start-up report of those converted and those left in high precision, with why.
//!
//! As torchao's converter (`convert_to_float8_training` with TorchTitan's module filter), a
//! linear is converted unless a `filter_fqns` entry is a substring of its name, or its input or
//! output features are not multiples of 16 (the float8 GEMMs' requirement; 32, a block, for
//! `quantize.linear.mx`'s MXFP8), or, with
//! `auto_filter_small_kn` among the filters, it is below torchao's size thresholds for the recipe
//! (`_auto_filter_for_recipe`, measured on H100s). The features counted are the whole model's,
//! before tensor parallelism splits them.
//!
//! The blocks' projections and the output head (`output`, which TorchTitan's default
//! `filter_fqns` leaves out) are the linears converted. The router stays in high precision, and
//! the routed experts are grouped GEMMs that `quantize.grouped_mm.float8` converts
//! (`with_experts`): the report lists them as left out otherwise. A float8 head computes its
//! logits whole instead of fused with the loss in row chunks, because its casts need the whole
//! logit gradient (`Decoder::head_forward_backward`).

use anyhow::{bail, Result};

use super::args::ModelArgs;
use super::local_shapes::LocalShapes;
use super::params::ParamIds;
use super::projection::BlockProjection;
use crate::backend::float8::Float8Recipe;

/// What `[quantize.linear.float8]` asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Float8Options {
    pub recipe: Float8Recipe,
    /// Substrings of linear names to leave in high precision; the entry
    /// `auto_filter_small_kn` turns on torchao's size thresholds instead of naming a linear.
    pub filter_fqns: Vec<String>,
}

/// The filter entry that selects torchao's size thresholds.
pub const AUTO_FILTER_SMALL_KN: &str = "auto_filter_small_kn";

/// Which linears compute in float8: per block, per projection (`BlockProjection::index`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Float8Conversion {
    blocks: Vec<[Option<Float8Recipe>; BlockProjection::ALL.len()]>,
    /// Each block's routed experts' recipe (`quantize.grouped_mm.float8`; empty without).
    experts: Vec<Option<Float8Recipe>>,
    /// The output head's recipe (None: high precision, fused with the loss).
    head: Option<Float8Recipe>,
    /// Every linear's name and, for those left in high precision, why.
    pub report: Vec<(String, Option<String>)>,
    /// FSDP all-gathers the converted linears' weights as float8 (tensorwise): their casts skip
    /// the weight (`Linear::weight_gathered_in_float8`).
    pub weights_gathered_in_float8: bool,
    /// `enable_fsdp_float8_all_gather` was asked for a layout without FSDP (said in the report).
    pub float8_all_gather_without_fsdp: bool,
}

impl Float8Conversion {
    /// The conversion of `args`' linears under `options`.
    pub fn plan(args: &ModelArgs, options: &Float8Options) -> Result<Self> {
        Self::plan_linears(args, Some(options))
    }

    /// The report of a model whose linears no converter touches (the experts' may still be
    /// converted: `with_experts`).
    pub fn no_linears(args: &ModelArgs) -> Self {
        Self::plan_linears(args, None).expect("no options, nothing to refuse")
    }

    fn plan_linears(args: &ModelArgs, options: Option<&Float8Options>) -> Result<Self> {
        let no_converter = Float8Options {
            recipe: Float8Recipe::Rowwise,
            filter_fqns: Vec::new(),
        };
        let converts = options.is_some();
        let options = options.unwrap_or(&no_converter);
        let auto = options
            .filter_fqns
            .iter()
            .any(|f| f == AUTO_FILTER_SMALL_KN);
        if auto && options.recipe == Float8Recipe::RowwiseWithGwHp {
            bail!("[quantize.linear.float8] filter_fqns: `{AUTO_FILTER_SMALL_KN}` has no size thresholds for recipe_name = \"rowwise_with_gw_hp\" (torchao defines them for tensorwise and rowwise only)");
        }
        if auto && matches!(options.recipe, Float8Recipe::Mxfp8(_)) {
            bail!("[quantize.linear.mx] filter_fqns: `{AUTO_FILTER_SMALL_KN}` has no size thresholds for MXFP8 (torchao defines them for float8 tensorwise and rowwise only)");
        }
        let why_left_out = |name: &str, d_in, d_out| match converts {
            true => Self::left_out(name, d_in, d_out, options, auto),
            false => Some("no linear converter among [model] converters".into()),
        };
        let mut plan = Float8Conversion::default();
        for l in 0..args.n_layers {
            let mut block = [None; BlockProjection::ALL.len()];
            for (p, name, d_in, d_out) in block_linears(args, l) {
                let slot = &mut block[p.index()];
                let why = why_left_out(&name, d_in, d_out);
                if why.is_none() {
                    *slot = Some(options.recipe);
                }
                plan.report.push((name, why));
            }
            plan.blocks.push(block);
            if args.moe_at(l).is_some() {
                let p = format!("layers.{l}.moe");
                plan.report.push((
                    format!("{p}.router.gate"),
                    Some("the router stays in high precision".into()),
                ));
                plan.report.push((
                    format!("{p}.experts"),
                    Some("routed experts are grouped GEMMs: quantize.grouped_mm.float8 converts them".into()),
                ));
            }
        }
        let why = why_left_out("output", args.dim, args.vocab_size);
        if why.is_none() {
            plan.head = Some(options.recipe);
        }
        plan.report.push(("output".into(), why));
        Ok(plan)
    }

    /// This conversion under `tp` tensor-parallel ranks. Multi-head latent attention's latent
    /// down-projections (`wq_a`, `wkv_a`) stay in high precision there: every rank computes them
    /// whole, and their output gradients are each rank's share of a sum (its heads'), which a
    /// float8 scale cannot quantise as one process quantises the sum; the report says so.
    /// MXFP8 is checked as `check_tensor_parallel` says.
    pub fn for_tensor_parallel(mut self, args: &ModelArgs, tp: usize) -> Result<Self> {
        self.check_tensor_parallel(args, tp)?;
        if tp == 1 {
            return Ok(self);
        }
        for (l, block) in self.blocks.iter_mut().enumerate() {
            for p in [BlockProjection::WqA, BlockProjection::WkvA] {
                if block[p.index()].take().is_none() {
                    continue;
                }
                let name = format!("layers.{l}.attention.{}", p.name());
                if let Some(entry) = self.report.iter_mut().find(|(n, _)| *n == name) {
                    entry.1 = Some("under tensor parallelism MLA's latent down-projections stay in high precision (their gradients are partial sums over the ranks' heads)".into());
                }
            }
        }
        Ok(self)
    }

    /// MXFP8 under tensor parallelism: each rank's share of a converted linear's split features
    /// (a column-parallel one's outputs, a row-parallel one's inputs) must be whole blocks of 32,
    /// so that its blocks are one process's. Refused before the first step, naming the linear.
    fn check_tensor_parallel(&self, args: &ModelArgs, tp: usize) -> Result<()> {
        for (l, block) in self.blocks.iter().enumerate() {
            for (p, name, d_in, d_out) in block_linears(args, l) {
                let Some(recipe @ Float8Recipe::Mxfp8(_)) = block[p.index()] else {
                    continue;
                };
                let (what, split) = match p {
                    _ if p.row_parallel() => ("input", d_in),
                    // MLA's latent down-projections are replicated: nothing split.
                    BlockProjection::WqA | BlockProjection::WkvA => continue,
                    _ => ("output", d_out),
                };
                let multiple = recipe.feature_multiple();
                check_split_blocks(tp, (&name, what, split), multiple)?;
            }
        }
        // The head is column-parallel: its vocabulary rows are split.
        if let Some(recipe @ Float8Recipe::Mxfp8(_)) = self.head {
            let split = ("output", "output", args.vocab_size);
            check_split_blocks(tp, split, recipe.feature_multiple())?;
        }
        Ok(())
    }

    /// Why the linear `name` (`d_in` → `d_out` features) stays in high precision, if it does.
    fn left_out(
        name: &str,
        d_in: usize,
        d_out: usize,
        options: &Float8Options,
        auto: bool,
    ) -> Option<String> {
        if let Some(f) = options
            .filter_fqns
            .iter()
            .find(|f| name.contains(f.as_str()))
        {
            return Some(format!("filter_fqns \"{f}\""));
        }
        let multiple = options.recipe.feature_multiple();
        if !d_in.is_multiple_of(multiple) || !d_out.is_multiple_of(multiple) {
            return Some(format!(
                "features {d_in} -> {d_out} are not multiples of {multiple}"
            ));
        }
        if auto && below_torchao_thresholds(options.recipe, d_in, d_out) {
            return Some(format!(
                "{AUTO_FILTER_SMALL_KN}: {d_in} -> {d_out} is below torchao's thresholds for this recipe"
            ));
        }
        None
    }

    /// The output head's recipe (None: high precision).
    pub fn head(&self) -> Option<Float8Recipe> {
        self.head
    }

    /// The recipe of block `layer`'s projection `p` (None: high precision, and always without a
    /// conversion).
    pub fn recipe(&self, layer: usize, p: BlockProjection) -> Option<Float8Recipe> {
        self.blocks.get(layer).and_then(|b| b[p.index()])
    }

    /// Block `layer`'s routed experts' recipe (None: high precision).
    pub fn experts(&self, layer: usize) -> Option<Float8Recipe> {
        self.experts.get(layer).copied().flatten()
    }

    /// The routed experts computing with `recipe` (TorchTitan's `quantize.grouped_mm.float8`,
    /// torchao's rowwise grouped GEMM) in each MoE block whose `layers.N.moe.experts` contains an
    /// `fqns` entry; the report says which.
    pub fn with_experts(mut self, args: &ModelArgs, recipe: Float8Recipe, fqns: &[String]) -> Self {
        let Some(moe) = &args.moe else {
            return self;
        };
        let multiple = recipe.feature_multiple();
        let whole = args.dim.is_multiple_of(multiple) && moe.hidden.is_multiple_of(multiple);
        self.experts = (0..args.n_layers)
            .map(|l| {
                let name = format!("layers.{l}.moe.experts");
                args.moe_at(l)?;
                let named = fqns.iter().any(|f| name.contains(f.as_str()));
                let why = match (named, whole) {
                    (true, true) => None,
                    (false, _) => Some("not named by the grouped_mm converter's fqns".to_string()),
                    (true, false) => Some(format!(
                        "features {} and {} are not both multiples of {multiple}",
                        args.dim, moe.hidden
                    )),
                };
                let converted = why.is_none();
                if let Some(entry) = self.report.iter_mut().find(|(n, _)| *n == name) {
                    entry.1 = why;
                }
                converted.then_some(recipe)
            })
            .collect();
        self
    }

    /// `[quantize.linear.float8] enable_fsdp_float8_all_gather` on a layout that shards with
    /// FSDP when `fsdp` (else it gathers nothing: as in TorchTitan the option is then off, and
    /// the report says so). Only tensorwise linears' weights gather in float8 (the config
    /// refuses the option with another recipe).
    pub fn with_fsdp_float8_all_gather(mut self, fsdp: bool) -> Self {
        self.weights_gathered_in_float8 = fsdp;
        self.float8_all_gather_without_fsdp = !fsdp;
        self
    }

    /// The parameter ids of the weights FSDP gathers in float8: every converted tensorwise
    /// linear's (none unless `with_fsdp_float8_all_gather` found FSDP).
    pub fn gathered_weights(&self, ids: &ParamIds) -> Vec<usize> {
        if !self.weights_gathered_in_float8 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (block, layer) in self.blocks.iter().zip(&ids.layers) {
            for p in BlockProjection::ALL {
                if let (Some(Float8Recipe::Tensorwise), Some(id)) =
                    (block[p.index()], layer.projection(p))
                {
                    out.push(id);
                }
            }
        }
        if self.head_weight_gathered(ids) {
            out.push(ids.output);
        }
        out
    }

    /// Whether FSDP all-gathers the output head's weight in float8: a tensorwise head's, unless
    /// it is the embedding table (tied embeddings), whose lookups read it in high precision.
    pub fn head_weight_gathered(&self, ids: &ParamIds) -> bool {
        self.weights_gathered_in_float8
            && self.head == Some(Float8Recipe::Tensorwise)
            && ids.output != ids.tok_embeddings
    }

    /// Parameters one token multiplies in float8 (or MXFP8) GEMMs, over the whole model: the
    /// converted block projections, and the `top_k` routed experts it goes through where they are
    /// converted (the planner's share of the FLOPs that float8 speeds up), and the output head.
    pub fn params_per_token(&self, args: &ModelArgs) -> usize {
        let mut params = self.head.map_or(0, |_| args.dim * args.vocab_size);
        for (l, block) in self.blocks.iter().enumerate() {
            for (p, _, d_in, d_out) in block_linears(args, l) {
                params += block[p.index()].map_or(0, |_| d_in * d_out);
            }
            if let (Some(Some(_)), Some(moe)) = (self.experts.get(l), args.moe_at(l)) {
                params += moe.router.top_k * 3 * args.dim * moe.hidden;
            }
        }
        params
    }

    /// How many linears compute in float8 (the experts of a block count as one).
    pub fn converted(&self) -> usize {
        let linears = self.blocks.iter().flatten().filter(|r| r.is_some()).count();
        let head = self.head.is_some() as usize;
        linears + head + self.experts.iter().filter(|r| r.is_some()).count()
    }

    /// The start-up lines: the converted linears and those left out with why, a projection that
    /// fares alike in every block named once as `layers.*.…`.
    pub fn summary(&self, n_layers: usize) -> Vec<String> {
        let mut groups: Vec<(String, Option<String>, Vec<String>)> = Vec::new();
        for (name, why) in &self.report {
            let pattern = layer_pattern(name);
            match groups
                .iter_mut()
                .find(|(p, w, _)| *p == pattern && w == why)
            {
                Some(g) => g.2.push(name.clone()),
                None => groups.push((pattern, why.clone(), vec![name.clone()])),
            }
        }
        let named = |pattern: &String, names: &Vec<String>| match names.len() == n_layers
            || names.len() == 1 && !pattern.contains('*')
        {
            true => vec![pattern.clone()],
            false => names.clone(),
        };
        let mut converted = Vec::new();
        let mut lines = Vec::new();
        for (pattern, why, names) in &groups {
            match why {
                None => converted.extend(named(pattern, names)),
                Some(why) => lines.push(format!(
                    "  left in high precision: {} ({why})",
                    named(pattern, names).join(", ")
                )),
            }
        }
        let recipes = self.blocks.iter().flatten().chain(&self.experts);
        let recipes = recipes.chain(std::iter::once(&self.head)).flatten();
        let mx = recipes.clone().any(|r| matches!(r, Float8Recipe::Mxfp8(_)));
        let float8 = recipes
            .clone()
            .any(|r| !matches!(r, Float8Recipe::Mxfp8(_)));
        let kind = match (float8, mx) {
            (true, true) => "float8 or MXFP8",
            (false, true) => "MXFP8",
            _ => "float8",
        };
        let head = format!(
            "  {} linears in {kind}: {}",
            self.converted(),
            match converted.is_empty() {
                true => "none".to_string(),
                false => converted.join(", "),
            }
        );
        let gather = if self.weights_gathered_in_float8 {
            Some("  FSDP all-gathers their weights as float8 (enable_fsdp_float8_all_gather)")
        } else if self.float8_all_gather_without_fsdp {
            Some("  enable_fsdp_float8_all_gather: this layout has no FSDP, so no weight is gathered")
        } else {
            None
        };
        std::iter::once(head)
            .chain(gather.map(String::from))
            .chain(lines)
            .collect()
    }
}

/// MXFP8 under `tp` ranks: a linear's split features (`name`, `what` features, `split` of them)
/// must leave each rank whole blocks of `multiple`.
fn check_split_blocks(
    tp: usize,
    (name, what, split): (&str, &str, usize),
    multiple: usize,
) -> Result<()> {
    if tp > 1 && !(split / tp).is_multiple_of(multiple) {
        bail!("MXFP8 under tensor_parallel_degree = {tp}: {name} has {split} {what} features, {} per rank, not whole blocks of {multiple}; leave it out (`[quantize.linear.mx] filter_fqns`) or choose another degree", split / tp);
    }
    Ok(())
}

/// `layers.<n>.rest` as `layers.*.rest` (other names unchanged).
fn layer_pattern(name: &str) -> String {
    match name.strip_prefix("layers.").and_then(|r| r.split_once('.')) {
        Some((_, rest)) => format!("layers.*.{rest}"),
        None => name.to_string(),
    }
}

/// Block `l`'s projections: which, name, input and output features (the whole model's).
fn block_linears(args: &ModelArgs, l: usize) -> Vec<(BlockProjection, String, usize, usize)> {
    let whole = LocalShapes::whole(args);
    let ffn = match args.moe_at(l) {
        Some(_) => format!("layers.{l}.moe.shared_experts"),
        None => format!("layers.{l}.feed_forward"),
    };
    let attention = format!("layers.{l}.attention");
    BlockProjection::ALL
        .into_iter()
        .filter_map(|p| {
            let (d_in, d_out) = whole.projection(p, l)?;
            let module = if p.in_feed_forward() {
                &ffn
            } else {
                &attention
            };
            Some((p, format!("{module}.{}", p.name()), d_in, d_out))
        })
        .collect()
}

/// torchao's `_auto_filter_for_recipe` size thresholds (weights `[out, in]`): below them a float8
/// linear was measured slower than bf16 on H100s.
fn below_torchao_thresholds(recipe: Float8Recipe, d_in: usize, d_out: usize) -> bool {
    match recipe {
        Float8Recipe::Tensorwise => d_out <= 4096 && d_in <= 1024,
        _ => d_in <= 2048 || d_out <= 1024 || (d_in <= 4096 && d_out <= 2048),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_multiplies_every_converted_projection_in_float8() {
        let args = crate::model::families::llama3::flavor("8B").unwrap();
        let options = Float8Options {
            recipe: Float8Recipe::Rowwise,
            filter_fqns: vec!["output".into()],
        };
        let hd = args.head_dim();
        let (d, q, kv, f) = (
            args.dim,
            args.n_heads * hd,
            args.n_kv_heads * hd,
            args.ffn_hidden,
        );
        let per_block = 2 * d * q + 2 * d * kv + 3 * d * f;
        let all = Float8Conversion::plan(&args, &options).unwrap();
        assert_eq!(all.params_per_token(&args), args.n_layers * per_block);
        let no_ffn = Float8Options {
            filter_fqns: vec!["feed_forward".into(), "output".into()],
            ..options
        };
        let attention = Float8Conversion::plan(&args, &no_ffn).unwrap();
        assert_eq!(
            attention.params_per_token(&args),
            args.n_layers * (2 * d * q + 2 * d * kv)
        );
        assert_eq!(
            Float8Conversion::no_linears(&args).params_per_token(&args),
            0
        );
    }

    #[test]
    fn torchao_thresholds_read_weights_as_out_by_in() {
        // torchao names a weight's shape `K, N = weight.shape` ([out, in]).
        let tensorwise = |o, i| below_torchao_thresholds(Float8Recipe::Tensorwise, i, o);
        assert!(!tensorwise(8192, 2048));
        assert!(tensorwise(4096, 1024));
        assert!(!tensorwise(4096, 1040));
        let rowwise = |o, i| below_torchao_thresholds(Float8Recipe::Rowwise, i, o);
        assert!(rowwise(8192, 2048)); // in ≤ 2048
        assert!(rowwise(1024, 8192)); // out ≤ 1024
        assert!(rowwise(2048, 4096)); // in ≤ 4096 and out ≤ 2048
        assert!(!rowwise(2064, 4096));
        assert!(!rowwise(8192, 8192));
    }

    #[test]
    fn the_plan_converts_block_projections_and_reports_the_rest() {
        let mut args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        args.n_layers = 2;
        let options = Float8Options {
            recipe: Float8Recipe::Rowwise,
            filter_fqns: vec!["output".into(), "layers.1.".into()],
        };
        let plan = Float8Conversion::plan(&args, &options).unwrap();
        assert_eq!(plan.converted(), 7);
        use BlockProjection::*;
        let gqa = [Wq, Wk, Wv, Wo, W1, W2, W3];
        assert!(gqa
            .iter()
            .all(|&p| plan.recipe(0, p) == Some(Float8Recipe::Rowwise)));
        assert!(BlockProjection::ALL
            .iter()
            .all(|&p| plan.recipe(1, p).is_none()));
        let summary = plan.summary(args.n_layers).join("\n");
        assert!(
            summary.contains("7 linears in float8: layers.0.attention.wq")
                && summary.contains("layers.1.feed_forward.w2")
                && summary.contains("output (filter_fqns \"output\")"),
            "{summary}"
        );
        let auto = Float8Options {
            recipe: Float8Recipe::Rowwise,
            filter_fqns: vec![AUTO_FILTER_SMALL_KN.into()],
        };
        let small = Float8Conversion::plan(&args, &auto).unwrap();
        assert_eq!(
            small.converted(),
            0,
            "the debug model is below every threshold"
        );
        assert!(small
            .summary(2)
            .join("\n")
            .contains("output (auto_filter_small_kn: 256 -> 2048 is below"));
    }

    #[test]
    fn the_output_head_converts_when_no_filter_names_it() {
        let mut args = crate::model::families::llama3::flavor("debugmodel").unwrap();
        args.n_layers = 1;
        let options = Float8Options {
            recipe: Float8Recipe::Tensorwise,
            filter_fqns: Vec::new(),
        };
        let plan = Float8Conversion::plan(&args, &options).unwrap();
        assert_eq!(plan.head(), Some(Float8Recipe::Tensorwise));
        assert_eq!(plan.converted(), 8);
        let summary = plan.summary(1).join("\n");
        assert!(summary.contains("8 linears in float8: ") && summary.contains(", output"));
        let blocks = Float8Conversion::plan(
            &args,
            &Float8Options {
                filter_fqns: vec!["output".into()],
                ..options.clone()
            },
        )
        .unwrap();
        assert_eq!(blocks.head(), None);
        let head_params = args.dim * args.vocab_size;
        assert_eq!(
            plan.params_per_token(&args),
            blocks.params_per_token(&args) + head_params
        );
        // FSDP's float8 all-gather takes its weight with the blocks' (tensorwise).
        let ids = ParamIds::new(&args);
        let gathered = plan.clone().with_fsdp_float8_all_gather(true);
        assert!(gathered.gathered_weights(&ids).contains(&ids.output));
        // Not when it is the embedding table: the lookups read it in high precision.
        let tied_args = ModelArgs {
            tied_embeddings: true,
            ..args.clone()
        };
        let tied_ids = ParamIds::new(&tied_args);
        let tied = Float8Conversion::plan(&tied_args, &options)
            .unwrap()
            .with_fsdp_float8_all_gather(true);
        assert!(!tied.head_weight_gathered(&tied_ids));
        assert!(!tied.gathered_weights(&tied_ids).contains(&tied_ids.output));
        // A vocabulary that is not a multiple of 16 keeps it in high precision, and says why.
        args.vocab_size = 2050;
        let odd = Float8Conversion::plan(&args, &options).unwrap();
        assert_eq!(odd.head(), None);
        assert!(odd
            .summary(1)
            .join("\n")
            .contains("output (features 256 -> 2050 are not multiples of 16)"));
        // MXFP8 under TP 2: each rank's vocabulary rows must be whole blocks of 32.
        args.vocab_size = 2 * 1040;
        let mx = Float8Options {
            recipe: Float8Recipe::Mxfp8(crate::backend::float8::MxScaling::Rceil),
            filter_fqns: Vec::new(),
        };
        let mx_plan = Float8Conversion::plan(&args, &mx).unwrap();
        assert!(mx_plan.head().is_some());
        let err = mx_plan.for_tensor_parallel(&args, 2).unwrap_err();
        assert!(
            format!("{err}").contains("output has 2080 output features, 1040 per rank"),
            "{err}"
        );
    }
}
