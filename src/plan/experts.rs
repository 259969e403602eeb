//! A mixture of experts' GEMMs on a GPU beyond their FLOP count (issue 45's grouped-GEMM term):
//! each routed expert multiplies only the rows routed to it, so a microbatch's expert GEMMs are
//! many small ones. Two costs follow from that, both from the device's datasheet rather than a
//! fitted constant:
//!
//! - **Tiles**: a GPU GEMM computes whole tiles of output rows (`GroupedGemm::tile_rows`, 128 for
//!   cuBLAS's and CUTLASS's Hopper grouped kernels), so an expert with `r` rows costs
//!   `⌈r / 128⌉ · 128` rows of FLOPs.
//! - **Weights**: each expert's weights are read from memory once per GEMM, so an expert with few
//!   rows is bound by that read, `3·dim·hidden·bytes / bandwidth`, not by its FLOPs.
//!
//! An expert's forward is `max(tile FLOPs / rate, weight bytes / bandwidth)`; what exceeds the
//! FLOP count's `r` rows is added per MoE block and microbatch, twice more in the backward (its
//! input- and weight-gradient GEMMs have the same shapes) and again for a recompute. The rows
//! per expert are the mean (`tokens · top_k · ep / experts` on each rank): load imbalance is not
//! modelled. Expert parallelism raises the rows per expert (each rank's experts see the whole EP
//! group's tokens), which is why it pays on GPUs beyond the memory it saves. On CPU ranks the
//! calibrated `moe_efficiency` stands for all of this (`GroupedGemm` is None).

use super::cost::Weighing;

impl Weighing<'_> {
    /// Seconds a microbatch's forward spends in its routed experts' GEMMs beyond their FLOP
    /// count, on one rank at `rate` FLOP/s (0 without experts or without a `GroupedGemm`).
    pub(super) fn grouped_gemm_extra_s(&self, rate: f64, mb_tokens: f64) -> f64 {
        let Some(g) = self.device.grouped_gemm else {
            return 0.0;
        };
        let l = self.layout;
        let blocks = (0..self.args.n_layers).filter_map(|i| self.args.moe_at(i));
        let per_block = blocks.map(|moe| {
            let experts = moe.router.num_experts as f64;
            let local_experts = experts / l.ep as f64;
            let rows =
                mb_tokens / (l.tp * l.cp) as f64 * moe.router.top_k as f64 * l.ep as f64 / experts;
            let params = 3.0 * (self.args.dim * moe.hidden) as f64;
            let counted = 2.0 * rows * params / rate;
            let tiles = 2.0 * (rows / g.tile_rows).ceil() * g.tile_rows * params / rate;
            let weights = params * self.device.wire_bytes as f64 / g.weight_bytes_per_s;
            local_experts * (tiles.max(weights) - counted).max(0.0)
        });
        per_block.sum::<f64>() / l.pp as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::device::gpu;
    use crate::plan::layout::{AcChoice, Layout};

    fn layout(ep: usize, microbatch: usize) -> Layout {
        Layout {
            pp: 1,
            dp_replicate: 1,
            dp_shard: 8,
            cp: 1,
            tp: 1,
            ep,
            schedule: None,
            microbatch_size: microbatch,
            local_batch: microbatch,
            ac: AcChoice::None,
        }
    }

    fn extra(
        args: &crate::model::ModelArgs,
        device: &crate::plan::device::Device,
        l: &Layout,
        seq: usize,
    ) -> f64 {
        Weighing {
            layout: l,
            args,
            seq,
            accum: 1,
            device,
            world: 8,
            pipeline: None,
            async_tp: false,
            float8_params: 0.0,
        }
        .grouped_gemm_extra_s(device.compute.flops_per_s, (l.microbatch_size * seq) as f64)
    }

    #[test]
    fn few_rows_per_expert_cost_their_weight_reads_and_expert_parallelism_recovers_them() {
        // DeepSeek-V3 671B: 256 experts, 8 per token, hidden 2048 at dim 7168.
        let args = crate::model::families::deepseek_v3::flavors::flavor("671B").unwrap();
        let h100 = gpu("h100").unwrap();
        let g = h100.grouped_gemm.unwrap();
        let moe = args.moe.unwrap();
        let blocks = (0..args.n_layers)
            .filter(|&i| args.moe_at(i).is_some())
            .count() as f64;
        let params = 3.0 * (args.dim * moe.hidden) as f64;
        // One sequence of 1024 tokens: 32 rows per expert, a quarter tile, bound by the weights.
        let one = extra(&args, &h100, &layout(1, 1), 1024);
        let weights = params * 2.0 / g.weight_bytes_per_s;
        let rate = h100.compute.flops_per_s;
        assert!(2.0 * 128.0 * params / rate < weights);
        let want = blocks * 256.0 * (weights - 2.0 * 32.0 * params / rate);
        assert!((one - want).abs() < 1e-9 * want, "{one} vs {want}");
        // EP 8: each rank's 32 experts see 256 rows, two whole tiles, above the weights' read.
        assert!(2.0 * 256.0 * params / rate > weights);
        assert_eq!(extra(&args, &h100, &layout(8, 1), 1024), 0.0);
        // A dense model, and CPU ranks (their calibrated MoE efficiency covers it), add nothing.
        let dense = crate::model::families::llama3::flavor("8B").unwrap();
        assert_eq!(extra(&dense, &h100, &layout(1, 1), 1024), 0.0);
        let mut cpu = h100.clone();
        cpu.grouped_gemm = None;
        assert_eq!(extra(&args, &cpu, &layout(1, 1), 1024), 0.0);
    }

    #[test]
    fn a_partial_tile_costs_the_whole_tile() {
        // Qwen3-MoE 30B-A3B: 128 experts, 8 per token. 8192 tokens: 512 rows per expert, whole
        // tiles; 8192 + 1024 tokens: 576 rows, five tiles where 4.5 are counted.
        let args = crate::model::families::qwen3::flavors::flavor("30B-A3B").unwrap();
        let h100 = gpu("h100").unwrap();
        assert_eq!(extra(&args, &h100, &layout(1, 1), 8192), 0.0);
        let partial = extra(&args, &h100, &layout(1, 1), 9216);
        let moe = args.moe.unwrap();
        let params = 3.0 * (args.dim * moe.hidden) as f64;
        let want = args.n_layers as f64 * 128.0 * 2.0 * 64.0 * params / h100.compute.flops_per_s;
        assert!((partial - want).abs() < 1e-9 * want, "{partial} vs {want}");
    }
}
