//! Switches: what a probe's pending calls name instead of the probe.
//!
//! A call that a probe tracks to its return (a timing probe's, a return
//! probe's) may still be pending when the probe is detached and freed. It
//! must not name the probe then, and it need not keep the probe alive
//! either (that is what a lease or a reference count costs each call).
//! It names a [`Switch`] instead: a word that holds the probe's target
//! (a timing probe's cells, a return probe's handler) while the probe is
//! attached, and that is never freed.
//!
//! A detach turns the switch off, then waits for a grace period of the
//! table's domain; a return reads the target inside a read section of
//! that domain (or, for a timing probe's own routines, inside a
//! restartable sequence that the detach's fence restarts), so from then
//! on no return reaches the probe. Switches are reused by later probes,
//! each time in a new generation: a pending call names the generation it
//! was made in too, and a call left pending from an earlier probe reaches
//! nothing of a later one.

use std::ptr::NonNull;
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// A probe's target while it is attached, null once it is detached. Never
/// freed; reused by later probes. `#[repr(C)]`: the x86-64 timing return
/// routine reads both words (`crate::arch::timing`).
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Switch {
    target: AtomicPtr<()>,
    /// How many times it was given back: a call names the generation it
    /// was made in, and reaches the target only while that is the
    /// switch's.
    generation: AtomicU64,
}

// What the x86-64 return routine reads.
const _: () = assert!(
    core::mem::offset_of!(Switch, target) == 0 && core::mem::offset_of!(Switch, generation) == 8
);

/// Switches no probe uses.
static SPARE: Mutex<Vec<&'static Switch>> = Mutex::new(Vec::new());

impl Switch {
    /// A switch on, holding `target` (a spare one, or a new one, leaked).
    /// Not async-signal-safe.
    pub(crate) fn on(target: NonNull<()>) -> &'static Self {
        let spare = SPARE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let switch = spare.unwrap_or_else(|| {
            Box::leak(Box::new(Self {
                target: AtomicPtr::new(core::ptr::null_mut()),
                generation: AtomicU64::new(0),
            }))
        });
        switch.target.store(target.as_ptr(), Ordering::Release);
        switch
    }

    /// The switch's generation now. Async-signal-safe.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// The target, while the switch is on for the probe of `generation`.
    /// Async-signal-safe. What it points to stays valid only inside the
    /// read section (or sequence) the caller read it in.
    pub(crate) fn target_of(&self, generation: u64) -> Option<NonNull<()>> {
        // The target first: a switch turned on again for another probe
        // has its new generation before its new target (`give_back`, then
        // `on`), so a target seen with this generation is its probe's.
        let p = self.target.load(Ordering::Acquire);
        if self.generation.load(Ordering::Acquire) != generation {
            return None;
        }
        NonNull::new(p)
    }

    /// Turns the switch off: returns reach nothing through it once every
    /// restartable sequence and read section in flight is over (the
    /// caller's fence and grace period). Not async-signal-safe.
    pub(crate) fn off(&self) {
        self.target.store(core::ptr::null_mut(), Ordering::Release);
    }

    /// Gives the switch back for a later probe (turning it off first),
    /// once no return can reach its target (after the detach's grace
    /// period). Not async-signal-safe.
    pub(crate) fn give_back(&'static self) {
        self.off();
        self.generation.fetch_add(1, Ordering::Release);
        SPARE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(self);
    }
}
