//! The AVX-512 ISA compiled a second time, against software versions of its AVX-512
//! intrinsics, so the tests run its kernels on CPUs without AVX-512 (the machines this project
//! is built and tested on have AVX2 only; users' Xeons pick the AVX-512 ISA on their own).
//!
//! The code is the ISA's own source (`avx512.rs`, copied by the build script with AVX2 enabled
//! in place of AVX-512); only the AVX-512 intrinsics it calls are replaced, by the lane-by-lane
//! definitions in [`soft`], written from Intel's descriptions. Its SSE and AVX intrinsics run
//! natively, so it needs an AVX2 CPU. What this tests: the ISA's loops, indexing, tails,
//! lane order and arithmetic. What it cannot test: the compiler's AVX-512 code generation and
//! the CPU itself, which the runtime self-check (`verify`) guards where the ISA really runs.

// The copy is the shipped source, linted as such where it is compiled for real. Here a few of
// its unsafe blocks hold only calls that are safe, its FMA burst (for the peak-FLOP probe) is
// unused, and its CPU test reads `true && true && ...`.
#![allow(unused_unsafe, dead_code, clippy::eq_op, clippy::nonminimal_bool)]

use soft::{
    __m512, __m512i, _mm512_castps512_ps256, _mm512_castps_pd, _mm512_castsi512_ps,
    _mm512_cvtepi32_ps, _mm512_cvtepi8_epi32, _mm512_cvtepu16_epi32, _mm512_cvtph_ps,
    _mm512_extractf64x4_pd, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_permutexvar_ps,
    _mm512_set1_epi64, _mm512_set1_ps, _mm512_setr_epi32, _mm512_setzero_ps, _mm512_slli_epi32,
    _mm512_srlv_epi32, _mm512_storeu_ps,
};

/// The emulated ISA's detection: its AVX-512 instructions are software, so it runs wherever
/// its AVX2 ones do (`supported()` checks those too).
macro_rules! is_x86_feature_detected {
    ("avx512f") => {
        true
    };
    ("avx512bw") => {
        true
    };
}

include!(concat!(env!("OUT_DIR"), "/avx512_emulated.rs"));

/// AVX-512 intrinsics, lane by lane (lane 0 is the lowest element in memory, as in hardware).
#[allow(non_camel_case_types)]
mod soft {
    use std::arch::x86_64::{__m128i, __m256, __m256d, __m256i};

    /// 16 f32 lanes.
    #[derive(Clone, Copy, Debug)]
    #[repr(C, align(64))]
    pub(super) struct __m512(pub(super) [f32; 16]);

    /// 16 32-bit integer lanes.
    #[derive(Clone, Copy, Debug)]
    #[repr(C, align(64))]
    pub(super) struct M512i(pub(super) [u32; 16]);

    /// The ISA's name for 16 32-bit integer lanes.
    pub(super) type __m512i = M512i;

    /// 8 f64 lanes, kept as their bits.
    #[derive(Clone, Copy, Debug)]
    #[repr(C, align(64))]
    pub(super) struct M512d(pub(super) [u64; 8]);

    fn map(f: impl Fn(usize) -> f32) -> __m512 {
        __m512(std::array::from_fn(f))
    }

    /// `vmovups` load; reads 16 f32 at `p`, unaligned.
    ///
    /// # Safety
    /// 64 bytes at `p` are readable.
    pub(super) unsafe fn _mm512_loadu_ps(p: *const f32) -> __m512 {
        // SAFETY: 16 readable f32 (caller); unaligned read.
        __m512(unsafe { (p as *const [f32; 16]).read_unaligned() })
    }

    /// `vmovups` store of 16 f32 at `p`, unaligned.
    ///
    /// # Safety
    /// 64 bytes at `p` are writable.
    pub(super) unsafe fn _mm512_storeu_ps(p: *mut f32, a: __m512) {
        // SAFETY: 16 writable f32 (caller); unaligned write.
        unsafe { (p as *mut [f32; 16]).write_unaligned(a.0) }
    }

    pub(super) fn _mm512_set1_ps(v: f32) -> __m512 {
        __m512([v; 16])
    }

    /// `vpbroadcastq`: the 64-bit `v` in each of the eight 64-bit lanes.
    pub(super) fn _mm512_set1_epi64(v: i64) -> M512i {
        let v = v as u64;
        M512i(std::array::from_fn(|i| (v >> (32 * (i % 2))) as u32))
    }

    /// 16 32-bit lanes, lane 0 first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn _mm512_setr_epi32(
        e0: i32,
        e1: i32,
        e2: i32,
        e3: i32,
        e4: i32,
        e5: i32,
        e6: i32,
        e7: i32,
        e8: i32,
        e9: i32,
        e10: i32,
        e11: i32,
        e12: i32,
        e13: i32,
        e14: i32,
        e15: i32,
    ) -> M512i {
        M512i(
            [
                e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15,
            ]
            .map(|v| v as u32),
        )
    }

    pub(super) fn _mm512_setzero_ps() -> __m512 {
        __m512([0.0; 16])
    }

    /// `a * b + c` per lane, rounded once.
    pub(super) fn _mm512_fmadd_ps(a: __m512, b: __m512, c: __m512) -> __m512 {
        map(|i| a.0[i].mul_add(b.0[i], c.0[i]))
    }

    /// `vpermps`: lane `i` takes lane `idx[i] mod 16` of `a`.
    pub(super) fn _mm512_permutexvar_ps(idx: M512i, a: __m512) -> __m512 {
        map(|i| a.0[(idx.0[i] & 15) as usize])
    }

    /// `vpmovsxbd`: 16 bytes sign-extended to 32 bits.
    pub(super) fn _mm512_cvtepi8_epi32(a: __m128i) -> M512i {
        // SAFETY: 16 bytes reinterpreted as 16 bytes.
        let b: [i8; 16] = unsafe { std::mem::transmute(a) };
        M512i(b.map(|v| i32::from(v) as u32))
    }

    /// `vpmovzxwd`: 16 16-bit words zero-extended to 32 bits.
    pub(super) fn _mm512_cvtepu16_epi32(a: __m256i) -> M512i {
        // SAFETY: 32 bytes reinterpreted as 16 words.
        let w: [u16; 16] = unsafe { std::mem::transmute(a) };
        M512i(w.map(u32::from))
    }

    /// `vpsrlvd`: each lane shifted right (logically) by its own count; counts above 31 give 0.
    pub(super) fn _mm512_srlv_epi32(a: M512i, count: M512i) -> M512i {
        M512i(std::array::from_fn(|i| {
            a.0[i].checked_shr(count.0[i]).unwrap_or(0)
        }))
    }

    /// `vpslld` by an immediate: counts above 31 give 0.
    pub(super) fn _mm512_slli_epi32<const IMM8: u32>(a: M512i) -> M512i {
        M512i(a.0.map(|v| v.checked_shl(IMM8).unwrap_or(0)))
    }

    /// `vcvtdq2ps`: signed 32-bit integers to f32, rounded to nearest even.
    pub(super) fn _mm512_cvtepi32_ps(a: M512i) -> __m512 {
        map(|i| a.0[i] as i32 as f32)
    }

    /// `vcvtph2ps`: 16 IEEE half-precision values to f32 (exact).
    pub(super) fn _mm512_cvtph_ps(a: __m256i) -> __m512 {
        // SAFETY: 32 bytes reinterpreted as 16 words.
        let h: [u16; 16] = unsafe { std::mem::transmute(a) };
        __m512(h.map(|v| half::f16::from_bits(v).to_f32()))
    }

    pub(super) fn _mm512_castsi512_ps(a: M512i) -> __m512 {
        __m512(a.0.map(f32::from_bits))
    }

    pub(super) fn _mm512_castps_pd(a: __m512) -> M512d {
        M512d(std::array::from_fn(|i| {
            u64::from(a.0[2 * i].to_bits()) | u64::from(a.0[2 * i + 1].to_bits()) << 32
        }))
    }

    /// The low 8 lanes.
    pub(super) fn _mm512_castps512_ps256(a: __m512) -> __m256 {
        let lo: [f32; 8] = std::array::from_fn(|i| a.0[i]);
        // SAFETY: 8 f32 reinterpreted as a 256-bit vector.
        unsafe { std::mem::transmute(lo) }
    }

    /// `vextractf64x4`: the low (`IMM8` even) or high (odd) four f64 lanes.
    pub(super) fn _mm512_extractf64x4_pd<const IMM8: i32>(a: M512d) -> __m256d {
        let half: [u64; 4] = std::array::from_fn(|i| a.0[4 * (IMM8 as usize & 1) + i]);
        // SAFETY: 4 f64 bit patterns reinterpreted as a 256-bit vector.
        unsafe { std::mem::transmute(half) }
    }
}
