//! The vocabulary-parallel loss's three steps on the GPU (`Backend::vocab_shard_*`, kernels in
//! `kernels/loss.cu`): the logits stay on the device; only the row statistics cross ranks and
//! the rows' losses come back to the host (one float per row).

use cudarc::driver::PushKernelArg;

use super::{check_len, Buf, KernelArg};
use crate::backend::cuda::{rows_config, CudaBackend, CudaBuf};
use crate::backend::{LossSum, VocabShard};

/// Rows of `logits` for a shard, checked: a whole number of rows of f32 logits, and `targets`
/// (when given) one per row (a target outside the shard is another rank's: the kernels use a
/// target's logit only where it lies in the shard).
fn shard_rows(op: &str, logits: &Buf, shard: VocabShard, targets: Option<&[u32]>) -> usize {
    assert!(
        shard.vocab > 0 && logits.len().is_multiple_of(shard.vocab),
        "{op}: {} logits are not whole rows of a vocabulary shard of {}",
        logits.len(),
        shard.vocab
    );
    assert!(
        !logits.is_bf16_only(),
        "{op}: the logits are held in bf16 alone (the loss reads f32 logits)"
    );
    let rows = logits.len() / shard.vocab;
    if let Some(targets) = targets {
        assert_eq!(targets.len(), rows, "{op}: one target per row");
    }
    rows
}

impl CudaBackend {
    pub(super) fn vocab_shard_row_max_untimed(&self, logits: &Buf, shard: VocabShard) -> Buf {
        let rows = shard_rows("vocab_shard_row_max", logits, shard, None);
        let mut max = CudaBuf::new(self.alloc_unzeroed::<f32>(rows), rows);
        if rows > 0 {
            let v = shard.vocab as i32;
            launch!(
                self,
                "vocab_shard_row_max",
                rows_config(rows, 256),
                logits,
                &mut max,
                &v
            );
        }
        max
    }

    pub(super) fn vocab_shard_row_sums_untimed(
        &self,
        logits: &Buf,
        max: &Buf,
        targets: &[u32],
        shard: VocabShard,
    ) -> Buf {
        let rows = shard_rows("vocab_shard_row_sums", logits, shard, Some(targets));
        check_len("vocab_shard_row_sums", "max", max.len(), rows);
        let mut sums = CudaBuf::new(self.alloc_unzeroed::<f32>(2 * rows), 2 * rows);
        if rows > 0 {
            let ids = self.upload_ids(targets);
            let (v, offset) = (shard.vocab as i32, shard.offset as i32);
            launch!(
                self,
                "vocab_shard_row_sums",
                rows_config(rows, 256),
                logits,
                max,
                &ids,
                &v,
                &offset,
                &mut sums
            );
        }
        sums
    }

    pub(super) fn vocab_shard_loss_untimed(
        &self,
        logits: &mut Buf,
        (max, sums): (&Buf, &Buf),
        targets: &[u32],
        shard: VocabShard,
        (grad_scale, want_grad): (f32, bool),
        total: &mut LossSum,
    ) {
        let rows = shard_rows("vocab_shard_loss", logits, shard, Some(targets));
        check_len("vocab_shard_loss", "max", max.len(), rows);
        check_len("vocab_shard_loss", "sums", sums.len(), 2 * rows);
        if rows == 0 {
            return;
        }
        let ids = self.upload_ids(targets);
        let mut row_loss = self.alloc::<f32>(rows);
        let (v, offset, want) = (shard.vocab as i32, shard.offset as i32, want_grad as i32);
        launch!(
            self,
            "vocab_shard_loss_rows",
            rows_config(rows, 256),
            logits,
            max,
            sums,
            &ids,
            &v,
            &offset,
            &grad_scale,
            &want,
            &mut row_loss
        );
        self.add_row_losses(&row_loss, total);
    }
}
