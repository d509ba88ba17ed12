//! Reading the thread's stack during an unwind, so that an address a
//! corrupt frame names is an error rather than a crash:
//!
//! - **directly**, with a load the engine's fault handler recovers from
//!   (a fault there resumes at a second exit that says "unreadable", as
//!   the kernel's own user-memory accessors do), where that handler was
//!   the process's SIGSEGV and SIGBUS handler at the last refresh or
//!   attach, and the thread does not block them (a system call per
//!   stack, that only asks);
//! - else through `process_vm_readv`, a window of the stack per system
//!   call.

/// Bytes read at a time through `process_vm_readv`.
const WINDOW: usize = 512;

/// A window of the stack, read on demand.
// On the stack of a hit, where nothing may be allocated; a direct reader
// leaves the window's bytes unwritten.
#[allow(clippy::large_enum_variant)]
pub(super) enum Reader {
    /// Loads go straight to memory (see the module's docs).
    Direct,
    /// Through `process_vm_readv`, a window at a time.
    Window(Window),
}

/// The part of the stack last read through `process_vm_readv`.
pub(super) struct Window {
    start: usize,
    len: usize,
    buf: [u8; WINDOW],
}

impl Reader {
    pub(super) fn new() -> Self {
        if crate::process::safe_load::recoverable_here() {
            Self::Direct
        } else {
            Self::Window(Window {
                start: 0,
                len: 0,
                buf: [0; WINDOW],
            })
        }
    }

    /// The word at `addr` (aligned), if it can be read. Async-signal-safe.
    pub(super) fn read(&mut self, addr: usize) -> Option<usize> {
        match self {
            Self::Direct => crate::process::safe_load::load(addr),
            Self::Window(w) => w.read(addr),
        }
    }
}

impl Window {
    fn read(&mut self, addr: usize) -> Option<usize> {
        const WORD: usize = size_of::<usize>();
        if !addr.is_multiple_of(WORD) {
            return None;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_addresses_are_errors_not_faults() {
        crate::entry::faults::install().unwrap();
        crate::entry::faults::check_handlers();
        let word = 0x1234_5678usize;
        let mut r = Reader::new();
        assert!(
            matches!(r, Reader::Direct),
            "the fault handler is in and nothing blocks it"
        );
        assert_eq!(r.read(&raw const word as usize), Some(0x1234_5678));
        // The null page and a kernel address: no mapping.
        assert_eq!(r.read(8), None);
        assert_eq!(r.read(0xffff_8000_0000_0000), None);
        // A thread that blocks SIGSEGV reads through the system call.
        std::thread::spawn(move || {
            // SAFETY: masks of this new thread only.
            unsafe {
                let mut all: libc::sigset_t = core::mem::zeroed();
                libc::sigfillset(&raw mut all);
                libc::pthread_sigmask(libc::SIG_SETMASK, &raw const all, core::ptr::null_mut());
            }
            let Reader::Window(mut w) = Reader::new() else {
                panic!("a thread blocking SIGSEGV reads directly");
            };
            assert_eq!(w.read(8), None);
            // (qemu-user has no process_vm_readv: nothing reads there.)
            if w.fill(&raw const word as usize).is_some() {
                assert_eq!(w.read(&raw const word as usize), Some(0x1234_5678));
            }
        })
        .join()
        .unwrap();
    }
}
