//! `PerCpuStack`: intrusive per-CPU LIFO lists, pushed and popped on the
//! current CPU with rseq critical sections.

use core::ptr::NonNull;

use crate::PerCpu;
use crate::sync::atomic::{AtomicUsize, Ordering};

/// One CPU's list: the top node's address and the lock word that the rseq
/// critical sections check before their commit. `repr(C)`: the assembly
/// finds `lock` at offset 8.
#[repr(C)]
#[derive(Default)]
struct Head {
    top: AtomicUsize,
    lock: AtomicUsize,
}

/// The operation would have had to wait for a lock (returned by the `try_`
/// methods, which never wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WouldBlock;

impl core::fmt::Display for WouldBlock {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("per-CPU list is locked by another thread")
    }
}

impl std::error::Error for WouldBlock {}

/// Intrusive LIFO lists of nodes, one per possible CPU plus the overflow
/// slot: the building block of per-CPU freelists.
///
/// Nodes are caller-owned memory with a `usize` link word at a fixed offset
/// (`next_offset`). The stack never allocates, so every operation works on
/// preallocated pools.
///
/// # How it synchronises
/// - **rseq mode** (x86-64 with glibc's rseq area and
///   `MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ`): [`push`](Self::push) and
///   [`pop`](Self::pop) on the current CPU's list are rseq critical sections
///   of plain loads and stores; the pop loads the top node's link word
///   *inside* the section, so another pop/push on this CPU cannot slip in
///   between (no ABA, no tagged pointers).
/// - Each list has a lock word, which the critical sections check before
///   committing. Any operation on a list other than the caller's current
///   CPU's ([`pop_slot`](Self::pop_slot), [`push_slot`](Self::push_slot)),
///   and any operation that finds the lock taken, takes the lock and then
///   calls [`rseq::fence_cpu`](crate::rseq::fence_cpu) on that CPU, which
///   restarts a critical section that read the lock as free before the lock
///   was taken. From then until the unlock, that CPU's critical sections
///   leave the list alone.
/// - **fallback mode** (no rseq, aarch64, loom): every operation takes the
///   list's lock (a test-and-set spinlock).
///
/// The lock is only held for a few instructions, but userspace cannot stop
/// preemption: a holder that is descheduled makes the others wait (they
/// yield after a short spin). The `try_` variants never wait and are the
/// ones to use from signal handlers.
///
/// # Example
/// ```
/// use std::ptr::NonNull;
/// #[repr(C)]
/// struct Node { next: usize, value: u32 }
/// let stack = pcpu::PerCpuStack::new(std::mem::offset_of!(Node, next));
/// let node = Box::leak(Box::new(Node { next: 0, value: 7 }));
/// // SAFETY: the node is ours, outlives the stack's use of it, and its link
/// // word is at `next_offset`.
/// unsafe { stack.push(NonNull::from(&mut *node).cast()) };
/// let popped = stack.pop().or_else(|| (0..stack.slots()).find_map(|s| stack.pop_slot(s)));
/// assert_eq!(popped.map(|p| unsafe { p.cast::<Node>().as_ref().value }), Some(7));
/// ```
pub struct PerCpuStack {
    heads: PerCpu<Head>,
    next_offset: usize,
    use_rseq: bool,
}

impl PerCpuStack {
    /// An empty stack whose nodes keep their link word at `next_offset`.
    /// Decides the mode (rseq or locks) once. Not async-signal-safe.
    ///
    /// # Panics
    /// If `next_offset` is not a multiple of `align_of::<usize>()`.
    #[must_use]
    pub fn new(next_offset: usize) -> Self {
        assert!(
            next_offset.is_multiple_of(align_of::<usize>()),
            "link word must be usize-aligned"
        );
        // Under loom the stack models its fallback (the lock-word protocol).
        let use_rseq =
            cfg!(not(loom)) && crate::rseq::available() && crate::fence::register_rseq_fence();
        Self {
            heads: PerCpu::default(),
            next_offset,
            use_rseq,
        }
    }

    /// Whether pushes and pops on the current CPU use rseq critical sections.
    #[must_use]
    pub fn uses_rseq(&self) -> bool {
        self.use_rseq
    }

    /// The number of lists (possible CPUs plus the overflow slot).
    #[must_use]
    pub fn slots(&self) -> usize {
        self.heads.cpus() + 1
    }

    /// The slot index of the caller's current CPU.
    #[must_use]
    pub fn current_slot(&self) -> usize {
        self.heads.current_index()
    }

    /// A racy look at whether list `slot` is empty (one load of its top
    /// pointer, the merged kernel's hint). Async-signal-safe.
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    #[must_use]
    pub fn looks_empty(&self, slot: usize) -> bool {
        self.head(slot).top.load(Ordering::Relaxed) == 0
    }

    fn head(&self, slot: usize) -> &Head {
        self.heads.get(slot).expect("slot index out of range")
    }

    /// Pushes `node` on the current CPU's list. May wait for the list's lock
    /// (only while another thread holds it): not async-signal-safe; use
    /// [`try_push`](Self::try_push) there.
    ///
    /// # Safety
    /// `node` is valid for reads and writes of the link word at
    /// `next_offset` (a usize-aligned address), is not in any list, and stays
    /// valid until popped.
    pub unsafe fn push(&self, node: NonNull<u8>) {
        // SAFETY: forwarded.
        if unsafe { self.push_fast(node) } {
            return;
        }
        let slot = self.current_slot();
        self.with_lock(slot, true, |head| {
            // SAFETY: forwarded.
            unsafe { self.link(head, node) }
        });
    }

    /// Like [`push`](Self::push) but never waits: returns the node back if
    /// the list is locked. **Async-signal-safe.**
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    pub unsafe fn try_push(&self, node: NonNull<u8>) -> Result<(), NonNull<u8>> {
        // SAFETY: forwarded.
        if unsafe { self.push_fast(node) } {
            return Ok(());
        }
        let slot = self.current_slot();
        self.with_lock(slot, false, |head| {
            // SAFETY: forwarded.
            unsafe { self.link(head, node) }
        })
        .ok_or(node)
    }

    /// Pushes `node` on list `slot`, whichever CPU the caller is on (takes
    /// that list's lock). Not async-signal-safe.
    ///
    /// # Safety
    /// As for [`push`](Self::push).
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub unsafe fn push_slot(&self, slot: usize, node: NonNull<u8>) {
        self.with_lock(slot, true, |head| {
            // SAFETY: forwarded.
            unsafe { self.link(head, node) }
        });
    }

    /// Pops from the current CPU's list only. May wait for the list's lock:
    /// not async-signal-safe; use [`try_pop`](Self::try_pop) there.
    #[must_use]
    pub fn pop(&self) -> Option<NonNull<u8>> {
        match self.pop_fast() {
            Ok(node) => node,
            Err(()) => self
                .with_lock(self.current_slot(), true, |h| self.unlink(h))
                .flatten(),
        }
    }

    /// Like [`pop`](Self::pop) but never waits. **Async-signal-safe.**
    pub fn try_pop(&self) -> Result<Option<NonNull<u8>>, WouldBlock> {
        match self.pop_fast() {
            Ok(node) => Ok(node),
            Err(()) => self
                .with_lock(self.current_slot(), false, |h| self.unlink(h))
                .ok_or(WouldBlock),
        }
    }

    /// Pops from list `slot`, whichever CPU the caller is on (takes the
    /// list's lock, and in rseq mode fences that CPU). Not async-signal-safe.
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    #[must_use]
    pub fn pop_slot(&self, slot: usize) -> Option<NonNull<u8>> {
        self.with_lock(slot, true, |h| self.unlink(h)).flatten()
    }

    /// Like [`pop_slot`](Self::pop_slot) but never waits.
    /// **Async-signal-safe.**
    ///
    /// # Panics
    /// If `slot >= self.slots()`.
    pub fn try_pop_slot(&self, slot: usize) -> Result<Option<NonNull<u8>>, WouldBlock> {
        self.with_lock(slot, false, |h| self.unlink(h))
            .ok_or(WouldBlock)
    }

    /// The rseq push; `false` if it must take the locked path.
    #[inline]
    unsafe fn push_fast(&self, node: NonNull<u8>) -> bool {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        if self.use_rseq
            && let Some(area) = crate::rseq::area::offset()
        {
            let (base, stride) = self.heads.raw_layout();
            let next = self.link_word(node);
            // SAFETY: rseq mode: CPU slots are `Head`s written only by this
            // CPU's critical sections or under their lock; the caller
            // guarantees the node's link word.
            let rc = unsafe {
                crate::rseq::raw_push(
                    area,
                    base,
                    stride,
                    self.heads.cpus() as u32,
                    node.as_ptr() as usize,
                    next,
                )
            };
            return rc == crate::rseq::DONE;
        }
        let _ = node;
        false
    }

    /// The rseq pop; `Err` if it must take the locked path.
    #[inline]
    fn pop_fast(&self) -> Result<Option<NonNull<u8>>, ()> {
        #[cfg(all(target_arch = "x86_64", not(loom)))]
        if self.use_rseq
            && let Some(area) = crate::rseq::area::offset()
        {
            let (base, stride) = self.heads.raw_layout();
            // SAFETY: as in `push_fast`; nodes in a list have readable link
            // words (the push contract).
            let (rc, node) = unsafe {
                crate::rseq::raw_pop(
                    area,
                    base,
                    stride,
                    self.heads.cpus() as u32,
                    self.next_offset,
                )
            };
            return match rc {
                crate::rseq::DONE => Ok(NonNull::new(node as *mut u8)),
                crate::rseq::EMPTY => Ok(None),
                crate::rseq::SLOW => Err(()),
                other => unreachable!("rseq pop returned {other}"),
            };
        }
        Err(())
    }

    /// Runs `f` on list `slot` with its lock held; `None` if `wait` is false
    /// and the lock is taken.
    fn with_lock<R>(&self, slot: usize, wait: bool, f: impl FnOnce(&Head) -> R) -> Option<R> {
        let head = self.head(slot);
        let mut spins = 0u32;
        while head
            .lock
            .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            if !wait {
                return None;
            }
            spins += 1;
            if spins < 64 {
                crate::sync::hint::spin_loop();
            } else {
                crate::sync::thread::yield_now();
            }
        }
        if self.use_rseq && slot < self.heads.cpus() {
            // A critical section on `slot`'s CPU may have read the lock as
            // free just before we took it: restart it. Registration
            // succeeded in `new`, so the fence cannot be refused.
            let fenced = crate::rseq::fence_cpu(slot);
            debug_assert!(fenced, "membarrier RSEQ fence refused after registration");
        }
        let r = f(head);
        head.lock.store(0, Ordering::Release);
        Some(r)
    }

    /// The address of `node`'s link word (aligned: `new` checked the offset,
    /// and nodes are at least usize-aligned by the push contract).
    #[allow(clippy::cast_ptr_alignment)]
    fn link_word(&self, node: NonNull<u8>) -> *mut usize {
        node.as_ptr().wrapping_add(self.next_offset).cast::<usize>()
    }

    /// `node.next = top; top = node`, with the list's lock held.
    unsafe fn link(&self, head: &Head, node: NonNull<u8>) {
        let top = head.top.load(Ordering::Relaxed);
        // SAFETY: the push contract: the link word is valid and ours.
        unsafe { self.link_word(node).write(top) };
        head.top.store(node.as_ptr() as usize, Ordering::Relaxed);
    }

    /// `top = top.next`, with the list's lock held.
    fn unlink(&self, head: &Head) -> Option<NonNull<u8>> {
        let top = NonNull::new(head.top.load(Ordering::Relaxed) as *mut u8)?;
        // SAFETY: `top` is in the list, whose nodes have valid link words.
        let next = unsafe { self.link_word(top).read() };
        head.top.store(next, Ordering::Relaxed);
        Some(top)
    }
}

impl core::fmt::Debug for PerCpuStack {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PerCpuStack")
            .field("slots", &self.slots())
            .field("uses_rseq", &self.use_rseq)
            .finish_non_exhaustive()
    }
}
