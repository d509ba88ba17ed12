//! The return way in: the return trampoline (the architecture's
//! `return_entry`) has saved the registers at a probed function's return
//! and calls `return_hit` (bound to its symbol here), which hands them to
//! `crate::hit::returns`. Async-signal-safe.

use crate::arch::{SavedRegs, SavedVector};

crate::arch::define_callee!("uprobe_core_return_hit", return_hit);

/// What the return trampoline calls: the return's work, which also sets
/// where the thread goes on (the original return address).
/// Async-signal-safe.
extern "C" fn return_hit(regs: &mut SavedRegs, vector: &mut SavedVector) {
    crate::hit::returns::on_return(regs, vector);
}
