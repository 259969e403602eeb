//! Distributed Muon's traffic: each weight matrix orthogonalised once per step, by one rank, for
//! every rank that holds a piece of it.
//!
//! Muon's Newton–Schulz iteration needs each matrix whole, while FSDP/HSDP shard it (flat ranges
//! of a tensor-parallel part), tensor parallelism splits it by rows or columns, expert
//! parallelism places each expert on some ranks, and a pipeline rank holds its stages alone. A
//! rank describes the pieces it holds (`Piece`: which matrix, which tensor-parallel part, which
//! flat range); the descriptions are gathered once, and every rank derives the same plan from
//! them: each matrix gets an owner among its holders (largest matrices first, each to the holder
//! with the least Newton–Schulz work so far: the work is spread, never repeated), and one holder
//! of each distinct piece (replicas hold the same ones) sends it. A step is then two
//! all-to-alls over the job: the pieces to their matrices' owners, which assemble and
//! orthogonalise them, and each holder's piece of the result back (TorchTitan's `dist_muon`
//! and PyTorch's distributed-Muon design: gather to one rank, orthogonalise, scatter).
//!
//! The pieces are packed and unpacked on the backend's buffers; the all-to-alls run on the job
//! group's device communicator when it carries one (NCCL between GPUs, attached for Muon jobs:
//! `launch::device_groups`), else through the host transport.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::backend::Backend;
use crate::comm::device_group::all_to_all_on;
use crate::comm::group::ProcessGroup;
use crate::model::params::TpSharding;

/// A rank's piece of one matrix: the flat range `[lo, hi)` of its tensor-parallel part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The matrix: its index in the model's `param_specs`.
    pub matrix: usize,
    pub split: TpSharding,
    pub tp_rank: usize,
    pub tp_parts: usize,
    pub lo: usize,
    pub hi: usize,
}

impl Piece {
    /// What distinguishes the piece's values: replicas (and the tensor-parallel ranks of a
    /// replicated matrix) hold the same.
    fn identity(&self) -> (usize, usize, usize) {
        let part = match self.split {
            TpSharding::Replicated => 0,
            _ => self.tp_rank,
        };
        (part, self.lo, self.hi)
    }

    /// Where value `k` of the piece's part sits in the whole `[rows, cols]` matrix: calls `run`
    /// with (offset in the piece, offset in the matrix, length) for each contiguous run.
    fn runs(&self, [rows, cols]: [usize; 2], mut run: impl FnMut(usize, usize, usize)) {
        match self.split {
            TpSharding::Replicated => run(0, self.lo, self.hi - self.lo),
            TpSharding::Rows => {
                let part_start = self.tp_rank * (rows / self.tp_parts) * cols;
                run(0, part_start + self.lo, self.hi - self.lo)
            }
            TpSharding::Columns => {
                let width = cols / self.tp_parts;
                let mut k = self.lo;
                while k < self.hi {
                    let (row, col) = (k / width, k % width);
                    let len = (width - col).min(self.hi - k);
                    run(k - self.lo, row * cols + self.tp_rank * width + col, len);
                    k += len;
                }
            }
        }
    }

    const WORDS: usize = 12;

    /// The piece as f32 words exact in transit: each number as two 20-bit halves.
    fn encode(&self) -> [f32; Self::WORDS] {
        let split = match self.split {
            TpSharding::Replicated => 0,
            TpSharding::Rows => 1,
            TpSharding::Columns => 2,
        };
        let numbers = [
            self.matrix,
            split,
            self.tp_rank,
            self.tp_parts,
            self.lo,
            self.hi,
        ];
        let mut out = [0f32; Self::WORDS];
        for (n, x) in numbers.iter().enumerate() {
            out[2 * n] = (x & 0xF_FFFF) as f32;
            out[2 * n + 1] = (x >> 20) as f32;
        }
        out
    }

    fn decode(w: &[f32]) -> Self {
        let n = |i: usize| w[2 * i] as usize | ((w[2 * i + 1] as usize) << 20);
        Piece {
            matrix: n(0),
            split: match n(1) {
                1 => TpSharding::Rows,
                2 => TpSharding::Columns,
                _ => TpSharding::Replicated,
            },
            tp_rank: n(2),
            tp_parts: n(3),
            lo: n(4),
            hi: n(5),
        }
    }
}

/// A matrix this rank orthogonalises.
struct Owned {
    shape: [usize; 2],
}

/// One piece on its way: between this rank and `peer`, of owned matrix / local slot `at`.
#[derive(Debug, Clone, Copy)]
struct Transfer {
    peer: usize,
    matrix: usize,
    at: usize,
    piece: Piece,
}

/// The plan every rank derived from the same descriptions (see the module doc).
pub struct MuonExchange {
    group: Arc<dyn ProcessGroup>,
    /// The length of each local slot's buffer (a shard is padded past its piece).
    slot_len: Vec<usize>,
    owned: Vec<Owned>,
    /// The pieces to their matrices' owners.
    gather: Legs,
    /// The owners' results to every holder.
    scatter: Legs,
}

/// One all-to-all's transfers as this rank sees them, sorted by peer then matrix (the order both
/// ends pack and unpack in).
#[derive(Default)]
struct Legs {
    send: Vec<Transfer>,
    recv: Vec<Transfer>,
}

impl Legs {
    /// A piece of `matrix` going from rank `from` (its slot or owned matrix `at`) to rank `to`
    /// (into its `at`): this rank's send or receive, if either.
    fn add(
        &mut self,
        me: usize,
        (from, from_at): (usize, usize),
        (to, to_at): (usize, usize),
        matrix: usize,
        piece: Piece,
    ) {
        let transfer = |peer, at| Transfer {
            peer,
            matrix,
            at,
            piece,
        };
        if from == me {
            self.send.push(transfer(to, from_at));
        }
        if to == me {
            self.recv.push(transfer(from, to_at));
        }
    }
}

/// The pieces a rank holds and what the plan needs to know of the model.
pub struct ExchangeInputs<'a> {
    pub group: Arc<dyn ProcessGroup>,
    /// Each local slot's piece (None: a shard holding only padding) and buffer length.
    pub slots: Vec<(Option<Piece>, usize)>,
    /// Every matrix's whole shape, by its index in `param_specs` (None: not Muon's).
    pub shapes: &'a [Option<[usize; 2]>],
    pub names: &'a [String],
    /// The Newton–Schulz cost of a `[rows, cols]` matrix, to spread the work by.
    pub cost: &'a dyn Fn(usize, usize) -> f64,
}

impl MuonExchange {
    /// Gathers every rank's pieces over `group` (collective) and derives the plan.
    pub fn new(inputs: ExchangeInputs<'_>) -> Result<Self> {
        let all = gather_pieces(inputs.group.as_ref(), &inputs.slots)?;
        let me = inputs.group.rank();
        let mut by_matrix: BTreeMap<usize, Vec<(usize, Piece)>> = BTreeMap::new();
        for (rank, pieces) in all.iter().enumerate() {
            for p in pieces {
                let Some(Some(_)) = inputs.shapes.get(p.matrix) else {
                    bail!("Muon: rank {rank} describes a piece of tensor #{} that is not a matrix Muon updates (ranks disagree on the model)", p.matrix);
                };
                by_matrix.entry(p.matrix).or_default().push((rank, *p));
            }
        }
        let owners = assign_owners(&by_matrix, inputs.shapes, inputs.cost, all.len());
        let slot_of: BTreeMap<usize, usize> = inputs
            .slots
            .iter()
            .enumerate()
            .filter_map(|(s, (p, _))| p.map(|p| (p.matrix, s)))
            .collect();
        let mut plan = MuonExchange {
            group: inputs.group.clone(),
            slot_len: inputs.slots.iter().map(|(_, len)| *len).collect(),
            owned: Vec::new(),
            gather: Legs::default(),
            scatter: Legs::default(),
        };
        for (&m, holders) in &by_matrix {
            let shape = inputs.shapes[m].expect("checked above");
            let owner = owners[&m];
            let sources = choose_sources(holders, owner);
            if !covers(shape, sources.iter().map(|(_, p)| p)) {
                bail!("Muon: the ranks' pieces of {} do not cover its {shape:?} values exactly (a titan bug)", inputs.names[m]);
            }
            let owned_at = plan.owned.len();
            if owner == me {
                plan.owned.push(Owned { shape });
            }
            // This rank's slot of the matrix (used only where it holds a piece of it).
            let slot = slot_of.get(&m).copied().unwrap_or(usize::MAX);
            for &(source, piece) in &sources {
                plan.gather
                    .add(me, (source, slot), (owner, owned_at), m, piece);
            }
            for &(holder, piece) in holders {
                plan.scatter
                    .add(me, (owner, owned_at), (holder, slot), m, piece);
            }
        }
        for legs in [&mut plan.gather, &mut plan.scatter] {
            legs.send.sort_by_key(|t| (t.peer, t.matrix));
            legs.recv.sort_by_key(|t| (t.peer, t.matrix));
        }
        Ok(plan)
    }

    /// Replaces every slot's piece (`updates`, laid out as the slots) by its piece of the
    /// orthogonalised matrix: the pieces go to their owners, each owner runs `orthogonalize` on
    /// its whole matrices, and the results come back (two all-to-alls; collective over the
    /// group).
    pub fn orthogonalize<B: Backend>(
        &self,
        be: &B,
        updates: &mut [B::Buf],
        orthogonalize: &mut dyn FnMut(&mut B::Buf, usize, usize),
    ) -> Result<()> {
        let received = self.all_to_all(be, &self.gather, |t, send, at| {
            be.copy_range(send, at, &updates[t.at], 0, t.piece.hi - t.piece.lo)
        })?;
        let mut whole: Vec<B::Buf> = self
            .owned
            .iter()
            .map(|o| be.zeros(o.shape[0] * o.shape[1]))
            .collect();
        let mut at = 0;
        for t in &self.gather.recv {
            let matrix = &mut whole[t.at];
            t.piece.runs(self.owned[t.at].shape, |from, to, len| {
                be.copy_range(matrix, to, &received, at + from, len)
            });
            at += t.piece.hi - t.piece.lo;
        }
        for (values, o) in whole.iter_mut().zip(&self.owned) {
            orthogonalize(values, o.shape[0], o.shape[1]);
        }
        let received = self.all_to_all(be, &self.scatter, |t, send, at| {
            t.piece.runs(self.owned[t.at].shape, |from, to, len| {
                be.copy_range(send, at + from, &whole[t.at], to, len)
            });
        })?;
        for (u, &len) in updates.iter_mut().zip(&self.slot_len) {
            *u = be.zeros(len);
        }
        let mut at = 0;
        for t in &self.scatter.recv {
            let len = t.piece.hi - t.piece.lo;
            be.copy_range(&mut updates[t.at], 0, &received, at, len);
            at += len;
        }
        Ok(())
    }

    /// One all-to-all of `legs` on `B`'s buffers: `fill` copies each sent transfer's values into
    /// the send buffer at the offset given; returns the received values in `legs.recv`'s order.
    /// On the group's device communicator when it carries one, else through the host.
    fn all_to_all<B: Backend>(
        &self,
        be: &B,
        legs: &Legs,
        mut fill: impl FnMut(&Transfer, &mut B::Buf, usize),
    ) -> Result<B::Buf> {
        let n = self.group.size();
        let (send_counts, recv_counts) = (counts(n, &legs.send), counts(n, &legs.recv));
        let mut send = be.uninit(send_counts.iter().sum());
        let mut at = 0;
        for t in &legs.send {
            fill(t, &mut send, at);
            at += t.piece.hi - t.piece.lo;
        }
        all_to_all_on(be, self.group.as_ref(), send, &send_counts, &recv_counts)
    }

    /// The whole shapes of the matrices this rank orthogonalises (the gathered matrices it holds
    /// during the optimizer step).
    pub fn owned_shapes(&self) -> impl Iterator<Item = [usize; 2]> + '_ {
        self.owned.iter().map(|o| o.shape)
    }
}

/// Every rank's pieces (collective over `group`): the counts first, then the descriptions
/// padded to the largest count.
fn gather_pieces(
    group: &dyn ProcessGroup,
    slots: &[(Option<Piece>, usize)],
) -> Result<Vec<Vec<Piece>>> {
    let mine: Vec<Piece> = slots.iter().filter_map(|(p, _)| *p).collect();
    let mut counts = vec![0f32; group.size()];
    group.all_gather(&[mine.len() as f32], &mut counts)?;
    let most = counts.iter().fold(0f32, |a, &b| a.max(b)) as usize;
    let mut words = vec![0f32; most * Piece::WORDS];
    for (i, p) in mine.iter().enumerate() {
        words[i * Piece::WORDS..(i + 1) * Piece::WORDS].copy_from_slice(&p.encode());
    }
    let mut all = vec![0f32; group.size() * words.len()];
    group.all_gather(&words, &mut all)?;
    Ok(counts
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let rank = &all[r * words.len()..];
            (0..c as usize)
                .map(|i| Piece::decode(&rank[i * Piece::WORDS..]))
                .collect()
        })
        .collect())
}

/// Each matrix's owner: the largest matrices first, each to the holder with the least work so far
/// (ties to the lowest rank).
fn assign_owners(
    by_matrix: &BTreeMap<usize, Vec<(usize, Piece)>>,
    shapes: &[Option<[usize; 2]>],
    cost: &dyn Fn(usize, usize) -> f64,
    ranks: usize,
) -> BTreeMap<usize, usize> {
    let cost_of = |m: usize| {
        let [r, c] = shapes[m].expect("a Muon matrix");
        cost(r, c)
    };
    let mut order: Vec<usize> = by_matrix.keys().copied().collect();
    order.sort_by(|&a, &b| cost_of(b).total_cmp(&cost_of(a)).then(a.cmp(&b)));
    let mut load = vec![0f64; ranks];
    let mut owners = BTreeMap::new();
    for m in order {
        let owner = by_matrix[&m]
            .iter()
            .map(|&(rank, _)| rank)
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .expect("a matrix has a holder");
        load[owner] += cost_of(m);
        owners.insert(m, owner);
    }
    owners
}

/// One holder of each distinct piece: the owner when it holds it (no traffic), else the lowest
/// rank; in the order of the pieces' identities.
fn choose_sources(holders: &[(usize, Piece)], owner: usize) -> Vec<(usize, Piece)> {
    let mut chosen: BTreeMap<(usize, usize, usize), (usize, Piece)> = BTreeMap::new();
    for &(rank, piece) in holders {
        let entry = chosen.entry(piece.identity()).or_insert((rank, piece));
        if rank == owner {
            *entry = (rank, piece);
        }
    }
    chosen.into_values().collect()
}

/// Whether the pieces tile the `[rows, cols]` matrix exactly: every tensor-parallel part
/// present, and its flat ranges covering it without gap or overlap.
fn covers<'a>(shape: [usize; 2], pieces: impl Iterator<Item = &'a Piece>) -> bool {
    let mut parts: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
    let mut kinds = Vec::new();
    for p in pieces {
        parts.entry(p.identity().0).or_default().push((p.lo, p.hi));
        kinds.push((p.split, p.tp_parts));
    }
    kinds.dedup();
    let [(split, tp)] = kinds[..] else {
        return false;
    };
    let n_parts = if split == TpSharding::Replicated {
        1
    } else {
        tp
    };
    let part_len = shape[0] * shape[1] / n_parts;
    parts.len() == n_parts
        && parts.values_mut().all(|ranges| {
            ranges.sort();
            let mut end = 0;
            ranges.iter().all(|&(lo, hi)| {
                let ok = lo == end && hi > lo;
                end = hi;
                ok
            }) && end == part_len
        })
}

/// Values per peer of `transfers`.
fn counts(n: usize, transfers: &[Transfer]) -> Vec<usize> {
    let mut c = vec![0; n];
    for t in transfers {
        c[t.peer] += t.piece.hi - t.piece.lo;
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(split: TpSharding, tp_rank: usize, tp_parts: usize, lo: usize, hi: usize) -> Piece {
        Piece {
            matrix: 3,
            split,
            tp_rank,
            tp_parts,
            lo,
            hi,
        }
    }

    #[test]
    fn pieces_travel_exactly_and_place_their_values() {
        let p = piece(TpSharding::Columns, 1, 2, 3, (1 << 33) + 5);
        assert_eq!(Piece::decode(&p.encode()), p);
        // A [2, 4] matrix split by columns in 2 parts of [2, 2]; part 1's values 1..4 are
        // columns 2 and 3.
        let mut placed = Vec::new();
        piece(TpSharding::Columns, 1, 2, 1, 4)
            .runs([2, 4], |from, to, len| placed.push((from, to, len)));
        assert_eq!(placed, vec![(0, 3, 1), (1, 6, 2)]);
    }

    #[test]
    fn coverage_needs_every_part_and_no_gap() {
        let rows = |t, lo, hi| piece(TpSharding::Rows, t, 2, lo, hi);
        let whole = [rows(0, 0, 3), rows(0, 3, 4), rows(1, 0, 4)];
        assert!(covers([2, 4], whole.iter()));
        assert!(!covers([2, 4], whole[..2].iter()));
        assert!(!covers([2, 4], [rows(0, 0, 3), rows(1, 0, 4)].iter()));
    }
}
