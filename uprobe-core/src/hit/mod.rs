//! What every probe hit does, whichever way it came in (a trap or a
//! jump): run the site's consumers with the thread's registers, count
//! the hits, and prepare the returns of return probes ([`returns`]).
//!
//! Everything here runs inside a read section of the table's domain, in
//! a signal handler or called from a trampoline: it never allocates,
//! never locks and makes no system call (a thread filter asks for the
//! thread id once per thread).

pub(crate) mod returns;
pub(crate) mod timing;
pub mod unwind;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::base::thread::{AbortOnUnwind, current_tid, enter, leave, observed};
use crate::site::Site;
use crate::site::consumer::Consumer;
use crate::site::jump::JumpCell;

/// Runs the consumers of `site` with the registers `frame` (unless the
/// thread is already inside the engine: then the hit is counted as
/// missed). Both ways in share it: the trap handler and the trampolines.
/// Returns whether a handler moved the instruction pointer.
/// Async-signal-safe; inside a read section of the table's domain.
///
/// The common case, one consumer with no thread filter, runs inline here
/// (its return, if it tracks one, out of line), and through a jump
/// without the site and its list ([`run_one_consumer`]); the others run
/// through [`run_each`].
#[inline]
pub(crate) fn run_consumers(site: &Site, frame: &mut crate::arch::Frame) -> bool {
    in_engine(
        || nested(site),
        || {
            // SAFETY: lists are freed only after a grace period, and we
            // are in a read section.
            let consumers = unsafe { &*site.consumers.load(Ordering::Acquire) };
            match &consumers[..] {
                [c] if c.only_thread.is_none() => {
                    !c.removed.load(Ordering::Relaxed) && run_one(c, site.addr, frame)
                }
                all => run_each(all, site.addr, frame),
            }
        },
    )
}

/// [`run_consumers`] for a trampoline whose cell names its site's only
/// consumer, which has no thread filter (`JumpCell::lone_consumer`): the same,
/// without loading the site and its list on the way (the site only for
/// a nested hit, to count it as missed). Async-signal-safe; inside a
/// read section of the table's domain.
#[inline]
pub(crate) fn run_one_consumer(
    c: &Consumer,
    cell: &JumpCell,
    frame: &mut crate::arch::Frame,
) -> bool {
    in_engine(
        || {
            let site = cell.site.load(Ordering::Acquire);
            if !site.is_null() {
                // SAFETY: as in `crate::entry::jump::on_jump`.
                nested(unsafe { &*site });
            }
        },
        || !c.removed.load(Ordering::Relaxed) && run_one(c, cell.addr, frame),
    )
}

/// Runs `consumers` with the thread marked inside the engine, a panic
/// in them fatal; returns whether a handler moved the instruction
/// pointer. A thread already inside the engine (or not observed) runs
/// `nested` instead. Async-signal-safe. Always inlined: both callers
/// are on the hit path.
#[allow(clippy::inline_always)]
#[inline(always)]
fn in_engine(nested: impl FnOnce(), consumers: impl FnOnce() -> bool) -> bool {
    if enter() {
        nested();
        return false;
    }
    let abort = AbortOnUnwind::new();
    let ip_changed = consumers();
    abort.disarm();
    leave(false);
    ip_changed
}

/// Counts a hit of `c`, runs its handler and tracks the return of a
/// return probe (unless the handler said not to); returns whether the
/// handler moved the instruction pointer. Async-signal-safe. Always
/// inlined into [`run_consumers`]: a call level more is a tenth of a
/// hit's cost (`bench uprobe-nop5` shows it).
#[allow(clippy::inline_always)]
#[inline(always)]
fn run_one(c: &Consumer, addr: usize, frame: &mut crate::arch::Frame) -> bool {
    c.count_hit();
    let out = c.handler.run(frame, addr, c.usdt_args.as_deref());
    if out.remove() {
        c.removed.store(true, Ordering::Relaxed);
    }
    if c.returns && !out.skip_return() {
        track_return_of(c, addr, out.cookie, frame);
    }
    out.ip_changed()
}

/// [`run_consumers`] for any list: thread filters, return sides, several
/// consumers. Async-signal-safe.
#[inline(never)]
fn run_each(consumers: &[Arc<Consumer>], addr: usize, frame: &mut crate::arch::Frame) -> bool {
    let mut ip_changed = false;
    // The thread id costs a system call: only asked for by a filter.
    let mut tid = None;
    for c in consumers {
        if c.removed.load(Ordering::Relaxed)
            || c.only_thread
                .is_some_and(|t| t.get() != *tid.get_or_insert_with(current_tid))
        {
            continue;
        }
        ip_changed |= run_one(c, addr, frame);
    }
    ip_changed
}

/// A hit of a thread already inside the engine: no handler runs; counted
/// as missed, and for counting and timing probes as a hit (their counts
/// stay exact; the call is not timed).
/// A thread that is not observed counts nothing. Async-signal-safe.
#[cold]
fn nested(site: &Site) {
    if !observed() {
        return;
    }
    site.missed.add(1);
    // SAFETY: as in `run_consumers`.
    let consumers = unsafe { &*site.consumers.load(Ordering::Acquire) };
    for c in consumers
        .iter()
        .filter(|c| c.counting || c.switch.is_some())
    {
        c.count_hit();
    }
}

/// Tracks the return of the function entered at `func` for `c`'s return
/// handler or its timing (kept out of line: most hits have neither, and
/// their path stays short). Async-signal-safe.
#[inline(never)]
fn track_return_of(c: &Consumer, func: usize, cookie: u64, frame: &mut crate::arch::Frame) {
    let (sp, ret_at) = crate::arch::return_address_at(frame);
    // SAFETY: return and timing probes are attached at a function's first
    // instruction, where `ret_at` holds its return address (checked at
    // attach, or `Uprobe::address`'s contract).
    unsafe {
        if let Some(ret) = &c.ret {
            returns::prepare(ret, func, cookie, sp, ret_at);
        }
        if let Some(switch) = c.switch {
            returns::prepare_timed(switch, sp, ret_at);
        }
    }
}
