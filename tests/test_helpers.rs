//! The shared test helpers' own checks: `common::assert_parity` refuses empty curves and curves
//! over other steps, and a missing reference fails in CI and skips elsewhere.

mod common;

use common::{assert_parity, reference_missing_in};

const CURVE: &[(u64, f64)] = &[(1, 5.0), (2, 4.5), (3, 4.25)];

#[test]
fn parity_holds_on_the_same_steps_within_tolerance() {
    let close: Vec<(u64, f64)> = CURVE.iter().map(|&(s, l)| (s, l * (1.0 + 1e-7))).collect();
    assert_parity(CURVE, &close, "close curves");
}

#[test]
#[should_panic(expected = "two empty runs: an empty curve")]
fn parity_refuses_two_empty_curves() {
    assert_parity(&[], &[], "two empty runs");
}

#[test]
#[should_panic(expected = "empty parallel run: an empty curve")]
fn parity_refuses_one_empty_curve() {
    assert_parity(CURVE, &[], "empty parallel run");
}

#[test]
#[should_panic(expected = "shifted steps: the curves' steps differ")]
fn parity_refuses_other_steps() {
    let shifted: Vec<(u64, f64)> = CURVE.iter().map(|&(s, l)| (s + 1, l)).collect();
    assert_parity(CURVE, &shifted, "shifted steps");
}

#[test]
#[should_panic(expected = "short run: the curves' steps differ")]
fn parity_refuses_a_shorter_curve() {
    assert_parity(CURVE, &CURVE[..2], "short run");
}

#[test]
#[should_panic(expected = "far apart, step 2")]
fn parity_refuses_values_apart() {
    let apart = [(1, 5.0), (2, 4.6), (3, 4.25)];
    assert_parity(CURVE, &apart, "far apart");
}

#[test]
#[should_panic(expected = "no reference here; CI is set")]
fn a_missing_reference_fails_in_ci() {
    reference_missing_in(true, "no reference here");
}

#[test]
fn a_missing_reference_skips_outside_ci() {
    reference_missing_in(false, "no reference here");
}
