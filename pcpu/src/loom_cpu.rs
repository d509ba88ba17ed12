//! The CPU id under loom: loom threads are not on CPUs, so a model says
//! which CPU each of its threads "runs on" with [`set_current`], and may
//! "migrate" a thread by calling it again mid-test.

use core::cell::Cell;

loom::thread_local! {
    static CPU: Cell<usize> = Cell::new(0);
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
