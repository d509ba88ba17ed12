//! Per-thread reader slots: where a domain counts the guard sections
//! ([`ReadGuard`](crate::ReadGuard), and so [`SrcuCell::read`](crate::SrcuCell::read))
//! of each thread.
//!
//! # Why per thread, and why stores rather than counts
//! A guard ends on the thread that began it, so its sections can be
//! counted in words only that thread writes. A slot's `outer` word holds
//! the thread's outermost open guard section of the domain: `read_lock`
//! reads it and, when it is 0 (the usual case), stores the domain's
//! [`hot`](Readers::hot) word there (the active bank, and bit 0 so it is
//! never 0); the guard's drop stores 0. A section begun while `outer` is
//! taken (a nested one, or one begun while the outermost one's guard,
//! dropped out of order, left a nested one open) adds 1 to a count of
//! open sections of its own bank, `nested[bank]`, and its drop takes 1
//! away. The light fence comes after the store or add, and before the
//! drop's. A grace period waiting for bank `b` waits while a slot's
//! `outer` holds `b` or its `nested[b]` is not 0.
//!
//! No `lock`-prefixed instruction and no restartable sequence, and above
//! all, on the usual path, no chain of dependent memory operations from
//! one section to the next, and no load at the drop: the outermost store
//! writes a value loaded from the domain, not one computed from the slot,
//! and the drop writes a constant, so a section waits for no earlier
//! store to be forwarded (counts that only grow, which this replaced, did:
//! every add read the last add's result, a chain from each section to the
//! next that liburcu's read side does not have either).
//!
//! **Signal handlers.** Each store, and each add to a `nested` count, is
//! one instruction that a handler cannot split (on x86-64 the adds are
//! `inc`/`dec` on memory, which no other thread writes, so no `lock`
//! prefix; elsewhere relaxed atomic read-modify-writes). Between reading
//! `outer` as 0 and storing the hot word a handler may run read sections
//! of its own, which take `outer` and give it back: they end before the
//! handler returns (guards are scoped, not `Send`, and a handler's must
//! not outlive it, as liburcu's readers and this crate's per-thread
//! per-CPU bookkeeping, `fork::held_add`, assume too), so `outer` is 0
//! again when the interrupted store writes. A handler that interrupts an
//! open outermost section finds `outer` taken and counts in `nested`.
//!
//! Sections that may end on another thread (raw sections, leases) stay on
//! the per-CPU counts, whose lock and unlock counts only grow; a grace
//! period waits for both kinds.
//!
//! # Slots, tables, claims and thread exit
//! A domain's slots are a *table* of [`CAPACITY`](slot::CAPACITY) slots of one
//! cache-line pair each (virtual memory only; a page is touched when a
//! slot on it is first claimed), aligned to its size rounded up to a
//! power of two ([`TABLE_ALIGN`](slot::TABLE_ALIGN)). A thread claims a slot on its first
//! guard section of the domain and remembers the slot's address in a
//! small thread-local cache: one entry per way, and the slot it used
//! last. Claiming is a scan and a compare-and-swap, with no lock and no
//! allocation, so a first section in a signal handler is fine.
//!
//! Tables are never unmapped: a dropped domain's table goes back to a
//! process-wide list and the next new domain takes it, **with its
//! owners**. So a cached address is right whenever it lies inside the
//! domain's table: a thread caches only slots it owns, and it owns them
//! in whichever domain holds the table. There is no domain id to compare
//! (an id or an `Inner` address can be reused with another table: a
//! table's address cannot), and an address from a dropped domain never
//! points at freed memory. The read side's check of the slot used last
//! is one exclusive or: the domain's hot word carries the table's base
//! above bit `TABLE_ALIGN.trailing_zeros()` (its bank and bit 0 below),
//! so it agrees with a slot address there exactly when the slot lies in
//! the table. The same load gives the word to store, so the fast path
//! loads one word of the domain, one thread-local word and the slot's.
//!
//! There is no registration and nothing runs at thread exit (a
//! thread-local destructor cannot be registered from a signal handler).
//! Instead a slot records its owner's kernel thread id, and a thread that
//! finds no free slot takes over one whose owner has exited
//! (`tgkill(pid, tid, 0)` fails with `ESRCH`) and whose words are all 0
//! (every section it began has ended).
//! A table therefore holds about as many slots as threads that used its
//! domains at once, and the process as many tables as domains that were
//! alive at once. When all [`CAPACITY`](slot::CAPACITY) slots are taken by live threads,
//! further threads count their guard sections per CPU instead: correct,
//! slower.
//!
//! # What a grace period pays
//! Checking a bank sums the unlock counts of every CPU, issues the heavy
//! fence (A), sums their lock counts and reads every claimed slot's
//! `outer` and `nested[bank]` (each slot on its own cache line): the cost
//! grows with the number of threads that used the domain's table, where
//! the per-CPU scheme's grew with the number of CPUs. Each section lives
//! in one word from its beginning to its end, so each word is checked on
//! its own, after the fence: a section whose store or add the read
//! misses began after it, so (B pairing with A) sees the caller's
//! updates; one whose drop the read sees had done its loads (C pairing
//! with the grace period's last heavy fence, D). See the crate's
//! *Memory ordering*.
//!
//! # Layout
//!
//! Each submodule uses only those listed before it:
//!
//! - `step`: the one-instruction add to a nested count;
//! - `slot`: a thread's slot of a domain, the table geometry its words
//!   encode, and [`Section`], where a guard section is counted;
//! - `thread`: the calling thread's ids (ours and the kernel's) and its
//!   cache of slot addresses;
//! - `table`: the process-wide tables of slots, their memory, and
//!   claiming a slot (taking over an exited thread's);
//! - `lookup`: a domain's slots ([`Readers`]): finding the calling
//!   thread's, on the read side;
//! - `fork`: a fork child's slots (the vanished threads' freed).

#[cfg(not(pcpu_loom))]
mod fork;
mod lookup;
mod slot;
mod step;
mod table;
mod thread;

#[cfg(not(pcpu_loom))]
pub(crate) use fork::after_fork;
pub(crate) use lookup::Readers;
pub(crate) use slot::{Section, Slot};
