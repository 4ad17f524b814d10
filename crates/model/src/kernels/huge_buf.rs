//! Zeroed buffers for the packed weights and the KV pool, backed by 2 MiB pages where the OS
//! gives them.
//!
//! Decode streams every weight once per token. With 4 KiB pages that is a TLB miss every 4 KiB
//! (68 000 a token for a 278 MB model), and the page walks eat into the memory bandwidth decode
//! is bound by. Linux hands out transparent huge pages to a mapping only when asked
//! (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on many systems), so a buffer of
//! at least 2 MiB is a 2 MiB-aligned mapping of its own, advised with `MADV_HUGEPAGE` before its
//! first touch. Measured on a 2-core Xeon (alternated runs): a 2-thread streaming read 26 → 32
//! GB/s; Qwen2.5-0.5B decode +17% for Q4_0 and Q8_0, +8–11% at 16 parallel sequences.
//!
//! A smaller buffer is carved from a shared huge-page mapping ([`SLAB`] bytes, handed out in
//! order and never reused, so what is carved is still zero). A model's small weights (a GQA
//! layer's k and v projections, a mixture's router) are then on huge pages too, and one layer's
//! lie next to each other in the order they were loaded. Measured on the AMX Xeon (2026-12-06, 2
//! threads, builds alternated): `chain_cost` (48 layers of qwen3-30b-a3b's q/k/v, o and f32
//! router, one row) took 188–193 µs a layer for the fused q/k/v call against 201–206 with k and v
//! (0.6 MB each) on 4 KiB pages, and 32–34 µs for the 1 MB router against 38–39; decoding
//! qwen2.5-1.5b Q4_K (whose q and o are 1.3 MB) ran 1.6–3.4% faster (3 rounds of tg128); 104
//! MiB more of qwen3-30b-a3b's weights were on huge pages. A slab is unmapped when the last buffer
//! carved from it is dropped and the next buffer no longer fits in it.
//!
//! Elsewhere, or when the kernel says no, a buffer is an ordinary allocation.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Element types whose all-zero bit pattern is a valid value (so a zeroed buffer is initialised).
pub trait Plain: Copy + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for i8 {}
impl Plain for u16 {}
impl Plain for f32 {}

/// One huge page.
const HUGE: usize = 2 << 20;
/// The shared mapping smaller buffers are carved from: at most a huge page of it is lost when
/// the next buffer does not fit, and its pages cost memory only once touched.
const SLAB: usize = 16 * HUGE;
/// Where carved buffers start: a cache line, more than any [`Plain`] type's alignment.
const LINE: usize = 64;

/// A fixed-length, zero-initialised, heap buffer of `T`. Its pages are mapped lazily, as
/// `calloc`'s are: a KV pool sized for the worst case costs memory only as it fills.
pub struct HugeBuf<T: Plain> {
    ptr: NonNull<T>,
    len: usize,
    backing: Backing,
}

/// Where a buffer's memory comes from, and so how it is given back.
enum Backing {
    /// The global allocator (or nothing, for an empty buffer).
    Heap,
    /// A huge-page mapping of its own, of this many bytes.
    Mapped(usize),
    /// Part of a shared slab, unmapped with the last buffer carved from it.
    Carved { _slab: Arc<Slab> },
}

/// A huge-page mapping that small buffers are carved from.
struct Slab {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the slab is only ever unmapped (in `drop`, once no buffer refers to it); each carved
// buffer owns its own disjoint part of it.
unsafe impl Send for Slab {}
// SAFETY: as above; the slab itself hands out no access.
unsafe impl Sync for Slab {}

impl Drop for Slab {
    fn drop(&mut self) {
        unmap(self.base, self.len);
    }
}

/// The slab being carved and the offset of its first free byte.
static CARVER: Mutex<Option<(Arc<Slab>, usize)>> = Mutex::new(None);

// SAFETY: the buffer owns its elements exclusively, like a `Vec<T>`, and `T` is Send + Sync.
unsafe impl<T: Plain> Send for HugeBuf<T> {}
// SAFETY: as above; shared access only hands out `&[T]`.
unsafe impl<T: Plain> Sync for HugeBuf<T> {}

impl<T: Plain> HugeBuf<T> {
    /// `len` zeroed elements. Aborts like `Vec` when memory runs out.
    pub fn zeroed(len: usize) -> Self {
        // `Layout::array` checks the byte size for overflow.
        let Ok(layout) = Layout::array::<T>(len) else {
            panic!("buffer of {len} elements is too large") // as `Vec` would
        };
        if layout.size() == 0 {
            return Self { ptr: NonNull::dangling(), len, backing: Backing::Heap };
        }
        if layout.size() >= HUGE {
            if let Some((ptr, mapped)) = map_huge(layout.size()) {
                return Self { ptr: ptr.cast(), len, backing: Backing::Mapped(mapped) };
            }
        } else if let Some((ptr, slab)) = carve(layout.size()) {
            return Self { ptr: ptr.cast(), len, backing: Backing::Carved { _slab: slab } };
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len, backing: Backing::Heap }
    }

    /// A copy of `v`.
    pub fn from_slice(v: &[T]) -> Self {
        let mut b = Self::zeroed(v.len());
        b.copy_from_slice(v);
        b
    }
}

/// A fresh anonymous mapping of at least `bytes`, 2 MiB-aligned and advised to use huge pages;
/// returns it and its length. `None` off Linux or when the OS refuses (the caller falls back
/// to the allocator).
#[cfg(target_os = "linux")]
fn map_huge(bytes: usize) -> Option<(NonNull<u8>, usize)> {
    let len = bytes.checked_next_multiple_of(HUGE)?;
    let span = len.checked_add(HUGE)?;
    // SAFETY: a new private anonymous mapping (zero-filled, touching no existing memory); the
    // unaligned head and the tail beyond `len` are unmapped again, leaving `[start, start + len)`
    // owned by the returned buffer alone. The advice only changes how its pages are backed; a
    // refusal (THP disabled, an old kernel) leaves ordinary pages.
    unsafe {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let base = libc::mmap(std::ptr::null_mut(), span, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE);
        if start > base {
            libc::munmap(base as *mut libc::c_void, start - base);
        }
        let tail = base + span - (start + len);
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        Some((NonNull::new(start as *mut u8)?, len))
    }
}

#[cfg(not(target_os = "linux"))]
fn map_huge(_bytes: usize) -> Option<(NonNull<u8>, usize)> {
    None
}

/// Give back a mapping made by [`map_huge`].
fn unmap(ptr: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: a mapping of this length from `map_huge`, given back once by its one owner.
    unsafe {
        libc::munmap(ptr.as_ptr().cast(), len);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// `bytes` (less than a huge page, more than none) of never-used, so zeroed, slab memory, aligned
/// to a cache line, and the slab it is in; a fresh slab when the current one has no room left.
/// `None` where no huge-page mapping is to be had.
fn carve(bytes: usize) -> Option<(NonNull<u8>, Arc<Slab>)> {
    let mut carver = CARVER.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if carver.as_ref().is_none_or(|(slab, next)| next + bytes > slab.len) {
        let (base, len) = map_huge(SLAB)?;
        *carver = Some((Arc::new(Slab { base, len }), 0));
    }
    let (slab, next) = carver.as_mut()?;
    let at = *next;
    *next = (at + bytes).next_multiple_of(LINE);
    // SAFETY: `at + bytes <= slab.len`, so the offset stays inside the slab's mapping.
    let ptr = unsafe { slab.base.add(at) };
    Some((ptr, Arc::clone(slab)))
}

impl<T: Plain> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        match self.backing {
            Backing::Mapped(len) => unmap(self.ptr.cast(), len),
            // The slab goes when its last buffer does (its `Arc`).
            Backing::Carved { .. } => {}
            Backing::Heap => {
                if let Ok(layout) = Layout::array::<T>(self.len) {
                    if layout.size() > 0 {
                        // SAFETY: allocated in `zeroed` with this same layout.
                        unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), layout) };
                    }
                }
            }
        }
    }
}

impl<T: Plain> Deref for HugeBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (or is dangling with `len == 0`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Plain> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl<T: Plain + std::fmt::Debug> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_writable_and_aligned_when_large() {
        for len in [0usize, 1, 1000, HUGE / 4 - 1, HUGE / 4, HUGE / 4 + 3, 3 * HUGE / 4 + 5] {
            let mut b = HugeBuf::<f32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&v| v == 0.0), "zeroed at {len}");
            for (i, v) in b.iter_mut().enumerate() {
                *v = i as f32;
            }
            if cfg!(target_os = "linux") && len * 4 >= HUGE {
                assert_eq!(b.as_ptr() as usize % HUGE, 0, "{len} floats: 2 MiB-aligned");
            }
            let c = b.clone();
            assert_eq!(&c[..], &b[..]);
            assert!(c.iter().enumerate().all(|(i, &v)| v == i as f32));
        }
        let bytes = HugeBuf::<u8>::from_slice(&[1, 2, 3]);
        assert_eq!(&bytes[..], &[1, 2, 3]);
    }

    /// Small buffers are carved from shared slabs: each starts on a cache line, is zeroed, and
    /// overlaps no other live buffer, across more than one slab's worth, with some dropped
    /// (and their slabs given back) on the way.
    #[test]
    fn carved_buffers_are_zeroed_aligned_and_disjoint() {
        let mut live: Vec<HugeBuf<u16>> = Vec::new();
        let mut total = 0;
        for (i, len) in [1usize, 31, 4096, HUGE / 2 - 1, 300_000, HUGE / 2 - 7, 77].iter().cycle().take(120).enumerate()
        {
            let mut b = HugeBuf::<u16>::zeroed(*len);
            assert!(b.iter().all(|&v| v == 0), "buffer {i} of {len} zeroed");
            if cfg!(target_os = "linux") {
                assert_eq!(b.as_ptr() as usize % LINE, 0, "buffer {i} on a cache line");
            }
            b.fill(i as u16 + 1);
            total += len * 2;
            if i % 3 == 0 {
                drop(b); // its slab may be given back once the carver has moved on
            } else {
                live.push(b);
            }
        }
        assert!(total > 2 * SLAB, "the test spans several slabs");
        let mut spans: Vec<(usize, usize)> =
            live.iter().map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.len() * 2)).collect();
        spans.sort_unstable();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "live buffers overlap");
        for b in &live {
            let first = b[0];
            assert!(b.iter().all(|&v| v == first), "a buffer kept its own values");
        }
    }
}
