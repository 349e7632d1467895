//! What bounds the AVX-512 MXFP4 decode kernel on a core: the instruction mix of one block
//! (32 weights, one position) in four decodes, timed alone on one thread over 16 KiB of
//! weights (in L1, so memory plays no part):
//!
//! - `published`: today's kernel (`decode` in `engine/src/kernels/avx512.rs`): per
//!   block two 8-byte broadcasts, two variable shifts (`vpsrlvd`) that bring each lane's
//!   nibble to the bits `vpermps` reads, two `vpermps` table lookups and two fused
//!   multiply-adds;
//! - `interleaved`: the bytes of four consecutive blocks interleaved at a stride of four (a
//!   repacking at load time, not built): four loads at byte offsets 0 to 3 put the low
//!   nibbles in place with no shift, one immediate shift by 4 per load gives the high
//!   nibbles; per block one shift, two lookups, two multiply-adds;
//! - `words`: today's layout with one 32-word lookup per block (not built): the block
//!   broadcast to the four 128-bit lanes, one `vpsrlvd` (128-bit lane `L` shifted by `4L`),
//!   one `vpermw` (AVX-512 BW) into 32 bf16 values (every scaled FP4 value is exact in bf16),
//!   then `vpslld` by 16 and `vpandd` widen the even and the odd words to two f32 vectors; per
//!   block three shift or permute operations and one logical one where today's kernel has
//!   four. It pairs element `e` with `e + 4` in a lane, not `e + 16`, so building it would
//!   change the canonical order of every ISA (`scalar::MXFP4_LANE`);
//! - `no-shift`: the lookups and multiply-adds alone, the bound of any layout of 4-bit codes
//!   that still needs one lookup per 16 weights.
//!
//! On Zen 4 the shifts and the lookups share the same two pipes, so `published` costs about
//! twice `no-shift` (docs/performance.md has the figures). Four rows at a time, as the kernel
//! streams them. Lab tool: `cargo bench -p stormo-engine --bench mxfp4_ports`.

use std::time::Instant;

/// Blocks each layout decodes per timing.
const BLOCKS: usize = 40_000_000;

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            eprintln!("mxfp4_ports: this CPU has no AVX-512 (F and BW)");
            return;
        }
        // 16 KiB of weights with every nibble value, and 64 bytes of slack for the offset loads.
        let bytes: Vec<u8> = (0..(16 << 10) + 64)
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for round in 0..3 {
            for (name, f) in [
                ("published", x86::published as unsafe fn(&[u8]) -> f32),
                ("interleaved", x86::interleaved),
                ("words", x86::words),
                ("no-shift", x86::no_shift),
            ] {
                let t = Instant::now();
                // SAFETY: the CPU runs AVX-512 F and BW (checked above).
                let r = unsafe { f(&bytes) };
                let ns = t.elapsed().as_nanos() as f64 / BLOCKS as f64;
                println!("round {round}  {name:12} {ns:.3} ns per block and row  (sum {r})");
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    eprintln!("mxfp4_ports: x86-64 only");
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Rows decoded side by side.
    const ROWS: usize = 4;

    /// Today's layout and decode; `b` holds 16-byte blocks.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn published(b: &[u8]) -> f32 {
        let table = _mm512_set1_ps(1.0);
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let x = _mm512_set1_ps(0.5);
        let mut acc = [_mm512_setzero_ps(); ROWS];
        let blocks = (b.len() - 64) / 16 - ROWS;
        let p = b.as_ptr();
        for i in 0..super::BLOCKS / ROWS {
            let blk = i % blocks;
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: blocks `blk + k < blocks + ROWS` lie within `b`.
                let q = unsafe { p.add(16 * (blk + k)) };
                let (lo, hi) = unsafe {
                    (
                        _mm512_set1_epi64((q as *const i64).read_unaligned()),
                        _mm512_set1_epi64((q.add(8) as *const i64).read_unaligned()),
                    )
                };
                let w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(lo, shifts), table);
                let w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(hi, shifts), table);
                *a = _mm512_fmadd_ps(w1, x, _mm512_fmadd_ps(w0, x, *a));
            }
        }
        sum(acc)
    }

    /// Four blocks' bytes interleaved at a stride of four; `b` holds 64-byte groups.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn interleaved(b: &[u8]) -> f32 {
        let table = _mm512_set1_ps(1.0);
        let x = _mm512_set1_ps(0.5);
        let mut acc = [_mm512_setzero_ps(); ROWS];
        let groups = (b.len() - 64) / 64 - ROWS;
        let p = b.as_ptr();
        for i in 0..super::BLOCKS / (4 * ROWS) {
            let g = i % groups;
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: group `g + k` and 3 bytes past it lie within `b` (64 bytes of slack).
                let q = unsafe { p.add(64 * (g + k)) };
                for o in 0..4 {
                    let v = unsafe { _mm512_loadu_si512(q.add(o) as *const _) };
                    let w0 = _mm512_permutexvar_ps(v, table);
                    let w1 = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table);
                    *a = _mm512_fmadd_ps(w1, x, _mm512_fmadd_ps(w0, x, *a));
                }
            }
        }
        sum(acc)
    }

    /// Today's layout, one 32-word lookup per block: the block broadcast to the four 128-bit
    /// lanes, one `vpsrlvd` (lane `L` shifted by `4L`), one `vpermw` into 32 bf16 values, then
    /// `vpslld` by 16 (even words) and `vpandd` (odd words) widen them to two f32 vectors.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn words(b: &[u8]) -> f32 {
        let table = _mm512_set1_epi16(0x3f80);
        let shifts = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let x = _mm512_set1_ps(0.5);
        let mut acc = [_mm512_setzero_ps(); ROWS];
        let blocks = (b.len() - 64) / 16 - ROWS;
        let p = b.as_ptr();
        for i in 0..super::BLOCKS / ROWS {
            let blk = i % blocks;
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: blocks `blk + k < blocks + ROWS` lie within `b`.
                let q = unsafe { p.add(16 * (blk + k)) };
                let v = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(q as *const __m128i)) };
                let w = _mm512_permutexvar_epi16(_mm512_srlv_epi32(v, shifts), table);
                let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                let w1 = _mm512_castsi512_ps(_mm512_and_si512(w, high));
                *a = _mm512_fmadd_ps(w1, x, _mm512_fmadd_ps(w0, x, *a));
            }
        }
        sum(acc)
    }

    /// Two lookups and two multiply-adds per block, no shift.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn no_shift(b: &[u8]) -> f32 {
        let table = _mm512_set1_ps(1.0);
        let x = _mm512_set1_ps(0.5);
        let mut acc = [_mm512_setzero_ps(); ROWS];
        let groups = (b.len() - 64) / 64 - ROWS;
        let p = b.as_ptr();
        for i in 0..super::BLOCKS / (4 * ROWS) {
            let g = i % groups;
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: group `g + k` lies within `b`.
                let v = unsafe { _mm512_loadu_si512(p.add(64 * (g + k)) as *const _) };
                for _ in 0..4 {
                    let w0 = _mm512_permutexvar_ps(v, table);
                    let w1 = _mm512_permutexvar_ps(v, table);
                    *a = _mm512_fmadd_ps(w1, x, _mm512_fmadd_ps(w0, x, *a));
                }
            }
        }
        sum(acc)
    }

    #[target_feature(enable = "avx512f")]
    fn sum(acc: [__m512; ROWS]) -> f32 {
        let s = acc
            .iter()
            .fold(_mm512_setzero_ps(), |s, &a| _mm512_add_ps(s, a));
        _mm512_reduce_add_ps(s)
    }
}
