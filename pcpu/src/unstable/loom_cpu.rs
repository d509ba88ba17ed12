//! loom's model of CPUs and restartable sequences.
//!
//! loom threads are not on CPUs, so a model says which CPU each of its
//! threads "runs on" with [`set_current`] (default 0), and may "migrate" a
//! thread by calling it again mid-test.
//!
//! rseq is modelled, not replaced by atomics: each modelled CPU has a loom
//! mutex, a critical section runs under its CPU's mutex with plain
//! (relaxed, non-RMW) accesses, so it is atomic only with respect to
//! sections of the same CPU, exactly what rseq promises. A membarrier RSEQ
//! fence (`rseq::fence_all`) takes and releases every CPU's mutex, which
//! waits for the sections in flight (in reality they are restarted; a
//! restarted section is one that runs after the fence, which the model
//! also explores) and gives the fence's happens-before edges, then issues
//! `fence(SeqCst)`. Gated adds therefore run fence-free in the model, as
//! they do for real, so models check the fast paths themselves. (`fence::
//! light` stays `fence(SeqCst)`: for stores outside critical sections,
//! modelling only the heavy side would be unsound.)
//! [`set_rseq_modelled`]`(false)` switches a test to the fallback world
//! (no gated adds; rseq operations are atomic read-modify-writes).

use core::cell::Cell;

/// How many CPUs (slot indexes) the model distinguishes; larger indexes
/// share the last one's mutex.
const MODELLED_CPUS: usize = 4;

loom::thread_local! {
    static CPU: Cell<usize> = Cell::new(0);
}

loom::lazy_static! {
    static ref CPU_LOCKS: Vec<loom::sync::Mutex<()>> = (0..MODELLED_CPUS).map(|_| loom::sync::Mutex::new(())).collect();
}

std::thread_local! {
    /// Per test thread: loom runs a model's threads on the thread that
    /// called `loom::model`, so tests running in parallel do not interfere.
    static RSEQ_MODELLED: Cell<bool> = const { Cell::new(true) };
}

/// The modelled CPU of the calling loom thread (0 unless set).
#[must_use]
pub fn current() -> usize {
    CPU.with(Cell::get)
}

/// Makes the calling loom thread report `cpu` from
/// [`current_cpu`](crate::current_cpu) from now on.
pub fn set_current(cpu: usize) {
    CPU.with(|c| c.set(cpu));
}

/// Chooses between the rseq model (default) and the fallback world for
/// the models the calling test thread runs next. Call before `loom::model`.
pub fn set_rseq_modelled(on: bool) {
    RSEQ_MODELLED.with(|m| m.set(on));
}

/// Whether the rseq model is on.
#[must_use]
pub fn rseq_modelled() -> bool {
    RSEQ_MODELLED.with(Cell::get)
}

/// Runs `f` as a critical section of slot `slot`'s CPU.
pub(crate) fn critical_section<R>(slot: usize, f: impl FnOnce() -> R) -> R {
    let _cpu = CPU_LOCKS[slot.min(MODELLED_CPUS - 1)].lock().unwrap();
    f()
}

/// The membarrier RSEQ fence: waits out every CPU's section in flight.
pub(crate) fn fence_all_cpus() {
    for lock in CPU_LOCKS.iter() {
        drop(lock.lock().unwrap());
    }
    loom::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
}

/// The membarrier RSEQ fence aimed at one CPU: waits out that CPU's
/// section in flight.
pub(crate) fn fence_cpu(slot: usize) {
    drop(CPU_LOCKS[slot.min(MODELLED_CPUS - 1)].lock().unwrap());
    loom::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
}
