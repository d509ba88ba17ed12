//! `BareStack`: per-CPU intrusive lists with no lock word and no empty
//! flag, pushed and popped on the current CPU by one restartable sequence
//! each, as librseq's `basic_percpu_ops` does. Only the current CPU's
//! list can be touched (no remote pop or push, no fallback without rseq):
//! it is the floor that [`PerCpuStack`](crate::PerCpuStack) and the
//! freelists built on it are measured against, not a building block.

use core::ptr::NonNull;

use crate::PerCpu;
use crate::sync::atomic::AtomicUsize;

// The sections find a CPU's head at `base + (cpu << shift)`.
#[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
const _: () =
    assert!(size_of::<crossbeam_utils::CachePadded<AtomicUsize>>() == crate::rseq::LIST_STRIDE);

/// Per-CPU LIFO lists of caller-owned nodes with a `usize` link word at
/// `next_offset`; each operation is one rseq critical section on the
/// current CPU's head, and nothing else.
pub struct BareStack {
    heads: PerCpu<AtomicUsize>,
    next_offset: usize,
}

impl BareStack {
    /// Empty lists, or `None` where the rseq sections do not run (not
    /// x86-64, no rseq area registered by glibc, loom models).
    /// Not async-signal-safe.
    ///
    /// # Panics
    /// If `next_offset` is not a multiple of `align_of::<usize>()`.
    #[must_use]
    pub fn new(next_offset: usize) -> Option<Self> {
        assert!(
            next_offset.is_multiple_of(align_of::<usize>()),
            "link word must be usize-aligned"
        );
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if crate::rseq_area::offset().is_some() {
            return Some(Self {
                heads: PerCpu::new(|_| AtomicUsize::new(0)),
                next_offset,
            });
        }
        None
    }

    /// The number of lists (possible CPUs plus the overflow slot, which
    /// these sections never use).
    #[must_use]
    pub fn slots(&self) -> usize {
        self.heads.cpus() + 1
    }

    /// Pushes `node` on list `slot` of lists no other thread can reach
    /// yet (`&mut self`), for filling them. Not async-signal-safe.
    ///
    /// # Safety
    /// `node`'s link word at `next_offset` is writable, `node` is in no
    /// list and stays valid while the lists may hand it out.
    ///
    /// # Panics
    /// If `slot` is not a CPU's list.
    pub unsafe fn push_slot_mut(&mut self, slot: usize, node: NonNull<u8>) {
        let link = self.link_word(node);
        let head = self.heads.get_mut(slot).expect("a CPU's list");
        // SAFETY: the caller's contract.
        unsafe { link.write(*head.get_mut()) };
        *head.get_mut() = node.as_ptr() as usize;
    }

    /// `node`'s link word (usize-aligned: `next_offset` is checked, the
    /// node's own alignment is the callers' contract).
    #[allow(clippy::cast_ptr_alignment)]
    #[inline]
    fn link_word(&self, node: NonNull<u8>) -> *mut usize {
        node.as_ptr().wrapping_add(self.next_offset).cast()
    }

    /// Pushes `node` on the current CPU's list; `false` (nothing done)
    /// when the CPU id has no list (hotplug, or no rseq registration).
    /// Async-signal-safe.
    ///
    /// # Safety
    /// As for [`push_slot_mut`](Self::push_slot_mut).
    #[must_use]
    #[inline]
    pub unsafe fn push(&self, node: NonNull<u8>) -> bool {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if let Some(area) = crate::rseq_area::offset() {
            let base = self.heads.raw_layout().0;
            // SAFETY: the heads are written only by these sections of
            // their own CPU; the caller's contract covers the link word.
            let rc = unsafe {
                crate::rseq::raw_bare_push(
                    area,
                    base,
                    self.heads.cpus() as u32,
                    node.as_ptr() as usize,
                    self.link_word(node),
                )
            };
            return rc == crate::rseq::DONE;
        }
        let _ = node;
        false
    }

    /// Pops the current CPU's list (`None` if it is empty or the CPU id
    /// has no list). Async-signal-safe.
    #[must_use]
    #[inline]
    pub fn pop(&self) -> Option<NonNull<u8>> {
        #[cfg(all(pcpu_arch = "x86_64", not(pcpu_loom)))]
        if let Some(area) = crate::rseq_area::offset() {
            let base = self.heads.raw_layout().0;
            // SAFETY: as in `push`; nodes in a list have readable link
            // words (the push contract).
            let (rc, node) = unsafe {
                crate::rseq::raw_bare_pop(area, base, self.heads.cpus() as u32, self.next_offset)
            };
            return if rc == crate::rseq::DONE {
                NonNull::new(node as *mut u8)
            } else {
                None
            };
        }
        None
    }
}

impl core::fmt::Debug for BareStack {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("BareStack")
            .field("slots", &self.slots())
            .field("next_offset", &self.next_offset)
            .finish_non_exhaustive()
    }
}
