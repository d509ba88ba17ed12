//! The lists' locks: pushing and popping under a list's lock (any
//! list, from any CPU), the link words of the nodes, and `LockedList`,
//! which makes a locked list exclusive against its CPU's critical
//! sections.

use core::ptr::NonNull;

use crate::sync::atomic::Ordering;

use super::{Head, PerCpuStack, WouldBlock};

impl PerCpuStack {
    /// Pushes under list `slot`'s lock; the node back if `wait` is false
    /// and the lock is taken.
    pub(super) unsafe fn push_locked(
        &self,
        slot: usize,
        wait: bool,
        node: NonNull<u8>,
    ) -> Result<(), NonNull<u8>> {
        let Some(list) = self.lock(slot, wait) else {
            return Err(node);
        };
        list.exclude_cpu();
        // SAFETY: forwarded.
        unsafe { self.link(slot, node) };
        Ok(())
    }

    /// Pops under list `slot`'s lock; `WouldBlock` if `wait` is false and
    /// the lock is taken. An empty list is answered without the CPU fence: the
    /// look at its head is as good as any racy look, and writes nothing.
    pub(super) fn pop_locked(
        &self,
        slot: usize,
        wait: bool,
    ) -> Result<Option<NonNull<u8>>, WouldBlock> {
        let list = self.lock(slot, wait).ok_or(WouldBlock)?;
        if list.head.top.load(Ordering::Relaxed) == 0 {
            if self.empty_flags && list.head.empty.load(Ordering::Relaxed) == 0 {
                self.repair_flag(&list, slot);
            }
            return Ok(None);
        }
        list.exclude_cpu();
        Ok(self.unlink_top(slot))
    }

    /// Takes list `slot`'s lock; `None` if `wait` is false and it is taken.
    ///
    /// A weak compare-and-swap may fail with the lock free (spuriously: an
    /// LL/SC pair on aarch64 without LSE, and Miri, which emulates such
    /// failures); only a failure that saw the lock taken refuses a `try_`
    /// operation, or one would report [`WouldBlock`] on a free list.
    fn lock(&self, slot: usize, wait: bool) -> Option<LockedList<'_>> {
        let head = self.head(slot);
        let mut spins = 0u32;
        while let Err(held) =
            head.lock
                .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
        {
            if held == 0 {
                continue; // spurious: free, try again
            }
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
        Some(LockedList {
            head,
            fence_cpu: (self.use_rseq && slot < self.fenced).then_some(slot),
        })
    }

    /// The address of `node`'s link word (aligned: `new` checked the offset,
    /// and nodes are at least usize-aligned by the push contract).
    #[allow(clippy::cast_ptr_alignment)]
    pub(super) fn link_word(&self, node: NonNull<u8>) -> *mut usize {
        node.as_ptr().wrapping_add(self.next_offset).cast::<usize>()
    }

    /// `node.next = top; top = node` on list `slot` (into an empty list:
    /// clearing its empty flag and setting its summary bit first), with the
    /// list held exclusively.
    pub(super) unsafe fn link(&self, slot: usize, node: NonNull<u8>) {
        let head = self.head(slot);
        let top = head.top.load(Ordering::Relaxed);
        // SAFETY: the push contract: the link word is valid and ours.
        unsafe { self.link_word(node).write(top) };
        if self.empty_flags && top == 0 {
            head.empty.store(0, Ordering::Relaxed);
            self.note_filled(slot);
        }
        head.top.store(node.as_ptr() as usize, Ordering::Relaxed);
    }

    /// `top = top.next` on list `slot` (setting the empty flag, and
    /// clearing the summary bit first, if that empties the list), with the
    /// list held exclusively.
    pub(super) fn unlink_top(&self, slot: usize) -> Option<NonNull<u8>> {
        let head = self.head(slot);
        let top = NonNull::new(head.top.load(Ordering::Relaxed) as *mut u8)?;
        // SAFETY: `top` is in the list, whose nodes have valid link words.
        let next = unsafe { self.link_word(top).read() };
        head.top.store(next, Ordering::Relaxed);
        if self.empty_flags && next == 0 {
            self.note_emptied(slot);
            head.empty.store(1, Ordering::Relaxed);
        }
        Some(top)
    }

    /// A locked list found empty with its flag clear: set the flag (and
    /// clear its summary bit), so that the next pops skip the list without
    /// its lock. The CPU fence first (a push of that CPU may be committing
    /// right now), then the head again: the flag is only set on a list
    /// that is empty while nobody else can touch it. Costs one fence, once
    /// per wrong flag.
    #[cold]
    fn repair_flag(&self, list: &LockedList<'_>, slot: usize) {
        list.exclude_cpu();
        if list.head.top.load(Ordering::Relaxed) == 0 {
            self.note_emptied(slot);
            list.head.empty.store(1, Ordering::Relaxed);
        }
    }
}

/// A list whose lock the caller holds; unlocks on drop.
struct LockedList<'a> {
    head: &'a Head,
    /// The CPU whose critical sections may still touch the list (rseq mode).
    fence_cpu: Option<usize>,
}

impl LockedList<'_> {
    /// Makes the list exclusively ours before writing it: in rseq mode a
    /// critical section on the list's CPU may have read the lock as free
    /// just before we took it, so restart it (from then on that CPU's
    /// sections see the lock and leave the list alone).
    fn exclude_cpu(&self) {
        let Some(cpu) = self.fence_cpu else { return };
        #[cfg(pcpu_loom)]
        crate::loom_cpu::fence_cpu(cpu);
        #[cfg(not(pcpu_loom))]
        {
            // Registration succeeded when the stack chose rseq mode, so the
            // fence cannot be refused.
            let fenced = crate::rseq::fence_cpu(cpu);
            debug_assert!(fenced, "membarrier RSEQ fence refused after registration");
        }
    }
}

impl Drop for LockedList<'_> {
    fn drop(&mut self) {
        self.head.lock.store(0, Ordering::Release);
    }
}
