//! Reading and writing safetensors files of host `Tensor`s (f32 and bf16), with errors naming the file.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::tensor::{DType, Tensor};

/// Serialized safetensors bytes of `tensors` (in the given order, with optional metadata).
pub fn to_bytes(
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let raw: Vec<(String, Vec<u8>, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let dtype = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::BF16 => Dtype::BF16,
            };
            (n.clone(), t.to_le_bytes(), dtype, t.shape.clone())
        })
        .collect();
    let views: Vec<(String, TensorView)> = raw
        .iter()
        .map(|(n, b, d, s)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    Ok(safetensors::tensor::serialize(views, metadata)?)
}

/// Every tensor of a safetensors file (f32/bf16/f16 are accepted; f16 is widened to f32).
pub fn read_file(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    from_bytes(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// A file's tensors by name.
pub type NamedTensors = Vec<(String, Tensor)>;

/// Every tensor of a safetensors file of a Hugging Face release, FP8 (e4m3) ones too: their
/// values decoded to f32 unscaled and named in the second list (`hf_fp8` scales them).
pub fn read_release_file(path: &Path) -> Result<(NamedTensors, Vec<String>)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut fp8 = Vec::new();
    let tensors = read(&bytes, Some(&mut fp8)).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok((tensors, fp8))
}

pub fn from_bytes(bytes: &[u8]) -> Result<Vec<(String, Tensor)>> {
    read(bytes, None)
}

/// The tensors of `bytes`; e4m3 ones only where `fp8` collects their names.
fn read(bytes: &[u8], mut fp8: Option<&mut Vec<String>>) -> Result<Vec<(String, Tensor)>> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow!("not a valid safetensors file ({e}); is it truncated or corrupt?"))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let t = match view.dtype() {
            Dtype::F32 => Tensor::from_le_bytes(shape, DType::F32, view.data())?,
            Dtype::BF16 => Tensor::from_le_bytes(shape, DType::BF16, view.data())?,
            Dtype::F16 => {
                let v: Vec<f32> = view
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect();
                Tensor::from_f32(shape, v)
            }
            Dtype::F8_E4M3 if fp8.is_some() => {
                use crate::backend::float8::{decode_codes, Fp8Format};
                let v = decode_codes(view.data().iter().copied(), Fp8Format::E4M3);
                if let Some(names) = fp8.as_mut() {
                    names.push(name.clone());
                }
                Tensor::from_f32(shape, v)
            }
            // MXFP4 releases' codes and exponents, a byte each (`hf_mxfp4`).
            Dtype::U8 if fp8.is_some() => {
                Tensor::from_f32(shape, view.data().iter().map(|&b| b as f32).collect())
            }
            other => bail!("tensor `{name}` has dtype {other:?}; titan reads F32, BF16 and F16 (and E4M3 and U8 in FP8 and MXFP4 releases)"),
        };
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
