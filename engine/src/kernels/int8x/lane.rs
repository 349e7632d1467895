//! The row-lane AVX-512 VNNI kernel ([`lane_rows`]) for calls of more than
//! [`super::POSITIONS`] positions: integer lane `k` of every register is row `k` of a tile of
//! sixteen rows, decoded once per call into a thread-local tile that every position walks in
//! the reference's lane order (the parent module's docs say how and what it measured).

use std::arch::x86_64::*;

use super::{BIASED, GROUP, LANES, POSITIONS, SCALE_0_BITS};

/// Rows of one tile of the row-lane VNNI kernel: one per i32 lane of a 512-bit register.
const LANE_ROWS: usize = 16;

/// Most positions one call of the row-lane VNNI kernel takes: its tile's decode is shared by
/// all of them, [`CHUNK`] at a time.
pub(in crate::kernels) const LANE_POSITIONS: usize = 64;

/// Positions the row-lane kernel's inner loop takes at once (their sums held in registers).
const CHUNK: usize = 8;

/// Fewest positions for which the row-lane kernel beats [`avx512vnni_tile`](super::avx512vnni_tile), whose decode
/// goes straight into registers with no tile written and read back (Zen 4, one thread,
/// weights streamed from memory, `KERNEL_MIN_ROWS=46080 kernel_min mxfp4-int8 P 10 avx512`,
/// builds alternated twice: at 3-7 positions the row-lane kernel took 1.05-1.35x as long, at
/// 8 about the same, at 10 and 12 0.83-0.88x).
pub(super) const LANE_MIN_POSITIONS: usize = POSITIONS + 1;

thread_local! {
    /// The row-lane kernel's decoded tile, reused from call to call (taken while in use).
    static LANE_TILE: std::cell::Cell<Vec<__m512i>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Where, in a position's int8 values, the eight 4-byte words of block `b` lie that the
/// row-lane kernel multiplies by its weight words `2 J + odd` (the low or high nibbles of
/// byte word `J` of the block's 16 bytes): [`byte_at`](super::byte_at) of element `8 J + odd`.
#[inline(always)]
pub(super) fn lane_words(nb: usize, b: usize) -> [usize; 8] {
    if b < nb / LANES * LANES {
        // `byte_at` for a whole group, spelled out so it costs a few adds.
        let base = GROUP * (b / LANES) + 4 * (b % LANES);
        std::array::from_fn(|j| {
            let (jj, odd) = (j / 2, j % 2);
            base + 64 * (2 * (jj / 2) + odd) + 4 * LANES * (jj % 2)
        })
    } else {
        std::array::from_fn(|j| 32 * b + 16 * (j % 2) + 4 * (j / 2))
    }
}

/// Where block `b`'s decoded words lie in the row-lane tile: blocks grouped by lane `b mod 8`
/// (the order the kernel walks them), in increasing `b` within a lane.
#[inline(always)]
fn lane_slot(nb: usize, b: usize) -> usize {
    let c = b % LANES;
    // Blocks of lanes before `c`: `nb / 8` each, and one more for each lane below `nb mod 8`.
    c * (nb / LANES) + c.min(nb % LANES) + b / LANES
}

/// The row-lane AVX-512 VNNI kernel (rows `r0 .. r0 + n`, `p <= LANE_POSITIONS` positions):
/// integer lane `r` of every register belongs to row `r` of a tile of [`LANE_ROWS`], so a
/// block's exact sum for sixteen rows is eight `vpdpbusd` of the rows' decoded words by one
/// broadcast input word each, and no sums are transposed. Per tile, every block's nibbles are
/// gathered from the sixteen rows (a 4x4 word transpose within each 128-bit lane), looked up
/// as biased weights and written once to a thread-local tile (about 52 KB at 2880 columns);
/// then every position, [`CHUNK`] at a time, walks it lane by lane (`b mod 8`, the
/// reference's f32 lanes), each block one conversion, one multiply and one fused
/// multiply-add of sixteen rows, and the tree sums the eight lanes' registers.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; the arguments passed [`check_rows`](crate::kernels::check_rows);
/// `p <= LANE_POSITIONS`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn lane_rows(
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
    let mut tile = LANE_TILE.take();
    // Eight words of weights and one register of half scales per block.
    tile.resize(9 * nb, _mm512_setzero_si512());
    let (words, halves) = tile.split_at_mut(8 * nb);
    // The first tile's rows, all their lines asked for at once (the next tiles' are
    // prefetched while the one before runs).
    for k in 0..LANE_ROWS.min(n) {
        let row = blocks.as_ptr().wrapping_add((r0 + k) * nb * 16);
        for line in (0..16 * nb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(line) as *const i8);
        }
    }
    let mut i = 0;
    while i < n {
        let rows = LANE_ROWS.min(n - i);
        // SAFETY: rows `r0 + i .. r0 + i + rows` are in bounds (caller); the tile holds
        // `9 nb` registers.
        unsafe { lane_decode(blocks, scales, nb, r0 + i, rows, words, halves) };
        // The next tile's rows, prefetched into L2 while the first chunk runs (a row stream
        // per lane is more than the hardware prefetchers follow).
        let ahead = LANE_ROWS.min(n - i - rows);
        let next: [*const u8; LANE_ROWS] = std::array::from_fn(|k| {
            blocks
                .as_ptr()
                .wrapping_add((r0 + i + rows + k.min(ahead.max(1) - 1)) * nb * 16)
        });
        let mut q0 = 0;
        while q0 < p {
            let pc = CHUNK.min(p - q0);
            let prefetch = (q0 == 0 && ahead > 0).then_some(&next);
            // SAFETY: positions `q0 .. q0 + pc` of `cols` slots are in `xs`, and outputs
            // `(q, i .. i + rows)` in `out` (caller); the tile is decoded.
            unsafe {
                with_positions!(
                    pc,
                    lane_chunk(
                        nb,
                        words,
                        halves,
                        &xs[q0 * cols..],
                        cols,
                        &mut out[q0 * n..],
                        n,
                        i,
                        rows,
                        prefetch
                    )
                )
            };
            q0 += pc;
        }
        i += rows;
    }
    LANE_TILE.set(tile);
}

/// Decodes `rows` (at most 16) rows from `r` into the row-lane tile: per block eight
/// registers of biased weights (lane `k` from row `r + k`; rows past `rows` repeat the last)
/// at [`lane_slot`], and its half scales (`SCALE[s] · 0.5`, as [`half_scales`](super::half_scales) computes them).
///
/// # Safety
/// The CPU has AVX-512 F and BW; rows `r .. r + rows` of `blocks` (`16 nb` bytes each) and
/// `scales` (`nb`) are in bounds; `words` holds `8 nb` registers and `halves` `nb`.
#[inline(never)] // a profile shows the decode apart
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn lane_decode(
    blocks: &[u8],
    scales: &[u8],
    nb: usize,
    r: usize,
    rows: usize,
    words: &mut [__m512i],
    halves: &mut [__m512i],
) {
    // Row of lane `k`.
    let row = |k: usize| r + k.min(rows - 1);
    let wrow: [*const u8; LANE_ROWS] =
        std::array::from_fn(|k| blocks.as_ptr().wrapping_add(row(k) * nb * 16));
    let srow: [*const u8; LANE_ROWS] =
        std::array::from_fn(|k| scales.as_ptr().wrapping_add(row(k) * nb));
    // SAFETY (whole body): every read is of block `b < nb` of a row in bounds (caller), every
    // write within `words` and `halves`; prefetches may point anywhere.
    unsafe {
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(BIASED.as_ptr() as *const __m128i));
        let nibble = _mm512_set1_epi8(0x0f);
        let min_bits = _mm512_set1_epi32(SCALE_0_BITS);
        let half = _mm512_set1_ps(0.5);
        for b in 0..nb {
            if b % 4 == 0 {
                // The line four blocks (a line) ahead of each row.
                for p in &wrow {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(16 * b + 256) as *const i8);
                }
            }
            // Register `k` holds rows `k`, `k + 4`, `k + 8`, `k + 12` in its four 128-bit lanes,
            // so that after the transpose word lane `4 L + k` is row `4 L + k`.
            let a: [__m512i; 4] = std::array::from_fn(|k| {
                let ld = |l: usize| _mm_loadu_si128(wrow[4 * l + k].add(16 * b) as *const __m128i);
                let v = _mm512_castsi128_si512(ld(0));
                let v = _mm512_inserti32x4::<1>(v, ld(1));
                let v = _mm512_inserti32x4::<2>(v, ld(2));
                _mm512_inserti32x4::<3>(v, ld(3))
            });
            let t0 = _mm512_unpacklo_epi32(a[0], a[1]);
            let t1 = _mm512_unpackhi_epi32(a[0], a[1]);
            let t2 = _mm512_unpacklo_epi32(a[2], a[3]);
            let t3 = _mm512_unpackhi_epi32(a[2], a[3]);
            // Byte word `J` of every row's block.
            let w = [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ];
            let at = 8 * lane_slot(nb, b);
            for (jj, wj) in w.iter().enumerate() {
                let lo = _mm512_and_si512(*wj, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(*wj), nibble);
                *words.get_unchecked_mut(at + 2 * jj) = _mm512_shuffle_epi8(table, lo);
                *words.get_unchecked_mut(at + 2 * jj + 1) = _mm512_shuffle_epi8(table, hi);
            }
        }
        // The half scales, sixteen blocks at a time: each row's sixteen scale bytes loaded,
        // the 16 x 16 bytes transposed (four rounds of interleaving, each pairing register
        // `k` with `k + 8`), then widened per block. (A gather of each row's bytes cost a
        // third of the decode.)
        let mut b = 0;
        while b < nb {
            let m = 16.min(nb - b);
            let mut pad = [[0u8; 16]; LANE_ROWS];
            let mut x: [__m128i; 16] = std::array::from_fn(|k| {
                if m == 16 {
                    _mm_loadu_si128(srow[k].add(b) as *const __m128i)
                } else {
                    // The last blocks, copied so that no load reads past the row.
                    std::ptr::copy_nonoverlapping(srow[k].add(b), pad[k].as_mut_ptr(), m);
                    _mm_loadu_si128(pad[k].as_ptr() as *const __m128i)
                }
            });
            for _ in 0..4 {
                x = std::array::from_fn(|k| {
                    let (a, c) = (x[k / 2], x[k / 2 + 8]);
                    if k % 2 == 0 {
                        _mm_unpacklo_epi8(a, c)
                    } else {
                        _mm_unpackhi_epi8(a, c)
                    }
                });
            }
            for (j, col) in x.iter().enumerate().take(m) {
                let bits = _mm512_slli_epi32::<23>(_mm512_cvtepu8_epi32(*col));
                let bits = _mm512_max_epi32(bits, min_bits);
                *halves.get_unchecked_mut(lane_slot(nb, b + j)) =
                    _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(bits), half));
            }
            b += 16;
        }
    }
}

/// `P` positions (`P <= CHUNK`) of the row-lane kernel over a decoded tile: for each lane
/// `c` of the reference's eight, blocks `c, c + 8, ...` in order, each block's sixteen rows'
/// exact sums (eight `vpdpbusd` onto the block's offset), converted, times `d_b · half`,
/// fused into the lane's register; then the tree over the eight lanes' registers, written to
/// `out[q n + i ..]` (`rows` of them).
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; `xs` holds `P` positions of `cols` slots, `out`
/// outputs `(q, i .. i + rows)` for `q < P` at stride `n`, `rows <= 16`; the tile is decoded.
#[allow(clippy::too_many_arguments)]
#[inline(never)] // a profile shows the kernel apart
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn lane_chunk<const P: usize>(
    nb: usize,
    words: &[__m512i],
    halves: &[__m512i],
    xs: &[f32],
    cols: usize,
    out: &mut [f32],
    n: usize,
    i: usize,
    rows: usize,
    prefetch: Option<&[*const u8; LANE_ROWS]>,
) {
    debug_assert!(xs.len() >= P * cols && out.len() >= (P - 1) * n + i + rows);
    let base: [*const f32; P] = std::array::from_fn(|q| xs[q * cols..].as_ptr());
    let xq: [*const u8; P] = std::array::from_fn(|q| base[q] as *const u8);
    // SAFETY (whole body): each position's int8 values (`cols` bytes), scales and offsets
    // (`nb` slots each) follow its first slot (the layout `quantize` writes); the tile holds
    // `9 nb` registers (caller); outputs are in bounds (caller).
    unsafe {
        let xd: [*const f32; P] = std::array::from_fn(|q| base[q].add(cols / 4));
        let xo: [*const i32; P] = std::array::from_fn(|q| base[q].add(cols / 4 + nb) as *const i32);
        // Lane `c`'s register for each position (a lane no block reaches stays +0).
        let mut lanes = [[_mm512_setzero_ps(); P]; LANES];
        for (c, lane) in lanes.iter_mut().enumerate().take(nb) {
            // Summed in registers, stored once.
            let mut acc = [_mm512_setzero_ps(); P];
            let mut b = c;
            let mut at = lane_slot(nb, c);
            while b < nb {
                if let Some(rows) = prefetch.filter(|_| b % 4 == 0) {
                    // Block `b`'s line of each of the next tile's rows (every line, over lanes
                    // 0 and 4).
                    for p in rows {
                        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(16 * b) as *const i8);
                    }
                }
                let x = lane_words(nb, b);
                let mut isum: [__m512i; P] =
                    std::array::from_fn(|q| _mm512_set1_epi32(*xo[q].add(b)));
                for (j, &xj) in x.iter().enumerate() {
                    let w = *words.get_unchecked(8 * at + j);
                    for q in 0..P {
                        let v = (xq[q].add(xj) as *const i32).read_unaligned();
                        isum[q] = _mm512_dpbusd_epi32(isum[q], w, _mm512_set1_epi32(v));
                    }
                }
                let half = _mm512_castsi512_ps(*halves.get_unchecked(at));
                for q in 0..P {
                    let f = _mm512_mul_ps(_mm512_set1_ps(*xd[q].add(b)), half);
                    acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[q]), f, acc[q]);
                }
                b += LANES;
                at += 1;
            }
            *lane = acc;
        }
        let mask: __mmask16 = if rows == LANE_ROWS {
            !0
        } else {
            (1u16 << rows) - 1
        };
        let (low, high) = lanes.split_at(4);
        for q in 0..P {
            // The reference's tree: `l + 4`, then `l + 2`, then `l + 1`.
            let s4: [__m512; 4] = std::array::from_fn(|l| _mm512_add_ps(low[l][q], high[l][q]));
            let sum = _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(q * n + i), mask, sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::byte_at;
    use super::*;

    /// `lane_words` (spelled out for speed) is `byte_at` of each word's first element, in
    /// whole groups and past them.
    #[test]
    fn lane_words_are_where_byte_at_puts_each_word() {
        for nb in [1, 7, 8, 9, 17, 90] {
            for b in 0..nb {
                let want: [usize; 8] = std::array::from_fn(|j| byte_at(nb, b, 8 * (j / 2) + j % 2));
                assert_eq!(lane_words(nb, b), want, "{nb} blocks, block {b}");
            }
        }
    }
}
