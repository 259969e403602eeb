//! Hugging Face FP8 releases (`quantization_config.quant_method = "fp8"`, the fine-grained format
//! of DeepSeek-V3's and Qwen3's FP8 checkpoints): each linear's weight stored in e4m3 with a
//! `weight_scale_inv` tensor beside it, one f32 per block of `weight_block_size` (128 × 128) of
//! the weight, the weight being `e4m3 value × scale_inv` of its block. Import dequantises them to
//! f32 (titan trains in high precision; float8 is a compute recipe, `[model] converters`), each
//! value `decode(code) · scale_inv` in f32, as `transformers` dequantises; norms and embeddings
//! of such releases are already bf16. An FP8 weight without its scales, a scale without an FP8
//! weight, or another quantisation method is an error naming the tensor or key.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

use crate::tensor::Tensor;

/// The scales' name beside weight `name` (`….weight` → `….weight_scale_inv`).
pub fn scale_name(name: &str) -> String {
    format!("{name}_scale_inv")
}

/// The block size of an FP8 release from `config.json` (`[rows, columns]` of the weight per
/// scale), None without `quantization_config`; another method or format is refused.
pub fn block_size(cfg: &Value, file: &Path) -> Result<Option<(usize, usize)>> {
    let Some(q) = cfg.get("quantization_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let at = |key: &str| format!("{}: quantization_config.{key}", file.display());
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method == "mxfp4" {
        // gpt-oss's experts: `hf_mxfp4`, by the tensors' names.
        return Ok(None);
    }
    if method != "fp8" {
        bail!("{} = \"{method}\" is not supported (titan imports FP8 releases, \"fp8\", and MXFP4 ones, \"mxfp4\", dequantising them)", at("quant_method"));
    }
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
        if fmt != "e4m3" {
            bail!(
                "{} = \"{fmt}\" is not supported (FP8 releases store e4m3)",
                at("fmt")
            );
        }
    }
    let block = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .and_then(|b| match b.as_slice() {
            [r, c] => Some((r.as_u64()?, c.as_u64()?)),
            _ => None,
        })
        .filter(|&(r, c)| (1..=1 << 16).contains(&r) && (1..=1 << 16).contains(&c))
        .ok_or_else(|| {
            anyhow!("{} must be two block sizes from 1 to 65536 (per-tensor FP8 scales are not supported)", at("weight_block_size"))
        })?;
    Ok(Some((block.0 as usize, block.1 as usize)))
}

/// Weight `name` (`[rows, cols]` e4m3 values, already decoded to f32) times its block scales
/// `scale` (`[ceil(rows / br), ceil(cols / bc)]`).
pub fn dequantize(
    name: &str,
    weight: &Tensor,
    scale: &Tensor,
    (br, bc): (usize, usize),
) -> Result<Vec<f32>> {
    let [rows, cols] = weight.shape[..] else {
        bail!(
            "FP8 weight `{name}` has shape {:?}; block scales apply to matrices",
            weight.shape
        );
    };
    let want = vec![rows.div_ceil(br), cols.div_ceil(bc)];
    if scale.shape != want {
        bail!(
            "`{}` has shape {:?}; weight `{name}` {:?} in blocks of {br}x{bc} needs {want:?}",
            scale_name(name),
            scale.shape,
            weight.shape
        );
    }
    let (values, scales) = (weight.to_f32_vec(), scale.to_f32_vec());
    let per_row = want[1];
    Ok(values
        .chunks(cols)
        .enumerate()
        .flat_map(|(r, row)| {
            let block_row = &scales[(r / br) * per_row..(r / br + 1) * per_row];
            row.iter()
                .enumerate()
                .map(move |(c, &v)| v * block_row[c / bc])
        })
        .collect())
}
