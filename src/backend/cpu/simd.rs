//! Run-time selection of AVX-512 for titan's own loops.
//!
//! The binary is built for x86-64-v3 (AVX2) so it runs on any recent x86 machine; `multiversion!`
//! compiles a function body twice, once more with AVX-512 enabled, and picks that copy when the CPU
//! has it. Bodies must only call `#[inline(always)]` helpers so that the helpers inherit the feature.

/// Whether the AVX-512 copies may run (checked once; `TITAN_NO_AVX512=1` forces the AVX2 path).
#[inline(always)]
pub fn avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::env::var_os("TITAN_NO_AVX512").is_none()
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512bw")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Defines `pub fn NAME(args) -> R` whose body is compiled for the base target and for AVX-512.
macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::backend::cpu::simd::avx512() {
                    // SAFETY: the CPU reported every feature `v4` was compiled with.
                    return unsafe { v4($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;
