//! The mixture-of-experts ops' host defaults (`Backend::moe_route`, `moe_route_backward`,
//! `moe_dispatch_order`, `moe_combine`, `moe_count_load`): download, `routing`'s math, upload. A backend that keeps
//! the routing on its device overrides them; the CPU's run the same math without the copies.

use super::routing::{self, ids_of_bits, ids_to_bits, DispatchOrder, RoutedTokens, RouterArgs};
use super::Backend;

pub(super) fn route<B: Backend + ?Sized>(
    be: &B,
    logits: &B::Buf,
    bias: Option<&B::Buf>,
    args: &RouterArgs,
) -> RoutedTokens<B::Buf> {
    let bias = bias.map(|b| be.download(b));
    let r = routing::route(args, &be.download(logits), bias.as_deref());
    RoutedTokens {
        experts: be.upload_owned(ids_to_bits(&r.experts)),
        weights: be.upload_owned(r.weights),
        scores: be.upload_owned(r.scores),
    }
}

pub(super) fn route_backward<B: Backend + ?Sized>(
    be: &B,
    args: &RouterArgs,
    (scores, experts): (&B::Buf, &B::Buf),
    dweights: &B::Buf,
    aux_grads: Option<&B::Buf>,
) -> B::Buf {
    let (scores, chosen) = (be.download(scores), ids_of_bits(&be.download(experts)));
    let aux = aux_grads.map(|g| be.download(g));
    let dw = be.download(dweights);
    be.upload_owned(routing::route_backward(
        args,
        (&scores, &chosen),
        &dw,
        aux.as_deref(),
    ))
}

pub(super) fn dispatch_order<B: Backend + ?Sized>(
    be: &B,
    experts: &B::Buf,
    (num_experts, top_k): (usize, usize),
) -> DispatchOrder<B::Buf> {
    let experts = ids_of_bits(&be.download(experts));
    routing::dispatch_order(&experts, num_experts, top_k)
        .map(|ids| be.upload_owned(ids_to_bits(&ids)))
}

pub(super) fn combine<B: Backend + ?Sized>(
    be: &B,
    out: &mut B::Buf,
    rows: &B::Buf,
    row_of_slot: &B::Buf,
    (top_k, width): (usize, usize),
) {
    let mut host = be.download(out);
    let order = ids_of_bits(&be.download(row_of_slot));
    routing::combine(&mut host, &be.download(rows), &order, top_k, width);
    *out = be.upload_owned(host);
}

pub(super) fn count_load<B: Backend + ?Sized>(
    be: &B,
    counts: &mut B::Buf,
    offsets: &B::Buf,
    at: usize,
) {
    let mut host = be.download(counts);
    routing::count_load(&mut host, &ids_of_bits(&be.download(offsets)), at);
    *counts = be.upload_owned(host);
}
