//! The jump way in: a trampoline's common routine (the architecture's
//! `jump_entry`) has saved the registers and calls `jump_hit` (bound to
//! its symbol here), which calls [`on_jump`] with the trampoline's cell,
//! which names the site it serves (no table lookup). Async-signal-safe:
//! the routine can interrupt any code.

use std::sync::atomic::Ordering;

use crate::arch::jump_entry::{HitReturn, JumpFrame};
use crate::hit::{run_consumers, run_one_consumer};
use crate::site::jump::JumpCell;
use crate::table::lookup::with_read_side;

crate::arch::define_callee!("uprobe_core_jump_hit", jump_hit);

/// What the architecture's common routine calls: the hit of the
/// trampoline whose cell `arg` leads to (`arch::jump_entry::hit`).
/// Async-signal-safe.
extern "C" fn jump_hit(frame: &mut JumpFrame, arg: usize) -> HitReturn {
    crate::arch::jump_entry::hit(frame, arg, |cell, regs| {
        // SAFETY: a trampoline's header names its cell, which is never
        // freed.
        let cell = unsafe { &*(cell as *const JumpCell) };
        on_jump(cell, regs)
    })
}

/// A trampoline's call into the engine: the probed address's consumers,
/// with the saved registers `frame` (the PC is set to the probed address
/// here). Returns whether a handler moved the PC. Async-signal-safe.
#[inline]
pub(crate) fn on_jump(cell: &JumpCell, frame: &mut crate::arch::Frame) -> bool {
    crate::arch::set_frame_pc(frame, cell.addr);
    with_read_side(|| {
        let one = cell.lone_consumer.load(Ordering::Acquire);
        if !one.is_null() {
            // SAFETY: the consumer is in a list that is retired, after
            // a grace period, only once the cell no longer names it; we
            // are in a read section.
            return run_one_consumer(unsafe { &*one }, cell, frame);
        }
        let site = cell.site.load(Ordering::Acquire);
        // SAFETY: a site named by a cell is freed only after the cell was
        // cleared and a grace period passed; we are in a read section.
        !site.is_null() && run_consumers(unsafe { &*site }, frame)
    })
}
