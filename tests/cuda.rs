//! The CUDA backend on a machine without a GPU: every kernel compiles through NVRTC for sm_80 and
//! sm_90, `--training.device cuda` fails with a message naming the missing library, `auto` falls back
//! to the CPU, and the CUDA-vs-CPU op check catches a wrong kernel (shown with a broken backend).

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use titan::backend::{GemmOutput, GemmShape, RopeShape};

use titan::backend::cpu::CpuBackend;
use titan::backend::crosscheck::{check_ops, rel_err, Tolerances};
use titan::backend::{AdamWStep, AttnGrads, AttnInputs, AttnSaved, AttnShape, Backend, LossSum};

fn titan_with_env(args: &[&str], env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(common::titan_bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run titan")
}

/// The folder holding libnvrtc: `TITAN_NVRTC_LIB_DIR` (set by .ci/run). Outside CI a missing NVRTC
/// skips the compile test; in CI (`CI` set) it fails it, so an uncompilable kernel cannot land.
fn nvrtc_dir() -> Option<PathBuf> {
    match std::env::var_os("TITAN_NVRTC_LIB_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            common::reference_missing(
                "TITAN_NVRTC_LIB_DIR is not set (.ci/run sets it); the NVRTC compile test did not run",
            );
            None
        }
    }
}

#[test]
fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
    let Some(dir) = nvrtc_dir() else { return };
    let out = tempfile::tempdir().unwrap();
    let o = titan_with_env(
        &[
            "cuda",
            "compile",
            "--arch",
            "sm_80,sm_90",
            "--out",
            out.path().to_str().unwrap(),
        ],
        &[("LD_LIBRARY_PATH", dir.display().to_string())],
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "NVRTC failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for arch in ["sm_80", "sm_90"] {
        let n = titan::backend::cuda::kernels::KERNELS.len();
        assert!(
            stdout.contains(&format!("{arch}: {n} kernels compiled")),
            "{stdout}"
        );
        let cubin = std::fs::read(out.path().join(format!("titan_{arch}.cubin"))).unwrap();
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "{arch}: the cubin is not an ELF image"
        );
    }
}

#[test]
fn nvrtc_is_found_through_titan_cuda_lib_dirs_without_a_library_path() {
    let Some(dir) = nvrtc_dir() else { return };
    let o = titan_with_env(
        &["cuda", "compile", "--arch", "sm_90"],
        &[
            ("LD_LIBRARY_PATH", String::new()),
            ("TITAN_CUDA_LIB_DIRS", dir.display().to_string()),
        ],
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains("sm_90: "),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The tiny model trained on `device` with an empty library path, so that no CUDA library can be
/// found whatever this machine has.
fn train_tiny_without_cuda_libraries(dir: &std::path::Path, device: &str) -> Output {
    let mut args = vec![
        "train",
        "--quiet",
        "--training.device",
        device,
        "--training.steps",
        "2",
        "--job.dump_folder",
        dir.to_str().unwrap(),
    ];
    args.extend_from_slice(common::TINY_ARGS);
    titan_with_env(&args, &[("LD_LIBRARY_PATH", String::new())])
}

#[test]
fn training_on_cuda_without_a_driver_fails_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = train_tiny_without_cuda_libraries(dir.path(), "cuda");
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.success() {
        // A machine with a GPU and its driver in the system paths trains on it: nothing to check.
        return;
    }
    assert_eq!(o.status.code(), Some(1), "not a clean exit: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("libcuda.so.1") && err.contains("--training.device cpu"),
        "{err}"
    );
    assert!(
        !dir.path().join("metrics.jsonl").exists(),
        "nothing should be written"
    );
}

#[test]
fn auto_device_trains_on_the_cpu_when_there_is_no_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let o = train_tiny_without_cuda_libraries(dir.path(), "auto");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(dir.path().join("metrics.jsonl").exists());
}

#[test]
fn an_unknown_gemm_precision_is_refused_naming_the_key() {
    let o = titan_with_env(&["train", "--training.mixed_precision_param", "fp8"], &[]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("mixed_precision_param") && err.contains("bfloat16"),
        "{err}"
    );
}

#[test]
fn relative_error_never_passes_nan_or_a_length_mismatch() {
    assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    assert!((rel_err(&[1.0, 2.2], &[1.0, 2.0]) - 0.1).abs() < 1e-6);
    assert!(rel_err(&[f32::NAN, 2.0], &[1.0, 2.0]).is_nan());
    assert!(rel_err(&[f32::INFINITY], &[1.0]).is_nan());
    assert!(rel_err(&[1.0], &[1.0, 2.0]).is_nan());
}

const TOL: Tolerances = Tolerances {
    exact: 1e-5,
    gemm: 1e-5,
    attention: 1e-5,
};

#[test]
fn the_op_check_passes_cpu_against_itself() {
    let rows = check_ops(&CpuBackend::new(), &CpuBackend::new(), TOL, 3, false);
    assert!(rows.len() > 40, "{} rows", rows.len());
    for r in &rows {
        assert!(r.passed && r.rel_err == 0.0, "{r:?}");
    }
}

#[test]
fn the_op_check_catches_a_wrong_kernel() {
    let (_, failed) = check_skewed(false);
    assert!(!failed.is_empty());
    // Every attention backward's dK, and nothing else.
    assert!(
        failed
            .iter()
            .all(|op| op.starts_with("attention_backward") && op.ends_with("dk")),
        "{failed:?}"
    );
    assert!(failed.len() >= 10, "{failed:?}");
}

#[test]
fn a_panicking_op_fails_its_row_and_the_other_ops_still_run() {
    let (rows, failed) = check_skewed(true);
    assert!(
        failed
            .iter()
            .any(|op| op.starts_with("rope: panicked: ") && op.contains("device fault")),
        "{failed:?}"
    );
    assert!(failed.iter().any(|op| op.ends_with("dk")), "{failed:?}");
    let passed = |name: &str| rows.iter().any(|r| r.op == name && r.passed);
    assert!(passed("rmsnorm_backward dx") && passed("adamw_step param"));
}

/// The op check of `SkewedDkBackend` against the CPU: every row, and the names of the failed ones.
fn check_skewed(rope_panics: bool) -> (Vec<titan::backend::crosscheck::OpCheck>, Vec<String>) {
    let skewed = SkewedDkBackend {
        cpu: CpuBackend::new(),
        rope_panics,
    };
    let rows = check_ops(&CpuBackend::new(), &skewed, TOL, 3, rope_panics);
    let failed = rows
        .iter()
        .filter(|r| !r.passed)
        .map(|r| r.op.clone())
        .collect();
    (rows, failed)
}

/// The CPU backend with one bug: attention's dK is off by 0.1% (the size of a wrong scale factor);
/// with `rope_panics`, RoPE panics the way a failed CUDA launch does.
struct SkewedDkBackend {
    cpu: CpuBackend,
    rope_panics: bool,
}

impl Backend for SkewedDkBackend {
    type Buf = Vec<f32>;
    fn name(&self) -> &'static str {
        "skewed"
    }
    fn zeros(&self, len: usize) -> Vec<f32> {
        self.cpu.zeros(len)
    }
    fn upload(&self, data: &[f32]) -> Vec<f32> {
        self.cpu.upload(data)
    }
    fn download(&self, buf: &Vec<f32>) -> Vec<f32> {
        self.cpu.download(buf)
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn fill(&self, buf: &mut Vec<f32>, value: f32) {
        self.cpu.fill(buf, value)
    }
    fn copy_from(&self, dst: &mut Vec<f32>, src: &Vec<f32>) {
        self.cpu.copy_from(dst, src)
    }
    fn copy_into_at(&self, dst: &mut Vec<f32>, offset: usize, src: &Vec<f32>) {
        self.cpu.copy_into_at(dst, offset, src)
    }
    fn copy_range(&self, dst: &mut Vec<f32>, at: usize, src: &Vec<f32>, from: usize, n: usize) {
        self.cpu.copy_range(dst, at, src, from, n)
    }
    fn matmul(
        &self,
        out: &mut Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
        shape: GemmShape,
        output: GemmOutput,
    ) {
        self.cpu.matmul(out, a, b, shape, output)
    }
    fn embedding_forward(&self, out: &mut Vec<f32>, table: &Vec<f32>, ids: &[u32], dim: usize) {
        self.cpu.embedding_forward(out, table, ids, dim)
    }
    fn embedding_backward(&self, dt: &mut Vec<f32>, dout: &Vec<f32>, ids: &[u32], dim: usize) {
        self.cpu.embedding_backward(dt, dout, ids, dim)
    }
    fn rmsnorm_forward(
        &self,
        out: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
    ) {
        self.cpu.rmsnorm_forward(out, rstd, x, w, dim, eps)
    }
    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rstd: &Vec<f32>,
        dim: usize,
    ) {
        self.cpu.rmsnorm_backward(dx, dw, dout, x, w, rstd, dim)
    }
    fn rope_forward(&self, x: &mut Vec<f32>, cos: &Vec<f32>, sin: &Vec<f32>, shape: RopeShape) {
        assert!(
            !self.rope_panics,
            "CUDA kernel `rope_rotate` failed: device fault"
        );
        self.cpu.rope_forward(x, cos, sin, shape)
    }
    fn rope_backward(&self, dx: &mut Vec<f32>, cos: &Vec<f32>, sin: &Vec<f32>, shape: RopeShape) {
        self.cpu.rope_backward(dx, cos, sin, shape)
    }
    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        x: AttnInputs<'_, Vec<f32>>,
    ) {
        self.cpu.attention_forward(out, lse, x)
    }
    fn attention_backward(
        &self,
        grads: AttnGrads<'_, Vec<f32>>,
        dout: &Vec<f32>,
        x: AttnInputs<'_, Vec<f32>>,
        saved: AttnSaved<'_, Vec<f32>>,
    ) {
        let AttnGrads { dq, dk, dv } = grads;
        let lent = AttnGrads {
            dq,
            dk: &mut *dk,
            dv,
        };
        self.cpu.attention_backward(lent, dout, x, saved);
        self.cpu.scale(dk, 1.001);
    }
    fn attention_merge(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        part_out: &Vec<f32>,
        part_lse: &Vec<f32>,
        s: AttnShape,
    ) {
        self.cpu.attention_merge(out, lse, part_out, part_lse, s)
    }
    fn attention_sinks_forward(
        &self,
        out: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        sinks: &Vec<f32>,
        s: AttnShape,
    ) {
        self.cpu.attention_sinks_forward(out, lse, sinks, s)
    }
    fn attention_sinks_backward(
        &self,
        dsinks: &mut Vec<f32>,
        dout: &Vec<f32>,
        saved: AttnSaved<'_, Vec<f32>>,
        sinks: &Vec<f32>,
        s: AttnShape,
    ) {
        self.cpu
            .attention_sinks_backward(dsinks, dout, saved, sinks, s)
    }
    fn swiglu_forward(&self, out: &mut Vec<f32>, g: &Vec<f32>, u: &Vec<f32>) {
        self.cpu.swiglu_forward(out, g, u)
    }
    fn swiglu_backward(
        &self,
        dg: &mut Vec<f32>,
        du: &mut Vec<f32>,
        dout: &Vec<f32>,
        g: &Vec<f32>,
        u: &Vec<f32>,
    ) {
        self.cpu.swiglu_backward(dg, du, dout, g, u)
    }
    fn add(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) {
        self.cpu.add(out, a, b)
    }
    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) {
        self.cpu.add_assign(acc, x)
    }
    fn add_range(&self, acc: &mut Vec<f32>, at: usize, x: &Vec<f32>, from: usize, n: usize) {
        self.cpu.add_range(acc, at, x, from, n)
    }
    fn pack_bf16_pairs(&self, words: &mut Vec<f32>, src: &Vec<f32>) {
        self.cpu.pack_bf16_pairs(words, src)
    }
    fn unpack_bf16_pairs(&self, out: &mut Vec<f32>, words: &Vec<f32>) {
        self.cpu.unpack_bf16_pairs(out, words)
    }
    fn scale(&self, buf: &mut Vec<f32>, factor: f32) {
        self.cpu.scale(buf, factor)
    }
    fn cross_entropy_forward_backward(
        &self,
        h: &Vec<f32>,
        w: &Vec<f32>,
        t: &[u32],
        dim: usize,
        vocab: usize,
        gs: f32,
        grads: Option<(&mut Vec<f32>, &mut Vec<f32>)>,
    ) -> LossSum {
        self.cpu
            .cross_entropy_forward_backward(h, w, t, dim, vocab, gs, grads)
    }
    fn adamw_step(
        &self,
        p: &mut Vec<f32>,
        g: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        hp: AdamWStep,
    ) {
        self.cpu.adamw_step(p, g, m, v, hp)
    }
    fn sum_squares(&self, buf: &Vec<f32>) -> f64 {
        self.cpu.sum_squares(buf)
    }
    fn round_to_bf16(&self, buf: &mut Vec<f32>) {
        self.cpu.round_to_bf16(buf)
    }
}
