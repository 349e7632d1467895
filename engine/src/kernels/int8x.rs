//! MXFP4 weights times int8-quantized inputs ([`Mat::Mxfp4Int8`], the opt-in
//! `--int8-experts` path): each block of 32 inputs is rounded to int8 with one f32 scale
//! (max |x| / 127), the 4-bit weights times two are small integers (0, ±1, ±2, ±3, ±4, ±6,
//! ±8, ±12), and a block's 32 products are summed exactly in integers before the two
//! scales are applied once. Approximate (the rounding of the inputs); never the default.
//! The inputs' quantization is in [`quantize`](mod@self::quantize), the row-lane kernel for
//! more than [`POSITIONS`] positions in [`lane`]; the other kernels and the reference are here.
//!
//! # One arithmetic on every ISA
//!
//! The result is defined by the scalar reference ([`reference_rows`]) and every ISA computes
//! exactly it, as the exact formats do (see [`super`]'s "Same bits on every ISA"). For a row
//! and a position: block `b`'s integer sum `isum_b` (exact: `|isum_b| <= 32 · 12 · 127 <
//! 2^24`, so exact as an f32 too), its factor `f_b = d_b · (SCALE[s_b] · 0.5)` (the input scale
//! times half the weights' E8M0 scale: one f32 multiply), then eight f32 lanes, block `b` going
//! to lane `b mod 8` with one fused multiply-add `acc = fma(isum_b, f_b, acc)`, in increasing
//! `b`, then a fixed halving tree over the lanes (`l + 4`, `l + 2`, `l + 1`). Integers are
//! summed in whatever order an ISA likes (exact in any order); only the f32 steps have an
//! order, and eight blocks' worth of them is one vector multiply and one vector fused
//! multiply-add. (A lane that gets no block in a step, past the last block, is left unchanged
//! or gets `fma(0, 0, acc)`, which is `acc`: a lane never holds -0, since it starts at +0 and
//! every product is a multiple of 2^-149, so a sum is zero only when exact, and then +0.)
//!
//! # Layout of the quantized inputs
//!
//! Inputs reach the kernels in the layout [`quantize()`] writes, in place of the f32 inputs
//! (the same length; every ISA quantizes with this one function, in AVX-512 or AVX2 vectors
//! where the CPU has them and one element at a time elsewhere, the same arithmetic either way,
//! so the integers are the same on every CPU). Per position of `cols` slots: first the `cols` int8 values (a
//! quarter of the slots), then the `cols / 32` block scales `d_b`, then the blocks' offsets
//! `-12 · Σ q` (i32, for the x86 kernels below). The int8 values of each group of eight
//! blocks (256 bytes) are interleaved so that one 64-byte load meets a 4-byte word of each of
//! the eight blocks twice, in the order the AVX-512 kernel decodes the weights ([`byte_at`]):
//! integer lane `l` of every load belongs to block `l mod 8`, so summing the loads' products
//! lane by lane and adding the register's two halves leaves one exact sum per block, with no
//! transposition of sums. The blocks past the last whole group lie one after another, each's
//! even elements then its odd ones.
//!
//! # Kernels
//!
//! - **AVX-512 with VNNI, more than [`POSITIONS`] positions** ([`lane_rows`], the prefill of
//!   any expert with more than eight of a prompt's tokens): integer lane `k` of every register
//!   is row `k` of a tile of sixteen rows, so one `vpdpbusd` multiplies four weights of each of
//!   sixteen rows by the same four inputs (broadcast from memory; the weights `2w + 12`
//!   unsigned, the inputs signed), and a block's eight such give sixteen rows' exact sums
//!   with no sums transposed. The tile is decoded once per call of up to
//!   [`LANE_POSITIONS`]: the rows' nibbles transposed by words, looked up, written to a
//!   thread-local buffer lane `b mod 8` by lane, which every position then walks in that order,
//!   so each f32 lane of the reference is one register per position (the f32 step is one
//!   conversion, one multiply, one fused multiply-add per block and sixteen rows; the tree adds
//!   the eight lanes' registers). Zen 4, one thread, 2880 x 2880 rows from cache or 46080
//!   streamed (`kernel_min mxfp4-int8 P`): 262-295 GFLOP/s-equivalent at 32 and 64
//!   positions, 56-63% of the `vpdpbusd` peak, against 169-185 for the kernel below; 1.2-1.4x
//!   it at 12 and 16; level at 8, so it takes 9 positions and more ([`LANE_MIN_POSITIONS`];
//!   docs/performance.md has the table).
//! - **AVX-512 with VNNI, up to eight positions** (`vpdpbusd`, u8 × s8 summed by fours into
//!   i32): per group of eight blocks and row, two loads of the nibbles, two two-source dword
//!   permutes into the order above, a nibble split and a byte-table lookup giving `2w + 12`
//!   (in 0..=24, unsigned);
//!   per position four `vpdpbusd` with the inputs straight from memory, summing onto the
//!   blocks' offsets in the register's low half (`Σ (2w + 12) q − 12 Σ q = Σ 2w q`; 1.02x
//!   against adding them after), one add of the register's halves, then one conversion, one
//!   multiply and one fused multiply-add of eight lanes. Two rows at a time,
//!   so each 64-byte load of inputs feeds two `vpdpbusd` (1.03x on Zen 4, one thread, 8 and
//!   16 positions); the eight-lane sums use AVX-512 VL, which lets them live in any of the 32
//!   registers (without it LLVM spilled them to the stack; a CPU with AVX-512 BW but no VL
//!   runs the AVX2 kernel). On Zen 4 the kernel reaches about 39% of the `vpdpbusd` peak
//!   (`kernel_min peak`: one 512-bit `vpdpbusd` a cycle, 468 GOP/s a thread): a position
//!   costs about 8.5 cycles per group of eight blocks where its four `vpdpbusd` need 4 (the
//!   same steps with inputs in L1 and no weights to decode: 5.9), and a group's decode about
//!   18. Not understood further; 16 positions a call (inputs past L1) and column slabs (inputs
//!   kept in L1) were slower or no faster.
//! - **AVX-512 without VNNI** (BW): the same with `vpmaddubsw` (pairs into i16, at most
//!   4 · 2 · 24 · 127 after four loads' sums) and one `vpmaddwd` by ones in place of the four
//!   `vpdpbusd`.
//! - **AVX2**: the same 256 bits at a time (`vpmaddubsw`, `vpmaddwd`), the weights' words
//!   transposed with in-lane unpacks.
//! - **NEON**: signed weights (`2w`) by signed inputs (`SMULL`/`SMLAL` into i16 lanes, a word
//!   of one block per four lanes), pairwise widening adds into one i32 sum per block.
//! - Blocks past the last whole group: each kernel call copies each position's into a whole
//!   group's layout with zeros for the missing blocks ([`Tail`]), and each row's nibbles and
//!   scale bytes likewise, and runs them as one more group (GPT-OSS's 2880 columns are 11
//!   groups and 2 blocks).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Mat, SCALE};

/// Twice each FP4 value, by nibble.
const W2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// What the x86 kernels add to each doubled weight to make it unsigned (`vpmaddubsw` and
/// `vpdpbusd` take one unsigned operand); the layout's per-block offsets take it out again.
#[cfg(target_arch = "x86_64")]
const BIAS: i8 = 12;

/// Lanes of the f32 accumulator (and blocks per interleaved group).
const LANES: usize = 8;

/// Bytes of int8 inputs in a group of [`LANES`] blocks.
const GROUP: usize = 32 * LANES;

/// Where, within a position's int8 values (`nb` blocks), element `e` of block `b` lies: in a
/// whole group of eight blocks, byte `m` of 4-byte word `l` of 64-byte row `k` of the group
/// holds, for block `l mod 8`, the low (`k` even) or high (`k` odd) nibble of the block's
/// weight byte `4 j + m`, with `j = 2 (k / 2) + l / 8` (the order of the AVX-512 decode:
/// words `j` = 0 and 1 of the eight blocks' nibbles in the first two rows, low then high
/// nibbles; words 2 and 3 in the last two). Blocks past the last whole group: contiguous,
/// even elements (low nibbles) then odd ones.
pub(super) fn byte_at(nb: usize, b: usize, e: usize) -> usize {
    let (t, odd) = (e / 2, e % 2);
    if b < nb / LANES * LANES {
        let (g, i) = (b / LANES, b % LANES);
        let (j, m) = (t / 4, t % 4);
        let k = 2 * (j / 2) + odd;
        let l = i + LANES * (j % 2);
        GROUP * g + 64 * k + 4 * l + m
    } else {
        32 * b + 16 * odd + t
    }
}

/// A position's quantized inputs: int8 values, block scales, block offsets (as f32 slots).
fn position(xs: &[f32], cols: usize, q: usize) -> (&[i8], &[f32], &[f32]) {
    let nb = cols / 32;
    let x = &xs[q * cols..(q + 1) * cols];
    let (v, rest) = x.split_at(cols / 4);
    // SAFETY: the slots' memory read as bytes: in bounds (`4 * v.len()` bytes), `i8` has no
    // alignment or validity requirements, and nothing writes `xs` while it is borrowed.
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr() as *const i8, cols) };
    (bytes, &rest[..nb], &rest[nb..2 * nb])
}

/// Where one group of eight blocks of a position's inputs lies: its 256 int8 values (in the
/// order [`byte_at`] gives a whole group), eight block scales and eight offsets.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[derive(Clone, Copy)]
struct GroupInputs {
    q: *const u8,
    d: *const f32,
    /// (NEON multiplies signed weights and needs no offsets.)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    offsets: *const i32,
}

/// A position's blocks past its last whole group, laid out as a whole group: their int8
/// values where [`byte_at`] puts a whole group's, zeros for the missing blocks (and zero
/// scales and offsets), so the SIMD kernels run the tail as one more group. A missing block's
/// lane gets `fma(0, 0, acc)`, which leaves it as it is (module doc).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[repr(C, align(64))]
struct Tail {
    q: [u8; GROUP],
    d: [f32; LANES],
    offsets: [i32; LANES],
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
impl Tail {
    /// Position `p`'s tail (all zeros if `cols / 32` is a multiple of eight).
    fn of(xs: &[f32], cols: usize, p: usize) -> Self {
        let nb = cols / 32;
        let base = nb / LANES * LANES;
        let mut t = Self {
            q: [0; GROUP],
            d: [0.0; LANES],
            offsets: [0; LANES],
        };
        if base < nb {
            let (v, d, offsets) = position(xs, cols, p);
            for i in 0..nb - base {
                // Four elements `2 (4 j + m) + odd` lie side by side in both layouts.
                for j in 0..4 {
                    for odd in 0..2 {
                        let (to, from) = (
                            byte_at(LANES, i, 8 * j + odd),
                            byte_at(nb, base + i, 8 * j + odd),
                        );
                        for m in 0..4 {
                            t.q[to + m] = v[from + m] as u8;
                        }
                    }
                }
                t.d[i] = d[base + i];
                t.offsets[i] = offsets[base + i].to_bits() as i32;
            }
        }
        t
    }
}

/// The inputs of `P` positions, group by group.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
struct Positions<const P: usize> {
    /// Each position's first slot.
    base: [*const f32; P],
    cols: usize,
    /// Whole groups of eight blocks.
    groups: usize,
    tails: [Tail; P],
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
impl<const P: usize> Positions<P> {
    /// The first `P` positions of `xs` (positions past `p` repeat position `p - 1`).
    ///
    /// # Panics
    /// If `xs` holds fewer than `min(p, P)` positions of `cols` slots, or `p` is 0.
    fn new(xs: &[f32], cols: usize, p: usize) -> Self {
        assert!(p > 0 && xs.len() >= p.min(P) * cols);
        let at = |q: usize| q.min(p - 1);
        Self {
            base: std::array::from_fn(|q| xs[at(q) * cols..].as_ptr()),
            cols,
            groups: cols / 32 / LANES,
            tails: std::array::from_fn(|q| Tail::of(xs, cols, at(q))),
        }
    }

    /// Groups of eight blocks to run, the tail included.
    fn all_groups(&self) -> usize {
        (self.cols / 32).div_ceil(LANES)
    }

    /// Group `g` (`< all_groups()`) of position `q`.
    #[inline(always)]
    fn group(&self, q: usize, g: usize) -> GroupInputs {
        if g < self.groups {
            let (cols, base) = (self.cols, self.base[q]);
            // SAFETY: group `g` lies within the position (`new` checked its length); the
            // int8 values take the first `cols / 4` slots, the scales and offsets the next
            // `cols / 32` each.
            unsafe {
                GroupInputs {
                    q: (base as *const u8).add(GROUP * g),
                    d: base.add(cols / 4 + LANES * g),
                    offsets: (base.add(cols / 4 + cols / 32) as *const i32).add(LANES * g),
                }
            }
        } else {
            let t = &self.tails[q];
            GroupInputs {
                q: t.q.as_ptr(),
                d: t.d.as_ptr(),
                offsets: t.offsets.as_ptr(),
            }
        }
    }
}

/// The weights of group `g` of a row (nibbles at `b`, scale bytes at `s`, `nb` blocks): 128
/// bytes of nibbles and 8 scale bytes, in place, or for the tail copied into `w` and `s8`
/// with zeros for the missing blocks.
///
/// # Safety
/// The row's `16 nb` nibble bytes and `nb` scale bytes are readable.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn row_group(
    b: *const u8,
    s: *const u8,
    nb: usize,
    g: usize,
    w: &mut [u8; 16 * LANES],
    s8: &mut [u8; LANES],
) -> (*const u8, *const u8) {
    // SAFETY: within the row (caller).
    unsafe {
        if LANES * (g + 1) <= nb {
            (b.add(16 * LANES * g), s.add(LANES * g))
        } else {
            let r = nb - LANES * g;
            std::ptr::copy_nonoverlapping(b.add(16 * LANES * g), w.as_mut_ptr(), 16 * r);
            std::ptr::copy_nonoverlapping(s.add(LANES * g), s8.as_mut_ptr(), r);
            (w.as_ptr(), s8.as_ptr())
        }
    }
}

/// Sums the eight lanes in the reference's order: `l + 4`, then `l + 2`, then `l + 1`.
fn tree(a: [f32; LANES]) -> f32 {
    let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// How far ahead (bytes of blocks) the one-position x86 kernels prefetch.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Rows the AVX-512 kernels take at once, sharing each load of a position's inputs.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 2;

/// Most positions one SIMD call takes (one row's decode shared by all of them).
pub(super) const POSITIONS: usize = 8;

/// Most positions one call of `ISA`'s kernel takes: [`LANE_POSITIONS`] for the row-lane
/// VNNI kernel, else [`POSITIONS`].
pub(super) fn positions(isa: super::Isa) -> usize {
    #[cfg(target_arch = "x86_64")]
    if x86_kernel(isa) == Some(X86::Avx512Vnni) {
        return LANE_POSITIONS;
    }
    let _ = isa;
    POSITIONS
}

/// The x86 kernel `ISA` runs on this CPU.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum X86 {
    Avx2,
    Avx512Bw,
    Avx512Vnni,
}

#[cfg(target_arch = "x86_64")]
fn x86_kernel(isa: super::Isa) -> Option<X86> {
    use std::sync::OnceLock;
    static VNNI: OnceLock<bool> = OnceLock::new();
    static VL: OnceLock<bool> = OnceLock::new();
    match isa {
        // VL: the kernels' eight-lane sums in any of the 32 registers (without it, 256-bit
        // operations reach only the first 16, and the accumulators spilled to the stack).
        super::Isa::Avx512
            if super::avx512::supported()
                && *VL.get_or_init(|| is_x86_feature_detected!("avx512vl")) =>
        {
            let vnni = *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni"));
            Some(if vnni { X86::Avx512Vnni } else { X86::Avx512Bw })
        }
        // The AVX-512 ISA emulated in tests (a CPU without AVX-512) runs the AVX2 kernel.
        super::Isa::Avx2 | super::Isa::Avx512 if super::avx2::supported() => Some(X86::Avx2),
        _ => None,
    }
}

/// Integer multiply-add operations (two per u8 x s8 product, to compare with FLOPs) done by a
/// burst of the dot-product step `ISA`'s int8 kernel uses, on 12 independent register sums
/// (for [`super::peak_int8_ops`]): `vpdpbusd` on 512 bits where the CPU has VNNI, else
/// `vpmaddubsw` pairs widened by `vpmaddwd` as the AVX-512 BW and AVX2 kernels sum them (four
/// products to one widening). `None` where the path has no SIMD kernel measured here (NEON,
/// scalar).
pub(super) fn dot_burst(isa: super::Isa) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = x86_kernel(isa) {
        // SAFETY: the kernel's features were detected on this CPU.
        return Some(unsafe {
            match k {
                X86::Avx512Vnni => vnni_burst(),
                X86::Avx512Bw => bw_burst(),
                X86::Avx2 => avx2_burst(),
            }
        });
    }
    let _ = isa;
    None
}

/// Independent sums of a burst, and steps of each.
#[cfg(target_arch = "x86_64")]
const BURST: (usize, usize) = (12, 1 << 13);

/// # Safety
/// The CPU has AVX-512 F and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni_burst() -> f64 {
    let (chains, steps) = BURST;
    let w = _mm512_set1_epi8(std::hint::black_box(3));
    let x = _mm512_set1_epi8(std::hint::black_box(-5));
    let mut acc = [_mm512_setzero_si512(); BURST.0];
    for _ in 0..steps {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, w, x);
        }
    }
    std::hint::black_box(acc);
    (2 * 64 * chains * steps) as f64
}

/// # Safety
/// The CPU has AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bw_burst() -> f64 {
    let (chains, steps) = BURST;
    let w = _mm512_set1_epi8(std::hint::black_box(3));
    let x = _mm512_set1_epi8(std::hint::black_box(5));
    let y = _mm512_set1_epi8(std::hint::black_box(7));
    let z = _mm512_set1_epi8(std::hint::black_box(11));
    let ones = _mm512_set1_epi16(1);
    let mut acc = [_mm512_setzero_si512(); BURST.0];
    for _ in 0..steps / 4 {
        for v in acc.iter_mut() {
            // Four products of the sum's own bytes (so that none is hoisted out of the loop).
            let s = _mm512_add_epi16(
                _mm512_add_epi16(_mm512_maddubs_epi16(w, *v), _mm512_maddubs_epi16(x, *v)),
                _mm512_add_epi16(_mm512_maddubs_epi16(y, *v), _mm512_maddubs_epi16(z, *v)),
            );
            *v = _mm512_add_epi32(*v, _mm512_madd_epi16(s, ones));
        }
    }
    std::hint::black_box(acc);
    (2 * 64 * chains * (steps / 4 * 4)) as f64
}

/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_burst() -> f64 {
    let (chains, steps) = BURST;
    let w = _mm256_set1_epi8(std::hint::black_box(3));
    let x = _mm256_set1_epi8(std::hint::black_box(5));
    let y = _mm256_set1_epi8(std::hint::black_box(7));
    let z = _mm256_set1_epi8(std::hint::black_box(11));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); BURST.0];
    for _ in 0..steps / 4 {
        for v in acc.iter_mut() {
            // Four products of the sum's own bytes (so that none is hoisted out of the loop).
            let s = _mm256_add_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(w, *v), _mm256_maddubs_epi16(x, *v)),
                _mm256_add_epi16(_mm256_maddubs_epi16(y, *v), _mm256_maddubs_epi16(z, *v)),
            );
            *v = _mm256_add_epi32(*v, _mm256_madd_epi16(s, ones));
        }
    }
    std::hint::black_box(acc);
    (2 * 32 * chains * (steps / 4 * 4)) as f64
}

/// Rows `r0 .. r0 + n` for `p` quantized positions on `ISA`: on the AVX-512 ISA the VNNI
/// kernel where the CPU has VNNI, else the AVX-512 BW one; the AVX2 kernel for the AVX2 ISA
/// (and the AVX-512 ISA emulated in tests); the NEON kernel for NEON; else the scalar
/// reference. All give the reference's bits.
pub(super) fn rows(
    isa: super::Isa,
    w: &Mat<'_>,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    super::check_rows(w, r0, n, xs, p, out);
    let Mat::Mxfp4Int8 {
        blocks,
        scales,
        cols,
        ..
    } = *w
    else {
        unreachable!("int8x takes only Mxfp4Int8 weights")
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(k) = x86_kernel(isa) {
        if k == X86::Avx512Vnni && (LANE_MIN_POSITIONS..=LANE_POSITIONS).contains(&p) {
            // SAFETY: the kernel's features were detected on this CPU; bounds checked above.
            unsafe { lane_rows(blocks, scales, cols, r0, n, xs, p, out) };
            return;
        }
        if p <= POSITIONS {
            // SAFETY: as above.
            unsafe { x86_rows(k, blocks, scales, cols, r0, n, xs, p, out) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if isa == super::Isa::Neon && p <= POSITIONS && super::neon::supported() {
        // SAFETY: NEON detected on this CPU; bounds checked above.
        unsafe { neon_rows(blocks, scales, cols, r0, n, xs, p, out) };
        return;
    }
    let _ = isa;
    reference_rows(blocks, scales, cols, r0, n, xs, p, out)
}

/// Scalar reference: per block the exact integer sum of weights (times two) by quantized
/// inputs, times `d_b · (SCALE[s_b] · 0.5)`, fused into lane `b mod 8`; then [`tree`].
#[allow(clippy::too_many_arguments)]
pub(super) fn reference_rows(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    let nb = cols / 32;
    // Where each element of each block lies (the same for every row and position).
    let at: Vec<[usize; 32]> = (0..nb)
        .map(|b| std::array::from_fn(|e| byte_at(nb, b, e)))
        .collect();
    for q in 0..p {
        let (x, d, _) = position(xs, cols, q);
        for i in 0..n {
            let r = r0 + i;
            let mut acc = [0f32; LANES];
            for (b, at) in at.iter().enumerate() {
                let wb = &blocks[(r * nb + b) * 16..(r * nb + b + 1) * 16];
                let mut isum = 0i32;
                for (t, &wbyte) in wb.iter().enumerate() {
                    let even = W2[(wbyte & 15) as usize] as i32;
                    let odd = W2[(wbyte >> 4) as usize] as i32;
                    isum += even * x[at[2 * t]] as i32 + odd * x[at[2 * t + 1]] as i32;
                }
                let f = d[b] * (SCALE[scales[r * nb + b] as usize] * 0.5);
                acc[b % LANES] = (isum as f32).mul_add(f, acc[b % LANES]);
            }
            out[q * n + i] = tree(acc);
        }
    }
}

/// [`rows`] on x86 kernel `k`, for `p <= POSITIONS`.
///
/// # Safety
/// The CPU has `k`'s features; the arguments passed [`super::check_rows`].
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn x86_rows(
    k: X86,
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match k {
            X86::Avx2 => with_positions!(p, avx2_tile(blocks, scales, cols, r0, n, xs, out)),
            X86::Avx512Bw => {
                with_positions!(p, avx512bw_tile(blocks, scales, cols, r0, n, xs, out))
            }
            X86::Avx512Vnni => {
                with_positions!(p, avx512vnni_tile(blocks, scales, cols, r0, n, xs, out))
            }
        }
    }
}

/// `2w + BIAS` by nibble, for byte shuffles (both 128-bit lanes).
#[cfg(target_arch = "x86_64")]
const BIASED: [i8; 32] = {
    let mut t = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = W2[i % 16] + BIAS;
        i += 1;
    }
    t
};

/// The f32 bits standing for E8M0 scale byte 0 (2^-127, a subnormal), which shifting the
/// byte into the exponent would make 0: the floor both half-scale decodes ([`half_scales`]
/// and the row-lane kernel's) raise the shifted bits to.
#[cfg(target_arch = "x86_64")]
const SCALE_0_BITS: i32 = 0x0040_0000;

/// Half of each E8M0 scale of eight consecutive blocks (`SCALE[s] · 0.5`, exact): the scale
/// byte shifted into an f32's exponent (255 gives +inf), 0 raised to 2^-127's bits, halved.
///
/// # Safety
/// The CPU has AVX2; 8 bytes at `s` are readable.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_scales(s: *const u8) -> __m256 {
    // SAFETY: 8 readable bytes (caller); unaligned load.
    let bytes = unsafe { _mm_loadl_epi64(s as *const __m128i) };
    let bits = _mm256_slli_epi32::<23>(_mm256_cvtepu8_epi32(bytes));
    let bits = _mm256_max_epi32(bits, _mm256_set1_epi32(SCALE_0_BITS));
    _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5))
}

/// The eight biased weight vectors of a group of eight blocks (128 bytes at `b`): vector `h`
/// pairs with the group's input bytes `32 h .. 32 h + 32`, lane `i` of each from block `i`
/// ([`byte_at`]): words `j` of the eight blocks gathered by in-lane unpacks (blocks `i` and
/// `i + 4` share a load), then low and high nibbles looked up in [`BIASED`].
///
/// # Safety
/// The CPU has AVX2; 128 bytes at `b` are readable.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_group_weights(b: *const u8, table: __m256i) -> [__m256i; 8] {
    // SAFETY: 128 readable bytes (caller); unaligned loads.
    macro_rules! pair {
        ($a:expr) => {
            unsafe {
                _mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(_mm_loadu_si128(b.add(16 * $a) as *const __m128i)),
                    _mm_loadu_si128(b.add(16 * ($a + 4)) as *const __m128i),
                )
            }
        };
    }
    let q = [pair!(0), pair!(1), pair!(2), pair!(3)];
    let t0 = _mm256_unpacklo_epi32(q[0], q[1]);
    let t1 = _mm256_unpackhi_epi32(q[0], q[1]);
    let t2 = _mm256_unpacklo_epi32(q[2], q[3]);
    let t3 = _mm256_unpackhi_epi32(q[2], q[3]);
    // Word j of blocks 0-3 in the low lane, of blocks 4-7 in the high one.
    let m = [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ];
    let nibble = _mm256_set1_epi8(0x0f);
    macro_rules! lo {
        ($v:expr) => {
            _mm256_shuffle_epi8(table, _mm256_and_si256($v, nibble))
        };
    }
    macro_rules! hi {
        ($v:expr) => {
            _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>($v), nibble))
        };
    }
    [
        lo!(m[0]),
        lo!(m[1]),
        hi!(m[0]),
        hi!(m[1]),
        lo!(m[2]),
        lo!(m[3]),
        hi!(m[2]),
        hi!(m[3]),
    ]
}

/// AVX2 kernel for `P` (1-8) positions: per group of eight blocks, the weights of
/// [`avx2_group_weights`]; per position `vpmaddubsw` of each of the eight vectors with 32
/// input bytes, four such sums added in i16 (at most 4 · 2 · 24 · 127 < 2^15) and widened by
/// `vpmaddwd`, the block offsets added: lane `i` is block `i`'s exact sum. Then one step of the
/// f32 lanes. The tail runs as one more group ([`Tail`]).
///
/// # Safety
/// The CPU has AVX2 and FMA; rows `r0 .. r0 + n` and `P` positions are in bounds.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[inline(never)] // a profile shows each kernel apart
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_tile<const P: usize>(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    out: &mut [f32],
) {
    let nb = cols / 32;
    let x = Positions::<P>::new(xs, cols, P);
    let (mut wbuf, mut sbuf) = ([0u8; 16 * LANES], [0u8; LANES]);
    // SAFETY (whole body): rows `r0 .. r0 + n` of `blocks`/`scales` and `P` positions of
    // `cols` slots of `xs` are in bounds (caller); loads are unaligned.
    unsafe {
        let table = _mm256_loadu_si256(BIASED.as_ptr() as *const __m256i);
        let ones = _mm256_set1_epi16(1);
        for i in 0..n {
            let b = blocks.as_ptr().add((r0 + i) * nb * 16);
            let s = scales.as_ptr().add((r0 + i) * nb);
            let mut acc = [_mm256_setzero_ps(); P];
            for g in 0..x.all_groups() {
                {
                    // The hardware prefetcher alone keeps too few lines in flight: the weights
                    // (and scales) PREFETCH bytes ahead (a hint, harmless past the end).
                    let wb = b.wrapping_add(16 * LANES * g + PREFETCH);
                    _mm_prefetch::<_MM_HINT_T0>(wb as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(64) as *const i8);
                    if g % 8 == 0 {
                        let sb = s.wrapping_add(LANES * g + PREFETCH / 16);
                        _mm_prefetch::<_MM_HINT_T0>(sb as *const i8);
                    }
                }
                let (wb, sb) = row_group(b, s, nb, g, &mut wbuf, &mut sbuf);
                let w = avx2_group_weights(wb, table);
                let half = half_scales(sb);
                for (q, acc) in acc.iter_mut().enumerate() {
                    let xg = x.group(q, g);
                    macro_rules! ld {
                        ($h:expr) => {
                            _mm256_loadu_si256(xg.q.add(32 * $h) as *const __m256i)
                        };
                    }
                    let a = _mm256_add_epi16(
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[0], ld!(0)),
                            _mm256_maddubs_epi16(w[1], ld!(1)),
                        ),
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[2], ld!(2)),
                            _mm256_maddubs_epi16(w[3], ld!(3)),
                        ),
                    );
                    let c = _mm256_add_epi16(
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[4], ld!(4)),
                            _mm256_maddubs_epi16(w[5], ld!(5)),
                        ),
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(w[6], ld!(6)),
                            _mm256_maddubs_epi16(w[7], ld!(7)),
                        ),
                    );
                    let isum = _mm256_add_epi32(
                        _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones)),
                        _mm256_loadu_si256(xg.offsets as *const __m256i),
                    );
                    let f = _mm256_mul_ps(_mm256_loadu_ps(xg.d), half);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, *acc);
                }
            }
            for q in 0..P {
                // `hsum` sums `l + 4`, `l + 2`, `l + 1`: the reference's tree.
                out[q * n + i] = super::avx2::hsum(acc[q]);
            }
        }
    }
}

/// Source dwords (blocks 0-3 then 4-7, four words each) of the AVX-512 decode's two nibble
/// registers: lane `l` takes word `l / 8` (then `2 + l / 8`) of block `l mod 8`.
#[cfg(target_arch = "x86_64")]
const PERMUTE: [[i32; 16]; 2] = {
    let mut t = [[0i32; 16]; 2];
    let mut l = 0;
    while l < 16 {
        t[0][l] = (4 * (l % 8) + l / 8) as i32;
        t[1][l] = (4 * (l % 8) + 2 + l / 8) as i32;
        l += 1;
    }
    t
};

/// The AVX-512 kernels, with and without VNNI: `$dot(w, x)` sums four 64-byte products of
/// biased weights by inputs into sixteen i32 lanes.
#[cfg(target_arch = "x86_64")]
macro_rules! avx512_tile {
    ($(#[$doc:meta])* $name:ident, $features:literal, $dot:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU has the features named; rows `r0 .. r0 + n` and `P` positions are in bounds.
        #[allow(clippy::too_many_arguments)]
        #[inline(never)] // a profile shows each kernel apart
        #[target_feature(enable = $features)]
        unsafe fn $name<const P: usize>(
            blocks: &[u8],
            scales: &[u8],
            cols: usize,
            r0: usize,
            n: usize,
            xs: &[f32],
            out: &mut [f32],
        ) {
            let nb = cols / 32;
            let x = Positions::<P>::new(xs, cols, P);
            let (mut wbuf, mut sbuf) = ([0u8; 16 * LANES], [0u8; LANES]);
            // SAFETY (whole body): rows `r0 .. r0 + n` of `blocks`/`scales` and `P` positions
            // of `cols` slots of `xs` are in bounds (caller); loads are unaligned.
            unsafe {
                let table =
                    _mm512_broadcast_i32x4(_mm_loadu_si128(BIASED.as_ptr() as *const __m128i));
                let nibble = _mm512_set1_epi8(0x0f);
                let idx0 = _mm512_loadu_si512(PERMUTE[0].as_ptr() as *const __m512i);
                let idx1 = _mm512_loadu_si512(PERMUTE[1].as_ptr() as *const __m512i);
                // Each position's int8 values, block scales and offsets (whole groups).
                let whole = x.groups;
                let xq: [*const u8; P] = std::array::from_fn(|q| x.base[q] as *const u8);
                let xd: [*const f32; P] = std::array::from_fn(|q| x.base[q].add(cols / 4));
                let xo: [*const i32; P] =
                    std::array::from_fn(|q| x.base[q].add(cols / 4 + nb) as *const i32);
                // `R` rows at a time: each position's inputs are loaded once for all of them.
                macro_rules! pass {
                    ($r:literal, $i:expr) => {{
                        let i: usize = $i;
                        let b: [*const u8; $r] =
                            std::array::from_fn(|k| blocks.as_ptr().add((r0 + i + k) * nb * 16));
                        let s: [*const u8; $r] =
                            std::array::from_fn(|k| scales.as_ptr().add((r0 + i + k) * nb));
                        let mut acc = [[_mm256_setzero_ps(); P]; $r];
                        for g in 0..x.all_groups() {
                            let mut w = [[_mm512_setzero_si512(); 4]; $r];
                            let mut half = [_mm256_setzero_ps(); $r];
                            for k in 0..$r {
                                // As in the AVX2 kernel.
                                let wb = b[k].wrapping_add(16 * LANES * g + PREFETCH);
                                _mm_prefetch::<_MM_HINT_T0>(wb as *const i8);
                                _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(64) as *const i8);
                                if g % 8 == 0 {
                                    let sb = s[k].wrapping_add(LANES * g + PREFETCH / 16);
                                    _mm_prefetch::<_MM_HINT_T0>(sb as *const i8);
                                }
                                let (wb, sb) = row_group(b[k], s[k], nb, g, &mut wbuf, &mut sbuf);
                                let r0v = _mm512_loadu_si512(wb as *const __m512i);
                                let r1v = _mm512_loadu_si512(wb.add(64) as *const __m512i);
                                let n0 = _mm512_permutex2var_epi32(r0v, idx0, r1v);
                                let n1 = _mm512_permutex2var_epi32(r0v, idx1, r1v);
                                w[k] = [
                                    _mm512_shuffle_epi8(table, _mm512_and_si512(n0, nibble)),
                                    _mm512_shuffle_epi8(
                                        table,
                                        _mm512_and_si512(_mm512_srli_epi16::<4>(n0), nibble),
                                    ),
                                    _mm512_shuffle_epi8(table, _mm512_and_si512(n1, nibble)),
                                    _mm512_shuffle_epi8(
                                        table,
                                        _mm512_and_si512(_mm512_srli_epi16::<4>(n1), nibble),
                                    ),
                                ];
                                half[k] = half_scales(sb);
                            }
                            macro_rules! step {
                                ($xg:expr) => {
                                    for q in 0..P {
                                        let xg: GroupInputs = $xg(q);
                                        let xv: [__m512i; 4] = std::array::from_fn(|h| {
                                            _mm512_loadu_si512(xg.q.add(64 * h) as *const __m512i)
                                        });
                                        // The offsets start the low half's sums.
                                        let off = _mm512_zextsi256_si512(_mm256_loadu_si256(
                                            xg.offsets as *const __m256i,
                                        ));
                                        let d = _mm256_loadu_ps(xg.d);
                                        for k in 0..$r {
                                            let v = $dot(off, &w[k], &xv);
                                            let isum = _mm256_add_epi32(
                                                _mm512_castsi512_si256(v),
                                                _mm512_extracti64x4_epi64::<1>(v),
                                            );
                                            let f = _mm256_mul_ps(d, half[k]);
                                            acc[k][q] = _mm256_fmadd_ps(
                                                _mm256_cvtepi32_ps(isum),
                                                f,
                                                acc[k][q],
                                            );
                                        }
                                    }
                                };
                            }
                            if g < whole {
                                // A whole group: each position's inputs at one offset from its
                                // first slot, with no branch, so the positions' loop unrolls
                                // and the accumulators stay in registers.
                                step!(|q: usize| GroupInputs {
                                    q: xq[q].add(GROUP * g),
                                    d: xd[q].add(LANES * g),
                                    offsets: xo[q].add(LANES * g),
                                });
                            } else {
                                step!(|q: usize| x.group(q, g));
                            }
                        }
                        for (k, acc) in acc.iter().enumerate() {
                            for q in 0..P {
                                // `hsum` sums `l + 4`, `l + 2`, `l + 1`: the reference's tree.
                                out[q * n + i + k] = super::avx2::hsum(acc[q]);
                            }
                        }
                    }};
                }
                let mut i = 0;
                while i + ROWS <= n {
                    pass!(2, i);
                    i += ROWS;
                }
                if i < n {
                    pass!(1, i);
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
avx512_tile!(
    /// AVX-512 VNNI kernel for `P` (1-8) positions, [`ROWS`] rows a pass: per group of eight
    /// blocks and row, two permutes put the nibbles in the inputs' order and a byte lookup
    /// gives the biased weights; per position its inputs loaded once, and for each row four
    /// `vpdpbusd` (one register of sums, lane `l` for block `l mod 8`), its halves added and
    /// the offsets: lane `i` is block `i`'s exact sum. The tail runs as one more group
    /// ([`Tail`]).
    avx512vnni_tile,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    dot_vnni
);

#[cfg(target_arch = "x86_64")]
avx512_tile!(
    /// The AVX-512 kernel for CPUs without VNNI (Skylake-SP): [`avx512vnni_tile`] with each
    /// group's four products summed by `vpmaddubsw`, i16 adds and one `vpmaddwd`.
    avx512bw_tile,
    "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
    dot_bw
);

/// Four `vpdpbusd`: the biased weights `w` by 256 input bytes `x`, added to `init`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dot_vnni(init: __m512i, w: &[__m512i; 4], x: &[__m512i; 4]) -> __m512i {
    let mut v = _mm512_dpbusd_epi32(init, w[0], x[0]);
    v = _mm512_dpbusd_epi32(v, w[1], x[1]);
    v = _mm512_dpbusd_epi32(v, w[2], x[2]);
    _mm512_dpbusd_epi32(v, w[3], x[3])
}

/// [`dot_vnni`] without VNNI: `vpmaddubsw` pairs (at most 2 · 24 · 127), four summed in i16,
/// widened by `vpmaddwd`, added to `init`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dot_bw(init: __m512i, w: &[__m512i; 4], x: &[__m512i; 4]) -> __m512i {
    let s = _mm512_add_epi16(
        _mm512_add_epi16(
            _mm512_maddubs_epi16(w[0], x[0]),
            _mm512_maddubs_epi16(w[1], x[1]),
        ),
        _mm512_add_epi16(
            _mm512_maddubs_epi16(w[2], x[2]),
            _mm512_maddubs_epi16(w[3], x[3]),
        ),
    );
    _mm512_add_epi32(init, _mm512_madd_epi16(s, _mm512_set1_epi16(1)))
}

/// NEON kernel for up to [`POSITIONS`] positions: per group of eight blocks the nibbles'
/// words transposed (`TRN1`/`TRN2`) into the inputs' order and looked up (`TBL`) as signed
/// doubled weights; per position the sixteen 16-byte input vectors multiplied into i16 lanes
/// (`SMULL`/`SMLAL`, at most 8 · 12 · 127 per lane), each four lanes one word of one block,
/// then pairwise widening adds give the eight blocks' exact sums, converted and scaled into
/// the two f32 vectors of the eight lanes. The tail runs as one more group ([`Tail`]).
///
/// # Safety
/// The CPU has NEON; rows `r0 .. r0 + n` and `p <= POSITIONS` positions are in bounds.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn neon_rows(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    r0: usize,
    n: usize,
    xs: &[f32],
    p: usize,
    out: &mut [f32],
) {
    use std::arch::aarch64::*;
    let nb = cols / 32;
    let x = Positions::<POSITIONS>::new(xs, cols, p);
    let (mut wbuf, mut sbuf) = ([0u8; 16 * LANES], [0u8; LANES]);
    // SAFETY (whole body): rows `r0 .. r0 + n` of `blocks`/`scales` and `p` positions of
    // `cols` slots of `xs` are in bounds (caller).
    unsafe {
        let table = vld1q_s8(W2.as_ptr());
        let nibble = vdupq_n_u8(0x0f);
        for i in 0..n {
            let b = blocks.as_ptr().add((r0 + i) * nb * 16);
            let s = scales.as_ptr().add((r0 + i) * nb);
            let mut acc = [[vdupq_n_f32(0.0); 2]; POSITIONS];
            for g in 0..x.all_groups() {
                let (wb, sb) = row_group(b, s, nb, g, &mut wbuf, &mut sbuf);
                // Input vector `c` (16 bytes at `16 c` of the group) holds word
                // `j = 2 (c / 8) + (c / 2) % 2` of blocks `4 (c % 2) .. + 4`, low nibbles
                // for `(c / 4) % 2 == 0` ([`byte_at`]).
                let mut w = [vdupq_n_s8(0); 16];
                for h in 0..2 {
                    let mut v = [vdupq_n_u32(0); 4];
                    for (k, v) in v.iter_mut().enumerate() {
                        *v = vreinterpretq_u32_u8(vld1q_u8(wb.add(16 * (4 * h + k))));
                    }
                    let t0 = vreinterpretq_u64_u32(vtrn1q_u32(v[0], v[1]));
                    let t1 = vreinterpretq_u64_u32(vtrn2q_u32(v[0], v[1]));
                    let t2 = vreinterpretq_u64_u32(vtrn1q_u32(v[2], v[3]));
                    let t3 = vreinterpretq_u64_u32(vtrn2q_u32(v[2], v[3]));
                    // Word j of blocks 4h .. 4h + 4.
                    let m = [
                        vreinterpretq_u8_u64(vtrn1q_u64(t0, t2)),
                        vreinterpretq_u8_u64(vtrn1q_u64(t1, t3)),
                        vreinterpretq_u8_u64(vtrn2q_u64(t0, t2)),
                        vreinterpretq_u8_u64(vtrn2q_u64(t1, t3)),
                    ];
                    for c in (h..16).step_by(2) {
                        let word = m[2 * (c / 8) + (c / 2) % 2];
                        let nib = if (c / 4) % 2 == 0 {
                            vandq_u8(word, nibble)
                        } else {
                            vshrq_n_u8::<4>(word)
                        };
                        w[c] = vqtbl1q_s8(table, nib);
                    }
                }
                let mut half = [0f32; LANES];
                for (k, h) in half.iter_mut().enumerate() {
                    *h = SCALE[*sb.add(k) as usize] * 0.5;
                }
                let half = [vld1q_f32(half.as_ptr()), vld1q_f32(half.as_ptr().add(4))];
                for q in 0..p {
                    let xg = x.group(q, g);
                    let xq = xg.q as *const i8;
                    // Per half `h` (blocks 4h .. 4h + 4): i16 lanes of the low and high 8
                    // bytes of each vector (blocks 4h, 4h + 1 and 4h + 2, 4h + 3).
                    let mut lo16 = [vdupq_n_s16(0); 2];
                    let mut hi16 = [vdupq_n_s16(0); 2];
                    for c in 0..16 {
                        let xv = vld1q_s8(xq.add(16 * c));
                        let h = c % 2;
                        lo16[h] = vmlal_s8(lo16[h], vget_low_s8(w[c]), vget_low_s8(xv));
                        hi16[h] = vmlal_high_s8(hi16[h], w[c], xv);
                    }
                    for h in 0..2 {
                        let sums = vpaddq_s32(vpaddlq_s16(lo16[h]), vpaddlq_s16(hi16[h]));
                        let f = vmulq_f32(vld1q_f32(xg.d.add(4 * h)), half[h]);
                        acc[q][h] = vfmaq_f32(acc[q][h], vcvtq_f32_s32(sums), f);
                    }
                }
            }
            for q in 0..p {
                let mut lanes = [0f32; LANES];
                vst1q_f32(lanes.as_mut_ptr(), acc[q][0]);
                vst1q_f32(lanes.as_mut_ptr().add(4), acc[q][1]);
                out[q * n + i] = tree(lanes);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod lane;
mod quantize;

#[cfg(target_arch = "x86_64")]
pub(super) use lane::LANE_POSITIONS;
#[cfg(target_arch = "x86_64")]
use lane::{lane_rows, LANE_MIN_POSITIONS};
pub(super) use quantize::{quantize, rounded};

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout puts every element of every block at its own byte, within the int8 area.
    #[test]
    fn the_layout_is_a_permutation() {
        for nb in [1, 3, 8, 9, 16, 90] {
            let mut seen = vec![false; 32 * nb];
            for b in 0..nb {
                for e in 0..32 {
                    let at = byte_at(nb, b, e);
                    assert!(!seen[at], "{nb} blocks: byte {at} twice");
                    seen[at] = true;
                }
            }
        }
    }

    /// Each x86 kernel this CPU runs (the AVX-512 one without VNNI too, where the CPU has
    /// VNNI) gives the reference's bits, whatever the number of positions and blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_x86_kernel_gives_the_reference_bits() {
        let mut g = super::super::Gen::new(8);
        let mut kernels = vec![];
        if super::super::avx2::supported() {
            kernels.push(X86::Avx2);
        }
        if super::super::avx512::supported() {
            kernels.push(X86::Avx512Bw);
            if is_x86_feature_detected!("avx512vnni") {
                kernels.push(X86::Avx512Vnni);
            }
        }
        if !kernels.contains(&X86::Avx512Vnni) {
            eprintln!("NOT RUN: this CPU has no AVX-512 VNNI, so that kernel is not checked here");
        }
        if !kernels.contains(&X86::Avx512Bw) {
            eprintln!(
                "NOT RUN: this CPU has no AVX-512, so neither AVX-512 kernel is checked here"
            );
        }
        for nb in [1, 7, 8, 9, 17, 90] {
            let (rows, cols) = (13, 32 * nb);
            let (blocks, scales) = g.mxfp4(rows, cols);
            for p in 1..=POSITIONS {
                let mut xs = g.units(p * cols);
                if nb == 9 {
                    xs[3] = f32::NAN;
                    xs[(p - 1) * cols + 270] = f32::INFINITY;
                }
                let mut q = vec![0f32; xs.len()];
                quantize(&xs, cols, &mut q);
                let mut want = vec![0f32; p * rows];
                reference_rows(&blocks, &scales, cols, 0, rows, &q, p, &mut want);
                for &k in &kernels {
                    let mut got = vec![f32::NAN; p * rows];
                    // SAFETY: `k` was detected; shapes as `check_rows` requires.
                    unsafe { x86_rows(k, &blocks, &scales, cols, 0, rows, &q, p, &mut got) };
                    for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            super::super::verify::same_bits(*a, *b),
                            "{k:?}, {nb} blocks, {p} positions, output {j}: {a:e} vs {b:e}"
                        );
                    }
                }
            }
        }
    }

    /// The row-lane VNNI kernel gives the reference's bits at every position count it takes
    /// (several chunks of eight and a partial one), on tiles of sixteen rows, a partial tile
    /// and rows starting past the first, with scale bytes over the whole range (0 and 255
    /// included) and non-finite inputs. Where the CPU has no AVX-512 VNNI (with F, BW and VL)
    /// the kernel cannot run: the test says so on stderr and checks nothing, and `.ci/run`
    /// reports the VNNI kernels' bit tests as not run.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_row_lane_vnni_kernel_gives_the_reference_bits() {
        if x86_kernel(super::super::Isa::Avx512) != Some(X86::Avx512Vnni) {
            eprintln!("NOT RUN: this CPU has no AVX-512 VNNI, so the row-lane kernel cannot run");
            return;
        }
        let mut g = super::super::Gen::new(9);
        for nb in [1, 2, 7, 8, 9, 17, 90] {
            let (rows, cols) = (45, 32 * nb);
            let (blocks, mut scales) = g.mxfp4(rows, cols);
            // Every scale byte somewhere (inputs below 1 keep most sums finite).
            for (i, s) in scales.iter_mut().enumerate().step_by(3) {
                *s = (i / 3 % 256) as u8;
            }
            for p in 1..=LANE_POSITIONS {
                let mut xs = g.units(p * cols);
                if nb == 9 {
                    xs[3] = f32::NAN;
                    xs[(p - 1) * cols + 270] = f32::INFINITY;
                }
                let mut q = vec![0f32; xs.len()];
                quantize(&xs, cols, &mut q);
                // Rows 3 .. 45: two whole tiles and a partial one of ten rows.
                let (r0, n) = (3, rows - 3);
                let mut want = vec![0f32; p * n];
                reference_rows(&blocks, &scales, cols, r0, n, &q, p, &mut want);
                let mut got = vec![f32::NAN; p * n];
                // SAFETY: VNNI was detected; shapes as `check_rows` requires.
                unsafe { lane_rows(&blocks, &scales, cols, r0, n, &q, p, &mut got) };
                for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        super::super::verify::same_bits(*a, *b),
                        "{nb} blocks, {p} positions, output {j}: {a:e} vs {b:e}"
                    );
                }
            }
        }
    }
}
