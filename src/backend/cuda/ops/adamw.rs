//! AdamW on one tensor; the step over a whole parameter list is `multi_tensor`'s.

use cudarc::driver::PushKernelArg;

use super::{Buf, KernelArg};
use crate::backend::cuda::{elementwise_config, CudaBackend};
use crate::backend::AdamWStep;

impl CudaBackend {
    pub(super) fn adamw_step_untimed(
        &self,
        param: &mut Buf,
        grad: &Buf,
        exp_avg: &mut Buf,
        exp_avg_sq: &mut Buf,
        hp: AdamWStep,
    ) {
        let n = self.elementwise_len(
            "adamw_step",
            &[
                ("param", param.len()),
                ("grad", grad.len()),
                ("exp_avg", exp_avg.len()),
                ("exp_avg_sq", exp_avg_sq.len()),
            ],
        );
        let (step_size, bias2_sqrt, decay, l2) = hp.host_constants();
        launch_elementwise!(
            self,
            "adamw_step",
            n,
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            &hp.beta1,
            &hp.beta2,
            &hp.eps,
            &step_size,
            &bias2_sqrt,
            &decay,
            &l2,
            &hp.grad_scale,
        );
    }
}
