//! Reading the thread's stack during an unwind: through
//! `process_vm_readv`, so that an address a corrupt frame names is an
//! error rather than a fault, a window of it per system call.

/// Bytes read at a time.
const WINDOW: usize = 1024;

/// A window of the stack, read on demand.
pub(super) struct Reader {
    start: usize,
    len: usize,
    buf: [u8; WINDOW],
}

impl Reader {
    pub(super) fn new() -> Self {
        Self {
            start: 0,
            len: 0,
            buf: [0; WINDOW],
        }
    }

    /// The word at `addr`, if it can be read. Async-signal-safe.
    pub(super) fn read(&mut self, addr: usize) -> Option<usize> {
        const WORD: usize = size_of::<usize>();
        if addr < self.start || addr + WORD > self.start + self.len {
            self.fill(addr)?;
        }
        let at = addr - self.start;
        let mut word = [0u8; WORD];
        word.copy_from_slice(&self.buf[at..at + WORD]);
        Some(usize::from_ne_bytes(word))
    }

    /// Reads the window starting at `addr` (shorter at the end of a
    /// mapping, down to one word).
    fn fill(&mut self, addr: usize) -> Option<()> {
        let mut want = WINDOW;
        while want >= size_of::<usize>() {
            let local = libc::iovec {
                iov_base: self.buf.as_mut_ptr().cast(),
                iov_len: want,
            };
            let remote = libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: want,
            };
            // SAFETY: reads into our own buffer of at least `want` bytes;
            // a bad remote address fails with EFAULT.
            let n = unsafe {
                libc::process_vm_readv(libc::getpid(), &raw const local, 1, &raw const remote, 1, 0)
            };
            if let Ok(n) = usize::try_from(n)
                && n >= size_of::<usize>()
            {
                self.start = addr;
                self.len = n;
                return Some(());
            }
            // A window crossing into an unmapped page: try a shorter one
            // (what `process_vm_readv` read partially it reports, but a
            // first page that fails reads nothing).
            want /= 4;
        }
        None
    }
}
