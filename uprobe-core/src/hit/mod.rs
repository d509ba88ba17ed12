//! What every probe hit does, whichever way it came in (a trap or a
//! jump): run the site's consumers with the thread's registers, count
//! the hits, and prepare the returns of return probes ([`returns`]).
//!
//! Everything here runs inside a read section of the table's domain, in
//! a signal handler or called from a trampoline: it never allocates,
//! never locks and makes no system call (a thread filter asks for the
//! thread id once per thread).

pub(crate) mod returns;

use std::sync::atomic::Ordering;

use crate::context::EntryContext;
use crate::site::Site;
use crate::site::returns::ReturnProbe;
use crate::thread::{AbortOnUnwind, current_tid, enter, leave};

/// Runs the consumers of `site` with the registers `frame` (unless the
/// thread is already inside the engine: then the hit is counted as
/// missed). Both ways in share it: the trap handler and the trampolines.
/// Returns whether a handler moved the instruction pointer.
/// Async-signal-safe; inside a read section of the table's domain.
pub(crate) fn run_consumers(site: &Site, frame: &mut crate::arch::Frame) -> bool {
    let mut ip_changed = false;
    if enter() {
        site.missed.add(1);
        // SAFETY: as below.
        let consumers = unsafe { &*site.consumers.load(Ordering::Acquire) };
        // Counting probes run no handler: their counts stay exact here.
        for c in consumers.iter().filter(|c| c.counting) {
            c.hits.add(1);
        }
    } else {
        let _abort = AbortOnUnwind::new();
        // SAFETY: lists are freed only after a grace period, and we are in
        // a read section.
        let consumers = unsafe { &*site.consumers.load(Ordering::Acquire) };
        // The thread id costs a system call: only asked for by a filter.
        let mut tid = None;
        for c in consumers {
            if c.removed.load(Ordering::Relaxed)
                || (c.only_tid != 0 && c.only_tid != *tid.get_or_insert_with(current_tid))
            {
                continue;
            }
            c.hits.add(1);
            let mut cx = EntryContext::new(frame, site.addr);
            cx.usdt = c.usdt_args.as_deref();
            (c.handler)(&mut cx);
            ip_changed |= cx.ip_changed;
            if cx.remove {
                c.removed.store(true, Ordering::Relaxed);
            }
            let (cookie, track_return) = (cx.cookie, !cx.skip_return);
            if let Some(ret) = c.ret.as_ref().filter(|_| track_return) {
                track_return_of(ret, site.addr, cookie, frame);
            }
        }
        leave(false);
    }
    ip_changed
}

/// Tracks the return of the function entered at `func` (kept out of
/// line: most hits have no return probe, and their path stays short).
/// Async-signal-safe.
#[inline(never)]
fn track_return_of(ret: &ReturnProbe, func: usize, cookie: u64, frame: &mut crate::arch::Frame) {
    let (sp, ret_at) = crate::arch::return_address_at(frame);
    // SAFETY: return consumers are attached at a function's first
    // instruction, where `ret_at` holds its return address (checked at
    // attach, or `Uprobe::address`'s contract).
    unsafe { returns::prepare(ret, func, cookie, sp, ret_at) };
}
