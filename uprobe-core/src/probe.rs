//! `Uprobe` (the builder) and `Probe` (the attached handle).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::AttachError;
use crate::arch::EntryContext;
use crate::engine::{self, Consumer};

/// A probe to attach: where, and what runs on each hit.
///
/// ```no_run
/// use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
/// use uprobe_core::{Reg, Uprobe};
///
/// #[inline(never)]
/// extern "C" fn traced(x: u64) -> u64 { x + 1 }
///
/// static SEEN: AtomicU64 = AtomicU64::new(0);
/// // SAFETY: `traced` is a function: its address starts an instruction.
/// let probe = unsafe { Uprobe::address(traced as usize) }
///     .on_entry(|cx| SEEN.store(cx.arg(0).unwrap(), Relaxed))
///     .attach()?;
/// assert_eq!(traced(41), 42);
/// assert_eq!((SEEN.load(Relaxed), probe.hits()), (41, 1));
/// drop(probe); // detaches: the original byte is back
/// # Ok::<(), uprobe_core::AttachError>(())
/// ```
pub struct Uprobe {
    addr: usize,
    handler: Option<engine::Handler>,
    only_tid: i32,
}

impl Uprobe {
    /// A probe on the instruction at `addr`.
    ///
    /// # Safety
    /// `addr` is the first byte of an instruction of this process's code
    /// (a function's address is). A probe in the middle of an instruction
    /// corrupts it for every thread that runs it. (Symbol-checked
    /// constructors, which decode from a function's start, come with the
    /// ELF support.)
    #[must_use]
    pub unsafe fn address(addr: usize) -> Self {
        Self {
            addr,
            handler: None,
            only_tid: 0,
        }
    }

    /// The handler run on each hit, before the probed instruction, in the
    /// SIGTRAP handler of the thread that hit it: see [`EntryContext`] for
    /// what it may do. A handler that panics aborts the process (unwinding
    /// through a signal frame is not possible).
    #[must_use]
    pub fn on_entry(mut self, f: impl Fn(&mut EntryContext<'_>) + Send + Sync + 'static) -> Self {
        self.handler = Some(Box::new(f));
        self
    }

    /// Runs the handler only for hits of thread `tid` (a kernel thread id,
    /// as `gettid()` returns).
    #[must_use]
    pub fn only_thread(mut self, tid: i32) -> Self {
        self.only_tid = tid;
        self
    }

    /// Patches the breakpoint in (the first consumer at an address) or adds
    /// this consumer to the probe already there. Not async-signal-safe.
    pub fn attach(self) -> Result<Probe, AttachError> {
        let consumer = Arc::new(Consumer {
            handler: self.handler.unwrap_or_else(|| Box::new(|_| {})),
            only_tid: self.only_tid,
            hits: AtomicU64::new(0),
            removed: AtomicBool::new(false),
        });
        // SAFETY: `address`'s contract.
        unsafe { engine::attach(self.addr, Arc::clone(&consumer)) }?;
        Ok(Probe {
            addr: self.addr,
            consumer,
            attached: true,
        })
    }
}

impl core::fmt::Debug for Uprobe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Uprobe")
            .field("addr", &format_args!("{:#x}", self.addr))
            .finish_non_exhaustive()
    }
}

/// An attached probe; dropping it detaches (see [`detach`](Self::detach)).
pub struct Probe {
    addr: usize,
    consumer: Arc<Consumer>,
    attached: bool,
}

impl Probe {
    /// The probed address.
    #[must_use]
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Hits that ran this probe's handler.
    #[must_use]
    pub fn hits(&self) -> u64 {
        self.consumer.hits.load(Ordering::Relaxed)
    }

    /// Hits at this address that ran no handler because the thread was
    /// already inside the engine (a probed function called from a
    /// handler), shared by every probe on the address.
    #[must_use]
    pub fn missed(&self) -> u64 {
        engine::missed(self.addr)
    }

    /// Removes the probe; the last one at an address restores the original
    /// byte. Returns once no handler of this probe runs or will run (one
    /// SRCU grace period). Not async-signal-safe; must not be called from a
    /// probe handler.
    pub fn detach(mut self) -> Result<(), AttachError> {
        self.attached = false;
        engine::detach(self.addr, &self.consumer)
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if self.attached {
            let _ = engine::detach(self.addr, &self.consumer);
        }
    }
}

impl core::fmt::Debug for Probe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Probe")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("hits", &self.hits())
            .finish_non_exhaustive()
    }
}
