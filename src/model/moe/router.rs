//! The router of a mixture-of-experts layer: its settings and math are the backend's
//! (`backend::routing`, where `Backend::moe_route` and its backward are defined); the model keeps
//! what happens between steps, the expert bias of auxiliary-loss-free load balancing.

pub use crate::backend::routing::{
    normalised, route, route_backward, unnormalise_grad, RouterArgs, Routing, ScoreFunc,
};

/// Auxiliary-loss-free load balancing (DeepSeek-V3, TorchTitan's `load_balance_coeff`): after a
/// step, each expert's bias moves by `coeff` toward the mean load: up for an expert that got fewer
/// tokens than the mean, down for one that got more.
pub fn update_expert_bias(bias: &mut [f32], load: &[u64], coeff: f32) {
    let mean = load.iter().sum::<u64>() as f32 / load.len().max(1) as f32;
    for (b, &l) in bias.iter_mut().zip(load) {
        let diff = mean - l as f32;
        *b += coeff
            * if diff > 0.0 {
                1.0
            } else if diff < 0.0 {
                -1.0
            } else {
                0.0
            };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_moves_toward_the_mean_load() {
        let mut bias = vec![0.0; 3];
        update_expert_bias(&mut bias, &[1, 3, 2], 0.01);
        assert_eq!(bias, [0.01, -0.01, 0.0]);
    }
}
