//! Zeroed buffers for the packed weights and the KV pool, backed by 2 MiB pages where the OS
//! gives them.
//!
//! Decode streams every weight once per token. With 4 KiB pages that is a TLB miss every 4 KiB
//! (68 000 a token for a 278 MB model), and the page walks eat into the memory bandwidth decode
//! is bound by. Linux hands out transparent huge pages to a mapping only when asked
//! (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on many systems), so a buffer of
//! at least 2 MiB is a 2 MiB-aligned mapping of its own, advised with `MADV_HUGEPAGE` before its
//! first touch. Measured on a 2-core Xeon (alternated runs): a 2-thread streaming read 26 → 32
//! GB/s; Qwen2.5-0.5B decode +17% for Q4_0 and Q8_0, +8–11% at 16 parallel sequences. Elsewhere,
//! or when the kernel says no, it is an ordinary allocation.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Element types whose all-zero bit pattern is a valid value (so a zeroed buffer is initialised).
pub trait Plain: Copy + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for i8 {}
impl Plain for u16 {}
impl Plain for f32 {}

/// One huge page.
const HUGE: usize = 2 << 20;

/// A fixed-length, zero-initialised, heap buffer of `T`. Its pages are mapped lazily, as
/// `calloc`'s are: a KV pool sized for the worst case costs memory only as it fills.
pub struct HugeBuf<T: Plain> {
    ptr: NonNull<T>,
    len: usize,
    /// Bytes mapped for it when it is a huge-page mapping of its own.
    mapped: Option<usize>,
}

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
            return Self { ptr: NonNull::dangling(), len, mapped: None };
        }
        if layout.size() >= HUGE {
            if let Some((ptr, mapped)) = map_huge(layout.size()) {
                return Self { ptr: ptr.cast(), len, mapped: Some(mapped) };
            }
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { alloc::handle_alloc_error(layout) };
        Self { ptr, len, mapped: None }
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

impl<T: Plain> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        match self.mapped {
            #[cfg(target_os = "linux")]
            Some(len) => {
                // SAFETY: this buffer's own mapping, of this length, from `map_huge`.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), len) };
            }
            #[cfg(not(target_os = "linux"))]
            Some(_) => {}
            None => {
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
}
