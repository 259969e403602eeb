//! LoRA (TorchTitan's `lora` model converter): a linear `y = x·Wᵀ` becomes
//! `y = x·Wᵀ + (alpha/rank)·(x·Aᵀ)·Bᵀ` with `A` (`{linear}.lora_a.weight`, `[rank, d_in]`,
//! Kaiming-uniform) and `B` (`{linear}.lora_b.weight`, `[d_out, rank]`, zeros) trained and every
//! other weight frozen: no gradient, no AdamW state, no reduction.
//!
//! What this module owns: the adapter's own GEMMs, forward and backward, in one rank's shapes
//! (`Adapter`), and the merge of adapters into their weights (`merge_adapters`). Which linears
//! are adapted and the adapters' names are `lora_args`'; how tensor parallelism splits them is
//! `params::TpSharding`'s (TorchTitan's `_lora_adapter_sharding`). The layers of `parallel_linear` call these next
//! to the base linear's GEMMs, so every layout that runs the linear runs its adapter: the
//! adapter's products are added to the base's before any collective the layer runs, and the
//! gradient of a replicated factor is a partial sum over the group like a norm's, summed with
//! the other replicated weights' (`parallel::layout`).
//!
//! The adapter never goes through float8: with a float8 base its GEMMs read the high-precision
//! input and output gradient, as TorchTitan's LoRA over a `Float8Linear` does.

use super::linear::Linear;
pub use super::lora_args::*;
use super::params::ParamSet;
use crate::backend::{Backend, GemmOutput, GemmShape};

/// One linear's adapter as a rank holds it: `a` `[rank, d_in]`, `b` `[d_out, rank]` in the
/// linear's local shapes.
pub struct Adapter<'a, B: Backend> {
    pub a: &'a B::Buf,
    pub b: &'a B::Buf,
    pub rank: usize,
    pub scale: f32,
}

/// Where an adapter's factor gradients are added.
pub struct AdapterGrads<'a, B: Backend> {
    pub da: &'a mut B::Buf,
    pub db: &'a mut B::Buf,
}

impl<B: Backend> Adapter<'_, B> {
    /// `A` as a linear from the base's inputs to the rank, `B` from the rank to its outputs.
    fn factors(&self, base: Linear) -> (Linear, Linear) {
        (
            Linear::new(base.d_in, self.rank),
            Linear::new(self.rank, base.d_out),
        )
    }

    /// `u = scale · x·Aᵀ` (`[rows, rank]`).
    fn scaled_down(&self, be: &B, base: Linear, x: &B::Buf, rows: usize) -> B::Buf {
        let (a, _) = self.factors(base);
        let mut u = be.uninit(rows * self.rank);
        a.forward(be, &mut u, x, self.a, rows);
        be.scale(&mut u, self.scale);
        u
    }

    /// `du = scale · dy·B` (`[rows, rank]`).
    fn scaled_up_grad(&self, be: &B, base: Linear, dy: &B::Buf, rows: usize) -> B::Buf {
        let (_, b) = self.factors(base);
        let mut du = be.uninit(rows * self.rank);
        b.input_grad(be, &mut du, dy, self.b, rows);
        be.scale(&mut du, self.scale);
        du
    }

    /// `y += scale · (x·Aᵀ)·Bᵀ` for `base`'s `x` `[rows, d_in]` and `y` `[rows, d_out]`.
    pub fn add_forward(&self, be: &B, base: Linear, y: &mut B::Buf, x: &B::Buf, rows: usize) {
        let u = self.scaled_down(be, base, x, rows);
        self.factors(base).1.add_forward(be, y, &u, self.b, rows);
    }

    /// `dx += scale · (dy·B)·A`: the adapter's share of the input gradient.
    pub fn add_input_grad(&self, be: &B, base: Linear, dx: &mut B::Buf, dy: &B::Buf, rows: usize) {
        let du = self.scaled_up_grad(be, base, dy, rows);
        self.factors(base)
            .0
            .add_input_grad(be, dx, &du, self.a, rows);
    }

    /// `dA += (scale · dy·B)ᵀ·x` and `dB += dyᵀ·(scale · x·Aᵀ)`.
    pub fn add_weight_grads(
        &self,
        be: &B,
        base: Linear,
        grads: &mut AdapterGrads<'_, B>,
        dy: &B::Buf,
        x: &B::Buf,
        rows: usize,
    ) {
        let (a, b) = self.factors(base);
        let du = self.scaled_up_grad(be, base, dy, rows);
        a.add_weight_grad(be, grads.da, &du, x, rows);
        let u = self.scaled_down(be, base, x, rows);
        b.add_weight_grad(be, grads.db, dy, &u, rows);
    }

    /// Copies of the two factors, for a weight gradient computed later (zero-bubble schedules).
    pub fn to_owned(&self, be: &B) -> OwnedAdapter<B> {
        OwnedAdapter {
            a: be.copied(self.a),
            b: be.copied(self.b),
            rank: self.rank,
            scale: self.scale,
        }
    }
}

/// An adapter's factors copied (`Adapter::to_owned`).
pub struct OwnedAdapter<B: Backend> {
    pub a: B::Buf,
    pub b: B::Buf,
    pub rank: usize,
    pub scale: f32,
}

impl<B: Backend> OwnedAdapter<B> {
    pub fn view(&self) -> Adapter<'_, B> {
        Adapter {
            a: &self.a,
            b: &self.b,
            rank: self.rank,
            scale: self.scale,
        }
    }
}

/// `params` (whole tensors) with every adapter merged into its weight, `W += (alpha/rank)·B·A`,
/// and the adapters dropped: the plain model a LoRA run computes (Hugging Face export).
pub fn merge_adapters<B: Backend>(be: &B, params: ParamSet<B>, lora: &LoraArgs) -> ParamSet<B> {
    let ParamSet {
        names,
        shapes,
        mut bufs,
    } = params;
    let index = |n: &str| names.iter().position(|x| x == n);
    for (a_id, name) in names.iter().enumerate() {
        let Some(stem) = name.strip_suffix(LORA_A) else {
            continue;
        };
        let (Some(w_id), Some(b_id)) = (
            index(&format!("{stem}.weight")),
            index(&format!("{stem}{LORA_B}")),
        ) else {
            continue;
        };
        let (d_out, d_in) = (shapes[w_id][0], shapes[w_id][1]);
        let mut scaled_b = be.uninit(d_out * lora.rank);
        be.copy_from(&mut scaled_b, &bufs[b_id]);
        be.scale(&mut scaled_b, lora.scale());
        let a = std::mem::replace(&mut bufs[a_id], be.zeros(0));
        let shape = GemmShape::new(d_out, lora.rank, d_in);
        be.matmul(
            &mut bufs[w_id],
            &scaled_b,
            &a,
            shape,
            GemmOutput::Accumulate,
        );
        bufs[a_id] = a;
    }
    let keep: Vec<bool> = names.iter().map(|n| !is_adapter(n)).collect();
    ParamSet {
        names: kept(names, &keep),
        shapes: kept(shapes, &keep),
        bufs: kept(bufs, &keep),
    }
}

/// The items of `v` whose `keep` is true.
fn kept<T>(v: Vec<T>, keep: &[bool]) -> Vec<T> {
    v.into_iter()
        .zip(keep)
        .filter_map(|(x, &k)| k.then_some(x))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::TpSharding;

    fn lora(targets: &[&str]) -> LoraArgs {
        LoraArgs {
            rank: 4,
            alpha: 8.0,
            target_modules: targets.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn merged_weights_compute_what_the_adapted_linear_does() {
        use crate::backend::cpu::CpuBackend;
        let be = CpuBackend::new();
        let (d_in, d_out, rows) = (6, 5, 3);
        let l = lora(&[]);
        let values = |n: usize, k: f32| (0..n).map(|i| ((i as f32) * k).sin()).collect::<Vec<_>>();
        let (w, a, b) = (
            values(d_out * d_in, 0.7),
            values(l.rank * d_in, 1.3),
            values(d_out * l.rank, 0.4),
        );
        let x = values(rows * d_in, 0.9);
        let set = ParamSet {
            names: vec![
                "layers.0.attention.wq.weight".into(),
                format!("layers.0.attention.wq{LORA_A}"),
                format!("layers.0.attention.wq{LORA_B}"),
            ],
            shapes: vec![vec![d_out, d_in], vec![l.rank, d_in], vec![d_out, l.rank]],
            bufs: vec![w.clone(), a.clone(), b.clone()],
        };
        let merged = merge_adapters(&be, set, &l);
        assert_eq!(merged.names, ["layers.0.attention.wq.weight"]);
        let linear = Linear::new(d_in, d_out);
        let mut expect = vec![0.0; rows * d_out];
        linear.forward(&be, &mut expect, &x, &w, rows);
        let adapter = Adapter::<CpuBackend> {
            a: &a,
            b: &b,
            rank: l.rank,
            scale: l.scale(),
        };
        adapter.add_forward(&be, linear, &mut expect, &x, rows);
        let mut got = vec![0.0; rows * d_out];
        linear.forward(&be, &mut got, &x, &merged.bufs[0], rows);
        for (g, e) in got.iter().zip(&expect) {
            assert!((g - e).abs() < 1e-5, "{g} vs {e}");
        }
    }

    #[test]
    fn adapts_block_projections_only() {
        let all = lora(&[]);
        assert!(all.adapts("layers.0.attention.wq.weight"));
        assert!(all.adapts("layers.1.feed_forward.w2.weight"));
        assert!(all.adapts("layers.1.moe.shared_experts.w1.weight"));
        assert!(!all.adapts("layers.1.moe.experts.3.w1.weight"));
        assert!(!all.adapts("layers.1.moe.router.gate.weight"));
        assert!(!all.adapts("layers.0.attention_norm.weight"));
        assert!(!all.adapts("output.weight"));
        assert!(!all.adapts("tok_embeddings.weight"));
        let some = lora(&["wq", "wv"]);
        assert!(some.adapts("layers.0.attention.wv.weight"));
        assert!(!some.adapts("layers.0.attention.wk.weight"));
    }

    #[test]
    fn adapters_follow_their_weight_with_its_shapes_and_splits() {
        let specs = vec![
            ("layers.0.attention.wq.weight".to_string(), vec![32, 16]),
            ("layers.0.attention.wo.weight".to_string(), vec![16, 32]),
        ];
        let out = with_adapters(specs, &lora(&["wq", "wo"]));
        let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "layers.0.attention.wq.weight",
                "layers.0.attention.wq.lora_a.weight",
                "layers.0.attention.wq.lora_b.weight",
                "layers.0.attention.wo.weight",
                "layers.0.attention.wo.lora_a.weight",
                "layers.0.attention.wo.lora_b.weight",
            ]
        );
        assert_eq!(out[1].1, [4, 16]);
        assert_eq!(out[2].1, [32, 4]);
        assert_eq!(
            base_of("layers.0.attention.wo.lora_b.weight").as_deref(),
            Some("layers.0.attention.wo.weight")
        );
        // Column-parallel wq: B splits its rows, A is whole; row-parallel wo: A splits its columns.
        assert_eq!(TpSharding::of(&out[1].0), TpSharding::Replicated);
        assert_eq!(TpSharding::of(&out[2].0), TpSharding::Rows);
        assert_eq!(TpSharding::of(&out[4].0), TpSharding::Columns);
        assert_eq!(TpSharding::of(&out[5].0), TpSharding::Replicated);
    }
}
