//! Elastic rendezvous (`titan train --nnodes MIN:MAX`, torchrun's): before each generation the
//! nodes' launchers meet on the job's store. Node 0 (`--node-rank 0`, which hosts the store) closes
//! the membership when `MAX` nodes have arrived, or, once `--rdzv-timeout` has passed, with the
//! `MIN` or more present; it keeps node rank 0 and the others take ranks 1.. in arrival order. A
//! node that arrives after the membership closed waits for the next generation, and the running
//! nodes, which watch for it, stop their workers and regroup with it (growing the job); a node
//! that fails leaves the next generation's membership without it (shrinking the job). The
//! workers resume from the latest checkpoint, which reshards onto the new world size.
//!
//! Node 0 hosts the store: the job ends when it does (as with torchrun's static store host).

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::comm::store::StoreClient;

/// Who takes part in a generation: how many nodes, and this node's rank among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Membership {
    pub generation: usize,
    pub nodes: usize,
    pub node_rank: usize,
}

/// The node-count range and wait of an elastic job.
#[derive(Debug, Clone, Copy)]
pub struct Elastic {
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub timeout: Duration,
}

fn arrivals(generation: usize) -> String {
    format!("launch/elastic/g{generation}/arrivals")
}

fn members(generation: usize) -> String {
    format!("launch/elastic/g{generation}/members")
}

impl Elastic {
    /// This node's membership of generation `generation` or, when it arrives after that one
    /// closed, of the next that admits it (every node of a generation agrees on its number).
    pub fn join(
        &self,
        store: &StoreClient,
        mut generation: usize,
        host: bool,
        last: usize,
    ) -> Result<Membership> {
        loop {
            if generation > last {
                bail!("elastic rendezvous: no generation up to {last} (--max-restarts) admitted this node");
            }
            let joined = match host {
                true => self.close(store, generation)?,
                false => self.arrive(store, generation)?,
            };
            if let Some(m) = joined {
                return Ok(m);
            }
            generation += 1;
        }
    }

    /// Node 0: waits for the others and closes the membership.
    fn close(&self, store: &StoreClient, generation: usize) -> Result<Option<Membership>> {
        let deadline = Instant::now() + self.timeout;
        let others = loop {
            let others = store.add(&arrivals(generation), 0)? as usize;
            let present = others + 1;
            if present >= self.max_nodes
                || (Instant::now() >= deadline && present >= self.min_nodes)
            {
                break others.min(self.max_nodes - 1);
            }
            if Instant::now() >= deadline {
                bail!(
                    "elastic rendezvous: {present} node(s) arrived for generation {generation} within {:.0?}; --nnodes asks at least {}",
                    self.timeout,
                    self.min_nodes
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let nodes = others + 1;
        store.set(&members(generation), nodes.to_string().as_bytes())?;
        Ok(Some(Membership {
            generation,
            nodes,
            node_rank: 0,
        }))
    }

    /// Another node: arrives and waits for node 0's decision; None when it closed without this
    /// node.
    fn arrive(&self, store: &StoreClient, generation: usize) -> Result<Option<Membership>> {
        let index = store.add(&arrivals(generation), 1)? as usize;
        // Node 0 closes at its deadline at the latest; a late node waits for a later generation
        // as long as the running ones take to notice it (the store's own wait bounds it).
        let wait = self.timeout + Duration::from_secs(60);
        let value = store.get_within(&members(generation), wait).map_err(|_| {
            anyhow::anyhow!("elastic rendezvous: node 0 did not close generation {generation} within {wait:.0?} (is it running?)")
        })?;
        let nodes: usize = String::from_utf8_lossy(&value).parse().map_err(|_| {
            anyhow::anyhow!(
                "elastic rendezvous: generation {generation}'s membership is not a number"
            )
        })?;
        Ok((index < nodes).then_some(Membership {
            generation,
            nodes,
            node_rank: index,
        }))
    }

    /// Whether a node waits to join the generation after `generation` while it runs with
    /// `nodes` (room for it: fewer than `MAX`).
    pub fn someone_waits(&self, store: &StoreClient, generation: usize, nodes: usize) -> bool {
        nodes < self.max_nodes && store.add(&arrivals(generation + 1), 0).is_ok_and(|n| n > 0)
    }
}
