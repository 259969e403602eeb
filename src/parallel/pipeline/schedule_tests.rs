//! The schedules' tests: completeness, bubbles, PyTorch's own dumps, the CSV format.

use super::*;

fn all(p: usize, m: usize) -> Vec<Schedule> {
    ScheduleKind::ALL
        .into_iter()
        .map(|k| generate(k, p, k.stages_per_rank(None).unwrap(), m).unwrap())
        .collect()
}

#[test]
fn one_f_one_b_has_the_textbook_bubble() {
    for (p, m) in [(2, 2), (2, 8), (4, 8), (4, 4), (8, 16)] {
        let s = generate(ScheduleKind::OneFOneB, p, 1, m).unwrap();
        let expected = (p - 1) as f64 / (m + p - 1) as f64;
        assert!(
            (s.unit_bubble().unwrap() - expected).abs() < 1e-12,
            "p {p} m {m}"
        );
        assert_eq!(s.microbatch_lifetimes(0).1, p.min(m));
        assert_eq!(s.microbatch_lifetimes(p - 1).1, 1);
    }
    let s = generate(ScheduleKind::OneFOneB, 4, 1, 8).unwrap();
    assert!((s.unit_bubble().unwrap() - 3.0 / 11.0).abs() < 1e-12);
}

#[test]
fn every_schedule_is_complete_and_zero_bubble_beats_1f1b() {
    for (p, m) in [(2, 2), (2, 4), (4, 8), (4, 12), (3, 6)] {
        let schedules = all(p, m);
        let one_f_one_b = schedules[1].unit_bubble().unwrap();
        for s in &schedules {
            s.check().unwrap();
            let b = s.unit_bubble().unwrap();
            errln!("p {p} m {m} {}: bubble {b:.3}", s.name);
            if s.name.contains("ZeroBubble") {
                assert!(b < one_f_one_b, "{} {b} vs 1F1B {one_f_one_b}", s.name);
                // Deferred weight gradients are held between each I and its W.
                assert!(s.max_deferred_blocks(0, |_| 1) >= 1, "{}", s.name);
            } else if !s.name.contains("DualPipe") {
                assert_eq!(s.max_deferred_blocks(0, |_| 1), 0, "{}", s.name);
            }
        }
        // Interleaving shrinks the bubble (same work cut into twice the stages).
        assert!(schedules[2].unit_bubble().unwrap() < one_f_one_b);
    }
}

/// PyTorch 2.15's own dumps (`scripts/pytorch_schedule_csv.py`): GPipe with its
/// `REDUCE_GRAD` / `WAIT_REDUCE_GRAD` cells reads as titan's GPipe; 1F1B's, whose last stage
/// runs forwards 1–8 against backwards 0–7, is refused naming that stage and titan's 1F1B.
#[test]
fn pytorchs_own_dumps_are_read_or_refused_naming_the_stage() {
    let gpipe = include_str!("../../../tests/fixtures/pytorch_gpipe_pp4_mb8.csv");
    let read = Schedule::from_csv(gpipe, "gpipe.csv").unwrap();
    let ours = generate(ScheduleKind::GPipe, 4, 1, 8).unwrap();
    assert_eq!(read.actions, ours.actions);
    let f1b = include_str!("../../../tests/fixtures/pytorch_1f1b_pp4_mb8.csv");
    let e = format!("{:#}", Schedule::from_csv(f1b, "1f1b.csv").unwrap_err());
    assert!(
        e.contains("stage 3 runs forwards of microbatches 1–8 but stage 0 of 0–7")
            && e.contains("pipeline_parallel_schedule 1F1B"),
        "{e}"
    );
    // With its last stage numbered as it runs, PyTorch's 1F1B is titan's.
    let fixed: String = f1b
        .lines()
        .map(|line| match line.starts_with("3F") {
            false => line.to_string(),
            true => (0..8)
                .map(|mb| format!("3F{mb},3B{mb}"))
                .chain(["3REDUCE_GRAD,3WAIT_REDUCE_GRAD".to_string()])
                .collect::<Vec<_>>()
                .join(","),
        })
        .map(|l| l + "\n")
        .collect();
    let read = Schedule::from_csv(&fixed, "1f1b.csv").unwrap();
    let ours = generate(ScheduleKind::OneFOneB, 4, 1, 8).unwrap();
    assert_eq!(read.actions, ours.actions);
}

/// titan's DualPipeV is PyTorch 2.15's action for action (its dump,
/// `tests/fixtures/dualpipev_pp2_mb4.csv`; P 3, 4, 8 compared by hand with
/// `scripts/pytorch_dualpipev_csv.py`), so its unit-cost bubble is PyTorch's (P 2, M 4: 1/25,
/// ZBV's; the list-scheduled one it replaces had 3/27); with fewer microbatches than
/// stages, which PyTorch refuses, the list scheduler still orders the V.
#[test]
fn dual_pipe_v_is_pytorchs_and_no_worse_than_zbv() {
    let dump = include_str!("../../../tests/fixtures/dualpipev_pp2_mb4.csv");
    let pytorch = Schedule::from_csv(dump, "dualpipev.csv").unwrap();
    let ours = generate(ScheduleKind::DualPipeV, 2, 2, 4).unwrap();
    assert_eq!(pytorch.actions, ours.actions);
    assert!((ours.unit_bubble().unwrap() - 1.0 / 25.0).abs() < 1e-12);
    for p in 2..=8 {
        for m in [2 * p, 2 * p + 1, 3 * p, 4 * p] {
            let d = generate(ScheduleKind::DualPipeV, p, 2, m).unwrap();
            let zbv = generate(ScheduleKind::ZbvZeroBubble, p, 2, m).unwrap();
            let (db, zb) = (d.unit_bubble().unwrap(), zbv.unit_bubble().unwrap());
            assert!(
                db <= zb + 0.02,
                "p {p} m {m}: DualPipeV {db:.3}, ZBV {zb:.3}"
            );
        }
    }
    generate(ScheduleKind::DualPipeV, 4, 2, 5)
        .unwrap()
        .check()
        .unwrap();
}

/// PyTorch 2.15's dumps of the multi-stage schedules, as `_dump_csv` writes them with their
/// transfers, UNSHARD/RESHARD and gradient reductions (`scripts/pytorch_schedule_csv.py`), are
/// read; titan's Interleaved1F1B, InterleavedZeroBubble (also with microbatches not a multiple of
/// the degree: P 8, M 12, one round of 12), LoopedBFS and DualPipeV are PyTorch's action for
/// action, and titan's list-scheduled ZBVZeroBubble has PyTorch's bubble or a smaller one.
#[test]
fn pytorchs_multi_stage_dumps_are_titans_schedules() {
    let cases = [
        (
            ScheduleKind::Interleaved1F1B,
            4,
            8,
            include_str!("../../../tests/fixtures/pytorch_interleaved1f1b_pp4_mb8.csv"),
        ),
        (
            ScheduleKind::InterleavedZeroBubble,
            8,
            12,
            include_str!("../../../tests/fixtures/pytorch_interleavedzerobubble_pp8_mb12.csv"),
        ),
        (
            ScheduleKind::LoopedBfs,
            4,
            8,
            include_str!("../../../tests/fixtures/pytorch_loopedbfs_pp4_mb8.csv"),
        ),
        (
            ScheduleKind::DualPipeV,
            4,
            8,
            include_str!("../../../tests/fixtures/pytorch_dualpipev_pp4_mb8.csv"),
        ),
        (
            ScheduleKind::ZbvZeroBubble,
            4,
            8,
            include_str!("../../../tests/fixtures/pytorch_zbvzerobubble_pp4_mb8.csv"),
        ),
    ];
    for (kind, p, m, dump) in cases {
        let pytorch = Schedule::from_csv(dump, kind.name()).unwrap();
        let ours = generate(kind, p, 2, m).unwrap();
        assert_eq!(pytorch.placement, ours.placement, "{}", kind.name());
        let (theirs, mine) = (pytorch.unit_bubble().unwrap(), ours.unit_bubble().unwrap());
        if kind == ScheduleKind::ZbvZeroBubble {
            assert!(mine <= theirs, "ZBV: titan {mine:.3}, PyTorch {theirs:.3}");
        } else {
            assert_eq!(pytorch.actions, ours.actions, "{}", kind.name());
        }
    }
}

#[test]
fn csv_round_trips_and_bad_files_are_named() {
    for s in all(4, 8) {
        let back = Schedule::from_csv(&s.to_csv(), "x.csv").unwrap();
        assert_eq!(back.actions, s.actions);
        assert_eq!(back.placement, s.placement);
    }
    let ok = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n";
    Schedule::from_csv(ok, "ok.csv").unwrap();
    let e = Schedule::from_csv("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "m.csv").unwrap_err();
    assert!(format!("{e:#}").contains("0B1"), "{e:#}");
    let e = Schedule::from_csv("0F0,0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n", "d.csv").unwrap_err();
    assert!(format!("{e:#}").contains("2 forwards"), "{e:#}");
    let e = Schedule::from_csv("0F0,0X1\n", "b.csv").unwrap_err();
    assert!(format!("{e:#}").contains("b.csv line 1 column 2"), "{e:#}");
    // Rank 1 waits for a gradient rank 0 never lets it have: a deadlock, found before running.
    let e = Schedule::from_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "dl.csv").unwrap_err();
    assert!(format!("{e:#}").contains("deadlocks"), "{e:#}");
    // Text that is no action, even outside ASCII, and a rank left without a stage.
    let e = Schedule::from_csv("0F0,0Fé1\n", "u.csv").unwrap_err();
    assert!(format!("{e:#}").contains("u.csv line 1 column 2"), "{e:#}");
    let e = Schedule::from_csv("0F0,0B0\nnone\n", "e.csv").unwrap_err();
    assert!(format!("{e:#}").contains("rank 1 holds no stage"), "{e:#}");
    // TorchTitan's transfer actions are skipped.
    let with_comms = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";
    Schedule::from_csv(with_comms, "c.csv").unwrap();
}

#[test]
fn pytorchs_overlap_cells_run_their_actions_in_order() {
    let text = include_str!("../../../tests/fixtures/dualpipev_pp2_mb4.csv");
    let s = Schedule::from_csv(text, "dualpipev.csv").unwrap();
    assert_eq!((s.placement.clone(), s.microbatches), (vec![0, 1, 1, 0], 4));
    // `(0F3;3B1)OVERLAP_F_B` is 0F3 then 3B1, in the rank's order where the cell stood.
    let rank0: Vec<String> = s.actions[0].iter().map(|a| a.to_string()).collect();
    let at = rank0.iter().position(|a| a == "0F3").unwrap();
    assert_eq!(rank0[at + 1], "3B1");
    // Every (stage, microbatch) forward once: 4 stages × 4 microbatches.
    let forwards = s
        .actions
        .iter()
        .flatten()
        .filter(|a| a.work == Work::Forward);
    assert_eq!(forwards.count(), 16);
    for (bad, want) in [
        ("(0F0;0B0)OVERLAP_B_F\n", "OVERLAP_B_F"),
        ("(0F0;0B0\n", "without closing"),
        ("0WAIT_ALL\n", "is not an action"),
    ] {
        let e = format!("{:#}", Schedule::from_csv(bad, "bad.csv").unwrap_err());
        assert!(
            e.contains(want) && e.contains("bad.csv line 1"),
            "{bad}: {e}"
        );
    }
}

#[test]
fn too_few_microbatches_and_unknown_names_are_refused() {
    let e = generate(ScheduleKind::OneFOneB, 4, 1, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at least 4 microbatches"), "{e}");
    let e = generate(ScheduleKind::Interleaved1F1B, 4, 2, 18)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("4 rounds") && e.contains("18 microbatches"),
        "{e}"
    );
    assert!(ScheduleKind::parse("1f1b").is_ok());
    let e = ScheduleKind::parse("LoopedDFS").unwrap_err().to_string();
    assert!(e.contains("ZBVZeroBubble"), "{e}");
}

/// NCCL's pipeline channels join ring neighbours only (`comm::nccl::peers`): every built-in
/// schedule, at every degree, transfers between pipeline ranks `r` and `r ± 1 mod p` alone.
#[test]
fn every_schedule_transfers_between_ring_neighbours_only() {
    for (p, m) in [(2, 4), (3, 6), (4, 8), (5, 10), (8, 16)] {
        for s in all(p, m) {
            for from in 0..p {
                for to in (0..p).filter(|&to| to != from) {
                    let neighbours = (from + 1) % p == to || (to + 1) % p == from;
                    let sends = crate::parallel::pipeline::transfer::sent_from_to(&s, from, to);
                    assert!(
                        neighbours || sends.is_empty(),
                        "{} p {p}: rank {from} sends rank {to} {:?}",
                        s.name,
                        sends.first()
                    );
                }
            }
        }
    }
}
