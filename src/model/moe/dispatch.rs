//! Where a mixture-of-experts layer's dispatched rows go and come back from under expert
//! parallelism: the plan of one layer's two all-to-alls (`Dispatch`), made from the rows each rank
//! sends to each expert, and `ExpertRows`, which plans nothing (and downloads nothing) when one
//! rank holds every expert.
//!
//! A rank's dispatched rows are sorted by global expert, so the rows for rank `p` (whose experts
//! are a consecutive run) are consecutive too: the all-to-all sends them as they are. What a rank
//! receives is ordered by source rank, then by its local expert; the experts compute on
//! expert-major rows (one block per expert), so the received rows are permuted to expert order
//! after the all-to-all, and back before the return trip. With one rank both orders are the same
//! and nothing moves.

use anyhow::Result;

use crate::backend::routing::{ids_of_bits, ids_to_bits};
use crate::backend::Backend;
use crate::model::crossings::expert::ExpertParallelOps;

/// One layer's dispatch over the expert-parallel group (its forward's and its backward's: the
/// backward sends the output gradients the way the inputs went).
pub struct Dispatch {
    /// Rows this rank sends to each rank of the group, and receives from each.
    send: Vec<usize>,
    recv: Vec<usize>,
    /// The received rows in expert order: row `i` of the experts' input is received row
    /// `order[i]`, and received row `j` is row `inverse[j]` of it (None: the same order).
    order: Option<Vec<u32>>,
    inverse: Option<Vec<u32>>,
    /// Rows `offsets[x]..offsets[x + 1]` of the experts' input are this rank's local expert `x`'s,
    /// global expert `first_expert + x`.
    pub offsets: Vec<usize>,
    pub first_expert: usize,
}

impl Dispatch {
    /// The plan for a rank sending `counts[e]` rows to each global expert `e` (collective over
    /// the group: every rank calls it for the same layer).
    pub fn plan<B: Backend>(ep: &dyn ExpertParallelOps<B>, counts: &[usize]) -> Result<Self> {
        let (degree, experts) = (ep.degree(), counts.len());
        let per = experts / degree;
        let send: Vec<usize> = counts.chunks(per).map(|c| c.iter().sum()).collect();
        let received = ep.exchange_counts(counts)?;
        let recv: Vec<usize> = received.iter().map(|c| c.iter().sum()).collect();
        let mut offsets = vec![0usize; per + 1];
        for x in 0..per {
            offsets[x + 1] = offsets[x] + received.iter().map(|c| c[x]).sum::<usize>();
        }
        let (order, inverse) = if degree == 1 {
            (None, None)
        } else {
            // Received row of (source s, local expert x) blocks, in source-major order.
            let mut start = vec![vec![0usize; per]; degree];
            let mut at = 0;
            for (s, row) in received.iter().enumerate() {
                for (x, &c) in row.iter().enumerate() {
                    start[s][x] = at;
                    at += c;
                }
            }
            let mut order = Vec::with_capacity(at);
            for x in 0..per {
                for (s, row) in received.iter().enumerate() {
                    order.extend((start[s][x]..start[s][x] + row[x]).map(|j| j as u32));
                }
            }
            let mut inverse = vec![0u32; at];
            for (i, &j) in order.iter().enumerate() {
                inverse[j as usize] = i as u32;
            }
            (Some(order), Some(inverse))
        };
        Ok(Dispatch {
            send,
            recv,
            order,
            inverse,
            offsets,
            first_expert: ep.rank() * per,
        })
    }

    /// Rows the local experts compute on.
    pub fn local_rows(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// This rank's rows (`[_, width]`, sorted by global expert) to their experts' ranks: the
    /// experts' input rows of this rank, in expert order.
    pub fn to_experts<B: Backend>(
        &self,
        be: &B,
        ep: &dyn ExpertParallelOps<B>,
        rows: B::Buf,
        width: usize,
    ) -> Result<B::Buf> {
        let received = ep.all_to_all_rows(be, rows, &self.send, &self.recv, width)?;
        Ok(match &self.order {
            Some(order) => permuted(be, &received, order, width),
            None => received,
        })
    }

    /// The reverse of `to_experts`: the experts' output rows back to the ranks whose tokens they
    /// are, in those ranks' order.
    pub fn from_experts<B: Backend>(
        &self,
        be: &B,
        ep: &dyn ExpertParallelOps<B>,
        rows: B::Buf,
        width: usize,
    ) -> Result<B::Buf> {
        let rows = match &self.inverse {
            Some(inverse) => permuted(be, &rows, inverse, width),
            None => rows,
        };
        ep.all_to_all_rows(be, rows, &self.recv, &self.send, width)
    }
}

/// Where a layer's dispatched rows are computed: on this rank (one expert-parallel rank: nothing
/// moves, and the experts read the dispatch order's offsets where the backend keeps them), or by
/// their experts' ranks (`Dispatch`, with the local experts' offsets uploaded for their GEMMs).
pub enum ExpertRows<B: Backend> {
    Here,
    Group(Dispatch, B::Buf),
}

impl<B: Backend> ExpertRows<B> {
    /// The plan for the rows the dispatch order `offsets` (`[experts + 1]`, u32 bits) groups by
    /// expert: under expert parallelism their counts come to the host (they size the all-to-alls).
    pub fn plan(be: &B, ep: &dyn ExpertParallelOps<B>, offsets: &B::Buf) -> Result<Self> {
        if ep.degree() == 1 {
            return Ok(ExpertRows::Here);
        }
        let offsets = ids_of_bits(&be.download(offsets));
        let counts: Vec<usize> = offsets.windows(2).map(|w| (w[1] - w[0]) as usize).collect();
        let dispatch = Dispatch::plan(ep, &counts)?;
        let local: Vec<u32> = dispatch.offsets.iter().map(|&o| o as u32).collect();
        let local = be.upload_owned(ids_to_bits(&local));
        Ok(ExpertRows::Group(dispatch, local))
    }

    /// The local experts' offsets into their input rows (u32 bits): the dispatch order's when
    /// the rows stay here.
    pub fn offsets<'a>(&'a self, order_offsets: &'a B::Buf) -> &'a B::Buf {
        match self {
            ExpertRows::Here => order_offsets,
            ExpertRows::Group(_, local) => local,
        }
    }

    /// The first local expert's global id.
    pub fn first_expert(&self) -> usize {
        match self {
            ExpertRows::Here => 0,
            ExpertRows::Group(d, _) => d.first_expert,
        }
    }

    /// How many of a layer's `total` experts are this rank's.
    pub fn local_experts(&self, total: usize) -> usize {
        match self {
            ExpertRows::Here => total,
            ExpertRows::Group(d, _) => d.offsets.len() - 1,
        }
    }

    /// Rows the local experts compute on, of `dispatched` this rank sent.
    pub fn local_rows(&self, dispatched: usize) -> usize {
        match self {
            ExpertRows::Here => dispatched,
            ExpertRows::Group(d, _) => d.local_rows(),
        }
    }

    /// The local experts' blocks of rows on the host, (first row, count) each (a download of the
    /// dispatch order's offsets when the rows stay here).
    pub fn host_blocks(&self, be: &B, order_offsets: &B::Buf) -> Vec<(usize, usize)> {
        let offsets: Vec<usize> = match self {
            ExpertRows::Here => ids_of_bits(&be.download(order_offsets))
                .into_iter()
                .map(|o| o as usize)
                .collect(),
            ExpertRows::Group(d, _) => d.offsets.clone(),
        };
        offsets.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
    }

    /// `Dispatch::to_experts`, or the rows as they are.
    pub fn to_experts(
        &self,
        be: &B,
        ep: &dyn ExpertParallelOps<B>,
        rows: B::Buf,
        width: usize,
    ) -> Result<B::Buf> {
        self.through(rows, |d, rows| d.to_experts(be, ep, rows, width))
    }

    /// `Dispatch::from_experts`, or the rows as they are.
    pub fn from_experts(
        &self,
        be: &B,
        ep: &dyn ExpertParallelOps<B>,
        rows: B::Buf,
        width: usize,
    ) -> Result<B::Buf> {
        self.through(rows, |d, rows| d.from_experts(be, ep, rows, width))
    }

    /// `rows` through `trip` under expert parallelism, as they are otherwise.
    fn through(
        &self,
        rows: B::Buf,
        trip: impl FnOnce(&Dispatch, B::Buf) -> Result<B::Buf>,
    ) -> Result<B::Buf> {
        match self {
            ExpertRows::Here => Ok(rows),
            ExpertRows::Group(d, _) => trip(d, rows),
        }
    }
}

/// Row `i` of the result is row `from[i]` of `rows`.
fn permuted<B: Backend>(be: &B, rows: &B::Buf, from: &[u32], width: usize) -> B::Buf {
    let mut out = be.uninit(from.len() * width);
    if !from.is_empty() {
        be.embedding_forward(&mut out, rows, from, width);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// Rank 1 of two: the other rank's counts are given, and the all-to-all returns what the
    /// test says arrived.
    struct TwoRanks {
        theirs: Vec<usize>,
        arrived: Vec<f32>,
    }

    impl ExpertParallelOps<CpuBackend> for TwoRanks {
        fn degree(&self) -> usize {
            2
        }
        fn rank(&self) -> usize {
            1
        }
        fn exchange_counts(&self, counts: &[usize]) -> Result<Vec<Vec<usize>>> {
            Ok(vec![self.theirs[2..].to_vec(), counts[2..].to_vec()])
        }
        fn all_to_all_rows(
            &self,
            _be: &CpuBackend,
            rows: Vec<f32>,
            _send: &[usize],
            _recv: &[usize],
            _width: usize,
        ) -> Result<Vec<f32>> {
            assert_eq!(rows.len(), 7, "the forward's trip only");
            Ok(self.arrived.clone())
        }
    }

    #[test]
    fn received_rows_go_to_expert_order_and_back() {
        // Four experts over two ranks: rank 1 holds experts 2 and 3. Rank 0 sends it one row for
        // expert 2 and two for expert 3; rank 1 keeps two for expert 2 and one for expert 3.
        let ep = TwoRanks {
            theirs: vec![5, 5, 1, 2],
            // Source-major: rank 0's (e2: 10), (e3: 11, 12); rank 1's (e2: 20, 21), (e3: 22).
            arrived: vec![10.0, 11.0, 12.0, 20.0, 21.0, 22.0],
        };
        let be = CpuBackend::new();
        let plan = Dispatch::plan::<CpuBackend>(&ep, &[4, 0, 2, 1]).unwrap();
        assert_eq!(plan.send, [4, 3]);
        assert_eq!(plan.recv, [3, 3]);
        assert_eq!(plan.offsets, [0, 3, 6]);
        let local = plan.to_experts(&be, &ep, vec![0.0; 7], 1).unwrap();
        assert_eq!(local, [10.0, 20.0, 21.0, 11.0, 12.0, 22.0]);
        // Back in source-major order before the return trip.
        let back = permuted(&be, &local, plan.inverse.as_ref().unwrap(), 1);
        assert_eq!(back, ep.arrived);
    }
}
