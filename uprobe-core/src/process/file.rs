//! Object files read through a read-only mapping, not the heap.
//!
//! The engine reads whole object files (their symbol tables, unwind
//! information, `__rseq_cs`), some of them large (a library with debug
//! information: megabytes). Read into a `Vec`, each would be one large
//! `malloc`: glibc serves it with `mmap`, and freeing it raises glibc's
//! dynamic mmap threshold (to its size) and heap trim threshold (to
//! twice that) for the rest of the process. In a program the engine is
//! loaded into (a tracer's agent in a running process) that changes how
//! the program's own allocations are served after the engine is gone,
//! and keeps the freed top of the agent thread's heap resident. Mapped,
//! the file's pages are the page cache's and go with the mapping.

use std::os::fd::AsRawFd;
use std::path::Path;

/// A whole file mapped read-only (private); unmapped on drop.
pub(crate) struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapped {
    /// Maps `path` (an empty file maps to an empty slice). Not
    /// async-signal-safe.
    ///
    /// # Errors
    /// Why it cannot be opened or mapped.
    pub(crate) fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::File::open(path)?;
        let len = usize::try_from(file.metadata()?.len())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::FileTooLarge))?;
        if len == 0 {
            return Ok(Self {
                ptr: core::ptr::null_mut(),
                len: 0,
            });
        }
        // SAFETY: a fresh private read-only mapping of an open file; the
        // descriptor may be closed after (the mapping keeps the file).
        let ptr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr, len })
    }

    /// The file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` bytes mapped readable at `ptr` until drop. The
        // engine maps object files of the process (loaded libraries and
        // executables), which nothing rewrites in place while they are
        // loaded; one truncated meanwhile would fault here as it would in
        // the code that runs from it.
        unsafe { core::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: the mapping made in `open`, not used after.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}
