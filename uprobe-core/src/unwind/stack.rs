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

// The recoverable load: `uprobe_core_safe_load(addr, out)` returns 1 with
// the word at `addr` in `*out`, or 0 when the load at
// `uprobe_core_safe_load_at` faulted and the fault handler resumed at
// `uprobe_core_safe_load_fault`.
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_safe_load,\"ax\",@progbits",
    ".globl uprobe_core_safe_load",
    ".hidden uprobe_core_safe_load",
    ".type uprobe_core_safe_load, @function",
    "uprobe_core_safe_load:",
    ".globl uprobe_core_safe_load_at",
    ".hidden uprobe_core_safe_load_at",
    "uprobe_core_safe_load_at:",
    "mov rax, qword ptr [rdi]",
    "mov qword ptr [rsi], rax",
    "mov eax, 1",
    "ret",
    ".globl uprobe_core_safe_load_fault",
    ".hidden uprobe_core_safe_load_fault",
    "uprobe_core_safe_load_fault:",
    "xor eax, eax",
    "ret",
    ".size uprobe_core_safe_load, . - uprobe_core_safe_load",
    ".popsection",
);
#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".pushsection .text.uprobe_core_safe_load,\"ax\",@progbits",
    ".globl uprobe_core_safe_load",
    ".hidden uprobe_core_safe_load",
    ".type uprobe_core_safe_load, %function",
    "uprobe_core_safe_load:",
    ".globl uprobe_core_safe_load_at",
    ".hidden uprobe_core_safe_load_at",
    "uprobe_core_safe_load_at:",
    "ldr x2, [x0]",
    "str x2, [x1]",
    "mov w0, #1",
    "ret",
    ".globl uprobe_core_safe_load_fault",
    ".hidden uprobe_core_safe_load_fault",
    "uprobe_core_safe_load_fault:",
    "mov w0, #0",
    "ret",
    ".size uprobe_core_safe_load, . - uprobe_core_safe_load",
    ".popsection",
);

unsafe extern "C" {
    fn uprobe_core_safe_load(addr: usize, out: *mut usize) -> u32;
    fn uprobe_core_safe_load_at();
    fn uprobe_core_safe_load_fault();
}

/// For the fault handler: a fault at the recoverable load resumes at its
/// second exit. Async-signal-safe.
pub(crate) fn recover(uc: &mut libc::ucontext_t) -> bool {
    if crate::arch::pc(uc) != uprobe_core_safe_load_at as *const () as usize {
        return false;
    }
    crate::arch::set_pc(uc, uprobe_core_safe_load_fault as *const () as usize);
    true
}

/// Whether the engine's fault handler was the process's SIGSEGV and SIGBUS
/// handler when last looked (by [`check_handlers`], at every refresh and
/// attach): a program that installs its own afterwards, and then has the
/// unwinder read an unmapped address, gets that fault in its handler.
static HANDLERS_OURS: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Looks whether the engine's fault handler is the process's SIGSEGV and
/// SIGBUS handler. Ordinary context.
pub(crate) fn check_handlers() {
    let ours = crate::entry::faults::handler();
    let all = [libc::SIGSEGV, libc::SIGBUS].into_iter().all(|sig| {
        // SAFETY: a query: `act` null, `old` ours to fill.
        let mut old: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::sigaction(sig, core::ptr::null(), &raw mut old) }) == 0
            && old.sa_sigaction == ours
    });
    HANDLERS_OURS.store(all, core::sync::atomic::Ordering::Relaxed);
}

/// Whether a fault in this thread reaches the engine's handler: it is the
/// process's handler (see [`HANDLERS_OURS`]), and the thread blocks
/// neither SIGSEGV nor SIGBUS (a system call that only asks).
/// Async-signal-safe.
fn faults_recoverable() -> bool {
    if !HANDLERS_OURS.load(core::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    // SAFETY: a query of the calling thread's mask.
    let mut mask: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, core::ptr::null(), &raw mut mask) } != 0 {
        return false;
    }
    // SAFETY: reading our own set.
    unsafe {
        libc::sigismember(&raw const mask, libc::SIGSEGV) == 0
            && libc::sigismember(&raw const mask, libc::SIGBUS) == 0
    }
}

/// A window of the stack, read on demand.
pub(super) struct Reader {
    /// Loads go straight to memory (see the module's docs).
    direct: bool,
    start: usize,
    len: usize,
    buf: [u8; WINDOW],
}

impl Reader {
    pub(super) fn new() -> Self {
        Self {
            direct: faults_recoverable(),
            start: 0,
            len: 0,
            buf: [0; WINDOW],
        }
    }

    /// The word at `addr`, if it can be read. Async-signal-safe.
    pub(super) fn read(&mut self, addr: usize) -> Option<usize> {
        const WORD: usize = size_of::<usize>();
        if self.direct {
            if !addr.is_multiple_of(WORD) {
                return None;
            }
            let mut out = 0usize;
            // SAFETY: a load whose fault the engine's handler recovers
            // from (checked when the reader was made).
            return (unsafe { uprobe_core_safe_load(addr, &raw mut out) } == 1).then_some(out);
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
        check_handlers();
        let word = 0x1234_5678usize;
        let mut r = Reader::new();
        assert!(r.direct, "the fault handler is in and nothing blocks it");
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
            let mut r = Reader::new();
            assert!(!r.direct);
            assert_eq!(r.read(&raw const word as usize), Some(0x1234_5678));
            assert_eq!(r.read(8), None);
        })
        .join()
        .unwrap();
    }
}
