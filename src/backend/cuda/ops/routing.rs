//! A mixture of experts' routing on the GPU (`Backend::moe_route`, `moe_route_backward`,
//! `moe_dispatch_order`, `moe_combine`; kernels in `kernels/routing.cu`): the router's logits,
//! the choice, the dispatch order and the combine stay on the device, ids as u32 values in f32
//! buffers (`backend::routing`). A router of more than 512 experts or a top_k over 32 routes
//! through the host defaults instead (`fits_kernels`).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::{rows_config, CudaBackend, CudaBuf};
use crate::backend::routing::{DispatchOrder, RoutedTokens, RouterArgs, ScoreFunc};
use crate::backend::Backend;

/// The most experts and choices per token the kernels hold per thread (`TITAN_MOE_MAX_EXPERTS`,
/// `TITAN_MOE_MAX_TOP_K` in the source).
const MAX_EXPERTS: usize = 512;
const MAX_TOP_K: usize = 32;
/// Slots per block of the dispatch-order passes (`TITAN_MOE_CHUNK`).
const CHUNK: usize = 1024;
/// Threads per block of the per-token kernels.
const TOKEN_THREADS: usize = 128;

/// Whether the kernels hold a router of `experts` experts choosing `top_k` (a larger one routes
/// through the host defaults).
pub(super) fn fits_kernels(experts: usize, top_k: usize) -> bool {
    experts <= MAX_EXPERTS && (1..=MAX_TOP_K).contains(&top_k)
}

/// One thread per token.
pub(super) fn token_config(tokens: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (tokens.div_ceil(TOKEN_THREADS).max(1) as u32, 1, 1),
        block_dim: (TOKEN_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' router flags: (sigmoid, norm, groups, limited).
fn router_flags(args: &RouterArgs) -> (i32, i32, i32, i32) {
    let (groups, limited) = args.groups.unwrap_or((0, 0));
    (
        (args.score_func == ScoreFunc::Sigmoid) as i32,
        args.norm_topk_prob as i32,
        groups as i32,
        limited as i32,
    )
}

impl CudaBackend {
    pub(super) fn moe_route_untimed(
        &self,
        logits: &Buf,
        bias: Option<&Buf>,
        args: &RouterArgs,
    ) -> RoutedTokens<Buf> {
        let (e, k) = (args.num_experts, args.top_k);
        let tokens = logits.len() / e;
        check_len("moe_route", "logits", logits.len(), tokens * e);
        if let Some(b) = bias {
            check_len("moe_route", "bias", b.len(), e);
        }
        let mut routed = RoutedTokens {
            experts: self.uninit(tokens * k),
            weights: self.uninit(tokens * k),
            scores: self.uninit(tokens * e),
        };
        if tokens > 0 {
            let (sigmoid, norm, groups, limited) = router_flags(args);
            let (t, e, k) = (tokens as i32, e as i32, k as i32);
            let bias = self.address_or_null(bias.map(CudaBuf::data));
            let r = &mut routed;
            launch!(
                self,
                "moe_route",
                token_config(tokens),
                &mut r.experts,
                &mut r.weights,
                &mut r.scores,
                logits,
                &bias,
                &t,
                &e,
                &k,
                &sigmoid,
                &norm,
                &args.route_scale,
                &groups,
                &limited
            );
        }
        routed
    }

    pub(super) fn moe_route_backward_untimed(
        &self,
        args: &RouterArgs,
        (scores, experts): (&Buf, &Buf),
        dweights: &Buf,
        aux_grads: Option<&Buf>,
    ) -> Buf {
        let (e, k) = (args.num_experts, args.top_k);
        let tokens = scores.len() / e;
        check_len("moe_route_backward", "experts", experts.len(), tokens * k);
        check_len("moe_route_backward", "dweights", dweights.len(), tokens * k);
        if let Some(g) = aux_grads {
            check_len("moe_route_backward", "aux_grads", g.len(), tokens * e);
        }
        let mut dlogits = self.uninit(tokens * e);
        if tokens > 0 {
            let (sigmoid, norm, _, _) = router_flags(args);
            let (t, e, k) = (tokens as i32, e as i32, k as i32);
            let aux = self.address_or_null(aux_grads.map(CudaBuf::data));
            launch!(
                self,
                "moe_route_backward",
                token_config(tokens),
                &mut dlogits,
                scores,
                experts,
                dweights,
                &aux,
                &t,
                &e,
                &k,
                &sigmoid,
                &norm,
                &args.route_scale
            );
        }
        dlogits
    }

    pub(super) fn moe_dispatch_order_untimed(
        &self,
        experts: &Buf,
        (num_experts, top_k): (usize, usize),
    ) -> DispatchOrder<Buf> {
        let n = experts.len();
        let chunks = n.div_ceil(CHUNK);
        let mut order = DispatchOrder {
            rows: self.uninit(n),
            slots: self.uninit(n),
            row_of_slot: self.uninit(n),
            offsets: self.uninit(num_experts + 1),
        };
        let mut counts = self.alloc_unzeroed::<u32>(chunks * num_experts);
        let mut bases = self.alloc_unzeroed::<u32>(chunks * num_experts);
        let threads = num_experts.next_multiple_of(32).clamp(32, MAX_EXPERTS) as u32;
        let (n_arg, e, c, k) = (n as i64, num_experts as i32, chunks as i32, top_k as i32);
        if chunks > 0 {
            let per_chunk = rows_config(chunks, threads);
            launch!(
                self,
                "moe_chunk_counts",
                per_chunk,
                &mut counts,
                experts,
                &n_arg,
                &e
            );
        }
        let one = rows_config(1, threads);
        let o = &mut order;
        launch!(
            self,
            "moe_offsets",
            one,
            &mut o.offsets,
            &mut bases,
            &counts,
            &c,
            &e
        );
        if chunks > 0 {
            launch!(
                self,
                "moe_place",
                rows_config(chunks, threads),
                &mut o.rows,
                &mut o.slots,
                &mut o.row_of_slot,
                experts,
                &bases,
                &n_arg,
                &e,
                &k
            );
        }
        order
    }

    pub(super) fn moe_count_load_untimed(&self, counts: &mut Buf, offsets: &Buf, at: usize) {
        let experts = offsets.len().saturating_sub(1);
        assert!(
            counts.len() >= at + experts,
            "moe_count_load: counts hold {} < {at} + {experts}",
            counts.len()
        );
        if experts == 0 {
            return;
        }
        let (at, e) = (at as i64, experts as i32);
        launch!(
            self,
            "moe_count_load",
            token_config(experts),
            counts,
            offsets,
            &at,
            &e
        );
    }

    pub(super) fn moe_combine_untimed(
        &self,
        out: &mut Buf,
        rows: &Buf,
        row_of_slot: &Buf,
        (top_k, width): (usize, usize),
    ) {
        let tokens = out.len() / width.max(1);
        check_len(
            "moe_combine",
            "row_of_slot",
            row_of_slot.len(),
            tokens * top_k,
        );
        check_len("moe_combine", "rows", rows.len(), tokens * top_k * width);
        if tokens == 0 || width == 0 {
            return;
        }
        let (k, w) = (top_k as i32, width as i32);
        let threads = width.next_multiple_of(32).min(256) as u32;
        launch!(
            self,
            "moe_combine",
            rows_config(tokens, threads),
            out,
            rows,
            row_of_slot,
            &k,
            &w
        );
    }
}
