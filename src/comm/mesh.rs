//! The device mesh: named dims `pp, dp_replicate, dp_shard, cp, tp` (TorchTitan's order, `tp`
//! fastest) over the world's ranks, the degrees from `[parallelism]`, and the ranks of each
//! dimension's group and of the flattened groups (data loading and loss over `dp_replicate ×
//! dp_shard`, FSDP over `dp_shard × cp`), and expert parallelism's split of the FSDP group
//! (`expert_groups`).

use anyhow::{bail, Result};

pub const DIMS: [&str; 5] = ["pp", "dp_replicate", "dp_shard", "cp", "tp"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMesh {
    /// Degree of each dim, in `DIMS` order.
    pub degrees: [usize; 5],
    pub world: usize,
}

impl DeviceMesh {
    /// The dimensions above 1, as `dp_shard 2 × tp 2` (`one rank` for none).
    pub fn describe(&self) -> String {
        let dims: Vec<String> = DIMS
            .iter()
            .zip(self.degrees)
            .filter(|(_, n)| *n > 1)
            .map(|(dim, n)| format!("{dim} {n}"))
            .collect();
        match dims.is_empty() {
            true => "one rank".to_string(),
            false => dims.join(" × "),
        }
    }

    /// Resolves `dp_shard = -1` to fill the world and checks that the product is the world size.
    pub fn new(
        pp: usize,
        dp_replicate: usize,
        dp_shard: i64,
        cp: usize,
        tp: usize,
        world: usize,
    ) -> Result<Self> {
        for (name, d) in [
            ("pipeline_parallel_degree", pp),
            ("data_parallel_replicate_degree", dp_replicate),
            ("context_parallel_degree", cp),
            ("tensor_parallel_degree", tp),
        ] {
            if d == 0 {
                bail!("[parallelism] {name} must be at least 1");
            }
        }
        let others = pp * dp_replicate * cp * tp;
        let shard = match dp_shard {
            -1 => {
                if !world.is_multiple_of(others) {
                    bail!("[parallelism] cannot fill data_parallel_shard_degree = -1: world size {world} is not divisible by pp {pp} × dp_replicate {dp_replicate} × cp {cp} × tp {tp} = {others}");
                }
                world / others
            }
            d if d >= 1 => d as usize,
            d => bail!(
                "[parallelism] data_parallel_shard_degree = {d} must be -1 (fill) or at least 1"
            ),
        };
        if others * shard != world {
            bail!(
                "[parallelism] degrees pp {pp} × dp_replicate {dp_replicate} × dp_shard {shard} × cp {cp} × tp {tp} = {} but the world size is {world}; make their product equal the number of processes",
                others * shard
            );
        }
        Ok(DeviceMesh {
            degrees: [pp, dp_replicate, shard, cp, tp],
            world,
        })
    }

    pub fn degree(&self, dim: &str) -> usize {
        self.degrees[Self::index(dim)]
    }

    fn index(dim: &str) -> usize {
        DIMS.iter()
            .position(|d| *d == dim)
            .unwrap_or_else(|| panic!("unknown mesh dim `{dim}` (known: {DIMS:?})"))
    }

    /// Coordinates of `rank` along every dim.
    pub fn coords(&self, rank: usize) -> [usize; 5] {
        let mut c = [0; 5];
        let mut r = rank;
        for i in (0..5).rev() {
            c[i] = r % self.degrees[i];
            r /= self.degrees[i];
        }
        c
    }

    fn rank_of(&self, coords: &[usize; 5]) -> usize {
        coords
            .iter()
            .zip(&self.degrees)
            .fold(0, |acc, (c, d)| acc * d + c)
    }

    /// Ranks of the group through `rank` spanning `dims` (others fixed), in order; a flattened group
    /// when several dims are given. The position of `rank` in the list is its rank in the group.
    pub fn group_ranks(&self, rank: usize, dims: &[&str]) -> Vec<usize> {
        let base = self.coords(rank);
        let idx: Vec<usize> = dims.iter().map(|d| Self::index(d)).collect();
        let size: usize = idx.iter().map(|&i| self.degrees[i]).product();
        (0..size)
            .map(|mut k| {
                let mut c = base;
                for &i in idx.iter().rev() {
                    c[i] = k % self.degrees[i];
                    k /= self.degrees[i];
                }
                self.rank_of(&c)
            })
            .collect()
    }

    /// The dims parameters are sharded over: `dp_shard`, `× cp` with context parallelism (whose
    /// ranks must sum their gradients anyway).
    pub fn shard_dims(&self) -> &'static [&'static str] {
        if self.degree("cp") > 1 {
            &["dp_shard", "cp"]
        } else {
            &["dp_shard"]
        }
    }

    /// The ranks FSDP shards the parameters over (`dp_shard × cp`), None when they stay whole
    /// (the launcher joins a shard group exactly then, and the planner sizes one).
    pub fn fsdp_shard_degree(&self) -> Option<usize> {
        let shard = self.degree("dp_shard") * self.degree("cp");
        (shard > 1).then_some(shard)
    }

    /// Expert parallelism borrows its ranks from the shard group (`dp_shard × cp`, TorchTitan's
    /// dp2ep): the group's ranks, in order, are cut into consecutive runs of `ep`, each run one
    /// expert-parallel group splitting the experts; the ranks at the same place of every run hold
    /// the same experts and shard them with FSDP. Returns the two groups through `rank`: its
    /// expert-parallel group and its expert-shard group (`dp_shard × cp / ep` ranks), each in
    /// order. `ep` must divide the shard group's size.
    pub fn expert_groups(&self, rank: usize, ep: usize) -> (Vec<usize>, Vec<usize>) {
        let shard = self.group_ranks(rank, self.shard_dims());
        let at = shard
            .iter()
            .position(|&r| r == rank)
            .expect("a rank is in its own group");
        assert!(
            ep >= 1 && shard.len().is_multiple_of(ep),
            "expert_groups: ep {ep} does not divide the shard group of {} (checked with the config)",
            shard.len()
        );
        let run = at / ep;
        let ep_ranks = shard[run * ep..(run + 1) * ep].to_vec();
        let expert_shard = shard.iter().skip(at % ep).step_by(ep).copied().collect();
        (ep_ranks, expert_shard)
    }

    /// A stable name for the group through `rank` spanning `dims` (for store keys and messages).
    pub fn group_name(&self, rank: usize, dims: &[&str]) -> String {
        let ranks = self.group_ranks(rank, dims);
        format!(
            "{}[{}]",
            dims.join("+"),
            ranks.first().copied().unwrap_or(0)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_dp_shard_and_checks_the_product() {
        let m = DeviceMesh::new(1, 2, -1, 1, 2, 8).unwrap();
        assert_eq!(m.degree("dp_shard"), 2);
        let e = DeviceMesh::new(1, 2, 3, 1, 1, 8).unwrap_err().to_string();
        assert!(e.contains("= 6") && e.contains("world size is 8"), "{e}");
        let e = DeviceMesh::new(1, 3, -1, 1, 1, 8).unwrap_err().to_string();
        assert!(e.contains("not divisible"), "{e}");
    }

    #[test]
    fn groups_span_their_dims() {
        // world 8 = dp_replicate 2 × dp_shard 2 × tp 2 (tp fastest)
        let m = DeviceMesh::new(1, 2, 2, 1, 2, 8).unwrap();
        assert_eq!(m.group_ranks(5, &["tp"]), vec![4, 5]);
        assert_eq!(m.group_ranks(5, &["dp_shard"]), vec![5, 7]);
        assert_eq!(m.group_ranks(5, &["dp_replicate"]), vec![1, 5]);
        assert_eq!(
            m.group_ranks(5, &["dp_replicate", "dp_shard"]),
            vec![1, 3, 5, 7]
        );
        assert_eq!(m.group_ranks(0, &["dp_shard", "cp"]), vec![0, 2]);
        // Expert parallelism splits dp_shard × cp into runs of ep.
        let e = DeviceMesh::new(1, 1, 2, 2, 1, 4).unwrap();
        assert_eq!(e.group_ranks(3, &["dp_shard", "cp"]), vec![0, 1, 2, 3]);
        assert_eq!(e.expert_groups(3, 2), (vec![2, 3], vec![1, 3]));
        assert_eq!(e.expert_groups(0, 4), (vec![0, 1, 2, 3], vec![0]));
        assert_eq!(e.expert_groups(2, 1), (vec![2], vec![0, 1, 2, 3]));
        // Every rank appears in exactly one group of a dim.
        let mut seen: Vec<usize> = (0..8)
            .flat_map(|r| m.group_ranks(r, &["dp_shard"]))
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 8);
    }
}
