//! How the model is cut into pipeline stages: contiguous runs of whole blocks, the first stage
//! also holding the token embedding, the last the final norm, the output projection and the loss.
//!
//! By default the cut balances weight the way TorchTitan does: the embedding and the output each
//! count as one block, and the `n_layers + 2` units are shared out as evenly as contiguous runs
//! allow (the earlier stages take the extra unit). `pipeline_parallel_split_points` (the names of
//! the blocks that start stages 1, 2, …, e.g. `layers.2`) or `pipeline_parallel_layers_per_stage`
//! fix the cut instead.

use anyhow::{bail, Result};

/// One stage: blocks `blocks.start..blocks.end`, and whether it holds the embedding (first stage)
/// and the head (last stage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub blocks: std::ops::Range<usize>,
    pub embedding: bool,
    pub head: bool,
}

/// Every stage of the model, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSplit {
    pub stages: Vec<Stage>,
}

impl StageSplit {
    /// `n_stages` stages over `n_layers` blocks, balanced by units (embedding, blocks, output).
    pub fn balanced(n_layers: usize, n_stages: usize) -> Result<Self> {
        let units = n_layers + 2;
        if n_stages == 0 || n_stages > units {
            bail!("[parallelism] {n_stages} pipeline stages cannot split a model of {n_layers} blocks: each stage needs a block, the embedding or the output (at most {units} stages); use fewer stages per rank or a lower pipeline_parallel_degree");
        }
        // Unit boundaries: stage k takes units [starts[k], starts[k+1]).
        let starts: Vec<usize> = (0..=n_stages)
            .map(|k| k * (units / n_stages) + k.min(units % n_stages))
            .collect();
        Ok(Self::from_unit_bounds(n_layers, &starts))
    }

    /// Stages starting at the named blocks (`layers.N`), the first at the embedding.
    pub fn at_split_points(n_layers: usize, points: &[String]) -> Result<Self> {
        let mut starts = vec![0usize];
        for p in points {
            let block = p
                .strip_prefix("layers.")
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n < n_layers);
            let Some(block) = block else {
                bail!("[parallelism] pipeline_parallel_split_points: `{p}` names no block (expected layers.N with N below n_layers = {n_layers})");
            };
            // Unit of block N is N + 1 (unit 0 is the embedding).
            let unit = block + 1;
            if unit <= *starts.last().expect("starts holds 0") {
                bail!("[parallelism] pipeline_parallel_split_points must name increasing blocks after layers.0: `{p}` does not follow the previous point");
            }
            starts.push(unit);
        }
        starts.push(n_layers + 2);
        Ok(Self::from_unit_bounds(n_layers, &starts))
    }

    /// Stages of `per_stage` units each (the last may hold fewer).
    pub fn layers_per_stage(n_layers: usize, per_stage: usize) -> Result<Self> {
        if per_stage == 0 {
            bail!("[parallelism] pipeline_parallel_layers_per_stage must be at least 1");
        }
        let units = n_layers + 2;
        let mut starts: Vec<usize> = (0..units).step_by(per_stage).collect();
        starts.push(units);
        Ok(Self::from_unit_bounds(n_layers, &starts))
    }

    fn from_unit_bounds(n_layers: usize, starts: &[usize]) -> Self {
        let units = n_layers + 2;
        let stages = starts
            .windows(2)
            .map(|w| {
                // Units 1..=n_layers are the blocks.
                let first = w[0].clamp(1, n_layers + 1) - 1;
                let end = w[1].clamp(1, n_layers + 1) - 1;
                Stage {
                    blocks: first..end.max(first),
                    embedding: w[0] == 0,
                    head: w[1] == units,
                }
            })
            .collect();
        StageSplit { stages }
    }

    pub fn len(&self) -> usize {
        self.stages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// The stage running block `l`.
    pub fn stage_of_block(&self, l: usize) -> usize {
        self.stages
            .iter()
            .position(|s| s.blocks.contains(&l))
            .expect("every block is in a stage")
    }

    /// One line per stage, for the start of a run.
    pub fn describe(&self, placement: &[usize]) -> String {
        self.stages
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let mut parts = Vec::new();
                if s.embedding {
                    parts.push("embedding".to_string());
                }
                if !s.blocks.is_empty() {
                    parts.push(format!("blocks {}..{}", s.blocks.start, s.blocks.end - 1));
                }
                if s.head {
                    parts.push("norm, output, loss".to_string());
                }
                format!(
                    "stage {k} on pipeline rank {}: {}",
                    placement[k],
                    parts.join(", ")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(s: &StageSplit) -> Vec<(usize, usize, bool, bool)> {
        s.stages
            .iter()
            .map(|x| (x.blocks.start, x.blocks.end, x.embedding, x.head))
            .collect()
    }

    #[test]
    fn the_embedding_and_the_output_weigh_a_block() {
        // 2 blocks, 2 stages: embedding + block 0 | block 1 + output.
        let s = StageSplit::balanced(2, 2).unwrap();
        assert_eq!(blocks(&s), [(0, 1, true, false), (1, 2, false, true)]);
        // 2 blocks, 4 stages: one unit each.
        let s = StageSplit::balanced(2, 4).unwrap();
        assert_eq!(
            blocks(&s),
            [
                (0, 0, true, false),
                (0, 1, false, false),
                (1, 2, false, false),
                (2, 2, false, true)
            ]
        );
        // 6 blocks, 3 stages of 8 units: 3, 3, 2.
        let s = StageSplit::balanced(6, 3).unwrap();
        assert_eq!(
            blocks(&s),
            [
                (0, 2, true, false),
                (2, 5, false, false),
                (5, 6, false, true)
            ]
        );
        assert_eq!(s.stage_of_block(4), 1);
        let e = StageSplit::balanced(2, 5).unwrap_err().to_string();
        assert!(e.contains("at most 4 stages"), "{e}");
    }

    #[test]
    fn split_points_and_layers_per_stage_fix_the_cut() {
        let s = StageSplit::at_split_points(4, &["layers.2".into()]).unwrap();
        assert_eq!(blocks(&s), [(0, 2, true, false), (2, 4, false, true)]);
        let e = StageSplit::at_split_points(4, &["layers.9".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`layers.9` names no block"), "{e}");
        let s = StageSplit::layers_per_stage(4, 3).unwrap();
        assert_eq!(blocks(&s), [(0, 2, true, false), (2, 4, false, true)]);
    }
}
