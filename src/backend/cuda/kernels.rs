//! The CUDA C source of every non-GEMM kernel, embedded in the binary, and its compilation by NVRTC
//! for one GPU architecture (cached per process).
//!
//! The sources live one file per op family under `kernels/` and are joined into one program behind
//! `common.cuh`. They include no CUDA header, so a machine needs only `libnvrtc` to build them.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::Mutex;

use anyhow::{anyhow, Result};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use super::libs::{require, CudaLib};

/// The whole program: shared helpers first, then each op family.
pub const SOURCE: &str = concat!(
    include_str!("kernels/common.cuh"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/cast.cu"),
    include_str!("kernels/float8.cu"),
    include_str!("kernels/embedding.cu"),
    include_str!("kernels/norm.cu"),
    include_str!("kernels/rope.cu"),
    include_str!("kernels/adamw.cu"),
    include_str!("kernels/reduce.cu"),
    include_str!("kernels/multi_tensor.cu"),
    include_str!("kernels/loss.cu"),
    include_str!("kernels/routing.cu"),
    include_str!("kernels/moe_aux.cu"),
    include_str!("kernels/grouped_gemm.cu"),
    include_str!("kernels/attention.cu"),
    include_str!("kernels/tensor_core.cuh"),
    include_str!("kernels/attention_tc.cu"),
);

/// Every `extern "C" __global__` entry point of `SOURCE`; the backend loads each by name.
pub const KERNELS: &[&str] = &[
    "fill_f32",
    "add_f32",
    "add_assign_f32",
    "scale_f32",
    "scale_rows_f32",
    "row_dots_f32",
    "copy_rows_f32",
    "add_rows_f32",
    "swiglu_forward",
    "swiglu_backward",
    "round_to_bf16",
    "f32_to_bf16",
    "bf16_pairs_to_f32",
    "float8_amax_partial",
    "float8_amax_rows",
    "float8_amax_columns",
    "float8_fake_quantize",
    "float8_scale_product",
    "mx_fake_quantize",
    "float8_encode_words",
    "float8_decode_words",
    "embedding_forward",
    "embedding_backward",
    "rmsnorm_forward",
    "rmsnorm_backward_dx",
    "rmsnorm_dweight_partial",
    "rmsnorm_dweight_reduce",
    "rope_rotate",
    "adamw_step",
    "sum_squares_partial",
    "fill_all",
    "adamw_step_all",
    "copy_rounded_to_bf16_all",
    "sum_squares_all_partial",
    "cross_entropy_rows",
    "vocab_shard_row_max",
    "vocab_shard_row_sums",
    "vocab_shard_loss_rows",
    "moe_route",
    "moe_route_backward",
    "moe_chunk_counts",
    "moe_offsets",
    "moe_place",
    "moe_combine",
    "moe_count_load",
    "moe_aux_figures",
    "moe_aux_balance",
    "moe_aux_score_grads",
    "clamped_swiglu_forward",
    "clamped_swiglu_backward",
    "grouped_gemm",
    "grouped_weight_grad",
    "attention_forward",
    "attention_backward_delta",
    "attention_backward_dq",
    "attention_backward_dkdv",
    "attention_merge",
    "attention_sinks",
    "attention_sinks_grad",
    "attention_forward_tc64",
    "attention_forward_tc64x2",
    "attention_forward_tc128",
    "attention_backward_dq_tc64",
    "attention_backward_dq_tc128",
    "attention_backward_dkdv_tc64",
    "attention_backward_dk_tc128",
    "attention_backward_dv_tc128",
    "attention_backward_fused_tc64",
    "attention_backward_fused_tc64w8",
    "attention_backward_fused_tc128",
    "attention_backward_fused_tc128w8",
];

/// Threads per block of the attention kernels (one warp per row; `TITAN_ATTN_WARPS` in the source).
pub const ATTN_WARPS: usize = 4;
/// Rows per block of the RMSNorm kernels, one warp each (`TITAN_NORM_WARPS` in the source).
pub const NORM_WARPS: usize = 4;
/// Largest head dimension the attention kernels hold per warp (`TITAN_ATTN_MAX_D`).
pub const ATTN_MAX_HEAD_DIM: usize = 256;

/// `sm_90`, `compute_90` or `90` → `sm_90`.
pub fn real_arch(arch: &str) -> Result<String> {
    let digits = arch
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_");
    if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
        return Err(anyhow!(
            "GPU architecture `{arch}` is not of the form sm_90 (or compute_90, or 90)"
        ));
    }
    Ok(format!("sm_{digits}"))
}

/// The kernels built for one architecture.
#[derive(Clone)]
pub struct Compiled {
    pub arch: String,
    /// Device code (an ELF cubin). A cubin, not PTX, so a driver older than the NVRTC still loads
    /// it (CUDA's minor-version compatibility covers cubins but not PTX).
    pub cubin: Vec<u8>,
    /// ptxas's report: registers, shared memory and spills per kernel.
    pub log: String,
}

static CACHE: Mutex<Option<HashMap<String, Compiled>>> = Mutex::new(None);

/// `SOURCE` compiled for `arch` (e.g. `sm_90`), once per process.
pub fn compile(arch: &str) -> Result<Compiled> {
    let arch = real_arch(arch)?;
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if let Some(c) = cache.get(&arch) {
        return Ok(c.clone());
    }
    require(&[CudaLib::Nvrtc], "compiling titan's CUDA kernels")?;
    let compiled = nvrtc_cubin(&arch)?;
    for name in KERNELS {
        let needle = name.as_bytes();
        if !compiled.cubin.windows(needle.len()).any(|w| w == needle) {
            return Err(anyhow!(
                "NVRTC compiled the kernels for {arch} but the cubin has no entry `{name}`"
            ));
        }
    }
    cache.insert(arch, compiled.clone());
    Ok(compiled)
}

fn nvrtc_cubin(arch: &str) -> Result<Compiled> {
    let src = CString::new(SOURCE).expect("kernel source has no NUL");
    let name = CString::new("titan_kernels.cu").expect("no NUL");
    let prog = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| anyhow!("NVRTC could not create the program: {e:?}"))?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
    ];
    // SAFETY: prog is live until destroy_program below; every buffer is sized by NVRTC first.
    unsafe {
        let compiled = nvrtc::compile_program(prog, &options);
        let log = nvrtc::get_program_log(prog)
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let result = match compiled {
            Err(e) => Err(anyhow!(
                "NVRTC could not compile titan's CUDA kernels for {arch} ({e:?}):\n{log}"
            )),
            Ok(()) => {
                let mut size = 0usize;
                let cubin = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|_| {
                        let mut buf = vec![0u8; size];
                        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|_| buf)
                    })
                    .map_err(|e| anyhow!("NVRTC produced no cubin for {arch}: {e:?}"));
                cubin.map(|cubin| Compiled {
                    arch: arch.to_string(),
                    cubin,
                    log,
                })
            }
        };
        let _ = nvrtc::destroy_program(prog);
        result
    }
}
