//! `[model] converters` and `[quantize.*]`: TorchTitan's low-precision model converters and their
//! sections, with their checks. The CPU emulates every converter (it has no float8 GEMMs); CUDA
//! runs float8 linears in cuBLASLt's float8 GEMMs unless `emulate = true`, and MXFP8 emulated
//! only (the `mxfp8_emulated*` recipes; the others are refused naming the GPU: issue 28).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::Config;
use crate::backend::float8::{Float8Recipe, MxScaling};
use crate::model::float8_convert::Float8Options;

/// The converters `[model] converters` accepts (TorchTitan's names).
pub const CONVERTERS: [&str; 4] = [FLOAT8_LINEAR, FLOAT8_GROUPED_MM, MX_LINEAR, MX_GROUPED_MM];

/// Float8 linears with torchao's dynamic scaling.
pub const FLOAT8_LINEAR: &str = "quantize.linear.float8";

/// MXFP8 linears (blocks of 32 with E8M0 scales).
pub const MX_LINEAR: &str = "quantize.linear.mx";

/// Float8 grouped GEMMs for the routed experts (torchao's rowwise grouped GEMM).
pub const FLOAT8_GROUPED_MM: &str = "quantize.grouped_mm.float8";

/// MXFP8 grouped GEMMs for the routed experts.
pub const MX_GROUPED_MM: &str = "quantize.grouped_mm.mx";

/// `[quantize]`: one section per converter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeConfig {
    pub linear: LinearQuantizeConfig,
    pub grouped_mm: GroupedMmQuantizeConfig,
}

/// `[quantize.linear]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LinearQuantizeConfig {
    pub float8: Float8LinearConfig,
    pub mx: MxLinearConfig,
}

/// `[quantize.linear.float8]` (TorchTitan's keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Float8LinearConfig {
    /// `rowwise` (default), `rowwise_with_gw_hp` or `tensorwise`.
    pub recipe_name: String,
    /// Substrings of linear names left in high precision; `auto_filter_small_kn` among them
    /// applies torchao's size thresholds.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub filter_fqns: Vec<String>,
    /// Emulate the float8 GEMMs (the CPU always does).
    pub emulate: bool,
    /// FSDP all-gathers the converted linears' weights as float8 codes with one scale each
    /// (tensorwise only; a quarter of fp32's bytes).
    pub enable_fsdp_float8_all_gather: bool,
    /// The weights' scales agreed in one collective per weight update instead of one per
    /// forward-backward pass (with the above).
    pub precompute_float8_dynamic_scale_for_fsdp: bool,
}

impl Default for Float8LinearConfig {
    fn default() -> Self {
        Float8LinearConfig {
            recipe_name: "rowwise".into(),
            filter_fqns: vec!["output".into()],
            emulate: false,
            enable_fsdp_float8_all_gather: false,
            precompute_float8_dynamic_scale_for_fsdp: false,
        }
    }
}

/// `[quantize.linear.mx]` (TorchTitan's keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MxLinearConfig {
    /// `mxfp8_cublas` (FLOOR scales, default) or `mxfp8_cublas_rceil` (RCEIL scales); their
    /// `mxfp8_emulated` and `mxfp8_emulated_rceil` forms ask for the emulation on every device.
    pub recipe_name: String,
    /// Substrings of linear names left in high precision.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub filter_fqns: Vec<String>,
}

impl Default for MxLinearConfig {
    fn default() -> Self {
        MxLinearConfig {
            recipe_name: "mxfp8_cublas".into(),
            filter_fqns: vec!["output".into()],
        }
    }
}

/// `[quantize.grouped_mm]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct GroupedMmQuantizeConfig {
    pub float8: GroupedFloat8Config,
    pub mx: GroupedMxConfig,
}

/// `[quantize.grouped_mm.float8]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GroupedFloat8Config {
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub fqns: Vec<String>,
}

impl Default for GroupedFloat8Config {
    fn default() -> Self {
        GroupedFloat8Config {
            fqns: vec!["experts".into()],
        }
    }
}

/// `[quantize.grouped_mm.mx]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GroupedMxConfig {
    pub recipe_name: String,
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub fqns: Vec<String>,
}

impl Default for GroupedMxConfig {
    fn default() -> Self {
        GroupedMxConfig {
            recipe_name: "mxfp8_rceil".into(),
            fqns: vec!["experts".into()],
        }
    }
}

impl Config {
    /// Whether float8 linears ask for real float8 GEMMs (`quantize.linear.float8` with `emulate =
    /// false`): the CUDA backend then multiplies float8 operands in cuBLASLt's float8 GEMMs (and
    /// the experts' too, with `quantize.grouped_mm.float8`); the CPU always emulates.
    pub fn wants_float8_gemms(&self) -> bool {
        self.model.converters.iter().any(|c| c == FLOAT8_LINEAR)
            && !self.quantize.linear.float8.emulate
    }

    /// The MXFP8 converters whose recipe asks for MXFP8 GEMMs rather than their emulation
    /// (`mxfp8_cublas`, `mxfp8_cublas_rceil`, the experts' `mxfp8_rceil`), as `section.key =
    /// "value"` for an error; none on the CPU, which always emulates. titan has no MXFP8 GEMMs
    /// yet, so CUDA refuses these, naming the GPU (`CudaBackend::refuse_mx_gemms`).
    pub fn wanted_mx_gemms(&self) -> Vec<String> {
        let has = |c: &str| self.model.converters.iter().any(|x| x == c);
        let mut wanted = Vec::new();
        let linear = &self.quantize.linear.mx.recipe_name;
        if has(MX_LINEAR) && !linear.contains("emulated") {
            wanted.push(format!("[quantize.linear.mx] recipe_name = \"{linear}\""));
        }
        let experts = &self.quantize.grouped_mm.mx.recipe_name;
        if has(MX_GROUPED_MM) && !experts.contains("emulated") {
            wanted.push(format!(
                "[quantize.grouped_mm.mx] recipe_name = \"{experts}\""
            ));
        }
        wanted
    }

    /// The low-precision linears' options, when `[model] converters` asks for float8
    /// (`quantize.linear.float8`) or MXFP8 (`quantize.linear.mx`) linears.
    pub fn float8_linears(&self) -> Result<Option<Float8Options>> {
        let has = |c: &str| self.model.converters.iter().any(|x| x == c);
        if has(FLOAT8_LINEAR) {
            let f = &self.quantize.linear.float8;
            return Ok(Some(Float8Options {
                recipe: Float8Recipe::parse(&f.recipe_name)?,
                filter_fqns: f.filter_fqns.clone(),
            }));
        }
        if has(MX_LINEAR) {
            let m = &self.quantize.linear.mx;
            return Ok(Some(Float8Options {
                recipe: Float8Recipe::parse_mx(&m.recipe_name)?,
                filter_fqns: m.filter_fqns.clone(),
            }));
        }
        Ok(None)
    }

    /// The routed experts' grouped GEMMs: `quantize.grouped_mm.float8` (torchao's rowwise) or
    /// `quantize.grouped_mm.mx` (MXFP8 with RCEIL scales), and the `fqns` they apply to.
    pub fn float8_experts(&self) -> Result<Option<(Float8Recipe, &[String])>> {
        let has = |c: &str| self.model.converters.iter().any(|x| x == c);
        if has(FLOAT8_GROUPED_MM) {
            let fqns = &self.quantize.grouped_mm.float8.fqns[..];
            return Ok(Some((Float8Recipe::Rowwise, fqns)));
        }
        if has(MX_GROUPED_MM) {
            let mx = &self.quantize.grouped_mm.mx;
            let recipe = match mx.recipe_name.as_str() {
                "mxfp8_rceil" | "mxfp8_emulated_rceil" => Float8Recipe::Mxfp8(MxScaling::Rceil),
                other => bail!("[quantize.grouped_mm.mx] recipe_name = \"{other}\" is not known (accepted: mxfp8_rceil, mxfp8_emulated_rceil)"),
            };
            return Ok(Some((recipe, &mx.fqns[..])));
        }
        Ok(None)
    }

    /// `[quantize.linear.float8] enable_fsdp_float8_all_gather` with the float8 linear converter
    /// on, and whether its scales are precomputed once per weight update
    /// (`precompute_float8_dynamic_scale_for_fsdp`); None when it is off.
    pub fn fsdp_float8_all_gather(&self) -> Option<bool> {
        let f = &self.quantize.linear.float8;
        let on = self.model.converters.iter().any(|c| c == FLOAT8_LINEAR)
            && f.enable_fsdp_float8_all_gather;
        on.then_some(f.precompute_float8_dynamic_scale_for_fsdp)
    }

    /// The converter and recipe name of the low-precision linears (for reports).
    pub fn linear_recipe_name(&self) -> Option<&str> {
        let has = |c: &str| self.model.converters.iter().any(|x| x == c);
        if has(FLOAT8_LINEAR) {
            Some(&self.quantize.linear.float8.recipe_name)
        } else if has(MX_LINEAR) {
            Some(&self.quantize.linear.mx.recipe_name)
        } else {
            None
        }
    }

    pub(super) fn validate_quantize(&self) -> Result<()> {
        for c in &self.model.converters {
            if !CONVERTERS.contains(&c.as_str()) && c != super::LORA {
                bail!(
                    "[model] converters: `{c}` is not known (accepted: {}, {})",
                    CONVERTERS.join(", "),
                    super::LORA
                );
            }
        }
        let grouped = |c: &String| c == FLOAT8_GROUPED_MM || c == MX_GROUPED_MM;
        if self.model.converters.iter().filter(|c| grouped(c)).count() > 1 {
            bail!("[model] converters: quantize.grouped_mm.float8 and quantize.grouped_mm.mx both convert the experts; choose one");
        }
        self.float8_experts()?;
        let linear = |c: &String| c == FLOAT8_LINEAR || c == MX_LINEAR;
        if self.model.converters.iter().filter(|c| linear(c)).count() > 1 {
            bail!("[model] converters: quantize.linear.float8 and quantize.linear.mx both convert the linears; choose one");
        }
        self.validate_mx_linears()?;
        let Some(options) = self.float8_linears()? else {
            return Ok(());
        };
        if matches!(options.recipe, Float8Recipe::Mxfp8(_)) {
            return Ok(());
        }
        let f = &self.quantize.linear.float8;
        if f.enable_fsdp_float8_all_gather && options.recipe != Float8Recipe::Tensorwise {
            bail!("[quantize.linear.float8] enable_fsdp_float8_all_gather needs recipe_name = \"tensorwise\" (it is \"{}\")", f.recipe_name);
        }
        if f.precompute_float8_dynamic_scale_for_fsdp && !f.enable_fsdp_float8_all_gather {
            bail!("[quantize.linear.float8] precompute_float8_dynamic_scale_for_fsdp needs enable_fsdp_float8_all_gather = true (the scales it precomputes are the float8 all-gather's)");
        }
        Ok(())
    }
}

impl Config {
    /// MXFP8 linears: a context-parallel rank's chunks of a sequence must hold whole blocks of 32
    /// tokens (so its blocks are one process's).
    fn validate_mx_linears(&self) -> Result<()> {
        if !self.model.converters.iter().any(|c| c == MX_LINEAR) {
            return Ok(());
        }
        Float8Recipe::parse_mx(&self.quantize.linear.mx.recipe_name)?;
        let (cp, seq) = (
            self.parallelism.context_parallel_degree,
            self.training.seq_len,
        );
        let whole = 2 * cp * crate::backend::float8::MX_BLOCK;
        if cp > 1 && !seq.is_multiple_of(whole) {
            bail!("[model] converters = quantize.linear.mx with context_parallel_degree = {cp}: seq_len = {seq} must be a multiple of {whole} (2 × cp chunks of whole MXFP8 blocks of 32 tokens)");
        }
        Ok(())
    }
}
