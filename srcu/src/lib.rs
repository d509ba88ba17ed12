//! Sleepable RCU (SRCU) for userspace, and read-side leases that expire
//! into a reference.
//!
//! RCU lets readers run without locks or shared writes while writers wait
//! for a *grace period*, "every reader that might still see the old data
//! has finished", before freeing it. **SRCU** is the kernel flavour whose
//! readers may block and whose domains are independent: a slow reader of
//! one domain never delays another. No Rust crate offered it: epoch-based
//! reclamation (crossbeam-epoch, seize) has no `synchronize()` and lets one
//! stalled reader block all reclamation.
//!
//! - [`Srcu`]: a domain. [`read_lock`](Srcu::read_lock) adds 1 to a count in
//!   the calling thread's slot (claimed on first use, no registration)
//!   and issues a compiler fence, as liburcu's read side does;
//!   [`synchronize`](Srcu::synchronize) is the kernel's two-bank algorithm
//!   with `membarrier()` as the heavy fence (four per grace period); [`call`](Srcu::call),
//!   [`retire`](Srcu::retire) and [`barrier`](Srcu::barrier) defer work to a
//!   reclaimer thread.
//! - [`SrcuCell`]: an SRCU-protected pointer whose old values are dropped
//!   after grace periods.
//! - [`LeaseSet`], [`LeaseBlock`], [`Lease`]: the kernel's 2024 uretprobe
//!   "hprobe" idea. A lease is a read section on one value; an expiry
//!   thread converts leases older than a timeout (100 ms by default) into
//!   strong references, so a lease held across code of unbounded duration
//!   never stalls grace periods for longer than the timeout.
//!
//! # Memory ordering
//!
//! Sections are counted in two banks, in two ways:
//!
//! - **Guard sections** (they end on the thread that began them): per
//!   thread, in the thread's *slot* of the domain, written only by that
//!   thread: an `outer` word, the bank of the thread's outermost open
//!   section (0: none), and per bank a count of the sections begun while
//!   `outer` was taken (nested ones).
//! - **Sections that may end elsewhere** (raw sections, leases): per CPU
//!   and per bank, two counts, `lock` and `unlock`, that only grow, added
//!   to by rseq sections (or atomics).
//!
//! A guard section's reader reads the domain's word for the active bank;
//! if its slot's `outer` is 0 it stores that word there, else it adds 1
//! to `nested[bank]`; then a light fence (B). On unlock, a light fence
//! (C) and `outer` set to 0 (or 1 off the nested count). A per-CPU reader
//! reads the active
//! bank index, adds 1 to `lock[bank]` and issues B; on unlock, C and adds
//! 1 to `unlock[bank]`. A grace period sums `unlock[bank]` over CPUs,
//! issues a heavy fence (A), sums `lock[bank]` and reads every slot: the
//! bank has drained when the sums are equal (a section whose unlock was
//! counted had its lock counted too, so a mismatch can only
//! overestimate) and no slot is open on the bank.
//!
//! The light/heavy pairs are [`pcpu::fence`]'s asymmetric fences:
//! `membarrier()` on the writer's side makes every reader's compiler fence
//! act as a full fence. (Without membarrier, guard sections are counted
//! per CPU too, whose path has full fences.)
//!
//! `synchronize` (i) waits for the *inactive* bank, catching readers that
//! read the old index during the previous grace period but incremented
//! late, (ii) flips the index, (iii) waits for the bank that was active,
//! and (iv) fences (D) so the readers' loads are done before the caller
//! frees. The heavy fence (A) of the first check also separates the
//! caller's updates from every read of a count or slot that a section
//! raised: a reader whose increment (or outermost store) the grace
//! period misses therefore sees those updates. A reader that read the
//! index before the flip but increments after step (i) began after this
//! grace period started; it is not waited for, and it sees the caller's
//! updates.
//!
//! Per-CPU counts are 64-bit and wrap; the sums are compared, not
//! subtracted.
//!
//! # Why per-thread slots
//! The kernel's 2025 answer, SRCU-fast, keeps per-CPU counters and drops
//! the read side's full barrier; in userspace a per-CPU add is an rseq
//! critical section, and a read section needs two of them, where
//! liburcu's thread-local read side needs none. A thread's own slot needs no rseq
//! (only its thread writes it), which is what makes guard sections cost
//! what liburcu's do. The usual section stores a word loaded from the
//! domain into the slot and, at its end, 0, rather than adding to counts
//! that only grow: each add to such a count waits for the previous one's
//! result (store-to-load forwarding from section to section), where
//! those stores wait for nothing. The price: 128 bytes per thread per domain table
//! (tables are reused, never freed; see [`Srcu`]'s *Costs*), and a grace
//! period reads every claimed slot as well as every CPU. The loom models
//! (`tests/loom.rs`, `RUSTFLAGS="--cfg pcpu_loom"`) check guard sections
//! on several threads claiming slots across grace periods, nested guards
//! on both banks (an inner one outliving its outer one across two grace
//! periods, a later outermost one), raw sections ended elsewhere and the
//! leases.
//!
//! # Fork
//! A child discounts the read sections of the threads that do not exist
//! there and restarts the helper threads; see [`Srcu`]'s *Fork* section
//! and [`after_fork_in_child`].
//!
//! # Async-signal safety
//! Read sections, [`SrcuCell::load`], taking and consuming a lease,
//! [`LeaseSet::release`] and [`LeaseSet::drop_later`] are
//! async-signal-safe (after [`Srcu::prepare`]): a handler may begin a
//! thread's first section of a domain, and nest sections in one the
//! interrupted code holds or is beginning or ending. A read section that
//! a handler begins ends before the handler returns (as liburcu requires
//! of its readers too). Grace periods, callbacks, creating cells, sets
//! and blocks are not.
#![deny(unsafe_op_in_unsafe_fn)]

mod cell;
mod deferred_drop;
mod domain;
mod fork;
mod lease;
mod readers;
mod reclaim;
mod service;

pub use cell::{CellRef, SrcuCell, Strong};
pub use domain::{ReadGuard, ReadIndex, Srcu};
pub use fork::after_fork_in_child;
pub use lease::{
    DEFAULT_TIMEOUT, Held, Lease, LeaseBlock, LeaseError, LeaseSet, LeasedValue, RawLease,
};
pub use service::set_service_thread_hook;
