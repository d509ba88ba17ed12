//! A per-CPU freelist of preallocated elements, after the Linux kernel's
//! BPF `percpu_freelist`, with the `is_empty` hint of the 2022 patch
//! "bpf: avoid grabbing the spin locks of all CPUs when no free
//! elements".
//!
//! A [`FreeList<T>`] is a fixed pool: its values are built once, spread
//! over one list per possible CPU, and then only move between the lists
//! and the [`Element`] handles that [`pop`](FreeList::pop) hands out.
//! Nothing allocates after construction, so the pool can serve code that
//! must not allocate: a signal handler, a tracer's probe handler.
//!
//! ```
//! use pcpu_freelist::FreeList;
//! let pool = FreeList::new((0..64).map(|_| Vec::<u8>::with_capacity(256)));
//! let mut buf = pool.pop().expect("a free buffer");
//! buf.extend_from_slice(b"event");
//! assert_eq!(&buf[..], b"event");
//! buf.clear();
//! pool.push(buf);
//! ```
//!
//! # Structure
//! - **One list per possible CPU** (plus the overflow list of
//!   [`pcpu::PerCpu`] for CPU ids beyond the possible count), each an
//!   intrusive LIFO ([`pcpu::PerCpuStack`]). [`pop`](FreeList::pop) starts
//!   at the current CPU's list, then walks the others in turn, then the
//!   extralist; [`push`](FreeList::push) goes to the current CPU's list.
//! - **This CPU's list without a lock.** Where rseq runs (x86-64, glibc's
//!   rseq area, `membarrier` with rseq fences), pushes and pops on the
//!   current CPU's list are restartable sequences of plain loads and
//!   stores, **one section each, inlined** into the caller (the pop looks
//!   at its CPU's empty flag first, and goes out of line to walk the
//!   other lists only when its own is empty or locked): a thread
//!   preempted in the middle is restarted, so a thread descheduled
//!   "holding" the list holds nothing. Another CPU's list is
//!   popped under that list's lock plus a `membarrier` aimed at its CPU
//!   (which restarts a critical section that started before the lock);
//!   an empty list is answered under the lock without the fence. Elsewhere
//!   (aarch64, no rseq, loom) every list is a spinlocked LIFO, as in the
//!   kernel, with waiters yielding after a short spin.
//! - **The extralist**, where a push goes when it cannot take its CPU's
//!   list without waiting (the kernel's NMI path). Here it is lock-free (a
//!   versioned Treiber stack over element indexes), so a non-waiting push
//!   always succeeds: [`try_push`](FreeList::try_push) and dropping an
//!   [`Element`] never fail and never wait.
//!
//! # The hint
//! Each list carries the patch's **empty flag**, written only on empty
//! <-> non-empty transitions and read before taking the list's lock, so a
//! pop over empty lists takes no lock. By default
//! ([`EmptyHint::Summary`]) the flags are also summed up in a bitmap, a
//! bit per list in a few shared words, written on the same transitions:
//! a pop that finds its own list empty reads one word per 64 lists and
//! then looks only at lists that may hold nodes, so an empty pool costs a
//! pop the same whatever the number of CPUs. [`EmptyHint::Flag`] (one
//! flag read per list: the patch as posted), [`EmptyHint::Head`] (the
//! merged kernel's racy read of the head pointer) and [`EmptyHint::None`]
//! (lock every list, the kernel before the patch) exist so that the
//! before/after can be measured (`bench freelist-pop-empty` and
//! `freelist-steal`, with [`FreeList::with_lists`] for a pool built as if
//! the machine had more CPUs and [`FreeList::push_to`] to put elements on
//! a chosen list).
//!
//! **Memory ordering and what a stale hint costs.** The flag is read with
//! a relaxed load; a push clears it *before* linking its node (same
//! critical section, or under the lock), and it is set only by a pop that
//! emptied the list, in a step that re-checks the head (a second critical
//! section in rseq mode, or under the lock), so **a set flag always
//! describes a list that was empty when it was set**. The summary bit
//! follows the flag in the same critical sections and locked steps: set
//! (a locked `bts`) after the flag is cleared and before the node is
//! linked, cleared (`btr`) before the flag is set, so **a list holding a
//! node whose push has finished has its bit set**. A stale read can
//! therefore only:
//! - see the flag clear on an empty list: a wasted look (the lock, or the
//!   critical section, finds the list empty);
//! - see the flag set on a list that a concurrent push is filling: the pop
//!   misses an element that arrived during it, which a later pop finds.
//!
//! It never loses an element, and never hides one from a pop that starts
//! after the push finished. Precisely (what the loom models check):
//! **if the push of an element happens-before a `pop()` starts, and no
//! other pop runs concurrently, that `pop()` returns `Some`.** A `pop()`
//! that races other pops can return `None` while an element that one of
//! them is about to take still sits in a list, as in the kernel.
//!
//! # Exhaustion
//! When no element is free, [`pop`](FreeList::pop) and
//! [`try_pop`](FreeList::try_pop) return `None` at once; nothing ever
//! blocks waiting for an element to come back.
//!
//! # Async-signal safety
//! | operation | signal-safe | waits for a lock |
//! |---|---|---|
//! | [`try_pop`](FreeList::try_pop) | yes | never (locked lists are skipped) |
//! | [`try_push`](FreeList::try_push), dropping an [`Element`] | yes | never (extralist if this CPU's list is locked) |
//! | [`pop`](FreeList::pop), [`push`](FreeList::push) | no | briefly, for a list lock held by another pop |
//! | [`push_to`](FreeList::push_to) (a chosen CPU's list) | no | briefly, for that list's lock |
//! | [`Element`] deref, [`into_index`](Element::into_index), [`from_index`](FreeList::from_index) | yes | never |
//! | [`new`](FreeList::new), [`with_hint`](FreeList::with_hint) | no (allocates) | - |
//!
//! A signal handler that interrupts a thread in the middle of a `pop()`
//! holding some list's lock can still `try_pop` (it skips that list) and
//! `try_push` (it uses the extralist).
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

// Lowest layer first; each module uses only those before it.
// An element's storage, and the lock-free list of element indexes.
mod extralist;
mod node;
// The pool in nodes: its per-CPU lists, the extralist and the walk.
mod freelist;
// The handle, and the pool's operations in handles.
mod element;

pub use element::Element;
pub use freelist::{EmptyHint, FreeList};
