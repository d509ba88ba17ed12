//! A thread's pending timed calls: the calls of timing probes
//! ([`Uprobe::time_into`](crate::Uprobe::time_into)) that have not
//! returned yet, each with the stack slot of its return address, the
//! clock at its entry and its probe's switch (which holds the cells its
//! time goes to while the probe is attached).
//!
//! The stack lives in the thread's stack of pending returns
//! (`super::returns`), and is pushed and popped both here (the engine's
//! path) and by the architecture's entry routine and return trampoline
//! (`crate::arch::timing`), which read it through its `#[repr(C)]`
//! layout (`crate::base::abi`). Only the owning
//! thread touches it, in LIFO order even across signal handlers (a
//! handler's pushes are popped before it returns; one that `longjmp`s
//! away leaves entries whose slots lie below the stack pointer, dropped
//! as abandoned at the next push or return).

use core::cell::Cell;

use crate::site::timing::{LatencyCell, Switch};

pub(crate) use crate::base::abi::MAX_TIMED_DEPTH;

/// One pending timed call.
#[repr(C)]
struct Entry {
    /// Where its return address lives (the stack pointer at its entry).
    slot: Cell<usize>,
    /// The clock at its entry, in ticks (`crate::base::clock`).
    start: Cell<u64>,
    /// Its probe's switch (null: record nothing).
    switch: Cell<*const Switch>,
    /// The switch's generation at the call's entry.
    generation: Cell<u64>,
}

/// A thread's pending timed calls. All zeros is empty.
#[repr(C)]
pub(crate) struct TimedStack {
    depth: Cell<usize>,
    entries: [Entry; MAX_TIMED_DEPTH],
}

// The layout the architectures' routines read (`crate::base::abi`).
const _: () = assert!(
    core::mem::offset_of!(TimedStack, depth) == crate::base::abi::TIMED_DEPTH_AT
        && core::mem::offset_of!(TimedStack, entries) == crate::base::abi::TIMED_ENTRIES_AT
        && size_of::<Entry>() == crate::base::abi::TIMED_ENTRY_SIZE
        && core::mem::offset_of!(Entry, slot) == 0
        && core::mem::offset_of!(Entry, start) == 8
        && core::mem::offset_of!(Entry, switch) == 16
        && core::mem::offset_of!(Entry, generation) == 24
);

impl TimedStack {
    /// An empty stack.
    pub(crate) fn new() -> Self {
        Self {
            depth: Cell::new(0),
            entries: core::array::from_fn(|_| Entry {
                slot: Cell::new(0),
                start: Cell::new(0),
                switch: Cell::new(core::ptr::null()),
                generation: Cell::new(0),
            }),
        }
    }

    fn top(&self) -> Option<&Entry> {
        self.depth.get().checked_sub(1).map(|d| &self.entries[d])
    }

    /// Pops, from the top, the calls whose slot `gone` says was left.
    /// Async-signal-safe.
    pub(crate) fn drop_abandoned(&self, gone: impl Fn(usize) -> bool) {
        while let Some(e) = self.top() {
            if !gone(e.slot.get()) {
                break;
            }
            self.depth.set(self.depth.get() - 1);
        }
    }

    /// Pushes a call whose return address is at `slot`, entered at
    /// `start`; false if the stack is full. The entry is written before
    /// the depth that makes it visible (the engine's path runs with the
    /// thread inside the engine: no signal handler's hit pushes
    /// meanwhile). Async-signal-safe.
    pub(crate) fn push(&self, slot: usize, start: u64, switch: &'static Switch) -> bool {
        let depth = self.depth.get();
        let Some(e) = self.entries.get(depth) else {
            return false;
        };
        e.slot.set(slot);
        e.start.set(start);
        e.switch.set(switch);
        e.generation.set(switch.generation());
        self.depth.set(depth + 1);
        true
    }

    /// At the return of the frame whose return address was at `slot`, at
    /// `now`: times every pending call of that frame (several when
    /// chained by tail calls), after dropping those of frames left below
    /// it. Async-signal-safe.
    pub(crate) fn returned(&self, slot: usize, now: u64) {
        self.drop_abandoned(|s| s < slot);
        while let Some(e) = self.top().filter(|e| e.slot.get() == slot) {
            // Read before the pop: a signal handler's pushes may reuse
            // the entry once it is popped.
            let (start, switch, generation) = (e.start.get(), e.switch.get(), e.generation.get());
            self.depth.set(self.depth.get() - 1);
            let nanos = crate::base::clock::nanos(now.wrapping_sub(start));
            // SAFETY: switches are never freed.
            if let Some(switch) = unsafe { switch.as_ref() } {
                // In a read section: a detach (which turns the switch off,
                // then waits for a grace period) returns once no return
                // can still record into its cells.
                crate::table::lookup::with_read_side(|| {
                    if let Some(cells) = switch.cells_of(generation) {
                        LatencyCell::record_in_last(cells, nanos);
                    }
                });
            }
        }
    }

    /// Whether any timed call is pending. Async-signal-safe.
    pub(crate) fn pending(&self) -> bool {
        self.depth.get() > 0
    }

    /// Empties the stack (its thread is gone).
    pub(crate) fn clear(&self) {
        self.depth.set(0);
    }
}
