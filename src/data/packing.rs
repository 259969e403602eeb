//! How documents become training samples (`[training] packing`, TorchTitan's packing configs):
//! `concat_then_split` (the default) cuts the concatenated `[BOS] doc [EOS]` stream into windows
//! of `seq_len + 1` tokens, so a document may continue in the next sample; `first_fit` puts whole
//! documents into samples, each into the first sample with room for it (first-fit bin packing),
//! and pads what is left with `IGNORE_INDEX` tokens, whose targets count for nothing and whose
//! inputs embed as zeros. A document longer than a sample is truncated to one (with a warning),
//! as a packer that never splits a document must.

use anyhow::{bail, Result};

use crate::backend::IGNORE_INDEX;

/// The values `[training] packing` accepts.
pub const PACKINGS: &[&str] = &["concat_then_split", "first_fit"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    ConcatThenSplit,
    FirstFit,
}

impl Packing {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "concat_then_split" => Ok(Packing::ConcatThenSplit),
            "first_fit" => Ok(Packing::FirstFit),
            other => bail!(
                "[training] packing = `{other}` is not known (accepted: {})",
                PACKINGS.join(", ")
            ),
        }
    }
}

/// Samples being filled by first-fit: `bins` samples of `capacity` tokens each.
pub struct FirstFitBins {
    capacity: usize,
    bins: Vec<Vec<u32>>,
}

impl FirstFitBins {
    pub fn new(bins: usize, capacity: usize) -> Self {
        FirstFitBins {
            capacity,
            bins: vec![Vec::with_capacity(capacity); bins],
        }
    }

    /// Puts `doc` (at most `capacity` tokens) into the first sample with room for it; false when
    /// none has room (the samples are then complete).
    pub fn place(&mut self, doc: &[u32]) -> bool {
        debug_assert!(
            doc.len() <= self.capacity,
            "truncate documents to a sample first"
        );
        match self
            .bins
            .iter_mut()
            .find(|b| b.len() + doc.len() <= self.capacity)
        {
            Some(bin) => {
                bin.extend_from_slice(doc);
                true
            }
            None => false,
        }
    }

    /// Every sample, padded with `IGNORE_INDEX` to `capacity` tokens, in order.
    pub fn into_samples(self) -> Vec<Vec<u32>> {
        let capacity = self.capacity;
        self.bins
            .into_iter()
            .map(|mut b| {
                b.resize(capacity, IGNORE_INDEX);
                b
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_go_whole_into_the_first_sample_with_room() {
        let mut bins = FirstFitBins::new(2, 6);
        assert!(bins.place(&[1, 2, 3, 4]));
        assert!(bins.place(&[5, 6, 7])); // no room in the first: the second
        assert!(bins.place(&[8, 9])); // fits the first exactly
        assert!(bins.place(&[10])); // the second
        assert!(!bins.place(&[11, 12, 13])); // no room anywhere: the samples are complete
        let x = IGNORE_INDEX;
        assert_eq!(
            bins.into_samples(),
            vec![vec![1, 2, 3, 4, 8, 9], vec![5, 6, 7, 10, x, x]]
        );
    }

    #[test]
    fn packing_names_are_torchtitans_and_others_are_refused() {
        assert_eq!(Packing::parse("first_fit").unwrap(), Packing::FirstFit);
        let err = Packing::parse("best_fit").unwrap_err().to_string();
        assert!(err.contains("concat_then_split, first_fit"), "{err}");
    }
}
