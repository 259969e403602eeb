//! Finding the CUDA libraries at run time. titan links none of them: `cudarc` opens them with
//! `dlopen` on first use and panics when one is missing, so every entry point asks here first and
//! turns a missing library into an error that says which one and how to provide it.
//!
//! A library the dynamic loader does not find on its own is looked for in the usual places (see
//! `search_dirs`): a CUDA toolkit, or the `nvidia/*/lib` folders of the active Python environment
//! that holds PyTorch. Found there, it is loaded by path with global symbols; `cudarc`'s own lookup
//! by name (`libnvrtc.so.13`, …) then finds it already loaded, through its soname.

use std::path::PathBuf;
use std::sync::OnceLock;

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
        static PRELOADED: [OnceLock<bool>; 4] = [const { OnceLock::new() }; 4];
        self.loads_by_name()
            || (*PRELOADED[self as usize].get_or_init(|| self.preload()) && self.loads_by_name())
    }

    fn loads_by_name(self) -> bool {
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

    /// The file name every version of the library starts with.
    fn file_stem(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so",
            CudaLib::Nvrtc => "libnvrtc.so",
            CudaLib::CublasLt => "libcublasLt.so",
            CudaLib::Nccl => "libnccl.so",
        }
    }

    /// Loads the newest version of the library found in `search_dirs`, globally and for good.
    fn preload(self) -> bool {
        let stem = self.file_stem();
        for dir in search_dirs() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n == stem || n.strip_prefix(stem).is_some_and(|v| v.starts_with('.'))
                    })
                })
                .collect();
            files.sort();
            for file in files.iter().rev() {
                use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
                // SAFETY: loading a CUDA library runs only its own initialisers; it stays loaded
                // for the life of the process, as cudarc's handles to it expect.
                if let Ok(lib) = unsafe { Library::open(Some(file), RTLD_NOW | RTLD_GLOBAL) } {
                    std::mem::forget(lib);
                    return true;
                }
            }
        }
        false
    }
}

/// Where to look for a CUDA library the dynamic loader does not find on its own, in order:
/// `TITAN_CUDA_LIB_DIRS` (colon-separated), `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`,
/// `/usr/local/cuda/lib64`, and the `nvidia/*/lib` folders of the active Python environment
/// (`$VIRTUAL_ENV`, `$CONDA_PREFIX`: a CUDA build of PyTorch installs NVRTC and cuBLAS there).
fn search_dirs() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let mut dirs: Vec<PathBuf> = env("TITAN_CUDA_LIB_DIRS")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env(var) {
            dirs.push(PathBuf::from(root).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        let Some(prefix) = env(var) else { continue };
        let Ok(pythons) = std::fs::read_dir(PathBuf::from(prefix).join("lib")) else {
            continue;
        };
        for python in pythons.flatten() {
            let nvidia = python.path().join("site-packages").join("nvidia");
            if let Ok(packages) = std::fs::read_dir(nvidia) {
                let mut libs: Vec<PathBuf> =
                    packages.flatten().map(|p| p.path().join("lib")).collect();
                libs.sort();
                dirs.extend(libs);
            }
        }
    }
    dirs
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
         install with CUDA brings them under site-packages/nvidia/*/lib: activate its environment, \
         or name the folders in TITAN_CUDA_LIB_DIRS or LD_LIBRARY_PATH), or use \
         --training.device cpu",
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
