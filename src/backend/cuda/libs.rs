//! Finding the CUDA libraries at run time. titan links none of them: `cudarc` opens them with
//! `dlopen` on first use and panics when one is missing, so every entry point asks here first and
//! turns a missing library into an error that says which one and how to provide it.

use anyhow::{bail, Result};

/// One dynamically loaded CUDA library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    /// `libcuda.so.1`, installed with the NVIDIA driver.
    Driver,
    /// `libnvrtc.so`, the run-time CUDA C compiler (pip `nvidia-cuda-nvrtc-cu12` or `-cu13`).
    Nvrtc,
    /// `libcublasLt.so`, the GEMMs (pip `nvidia-cublas-cu12` or `-cu13`).
    CublasLt,
    /// `libnccl.so`, the collectives between GPUs (pip `nvidia-nccl-cu12` or `-cu13`, whose file
    /// is `libnccl.so.2`: link it as `libnccl.so` in a folder on `LD_LIBRARY_PATH`).
    Nccl,
}

impl CudaLib {
    pub fn describe(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so.1 (the NVIDIA driver)",
            CudaLib::Nvrtc => "libnvrtc.so (NVRTC, pip package nvidia-cuda-nvrtc or -cu12)",
            CudaLib::CublasLt => "libcublasLt.so (cuBLASLt, pip package nvidia-cublas or -cu12)",
            CudaLib::Nccl => {
                "libnccl.so (NCCL, pip package nvidia-nccl-cu13 or -cu12; link its libnccl.so.2 as libnccl.so)"
            }
        }
    }

    pub fn is_present(self) -> bool {
        // SAFETY: these only try to dlopen the library; no symbol is called.
        unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
                CudaLib::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }
}

/// Fails with one message naming every library in `libs` that cannot be loaded.
pub fn require(libs: &[CudaLib], purpose: &str) -> Result<()> {
    let missing: Vec<&str> = libs
        .iter()
        .filter(|l| !l.is_present())
        .map(|l| l.describe())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    bail!(
        "{purpose} needs CUDA libraries that could not be loaded: {}. Install them (a PyTorch \
         install with CUDA brings them under site-packages/nvidia/*/lib) and put their folders on \
         LD_LIBRARY_PATH, or use --training.device cpu",
        missing.join(", ")
    )
}

/// Number of CUDA devices, or an error saying why there are none usable.
pub fn device_count() -> Result<usize> {
    require(&[CudaLib::Driver], "the CUDA device")?;
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| {
        anyhow::anyhow!("the NVIDIA driver is installed but CUDA failed to start: {e}")
    })?;
    Ok(n.max(0) as usize)
}

/// Whether `device = "auto"` should pick CUDA: the libraries load and a device exists.
pub fn cuda_usable() -> bool {
    [CudaLib::Driver, CudaLib::Nvrtc, CudaLib::CublasLt]
        .iter()
        .all(|l| l.is_present())
        && device_count().map(|n| n > 0).unwrap_or(false)
}
