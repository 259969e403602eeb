//! The device road on CPU ranks: a GPU job's collectives run through the device communicators
//! attached to its mesh groups (NCCL's), by the code `comm::device_group` gives every layout
//! (FSDP's and HSDP's `DeviceQueue`, DDP's `DeviceGradReducer`, tensor parallelism's row
//! collectives on the queue, context parallelism's `allgather` and ring shifts, expert
//! parallelism's all-to-all of rows, the experts' shards), and the pipeline's stage transfers
//! through the point-to-point channels of the pipeline group, and Muon's exchange of whole
//! matrices on the job's group.
//! `TITAN_DEVICE_COLLECTIVES=host` attaches host-run device groups to a CPU job's groups, so that
//! code runs here: every layout's losses and gradient norms must equal the host road's bit for bit
//! (each group has two ranks, whose sums are exact in either order).

mod common;

use common::{bits, losses, metric, train_env};

const MOE: &[&str] = &[
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel_moe",
    "--model.dim",
    "64",
];

/// Trains `args` with `n` ranks on the host road and on the device road; both curves must be
/// the same bits, and the device road's ranks must say they took it.
fn same_on_both_roads(what: &str, n: &str, args: &[&str]) {
    let launcher = ["--nproc", n, "--master-port", "0"];
    let args = [args, &["--training.steps", "4"]].concat();
    let (host, device) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = train_env(host.path(), &launcher, &args, &[]);
    assert!(
        o.status.success(),
        "{what}, host road: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let road = [("TITAN_DEVICE_COLLECTIVES", "host")];
    let o = train_env(device.path(), &launcher, &args, &road);
    assert!(
        o.status.success(),
        "{what}, device road: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("collectives through host-run device groups"),
        "{what}: the device road was not taken: {out}"
    );
    let (h, d) = (losses(host.path()), losses(device.path()));
    assert_eq!(h.len(), 4, "{what}: {h:?}");
    assert_eq!(bits(&h), bits(&d), "{what}: losses {h:?} vs {d:?}");
    let (h, d) = (
        metric(host.path(), "grad_norm"),
        metric(device.path(), "grad_norm"),
    );
    assert_eq!(bits(&h), bits(&d), "{what}: grad norms {h:?} vs {d:?}");
}

#[test]
fn data_parallel_layouts_on_the_device_road_equal_the_host_road() {
    same_on_both_roads(
        "DDP 2",
        "2",
        &[
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ],
    );
    same_on_both_roads("FSDP 2", "2", &[]);
    same_on_both_roads(
        "Muon, FSDP 2 (the exchange of whole matrices on the job's device group)",
        "2",
        &["--optimizer.name", "Muon"],
    );
    same_on_both_roads(
        "HSDP 2 × 2, bf16 reductions",
        "4",
        &[
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--training.mixed_precision_param",
            "bfloat16",
            "--training.mixed_precision_reduce",
            "bfloat16",
        ],
    );
}

#[test]
fn tensor_and_context_parallel_on_the_device_road_equal_the_host_road() {
    let tp = ["--parallelism.tensor_parallel_degree", "2"];
    same_on_both_roads("TP 2", "2", &tp);
    let muon_tp = [&tp[..], &["--optimizer.name", "Muon"]].concat();
    same_on_both_roads("Muon, TP 2 (row- and column-split pieces)", "2", &muon_tp);
    let async_tp = [
        &tp[..],
        &["--parallelism.enable_async_tensor_parallel", "true"],
    ]
    .concat();
    same_on_both_roads("async TP 2", "2", &async_tp);
    let cp = ["--parallelism.context_parallel_degree", "2"];
    same_on_both_roads("CP 2 allgather", "2", &cp);
    let ring = [
        &cp[..],
        &["--parallelism.context_parallel_rotate_method", "alltoall"],
    ]
    .concat();
    same_on_both_roads("CP 2 alltoall (the ring)", "2", &ring);
}

#[test]
fn expert_shards_and_pipeline_stages_on_the_device_road_equal_the_host_road() {
    let ep = [MOE, &["--parallelism.expert_parallel_degree", "2"]].concat();
    same_on_both_roads("EP 2 (the rows' all-to-all)", "2", &ep);
    same_on_both_roads("FSDP 2 × EP 2 (experts FSDP-sharded over 2)", "4", &ep);
    same_on_both_roads(
        "PP 2 × FSDP 2",
        "4",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    );
    same_on_both_roads(
        "PP 2, ZBVZeroBubble (two stages a rank, in a V)",
        "2",
        &[
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--training.local_batch_size",
            "4",
        ],
    );
}
