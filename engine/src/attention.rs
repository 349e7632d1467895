//! Attention over the KV cache: for each query head and position, the scaled dot products with
//! the cached keys it sees, their softmax (with the head's sink logit where the layer has
//! sinks), and the weighted sum of the cached values.
//!
//! The arithmetic is defined once, by the scalar reference: each score is [`ops::dot`] (eight
//! interleaved partial sums of unfused products, reduced pairwise, then the tail) times the
//! scale; the softmax is [`ops::softmax`] or [`ops::softmax_with_sink`]; each output element
//! starts at zero and adds `p_j · v_j` (a rounded product, then a rounded sum) position by
//! position. The SIMD ISAs compute exactly that, only wider: AVX2 holds the eight partial sums
//! in one register and computes four keys at a time; AVX-512 uses the same scores and keeps
//! 64 output elements in four registers across all positions; NEON holds the partial sums in
//! two registers. Every ISA gives the same bits (tested on random shapes against the scalar
//! reference), so forcing an ISA never changes a token.
//!
//! The cache is a ring of `cap` slots per layer (a sliding layer keeps only its window), and
//! the positions a query sees are at most two contiguous runs of slots.

use crate::kernels::{for_each_index, Isa, SendPtr, Vector, PARALLEL_ELEMENTS};
use crate::ops;

/// One layer's attention for a block of `t` queries at positions `p0 .. p0 + t`, whose keys
/// and values are already in the cache.
pub(crate) struct Attend<'a> {
    /// Cached keys, `[cap, kv_dim]`, slot `pos % cap`.
    pub k: &'a [f32],
    /// Cached values, laid out as `k`.
    pub v: &'a [f32],
    /// Slots in the cache.
    pub cap: usize,
    /// Queries, `[t, heads · head_dim]`.
    pub q: &'a [f32],
    /// One sink logit per query head, if the layer has them.
    pub sinks: Option<Vector<'a>>,
    /// Positions a query sees (itself included), if the layer slides.
    pub window: Option<usize>,
    /// Position of the first query.
    pub p0: usize,
    /// Queries in the block.
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key-value heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl Attend<'_> {
    /// Writes `out` as `[heads, t, head_dim]`, using `scores` (`heads` equal slices of at least
    /// `p0 + t` each, or of `cap` when the layer slides) as scratch. Heads are split among
    /// the kernels' pool when the block is large enough to pay for the hand-off.
    pub(crate) fn run(&self, out: &mut [f32], scores: &mut [f32]) {
        let (nh, d, t) = (self.heads, self.head_dim, self.t);
        if nh == 0 || d == 0 || t == 0 {
            return;
        }
        let isa = Isa::active();
        let ctx = scores.len() / nh;
        assert!(
            out.len() >= nh * t * d && ctx >= t,
            "attention buffers too small"
        );
        let (o, sc) = (SendPtr(out.as_mut_ptr()), SendPtr(scores.as_mut_ptr()));
        let each = |head: usize| {
            // SAFETY: head `head`'s slices of `out` (`t·d`) and of `scores` (`ctx`), in bounds
            // (above), and each head is run by one call only; both outlive the loop.
            let (o, sc) = unsafe {
                (
                    std::slice::from_raw_parts_mut(o.at(head * t * d), t * d),
                    std::slice::from_raw_parts_mut(sc.at(head * ctx), ctx),
                )
            };
            self.head(isa, head, o, sc);
        };
        if t * (self.p0 + t) * d * nh < PARALLEL_ELEMENTS {
            (0..nh).for_each(each);
        } else {
            for_each_index(nh, each);
        }
    }

    /// Several blocks' attention (the sequences of a batched step, each over its own cache) in
    /// one parallel region: every (block, head) pair is one call of the kernels' pool when the
    /// blocks' work together pays for the hand-off, where [`Attend::run`] on each would keep a
    /// decoded token's few heads on one thread. Each head is computed by the same code as
    /// alone, so the bits are those of [`Attend::run`]. `outs[i]` and `scores[i]` are block
    /// `i`'s buffers, as [`Attend::run`] takes them.
    pub(crate) fn run_all(
        blocks: &[Attend<'_>],
        outs: &mut [&mut [f32]],
        scores: &mut [&mut [f32]],
    ) {
        assert!(
            blocks.len() == outs.len() && blocks.len() == scores.len(),
            "one output and one scores buffer per block"
        );
        let work: usize = blocks
            .iter()
            .map(|b| b.t * (b.p0 + b.t) * b.head_dim * b.heads)
            .sum();
        if blocks.len() == 1 || work < PARALLEL_ELEMENTS {
            // Small enough for one thread (or one block: its own split is the same).
            for ((b, o), sc) in blocks.iter().zip(outs.iter_mut()).zip(scores.iter_mut()) {
                b.run(o, sc);
            }
            return;
        }
        let isa = Isa::active();
        // Per block: its first pair's index, its buffers, and the scores' stride per head.
        let mut first = Vec::with_capacity(blocks.len() + 1);
        let mut bufs = Vec::with_capacity(blocks.len());
        let mut n = 0;
        for ((b, o), sc) in blocks.iter().zip(outs.iter_mut()).zip(scores.iter_mut()) {
            let (nh, d, t) = (b.heads, b.head_dim, b.t);
            first.push(n);
            let ctx = sc.len() / nh.max(1);
            if nh == 0 || d == 0 || t == 0 {
                bufs.push((SendPtr(o.as_mut_ptr()), SendPtr(sc.as_mut_ptr()), ctx));
                continue;
            }
            assert!(
                o.len() >= nh * t * d && ctx >= t,
                "attention buffers too small"
            );
            bufs.push((SendPtr(o.as_mut_ptr()), SendPtr(sc.as_mut_ptr()), ctx));
            n += nh;
        }
        first.push(n);
        for_each_index(n, |k| {
            // The block holding pair `k`: the last whose first pair is at most `k` (blocks
            // without heads take no pairs, so the search skips them).
            let i = first.partition_point(|&f| f <= k) - 1;
            let (b, (o, sc, ctx)) = (&blocks[i], bufs[i]);
            let head = k - first[i];
            let (t, d) = (b.t, b.head_dim);
            // SAFETY: block `i`'s head `head` slices of its `out` (`t·d`) and `scores`
            // (`ctx`), in bounds (checked above); each pair is run by one call only, and the
            // blocks' buffers are distinct borrows that outlive the loop.
            let (o, sc) = unsafe {
                (
                    std::slice::from_raw_parts_mut(o.at(head * t * d), t * d),
                    std::slice::from_raw_parts_mut(sc.at(head * ctx), ctx),
                )
            };
            b.head(isa, head, o, sc);
        });
    }

    /// One query head's `t` outputs (`out`, `[t, head_dim]`) by the module's arithmetic, on
    /// `ISA`'s instructions where this CPU has them (else a lower ISA's: the bits are the same).
    fn head(&self, isa: Isa, head: usize, out: &mut [f32], sc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if isa == Isa::Avx512 && isa.is_native() {
                // SAFETY: this CPU runs the AVX-512 ISA's instructions.
                return unsafe { self.head_avx512(head, out, sc) };
            }
            if isa >= Isa::Avx2 && Isa::Avx2.is_native() {
                // SAFETY: this CPU runs the AVX2 ISA's instructions.
                return unsafe { self.head_avx2(head, out, sc) };
            }
        }
        #[cfg(target_arch = "aarch64")]
        if isa == Isa::Neon && isa.is_native() {
            return self.head_with::<neon::Neon>(head, out, sc);
        }
        let _ = isa;
        self.head_with::<Scalar>(head, out, sc)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    fn head_avx512(&self, head: usize, out: &mut [f32], sc: &mut [f32]) {
        self.head_with::<x86::Avx512>(head, out, sc)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn head_avx2(&self, head: usize, out: &mut [f32], sc: &mut [f32]) {
        self.head_with::<x86::Avx2>(head, out, sc)
    }

    #[inline(always)]
    fn head_with<L: Lanes>(&self, head: usize, out: &mut [f32], sc: &mut [f32]) {
        let (nh, d) = (self.heads, self.head_dim);
        let kvd = self.kv_heads * d;
        let g = head / (nh / self.kv_heads);
        let scale = (1.0 / (d as f64).sqrt()) as f32;
        let sink = self.sinks.map(|s| s.at(head));
        for i in 0..self.t {
            let p = self.p0 + i;
            let lo = match self.window {
                Some(w) => (p + 1).saturating_sub(w),
                None => 0,
            };
            let q = &self.q[(i * nh + head) * d..][..d];
            let n = p + 1 - lo;
            let sc = &mut sc[..n];
            let runs = ring_runs(lo, n, self.cap);
            let mut j = 0;
            for &(slot, len) in &runs {
                let keys = Rows::new(self.k, slot * kvd + g * d, kvd, len, d);
                L::scores(q, &keys, scale, &mut sc[j..j + len]);
                j += len;
            }
            match sink {
                Some(s) => ops::softmax_with_sink(sc, s),
                None => ops::softmax(sc),
            }
            let o = &mut out[i * d..(i + 1) * d];
            o.fill(0.0);
            let mut j = 0;
            for &(slot, len) in &runs {
                let values = Rows::new(self.v, slot * kvd + g * d, kvd, len, d);
                L::weighted_sum(&sc[j..j + len], &values, o);
                j += len;
            }
        }
    }
}

/// The slot runs `(first slot, length)` of positions `lo .. lo + n` in a ring of `cap` slots
/// (`n <= cap`): the run up to the ring's end, then the run from slot 0 (empty if none).
fn ring_runs(lo: usize, n: usize, cap: usize) -> [(usize, usize); 2] {
    debug_assert!(n <= cap, "{n} positions in a ring of {cap}");
    let s0 = lo % cap;
    let first = n.min(cap - s0);
    [(s0, first), (0, n - first)]
}

/// `n` rows of `width` elements at `first + j · stride` of `data`, checked in bounds once.
struct Rows<'a> {
    data: &'a [f32],
    first: usize,
    stride: usize,
    n: usize,
}

impl<'a> Rows<'a> {
    /// # Panics
    /// If a row would end past `data` (a bug in the caller: the cache holds every slot).
    fn new(data: &'a [f32], first: usize, stride: usize, n: usize, width: usize) -> Self {
        if n > 0 {
            let end = first + (n - 1) * stride + width;
            assert!(
                end <= data.len(),
                "attention rows end at {end} of {}",
                data.len()
            );
        }
        Self {
            data,
            first,
            stride,
            n,
        }
    }

    fn row(&self, j: usize, width: usize) -> &'a [f32] {
        &self.data[self.first + j * self.stride..][..width]
    }

    /// Pointer to row `j < n` (in bounds: checked by [`Rows::new`] for `width` elements).
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    fn ptr(&self, j: usize) -> *const f32 {
        debug_assert!(j < self.n);
        // SAFETY: within the checked span (`new`).
        unsafe { self.data.as_ptr().add(self.first + j * self.stride) }
    }
}

/// [`Lanes::weighted_sum`] for the elements of `o` from `from` on, one at a time (the tail
/// the vector ISAs leave).
#[inline(always)]
fn weighted_tail(p: &[f32], values: &Rows<'_>, o: &mut [f32], from: usize) {
    for (e, oe) in o.iter_mut().enumerate().skip(from) {
        let mut s = *oe;
        for (j, &pj) in p.iter().enumerate() {
            s += pj * values.row(j, e + 1)[e];
        }
        *oe = s;
    }
}

/// An ISA's attention arithmetic (the module's, bit for bit).
trait Lanes {
    /// `out[j] = dot(q, key j) · scale` for the `out.len()` keys of `keys` (`q.len()` wide).
    fn scores(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]);
    /// `o[e] += p[j] · value j[e]`, position after position, for the `p.len()` values.
    fn weighted_sum(p: &[f32], values: &Rows<'_>, o: &mut [f32]);
}

/// The reference.
struct Scalar;

impl Lanes for Scalar {
    #[inline(always)]
    fn scores(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]) {
        for (j, s) in out.iter_mut().enumerate() {
            *s = ops::dot(q, keys.row(j, q.len())) * scale;
        }
    }

    #[inline(always)]
    fn weighted_sum(p: &[f32], values: &Rows<'_>, o: &mut [f32]) {
        let d = o.len();
        for (j, &pj) in p.iter().enumerate() {
            for (oo, &v) in o.iter_mut().zip(values.row(j, d)) {
                *oo += pj * v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Lanes, Rows};

    /// AVX2: the eight partial sums of a dot product in one register, four keys at a time.
    pub(super) struct Avx2;

    /// AVX-512: AVX2's scores; the weighted sum in 16-lane registers.
    pub(super) struct Avx512;

    impl Lanes for Avx2 {
        #[inline(always)]
        fn scores(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]) {
            // SAFETY: only inlined into functions compiled with AVX2 (`head_avx2`,
            // `head_avx512`), called on CPUs that have it; rows checked by `Rows::new`.
            unsafe { scores_avx2(q, keys, scale, out) }
        }

        #[inline(always)]
        fn weighted_sum(p: &[f32], values: &Rows<'_>, o: &mut [f32]) {
            // SAFETY: as `scores`.
            unsafe { weighted_sum_avx2(p, values, o) }
        }
    }

    impl Lanes for Avx512 {
        #[inline(always)]
        fn scores(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]) {
            // SAFETY: as `Avx2::scores` (AVX-512 implies AVX2 in `head_avx512`).
            unsafe { scores_avx2(q, keys, scale, out) }
        }

        #[inline(always)]
        fn weighted_sum(p: &[f32], values: &Rows<'_>, o: &mut [f32]) {
            // SAFETY: only inlined into `head_avx512`, called on CPUs with AVX-512 F.
            unsafe { weighted_sum_avx512(p, values, o) }
        }
    }

    /// [`Lanes::scores`] for `R` keys from row `j`: partial sum `l` in lane `l` of one register.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dots<const R: usize>(q: &[f32], keys: &Rows<'_>, j: usize) -> [f32; R] {
        let d = q.len();
        let n8 = d / 8 * 8;
        let k: [*const f32; R] = std::array::from_fn(|r| keys.ptr(j + r));
        let mut acc = [_mm256_setzero_ps(); R];
        let mut c = 0;
        while c < n8 {
            // SAFETY: `c + 8 <= d`, and each row holds `d` elements (`Rows::new`).
            let x = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
            for r in 0..R {
                let y = unsafe { _mm256_loadu_ps(k[r].add(c)) };
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(x, y));
            }
            c += 8;
        }
        std::array::from_fn(|r| {
            // ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), as `ops::dot`
            let h = _mm_add_ps(
                _mm256_castps256_ps128(acc[r]),
                _mm256_extractf128_ps::<1>(acc[r]),
            );
            let pairs = _mm_add_ps(h, _mm_movehdup_ps(h));
            let mut s = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehl_ps(pairs, pairs)));
            for (i, &qi) in q.iter().enumerate().skip(n8) {
                // SAFETY: `i < d`.
                s += qi * unsafe { *k[r].add(i) };
            }
            s
        })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_avx2(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]) {
        let n = out.len().min(keys.n);
        let mut j = 0;
        while j + 4 <= n {
            // SAFETY: rows `j .. j + 4` exist.
            let s = unsafe { dots::<4>(q, keys, j) };
            for r in 0..4 {
                out[j + r] = s[r] * scale;
            }
            j += 4;
        }
        while j < n {
            // SAFETY: row `j` exists.
            out[j] = unsafe { dots::<1>(q, keys, j) }[0] * scale;
            j += 1;
        }
    }

    /// Adds `p[j] · value j` to `o` for each `j` in order, 64 elements at a time held in
    /// registers across the positions, then one vector of `$lanes` at a time, then a scalar
    /// tail; `load`/`mul`/`add` are the ISA's.
    macro_rules! weighted_sum {
        ($name:ident, $feat:literal, $v:ty, $lanes:literal, $load:ident, $store:ident,
         $set1:ident, $mul:ident, $add:ident) => {
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $name(p: &[f32], values: &Rows<'_>, o: &mut [f32]) {
                /// Vectors one pass keeps in registers.
                const W: usize = 64 / $lanes;
                /// One pass over the positions for `N` vectors of `o` from element `e`.
                #[inline(always)]
                unsafe fn pass<const N: usize>(
                    p: &[f32],
                    values: &Rows<'_>,
                    o: &mut [f32],
                    e: usize,
                ) {
                    // SAFETY: `e + N · lanes <= o.len()` elements of `o` and of each row
                    // (caller; rows checked by `Rows::new`).
                    unsafe {
                        let mut acc: [$v; N] =
                            std::array::from_fn(|i| $load(o.as_ptr().add(e + i * $lanes)));
                        for (j, &pj) in p.iter().enumerate() {
                            let pj = $set1(pj);
                            let row = values.ptr(j).add(e);
                            for i in 0..N {
                                acc[i] = $add(acc[i], $mul(pj, $load(row.add(i * $lanes))));
                            }
                        }
                        for i in 0..N {
                            $store(o.as_mut_ptr().add(e + i * $lanes), acc[i]);
                        }
                    }
                }
                let d = o.len();
                let p = &p[..p.len().min(values.n)];
                let mut e = 0;
                while e + W * $lanes <= d {
                    // SAFETY: in bounds (loop condition).
                    unsafe { pass::<W>(p, values, o, e) };
                    e += W * $lanes;
                }
                while e + $lanes <= d {
                    // SAFETY: in bounds (loop condition).
                    unsafe { pass::<1>(p, values, o, e) };
                    e += $lanes;
                }
                super::weighted_tail(p, values, o, e);
            }
        };
    }

    weighted_sum!(
        weighted_sum_avx2,
        "avx2,fma",
        __m256,
        8,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_add_ps
    );
    weighted_sum!(
        weighted_sum_avx512,
        "avx512f,avx512bw,avx2,fma",
        __m512,
        16,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_add_ps
    );
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::{Lanes, Rows};

    /// NEON: the eight partial sums of a dot product in two registers, four keys at a time;
    /// the weighted sum in 4-lane registers. Unfused multiplies and adds throughout.
    pub(super) struct Neon;

    impl Lanes for Neon {
        #[inline(always)]
        fn scores(q: &[f32], keys: &Rows<'_>, scale: f32, out: &mut [f32]) {
            let n = out.len().min(keys.n);
            let mut j = 0;
            while j + 4 <= n {
                let s = dots::<4>(q, keys, j);
                for r in 0..4 {
                    out[j + r] = s[r] * scale;
                }
                j += 4;
            }
            while j < n {
                out[j] = dots::<1>(q, keys, j)[0] * scale;
                j += 1;
            }
        }

        #[inline(always)]
        fn weighted_sum(p: &[f32], values: &Rows<'_>, o: &mut [f32]) {
            /// Vectors one pass keeps in registers (64 elements).
            const W: usize = 16;
            let d = o.len();
            let p = &p[..p.len().min(values.n)];
            let mut e = 0;
            while e + 4 * W <= d {
                pass::<W>(p, values, o, e);
                e += 4 * W;
            }
            while e + 4 <= d {
                pass::<1>(p, values, o, e);
                e += 4;
            }
            super::weighted_tail(p, values, o, e);
        }
    }

    /// One pass over the positions for `N` vectors of `o` from element `e` (in bounds: the
    /// caller checks `e + 4N <= o.len()`; rows are checked by `Rows::new`).
    #[inline(always)]
    fn pass<const N: usize>(p: &[f32], values: &Rows<'_>, o: &mut [f32], e: usize) {
        assert!(e + 4 * N <= o.len());
        // SAFETY: NEON is baseline on AArch64; in bounds (above, and `Rows::new`).
        unsafe {
            let mut acc: [float32x4_t; N] =
                std::array::from_fn(|i| vld1q_f32(o.as_ptr().add(e + 4 * i)));
            for (j, &pj) in p.iter().enumerate() {
                let pj = vdupq_n_f32(pj);
                let row = values.ptr(j).add(e);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = vaddq_f32(*a, vmulq_f32(pj, vld1q_f32(row.add(4 * i))));
                }
            }
            for (i, a) in acc.iter().enumerate() {
                vst1q_f32(o.as_mut_ptr().add(e + 4 * i), *a);
            }
        }
    }

    #[inline(always)]
    fn dots<const R: usize>(q: &[f32], keys: &Rows<'_>, j: usize) -> [f32; R] {
        let d = q.len();
        let n8 = d / 8 * 8;
        let k: [*const f32; R] = std::array::from_fn(|r| keys.ptr(j + r));
        // SAFETY: NEON is baseline on AArch64; `c + 8 <= d` and rows hold `d` elements.
        unsafe {
            let mut lo = [vdupq_n_f32(0.0); R];
            let mut hi = [vdupq_n_f32(0.0); R];
            let mut c = 0;
            while c < n8 {
                let (x0, x1) = (
                    vld1q_f32(q.as_ptr().add(c)),
                    vld1q_f32(q.as_ptr().add(c + 4)),
                );
                for r in 0..R {
                    lo[r] = vaddq_f32(lo[r], vmulq_f32(x0, vld1q_f32(k[r].add(c))));
                    hi[r] = vaddq_f32(hi[r], vmulq_f32(x1, vld1q_f32(k[r].add(c + 4))));
                }
                c += 8;
            }
            std::array::from_fn(|r| {
                // ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), as `ops::dot`
                let h = vaddq_f32(lo[r], hi[r]);
                let pairs = vpaddq_f32(h, h);
                let mut s = vgetq_lane_f32::<0>(pairs) + vgetq_lane_f32::<1>(pairs);
                for (i, &qi) in q.iter().enumerate().skip(n8) {
                    s += qi * *k[r].add(i);
                }
                s
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{with_isa, Float, Gen};

    /// `n` values in `[-2, 2)`.
    fn noise(n: usize, seed: u64) -> Vec<f32> {
        Gen::new(seed).units(n).iter().map(|v| 2.0 * v).collect()
    }

    /// Every ISA this CPU runs gives the scalar reference's bits, on head widths with and
    /// without a tail (of eight and of the vector width), sliding windows whose positions wrap
    /// around the ring, sinks, grouped heads, blocks of one and several queries, heads split
    /// among threads or not.
    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let sink_bytes: Vec<u8> = noise(8, 99).iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut case = 0u64;
        for &(d, heads, kv_heads) in &[(64, 8, 2), (128, 4, 4), (72, 6, 3), (13, 2, 1), (8, 2, 2)] {
            for &(window, p0, t) in &[
                (None, 0, 1),
                (None, 37, 1),
                (None, 5, 9),
                (Some(16), 40, 1),
                (Some(16), 29, 7),
                (Some(7), 3, 5),
                // large enough to be split among the kernels' threads
                (None, 300, 1),
                (Some(16), 300, 9),
            ] {
                for sinks in [false, true] {
                    case += 1;
                    let cap = window.unwrap_or(p0 + t);
                    let kvd = kv_heads * d;
                    let k = noise(cap * kvd, case);
                    let v = noise(cap * kvd, case + 1000);
                    let q = noise(t * heads * d, case + 2000);
                    let a = Attend {
                        k: &k,
                        v: &v,
                        cap,
                        q: &q,
                        sinks: sinks.then(|| Vector {
                            fmt: Float::F32,
                            bytes: &sink_bytes[..4 * heads],
                        }),
                        window,
                        p0,
                        t,
                        heads,
                        kv_heads,
                        head_dim: d,
                    };
                    let run = |isa: Isa| {
                        let mut out = vec![f32::NAN; heads * t * d];
                        let mut scores = vec![f32::NAN; heads * cap.max(p0 + t)];
                        with_isa(isa, || a.run(&mut out, &mut scores));
                        out
                    };
                    let want = run(Isa::Scalar);
                    assert!(want.iter().all(|x| x.is_finite()));
                    for isa in Isa::available() {
                        let got = run(isa);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(
                            same,
                            "{isa}: d {d}, heads {heads}/{kv_heads}, window {window:?}, p0 {p0}, t {t}, sinks {sinks}"
                        );
                    }
                }
            }
        }
    }

    /// Blocks run together ([`Attend::run_all`], small and large enough to split, blocks
    /// without queries among them) give each block's bits from [`Attend::run`] alone, on
    /// every ISA.
    #[test]
    fn blocks_together_give_each_blocks_bits_alone() {
        let (d, heads, kv_heads) = (64, 8, 2);
        let kvd = kv_heads * d;
        for shape in [
            &[(3usize, 1usize), (10, 1), (0, 2)][..],
            &[(40, 1), (90, 1), (0, 0), (300, 1), (12, 3)][..],
        ] {
            let data: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = shape
                .iter()
                .enumerate()
                .map(|(i, &(p0, t))| {
                    let cap = p0 + t;
                    let seed = 10 * i as u64;
                    (
                        noise(cap * kvd, seed),
                        noise(cap * kvd, seed + 1),
                        noise(t * heads * d, seed + 2),
                    )
                })
                .collect();
            let blocks: Vec<Attend<'_>> = shape
                .iter()
                .zip(&data)
                .map(|(&(p0, t), (k, v, q))| Attend {
                    k,
                    v,
                    cap: p0 + t,
                    q,
                    sinks: None,
                    window: None,
                    p0,
                    t,
                    heads,
                    kv_heads,
                    head_dim: d,
                })
                .collect();
            let bufs = |b: &Attend<'_>| {
                (
                    vec![f32::NAN; heads * b.t * d],
                    vec![f32::NAN; heads * (b.p0 + b.t).max(1)],
                )
            };
            for isa in Isa::available() {
                let alone: Vec<Vec<f32>> = blocks
                    .iter()
                    .map(|b| {
                        let (mut o, mut sc) = bufs(b);
                        with_isa(isa, || b.run(&mut o, &mut sc));
                        o
                    })
                    .collect();
                let (mut outs, mut scs): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
                    blocks.iter().map(bufs).unzip();
                let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                let mut sc: Vec<&mut [f32]> = scs.iter_mut().map(|v| &mut v[..]).collect();
                with_isa(isa, || Attend::run_all(&blocks, &mut o, &mut sc));
                for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
                    assert!(
                        got.len() == want.len()
                            && got
                                .iter()
                                .zip(want)
                                .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{isa}: block {i} of {shape:?}"
                    );
                }
            }
        }
    }

    /// The reference itself against a direct f64 computation of attention.
    #[test]
    fn the_reference_is_attention() {
        // the second is large enough to be split among the kernels' threads
        for (d, heads, kv_heads, p0, t, w) in [(16, 4, 2, 11, 3, 6), (64, 8, 2, 290, 2, 40)] {
            reference_case(d, heads, kv_heads, p0, t, w);
        }
    }

    /// [`the_reference_is_attention`] for one shape, window `w` (the cache holds `w` slots).
    fn reference_case(d: usize, heads: usize, kv_heads: usize, p0: usize, t: usize, w: usize) {
        let (cap, window) = (w, Some(w));
        let kvd = kv_heads * d;
        let (k, v, q) = (
            noise(cap * kvd, 1),
            noise(cap * kvd, 2),
            noise(t * heads * d, 3),
        );
        let a = Attend {
            k: &k,
            v: &v,
            cap,
            q: &q,
            sinks: None,
            window,
            p0,
            t,
            heads,
            kv_heads,
            head_dim: d,
        };
        let mut out = vec![0.0; heads * t * d];
        let mut scores = vec![0.0; heads * cap];
        with_isa(Isa::Scalar, || a.run(&mut out, &mut scores));
        for head in 0..heads {
            let g = head / (heads / kv_heads);
            for i in 0..t {
                let p = p0 + i;
                let seen: Vec<usize> = (p + 1 - w..=p).collect();
                let qh = &q[(i * heads + head) * d..][..d];
                let s: Vec<f64> = seen
                    .iter()
                    .map(|&pos| {
                        let kr = &k[(pos % cap) * kvd + g * d..][..d];
                        qh.iter()
                            .zip(kr)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for e in 0..d {
                    let want: f64 = seen
                        .iter()
                        .zip(&s)
                        .map(|(&pos, x)| {
                            (x - m).exp() / z * v[(pos % cap) * kvd + g * d + e] as f64
                        })
                        .sum();
                    let got = out[(head * t + i) * d + e] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "head {head} i {i} e {e}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
