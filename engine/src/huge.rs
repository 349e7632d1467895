//! Memory for weights the kernels stream every token, backed by 2 MiB pages where the kernel
//! allows.
//!
//! With 4 KiB pages, a stream of weights crosses a page every 4 KiB: each crossing costs a
//! TLB miss and restarts the hardware prefetcher, which never follows a stream across a page.
//! With transparent huge pages advised (Linux; most distributions set THP to `madvise`, so
//! plain allocations never get them), the same stream crosses a page every 2 MiB. Measured at
//! gpt-oss-20b geometry on a 2-core Xeon VM: the 8-bit head screen (0.58 GB) went from 21.6
//! to 18.6 ms a decoded token.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// Bytes whose 2 MiB-aligned span is advised for huge pages: zero-initialised
/// ([`HugeBuf::zeroed`]), or an earlier buffer's for a caller that overwrites them
/// ([`HugeBuf::recycled`]).
pub struct HugeBuf {
    /// Taken only in `drop`.
    map: ManuallyDrop<memmap2::MmapMut>,
    off: usize,
    len: usize,
}

/// A huge page.
const HUGE: usize = 2 << 20;

/// At most this many bytes of dropped buffers are kept for [`HugeBuf::recycled`]: a few experts'
/// records (13.2 MB at gpt-oss geometry), enough for the buffers that a fetch or a read at the
/// smallest RAM budget drops as fast as it needs new ones.
const SPARE_BYTES: usize = 64 << 20;

/// Dropped buffers kept for reuse, the latest last, at most `limit` bytes of them.
///
/// A fresh mapping costs a page fault and the kernel zeroing each 2 MiB page on first touch:
/// measured on the network benchmark (`cargo bench -p stormo-cli --bench net`, `perf`), the
/// zeroing was 13% of the fetch phase's samples, more than hashing the bytes (8%) or copying
/// them in (8%). A reused buffer is already faulted in.
struct Spares {
    kept: VecDeque<(memmap2::MmapMut, usize)>,
    limit: usize,
}

impl Spares {
    const fn new(limit: usize) -> Self {
        Self {
            kept: VecDeque::new(),
            limit,
        }
    }

    /// The bytes a kept mapping offers from its aligned start.
    fn room((map, off): &(memmap2::MmapMut, usize)) -> usize {
        map.len() - off
    }

    /// The latest kept mapping with room for `len` bytes and not more than two huge pages
    /// over, with its aligned start.
    fn take(&mut self, len: usize) -> Option<(memmap2::MmapMut, usize)> {
        let i = self
            .kept
            .iter()
            .rposition(|k| (len..=len.saturating_add(2 * HUGE)).contains(&Self::room(k)))?;
        self.kept.remove(i)
    }

    /// Keeps `map` (its aligned start at `off`) unless it is larger than a quarter of the
    /// limit; the oldest kept ones over the limit come back to be unmapped.
    fn give(&mut self, map: memmap2::MmapMut, off: usize) -> Vec<memmap2::MmapMut> {
        if map.len() > self.limit / 4 {
            return vec![map];
        }
        self.kept.push_back((map, off));
        let mut total: usize = self.kept.iter().map(|(m, _)| m.len()).sum();
        let mut out = Vec::new();
        while total > self.limit {
            let Some((m, _)) = self.kept.pop_front() else {
                break;
            };
            total -= m.len();
            out.push(m);
        }
        out
    }
}

/// The process's kept buffers.
static SPARES: Mutex<Spares> = Mutex::new(Spares::new(SPARE_BYTES));

impl HugeBuf {
    /// `len` zero bytes. Advice that the kernel refuses is ignored: the memory is still good.
    /// A failure says how many bytes were asked for.
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        // Reserve a huge page more than needed so that the buffer can start on a 2 MiB
        // boundary; the slack is address space only, never touched.
        let slack = if len >= HUGE { HUGE } else { 0 };
        let map = memmap2::MmapMut::map_anon(len.saturating_add(slack).max(1)).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot allocate {len} bytes: {e}"))
        })?;
        let off = match slack {
            0 => 0,
            _ => map.as_ptr().align_offset(HUGE).min(slack),
        };
        #[cfg(target_os = "linux")]
        if slack > 0 {
            let _ = map.advise_range(memmap2::Advice::HugePage, off, len);
        }
        Ok(Self {
            map: ManuallyDrop::new(map),
            off,
            len,
        })
    }

    /// `len` bytes of unspecified content, for a caller that writes every byte before it
    /// reads any (an expert read from disk or fetched from peers, which is verified whole):
    /// a buffer dropped earlier in this process when one of about the size is kept, so that
    /// its pages are already faulted in and zeroed once; otherwise as [`HugeBuf::zeroed`].
    pub fn recycled(len: usize) -> std::io::Result<Self> {
        if len >= HUGE {
            let spare = SPARES.lock().ok().and_then(|mut s| s.take(len));
            if let Some((map, off)) = spare {
                // Advised for its first length; this one may be longer.
                #[cfg(target_os = "linux")]
                let _ = map.advise_range(memmap2::Advice::HugePage, off, len);
                return Ok(Self {
                    map: ManuallyDrop::new(map),
                    off,
                    len,
                });
            }
        }
        Self::zeroed(len)
    }

    /// A copy of `bytes` (as [`HugeBuf::zeroed`], then filled).
    pub fn copy_of(bytes: &[u8]) -> std::io::Result<Self> {
        let mut b = Self::zeroed(bytes.len())?;
        b.copy_from_slice(bytes);
        Ok(b)
    }
}

impl Drop for HugeBuf {
    /// Keeps buffers of a huge page or more for [`HugeBuf::recycled`] (up to `SPARE_BYTES`),
    /// unmaps the rest.
    fn drop(&mut self) {
        // SAFETY: `map` is not used again: this is the buffer's end.
        let map = unsafe { ManuallyDrop::take(&mut self.map) };
        if self.len < HUGE {
            return;
        }
        let unmap = match SPARES.lock() {
            Ok(mut s) => s.give(map, self.off),
            Err(_) => vec![map],
        };
        drop(unmap);
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }
}

/// One of the disjoint parts of a [`HugeBuf`] that [`HugeBuf::split`] cut: its bytes, writable
/// by their owner alone, while other owners (other threads) write the other parts. The parts
/// go back together with [`HugePart::join`], without copying a byte.
pub struct HugePart {
    /// The buffer the part belongs to: kept alive by every part, never read or written
    /// through while parts exist.
    whole: Arc<HugeBuf>,
    /// The start of the buffer's bytes.
    base: *mut u8,
    /// Where the part begins in the buffer.
    start: usize,
    len: usize,
}

// SAFETY: a part is the only handle to its bytes (parts are disjoint, and the whole buffer is
// not touched while any part lives), like a `&mut [u8]` it may move to another thread with.
unsafe impl Send for HugePart {}
// SAFETY: through `&HugePart` only its own bytes can be read.
unsafe impl Sync for HugePart {}

impl HugeBuf {
    /// Cuts the buffer at the offsets `cuts` (increasing, each within the buffer) into parts
    /// that can be written at once from several threads: `cuts.len() + 1` parts, in order,
    /// the first from 0, the last to the end. Offsets out of order or past the end are an
    /// error naming them, and the buffer comes back unchanged.
    pub fn split(mut self, cuts: &[usize]) -> Result<Vec<HugePart>, (Self, String)> {
        let mut last = 0;
        for &c in cuts {
            if c < last || c > self.len {
                let why = format!("cut at {c} after {last} in a buffer of {}", self.len);
                return Err((self, why));
            }
            last = c;
        }
        let base = self.deref_mut().as_mut_ptr();
        let whole = Arc::new(self);
        let mut bounds = Vec::with_capacity(cuts.len() + 2);
        bounds.push(0);
        bounds.extend_from_slice(cuts);
        bounds.push(whole.len);
        Ok(bounds
            .windows(2)
            .map(|w| HugePart {
                whole: whole.clone(),
                base,
                start: w[0],
                len: w[1] - w[0],
            })
            .collect())
    }
}

impl HugePart {
    /// Where the part begins in the buffer it was cut from.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Puts the parts of one [`HugeBuf::split`] back together, without copying: they must be
    /// all of them, in order. Otherwise they come back as they were, with the reason.
    pub fn join(parts: Vec<Self>) -> Result<HugeBuf, (Vec<Self>, String)> {
        let Some(first) = parts.first() else {
            return Err((parts, "no parts".into()));
        };
        let whole = first.whole.clone();
        let mut at = 0;
        for p in &parts {
            if !Arc::ptr_eq(&p.whole, &whole) || p.start != at {
                let why = format!("a part at {} where {at} was expected", p.start);
                return Err((parts, why));
            }
            at += p.len;
        }
        if at != whole.len {
            let why = format!("parts up to {at} of a buffer of {}", whole.len);
            return Err((parts, why));
        }
        drop(parts);
        Arc::try_unwrap(whole).map_err(|_| (Vec::new(), "a part is still held".into()))
    }
}

impl Deref for HugePart {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `start..start + len` lies within the buffer (`split` checked the cuts),
        // which `whole` keeps mapped; no other part covers these bytes and the buffer itself
        // is not accessed while parts exist, so no `&mut` to them exists elsewhere.
        unsafe { std::slice::from_raw_parts(self.base.add(self.start), self.len) }
    }
}

impl DerefMut for HugePart {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference to them.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(self.start), self.len) }
    }
}

impl std::fmt::Debug for HugePart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugePart")
            .field("start", &self.start)
            .field("len", &self.len)
            .finish()
    }
}

impl std::fmt::Debug for HugeBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_start_on_a_huge_page_and_hold_what_is_written() {
        for len in [0, 1, 4095, HUGE - 1, HUGE, 3 * HUGE + 17] {
            let mut b = HugeBuf::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            if len >= HUGE {
                assert_eq!(b.as_ptr() as usize % HUGE, 0, "len {len}");
            }
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
            let c = HugeBuf::copy_of(&b).unwrap();
            assert_eq!(&c[..], &b[..]);
        }
    }

    /// Parts written from several threads at once join back into the buffer they were cut
    /// from, at the same address (no copy), holding what each wrote; parts that are not all
    /// of one split, or not in order, are refused and handed back.
    #[test]
    fn parts_written_on_threads_join_back_without_a_copy() {
        let len = 3 * HUGE + 17;
        let mut b = HugeBuf::zeroed(len).unwrap();
        let addr = b.as_mut_ptr() as usize;
        let cuts = [HUGE / 2, HUGE / 2, 2 * HUGE + 5];
        let parts = b.split(&cuts).unwrap();
        assert_eq!(parts.len(), 4);
        let parts: Vec<HugePart> = std::thread::scope(|s| {
            let hs: Vec<_> = parts
                .into_iter()
                .map(|mut p| {
                    s.spawn(move || {
                        let start = p.start();
                        for (i, x) in p.iter_mut().enumerate() {
                            *x = ((start + i) % 251) as u8;
                        }
                        p
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut shuffled = parts;
        shuffled.swap(0, 2);
        let (mut parts, why) = HugePart::join(shuffled).unwrap_err();
        assert!(why.contains("expected"), "{why}");
        parts.swap(0, 2);
        let last = parts.pop().unwrap();
        let (mut parts, why) = HugePart::join(parts).unwrap_err();
        assert!(why.contains("parts up to"), "{why}");
        parts.push(last);
        let other = HugeBuf::zeroed(16).unwrap().split(&[8]).unwrap();
        let mut mixed = other;
        mixed.extend(parts);
        let (mixed, _) = HugePart::join(mixed).unwrap_err();
        let parts: Vec<HugePart> = mixed.into_iter().skip(2).collect();
        let mut whole = HugePart::join(parts).unwrap();
        assert_eq!(whole.len(), len);
        assert_eq!(whole.as_mut_ptr() as usize, addr, "joined without a copy");
        assert!(whole.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        let (back, why) = whole.split(&[5, 4]).unwrap_err();
        assert!(why.contains("cut at 4"), "{why}");
        assert_eq!(back.len(), len);
    }

    /// Kept mappings are handed out latest first, only to a request they have room for
    /// without more than two huge pages over, and the oldest go once the limit is passed.
    #[test]
    fn spares_are_reused_by_size_within_their_limit() {
        let map = |len: usize| memmap2::MmapMut::map_anon(len).unwrap();
        let mut s = Spares::new(16 * HUGE);
        assert!(s.give(map(3 * HUGE), 0).is_empty());
        assert!(s.give(map(3 * HUGE), HUGE).is_empty());
        let (m, off) = s.take(2 * HUGE).unwrap();
        assert_eq!((m.len(), off), (3 * HUGE, HUGE), "the latest first");
        assert!(s.take(4 * HUGE).is_none(), "no room");
        assert!(s.take(HUGE - 1).is_none(), "room for it, but too much");
        assert_eq!(s.take(HUGE).unwrap().0.len(), 3 * HUGE);
        assert!(s.take(HUGE).is_none(), "taken");
        assert_eq!(
            s.give(map(5 * HUGE), 0).len(),
            1,
            "over a quarter of the limit"
        );
        for len in [3, 4, 2, 2, 2] {
            assert!(s.give(map(len * HUGE), 0).is_empty());
        }
        let out = s.give(map(4 * HUGE), 7);
        assert_eq!(out.iter().map(|m| m.len()).collect::<Vec<_>>(), [3 * HUGE]);
        assert_eq!(
            s.kept.iter().map(|(m, _)| m.len()).sum::<usize>(),
            14 * HUGE
        );
        assert_eq!(s.kept.back().unwrap().1, 7);
    }

    /// A dropped buffer's mapping comes back for the next buffer of about its size (the same
    /// address). Other tests in this process use the same pool, so one of a few tries must see
    /// it; no other test asks for a buffer of this size.
    #[test]
    fn a_dropped_buffer_is_recycled() {
        let len = 3 * HUGE + 12_345;
        let reused = (0..5).any(|_| {
            let b = HugeBuf::recycled(len).unwrap();
            let at = b.as_ptr() as usize;
            drop(b);
            HugeBuf::recycled(len).unwrap().as_ptr() as usize == at
        });
        assert!(reused);
    }

    /// A recycled buffer has the length asked for, starts on a huge page and holds what is
    /// written; the bytes a dropped buffer held may come back in it, which its callers
    /// overwrite.
    #[test]
    fn recycled_buffers_hold_what_is_written() {
        for len in [17, HUGE + 3, 5 * HUGE + 1] {
            for _ in 0..3 {
                let mut b = HugeBuf::recycled(len).unwrap();
                assert_eq!(b.len(), len);
                if len >= HUGE {
                    assert_eq!(b.as_ptr() as usize % HUGE, 0, "len {len}");
                }
                for (i, x) in b.iter_mut().enumerate() {
                    *x = (i % 251) as u8;
                }
                assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
            }
        }
    }

    #[test]
    fn a_buffer_that_cannot_be_had_is_an_error_that_says_its_size() {
        let len = usize::MAX / 2;
        let e = HugeBuf::zeroed(len).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("cannot allocate {len} bytes: ")),
            "{e}"
        );
    }
}
