//! What the loaders do with a checkpoint's pages once a tensor has been copied out of them.
//!
//! flint computes from its own packed copy of each weight, so a checkpoint's bytes are read
//! once. Left in memory afterwards they would be a second copy of the model:
//! - mapped into the process (safetensors), they count in its resident memory: [`unmap`];
//! - in the page cache (both formats), they crowd the memory that the packed copy is being
//!   allocated from as it loads, and the huge pages it asks for ([`crate::kernels::huge_buf`])
//!   are then refused wherever no free 2 MiB is left: [`uncache`].
//!
//! The second one is measured. Loading qwen3-30b-a3b at Q4_K (a 17.2 GB file on a 24 GB machine,
//! Zen 4, Linux 6.18) with the file in the page cache left 0.2, 1.0 and 1.8 GB of the buffers that
//! asked for huge pages on 4 KiB ones (three loads), most in expert tensors; a two-thread streaming
//! read of 4 KiB pages ran at 0.79× the speed of huge ones there (a C loop, the two alternated, 1
//! GiB each). Dropping each tensor's pages from the cache once read left none (0.4 GB of the 17.7
//! GB resident stays on 4 KiB pages: the buffers under 2 MiB, which never ask). Asking again once a
//! buffer was written (`MADV_COLLAPSE`) did not mend it: refused for 49 and 90 of the 241 buffers
//! in two loads, no huge page to be had while the cache held the memory.
//!
//! The price: a later load of the same file reads it from the disk again, not from the cache.
//! Pages another process has mapped (llama.cpp serving the same file) stay: the kernel drops
//! only pages nobody maps.

use std::fs::File;

use memmap2::Mmap;

/// Drop this process's mapping of `len` bytes at `offset` once the tensor there has been copied
/// out: the pages no longer count in the process's resident memory. A later read (a tensor
/// sharing the edge page) maps them again from the unchanged file.
pub(crate) fn unmap(mmap: &Mmap, offset: usize, len: usize) {
    #[cfg(unix)]
    // SAFETY: the mapping is of a read-only file opened for reading; after MADV_DONTNEED a read
    // refaults the same bytes from the file, so no reference into it sees different contents.
    // Failure only leaves the pages mapped.
    let _ = unsafe { mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    #[cfg(not(unix))]
    let _ = (mmap, offset, len);
}

/// Ask the kernel to drop `file`'s pages from the page cache: all of them that no process maps
/// (clean ones; none of a file being written). Called after each tensor has been read and copied
/// out, it drops that tensor's bytes, whatever readahead fetched past them (a later read fetches
/// it again), and the pages an earlier call could not drop because they shared a large folio
/// with bytes not yet read: the cache's folios span up to 2 MiB, not a tensor's exact range.
/// Reads see the same bytes afterwards, from the disk. Off Linux, or where the kernel declines,
/// nothing changes: more memory used, never wrong.
pub(crate) fn uncache(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain system call on a descriptor this `File` owns (offset 0 and length 0:
        // the whole file); advice only, it changes no memory of this process.
        let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};

    const PAGE: usize = 4096;

    /// How many pages of `file`'s bytes `range` are in the page cache.
    fn resident_pages(file: &File, range: std::ops::Range<usize>) -> usize {
        // SAFETY: a read-only mapping of a file this test owns and does not change meanwhile.
        let map = unsafe { Mmap::map(file) }.expect("map the file");
        let mut vec = vec![0u8; range.len().div_ceil(PAGE)];
        // SAFETY: a page-aligned start inside the mapping and one byte per page of the range, as
        // mincore requires.
        let rc =
            unsafe { libc::mincore(map.as_ptr().add(range.start) as *mut libc::c_void, range.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore");
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// Whether `dir` is on a tmpfs, whose pages are the files themselves (the advice is a no-op).
    fn on_tmpfs(dir: &std::path::Path) -> bool {
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
        // SAFETY: a NUL-terminated path and a zeroed out-struct the call fills.
        unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC
        }
    }

    /// A file read and then uncached leaves the page cache, except the pages a live mapping has
    /// touched, and still reads the same bytes.
    #[test]
    fn uncached_files_leave_the_page_cache_but_mapped_pages_stay() {
        let dir = tempfile::tempdir().expect("temp dir");
        if on_tmpfs(dir.path()) {
            eprintln!("skipped: the temp dir is on a tmpfs");
            return;
        }
        let path = dir.path().join("weights.bin");
        let len = 1024 * PAGE;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / PAGE) as u8).collect();
        {
            let mut f = File::create(&path).expect("create");
            f.write_all(&bytes).expect("write");
            // Dirty pages cannot be dropped: written back first, as a checkpoint on disk is.
            f.sync_all().expect("sync");
        }
        let mut file = File::open(&path).expect("open");
        let mut back = Vec::new();
        file.read_to_end(&mut back).expect("read");
        assert_eq!(back, bytes);
        assert!(resident_pages(&file, 0..len) > 0, "a file just read is in the page cache");
        uncache(&file);
        assert_eq!(resident_pages(&file, 0..len), 0, "the file left the page cache");

        // SAFETY: as in `resident_pages`.
        let held = unsafe { Mmap::map(&file) }.expect("map the file");
        let last = len - PAGE;
        assert_eq!(std::hint::black_box(held[last]), bytes[last]);
        uncache(&file);
        assert_eq!(resident_pages(&file, last..len), 1, "a page another mapping holds stays");
        file.seek(SeekFrom::Start(0)).expect("seek");
        back.clear();
        file.read_to_end(&mut back).expect("read again");
        assert_eq!(back, bytes, "the same bytes after the cache let them go");
    }
}
