//! Host tensors: a shape plus contiguous storage in f32 or bf16.
//!
//! Everything the trainer computes lives in backend buffers; `Tensor` is the host-side currency used
//! by checkpoints, HF conversion and tests, where a name, a shape and a dtype travel with the data.

use anyhow::{bail, Result};
use half::bf16;

/// `values` rounded to bf16 (nearest even), two per f32 word: `values[2i]` in the low half,
/// `values[2i + 1]` (or 0 past the end) in the high one. Collectives that carry bf16 move these
/// words, half the bytes of the f32 values.
pub fn pack_bf16_pairs(values: &[f32]) -> Vec<f32> {
    values
        .chunks(2)
        .map(|pair| {
            let lo = bf16::from_f32(pair[0]).to_bits() as u32;
            let hi = pair.get(1).map_or(0, |&v| bf16::from_f32(v).to_bits()) as u32;
            f32::from_bits(lo | (hi << 16))
        })
        .collect()
}

/// Storage element types titan reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "float32" | "fp32" | "f32" => Ok(DType::F32),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            other => bail!("unknown dtype `{other}` (accepted: float32, bfloat16)"),
        }
    }
}

/// Contiguous storage in one of the supported dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

/// A contiguous, row-major host tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub storage: Storage,
}

impl Tensor {
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} does not match {} elements",
            data.len()
        );
        Tensor {
            shape,
            storage: Storage::F32(data),
        }
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Tensor::from_f32(shape, vec![0.0; n])
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn dtype(&self) -> DType {
        match self.storage {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
        }
    }

    /// The values as f32 (converting bf16 exactly).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::F32(v) => v.clone(),
            Storage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// A copy in `dtype` (f32 to bf16 rounds to nearest even).
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        let storage = match dtype {
            DType::F32 => Storage::F32(self.to_f32_vec()),
            DType::BF16 => match &self.storage {
                Storage::BF16(v) => Storage::BF16(v.clone()),
                Storage::F32(v) => Storage::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            },
        };
        Tensor {
            shape: self.shape.clone(),
            storage,
        }
    }

    /// Little-endian bytes, the layout safetensors stores.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.storage {
            Storage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        }
    }

    pub fn from_le_bytes(shape: Vec<usize>, dtype: DType, bytes: &[u8]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if bytes.len() != n * dtype.size_bytes() {
            bail!(
                "tensor of shape {shape:?} and dtype {dtype:?} needs {} bytes, found {}",
                n * dtype.size_bytes(),
                bytes.len()
            );
        }
        let storage = match dtype {
            DType::F32 => Storage::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::BF16 => Storage::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
        };
        Ok(Tensor { shape, storage })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_keeps_representable_values() {
        let t = Tensor::from_f32(vec![2, 2], vec![1.0, -2.5, 0.15625, 3.0e5]);
        let b = t.to_dtype(DType::BF16);
        let back = Tensor::from_le_bytes(vec![2, 2], DType::BF16, &b.to_le_bytes()).unwrap();
        assert_eq!(back.to_f32_vec()[..3], [1.0, -2.5, 0.15625]);
        assert!((back.to_f32_vec()[3] - 3.0e5).abs() / 3.0e5 < 1e-2);
    }

    #[test]
    fn wrong_byte_count_is_an_error() {
        assert!(Tensor::from_le_bytes(vec![3], DType::F32, &[0u8; 8]).is_err());
    }
}
