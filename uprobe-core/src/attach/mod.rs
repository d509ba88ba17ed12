//! Attach and detach, on top of everything else. The attach lock
//! ([`writer`]) serialises them; a batch pays one look at the process
//! (memory map, threads, rseq sections), one write of breakpoints page by
//! page with one instruction-stream sync, and one grace period.
//!
//! **Order of an attach**: analyse the instruction (`crate::arch`), make
//! the site and plan its jump (`crate::patch::jump::prepare`), publish it
//! in the table (so a thread that traps always finds the analysis), write
//! the breakpoints (`crate::patch::breakpoints`), then write the jumps of
//! the sites that qualify ([`modes`]). **Detach** takes jumps back to
//! breakpoints, restores the instructions, unpublishes, and frees what it
//! unpublished after a grace period of the table's domain, so no consumer
//! runs once its detach returned.

mod modes;
pub(crate) mod queries;
pub(crate) mod writer;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};

use pcpu::PerCpuCounter;

use crate::arch::{BREAKPOINT, MAX_INSN_LEN, analyze, is_breakpoint};
use crate::base::error::{AttachError, DetachError};
use crate::base::mode::NotOptimized;
use crate::code;
use crate::entry::{faults, trap};
use crate::hit::returns;
use crate::patch::{self, breakpoints, original::code_as_original};
use crate::process::maps::{Mapping, Snapshot};
use crate::process::threads::{RseqSections, threads_blocking_sigtrap};
use crate::site::consumer::Consumer;
use crate::site::{Site, SiteMode};
use crate::table::lookup::{WriteSide, write_side};
use crate::table::{self, DOMAIN};
use modes::{choose_modes, reoptimize, take_back_covering_jumps, to_traps};
use writer::writer;

/// Makes the engine ready, once: the table's domain usable from a signal
/// handler, the attach lock held across forks, srcu's service threads
/// not observed, the SIGTRAP handler in.
/// Not async-signal-safe.
fn init() -> Result<(), AttachError> {
    static ONCE: Once = Once::new();
    if crate::hit::unwind::keep_current() {
        // The unwinder reads stacks with loads the fault handler recovers
        // from, where it is the process's handler.
        faults::install()?;
        faults::check_handlers();
    }
    ONCE.call_once(|| {
        DOMAIN.prepare();
        writer::hold_across_fork();
        // The engine's SRCU threads (reclaimer, lease expiry) free and
        // allocate: not the program's calls.
        srcu::set_service_thread_hook(Some(|| {
            crate::base::thread::set_observed(false);
        }));
    });
    trap::install()
}

/// What attach and detach unpublish, freed after one grace period.
enum Garbage {
    List(*mut Vec<Arc<Consumer>>),
    Site(*mut Site),
    Table(*mut table::Table),
}

/// Frees what a batch unpublished: at once if `table` keeps every reader
/// out, else after one grace period for all of it (also waited for with
/// nothing to free when `wait`: a return handler was detached).
fn collect(garbage: Vec<Garbage>, table: &WriteSide, wait: bool) {
    if garbage.is_empty() && !wait {
        return;
    }
    if !table.excludes_readers() {
        DOMAIN.synchronize();
    }
    for g in garbage {
        match g {
            // SAFETY: unpublished before the grace period: no reader holds
            // it, and nothing else frees it.
            Garbage::List(list) => drop(unsafe { Box::from_raw(list) }),
            Garbage::Site(site) => {
                // SAFETY: as above; the site owns its current list.
                let site = unsafe { Box::from_raw(site) };
                // SAFETY: as above.
                drop(unsafe { Box::from_raw(site.consumers.load(Ordering::Relaxed)) });
            }
            // SAFETY: retired by an insert before the grace period.
            Garbage::Table(t) => unsafe { table::free(t) },
        }
    }
}

/// Attaches each `(address, consumer)`, paying one grace period for the
/// whole batch. Stops at the first error, with the earlier ones attached
/// (the caller detaches them).
///
/// # Safety
/// Every address is the first byte of an instruction.
pub(crate) unsafe fn attach_many(
    items: &[(usize, Arc<Consumer>)],
) -> Result<(), (usize, AttachError)> {
    init().map_err(|e| (0, e))?;
    // Counted before the service threads are asked for, uncounted below
    // for the items that do not end up attached.
    let with_returns =
        |items: &[(usize, Arc<Consumer>)]| items.iter().filter(|(_, c)| c.returns).count();
    // The clock: timing probes read it, and the routines below start
    // with it.
    if items
        .iter()
        .any(|(_, c)| c.switch.is_some() || c.lean_return.is_some())
    {
        crate::base::clock::init();
    }
    returns::consumers_attached(with_returns(items));
    if with_returns(items) > 0
        && let Err(e) = returns::init(crate::arch::return_entry::routine())
    {
        returns::consumers_detached(with_returns(items));
        return Err((0, e));
    }
    // The architecture's own entry routines for timing and return
    // probes, where it has them (on from the first such probe's attach,
    // once the clock and the stubs are ready; off where the process or
    // processor does not allow them).
    if items
        .iter()
        .any(|(_, c)| c.only_times || c.lean_return.is_some())
    {
        crate::site::jump::enable_routines();
    }
    let result = attach_batch(items);
    let attached = match &result {
        Ok(()) => items.len(),
        Err((i, _)) => *i,
    };
    returns::consumers_detached(with_returns(&items[attached..]));
    result
}

/// [`attach_many`]'s work, once return probes are ready.
fn attach_batch(items: &[(usize, Arc<Consumer>)]) -> Result<(), (usize, AttachError)> {
    let _w = writer();
    check_trap_handler().map_err(|e| (0, e))?;
    let mut garbage = Vec::new();
    let mut result = Ok(());
    let table = write_side();
    let mut batch = Batch::read();
    // Every site is published (its analysis in the table) before any
    // breakpoint is written; the breakpoints then go in page by page,
    // with one instruction-stream sync for the batch.
    let mut attached = items.len();
    for (i, (addr, consumer)) in items.iter().enumerate() {
        // SAFETY: forwarded.
        let one = unsafe { attach_one(*addr, Arc::clone(consumer), &mut batch, &mut garbage) };
        if let Err(e) = one {
            result = Err((i, e));
            attached = i;
            break;
        }
    }
    // Breakpoints for every site but those that get a direct jump.
    let with_breakpoint: Vec<usize> = (0..batch.writes.len())
        .filter(|&k| !batch.direct.contains(&batch.writes[k].2))
        .collect();
    if !batch.blocking.is_empty() && (!with_breakpoint.is_empty() || !batch.to_trap.is_empty()) {
        // Nothing is written yet: take every item back.
        let mut made = Vec::new();
        for (addr, consumer) in &items[..attached] {
            if let Some(site) = detach_one(*addr, consumer, &mut garbage) {
                made.push(site);
            }
        }
        let _ = unpublish(&made, &batch.maps, &mut garbage, &mut batch.retry);
        reoptimize(core::mem::take(&mut batch.retry));
        collect(garbage, &table, false);
        let tids = core::mem::take(&mut batch.blocking);
        return Err((0, AttachError::TrapBlocked { tids }));
    }
    let at: Vec<(Mapping, usize)> = with_breakpoint
        .iter()
        .map(|&k| (batch.writes[k].1, batch.writes[k].2))
        .collect();
    // Relocated code (slots, trampolines) has its faults reported at the
    // probed address before any breakpoint or jump can send a thread there.
    let faults = if !batch.writes.is_empty() && code::relocated_code_exists() {
        faults::install().map_err(|e| vec![(0, e)])
    } else {
        Ok(())
    };
    // SAFETY: each address starts an instruction (the caller's contract),
    // inside the mapping the snapshot showed.
    if let Err(failed) = faults.and_then(|()| unsafe { breakpoints::write(&at) }) {
        // Undo the items from the first one whose page could not be
        // written (the caller detaches the ones before it).
        let (k, e) = failed.into_iter().next().expect("an error names a patch");
        let first = batch.writes[with_breakpoint.get(k).copied().unwrap_or(0)].0;
        let mut last = Vec::new();
        for (addr, consumer) in &items[first..attached] {
            if let Some(site) = detach_one(*addr, consumer, &mut garbage) {
                last.push(site);
            }
        }
        let _ = unpublish(&last, &batch.maps, &mut garbage, &mut batch.retry);
        result = Err((first, e));
    }
    if result.is_ok() {
        let made: Vec<usize> = batch.writes.iter().map(|&(_, _, addr)| addr).collect();
        batch.retry.extend(choose_modes(&made, &batch.to_trap));
    }
    reoptimize(batch.retry);
    collect(garbage, &table, false);
    result
}

/// What every attach of a batch checks against, looked at once for the
/// batch (`WRITER` is held, so no attach of ours changes it meanwhile).
struct Batch {
    /// The memory map: attach writes code only inside mappings it saw,
    /// and a mapping that went away since makes the write fail (an error,
    /// never a write elsewhere).
    maps: Snapshot,
    /// The loaded objects' rseq critical sections.
    rseq: RseqSections,
    /// The breakpoints to write once every site is published: the item's
    /// index, its mapping and address.
    writes: Vec<(usize, Mapping, usize)>,
    /// Addresses of `writes` (a second consumer at one of them joins the
    /// site the batch made, whose breakpoint is not written yet).
    pending: HashSet<usize>,
    /// Items looked at so far.
    items: usize,
    /// Optimized sites that a trap-only consumer joined: back to traps.
    to_trap: Vec<usize>,
    /// Addresses of `writes` whose sites get a direct jump and never a
    /// breakpoint (signals are blocked there).
    direct: HashSet<usize>,
    /// Threads that block SIGTRAP now: a breakpoint would kill them, so a
    /// batch that writes one is refused (one that only writes direct
    /// jumps or joins sites already in the code is not).
    blocking: Vec<i32>,
    /// Sites taken back to their breakpoints for a neighbour, or refused
    /// a jump because of one: planned again once the batch's jumps are
    /// written (`modes::reoptimize`).
    retry: Vec<usize>,
}

impl Batch {
    fn read() -> Self {
        Self {
            maps: Snapshot::read(),
            rseq: RseqSections::read(),
            writes: Vec::new(),
            pending: HashSet::new(),
            items: 0,
            to_trap: Vec::new(),
            direct: HashSet::new(),
            blocking: threads_blocking_sigtrap(),
            retry: Vec::new(),
        }
    }
}

/// # Safety
/// `addr` is the first byte of an instruction; `WRITER` is held.
unsafe fn attach_one(
    addr: usize,
    consumer: Arc<Consumer>,
    batch: &mut Batch,
    garbage: &mut Vec<Garbage>,
) -> Result<(), AttachError> {
    let item = batch.items;
    batch.items += 1;
    let maps = &batch.maps;
    let Some(map) = maps.code_mapping_of(addr) else {
        return Err(AttachError::NotCode { addr });
    };
    if let Some((slot, site)) = table::find(addr) {
        let live =
            batch.pending.contains(&addr) || (site.armed.load(Ordering::Relaxed) && site.in_code());
        if live {
            let direct = site.direct_jump();
            if let Some(blocked) = &consumer.blocked
                && !direct
            {
                // Signals are blocked here, and the site has a breakpoint
                // (someone opted out): this probe did not.
                return Err(blocked.clone());
            }
            if consumer.trap_only && direct {
                return Err(AttachError::OneBytePatch { addr, site: addr });
            }
            if consumer.trap_only && site.is_jump() {
                batch.to_trap.push(addr);
            }
            let mut list = site.current_list().clone();
            list.push(consumer);
            garbage.push(Garbage::List(site.publish_list(list)));
            return Ok(());
        }
        // The code the site was made for is gone (unloaded, and other
        // code mapped at the same address since) or was disarmed: the
        // site must not swallow this attach. Its consumers' probes detach
        // without anything to restore.
        site.clear_cell();
        table::remove(slot);
        garbage.push(Garbage::Site(core::ptr::from_ref(site).cast_mut()));
    }
    batch.rseq.refuse(addr)?;
    // An instruction may straddle two mappings of one code segment.
    let code_end = maps.code_end(addr).unwrap_or(map.end);
    let len = (code_end - addr).min(MAX_INSN_LEN);
    // `[addr, addr + len)` lies in readable executable mappings; another
    // site's breakpoint or jump may cover part of it.
    let bytes = &code_as_original(addr, len)[..];
    if len < BREAKPOINT.len() || is_breakpoint(bytes) {
        return Err(AttachError::ForeignBreakpoint { addr });
    }
    let emulation = analyze(addr, bytes, crate::code::slots::slot_for)?;
    let direct = consumer.blocked.clone();
    if let Some(blocked) = &direct
        && consumer.trap_only
    {
        return Err(blocked.clone());
    }
    refuse_inside_direct_jump(addr)?;
    batch.retry.extend(take_back_covering_jumps(&[addr]));
    let site = Box::into_raw(Box::new(Site {
        addr,
        original: core::array::from_fn(|i| bytes[i]),
        map,
        emulation,
        consumers: AtomicPtr::new(Box::into_raw(Box::new(vec![consumer]))),
        missed: PerCpuCounter::new(),
        armed: AtomicBool::new(true),
        resume_at: AtomicUsize::new(0),
        landing: AtomicUsize::new(0),
        landing_entry: AtomicUsize::new(0),
        mode: Mutex::new(SiteMode::Trap(NotOptimized::TrapOnly)),
        cell: AtomicPtr::new(core::ptr::null_mut()),
    }));
    // SAFETY: just made, not published yet.
    let made = unsafe { &*site };
    let consumer = &made.current_list()[0];
    {
        let (function, trap_only) = (consumer.function, consumer.trap_only);
        let prepared =
            patch::jump::prepare(made, function, maps, trap_only, direct.is_some(), None);
        *made.mode() = match prepared {
            _ if trap_only => SiteMode::Trap(NotOptimized::TrapOnly),
            Ok(jump) => SiteMode::Ready(jump),
            Err(_) if direct.is_some() => {
                // SAFETY: made above, never published.
                unsafe { free_unpublished(site) };
                return Err(direct.expect("checked"));
            }
            Err(why) => {
                if matches!(
                    why,
                    NotOptimized::OtherProbeInRange { .. } | NotOptimized::NoPunTarget { .. }
                ) {
                    // Blocked by a neighbour that may take a jump in
                    // this batch, or whose jump may move its stub to make
                    // room: planned again after it.
                    batch.retry.push(addr);
                }
                SiteMode::Trap(why)
            }
        };
    }
    // Publish the analysis; the breakpoint (or a direct jump) follows
    // (`attach_many`).
    if let Some(old) = table::insert(site) {
        garbage.push(Garbage::Table(old));
    }
    batch.writes.push((item, map, addr));
    if direct.is_some() {
        batch.direct.insert(addr);
    }
    batch.pending.insert(addr);
    Ok(())
}

/// Frees a site made by `attach_one` and never published, with its
/// consumer list.
///
/// # Safety
/// `site` came from `Box::into_raw` and no one else has it.
unsafe fn free_unpublished(site: *mut Site) {
    // SAFETY: the caller's contract.
    let site = unsafe { Box::from_raw(site) };
    // SAFETY: the site's own list, never published.
    drop(unsafe { Box::from_raw(site.consumers.load(Ordering::Relaxed)) });
}

/// Refuses `addr` if it lies inside the bytes a direct jump depends on
/// (its own or its fixed bytes): that jump can neither change nor go
/// back to a breakpoint. `WRITER` is held.
fn refuse_inside_direct_jump(addr: usize) -> Result<(), AttachError> {
    for k in 1..=2 * crate::arch::JUMP_LEN + 4 {
        let Some(site) = addr.checked_sub(k).and_then(table::site_at) else {
            continue;
        };
        let covers = match &*site.mode() {
            SiteMode::Ready(j) | SiteMode::Jump(j) => j.direct && j.covers(addr),
            SiteMode::Trap(_) => false,
        };
        if covers {
            return Err(AttachError::OneBytePatch {
                addr,
                site: site.addr,
            });
        }
    }
    Ok(())
}

/// Detaches each `(address, consumer)`; the last consumer of an address
/// removes its breakpoint. One grace period for the whole batch; returns
/// once no handler of these consumers runs or will run. Reports the first
/// error (the others are still detached as far as they can be).
pub(crate) fn detach_many(items: &[(usize, Arc<Consumer>)]) -> Result<(), DetachError> {
    let _w = writer();
    // A replaced handler disarms every site; the detach itself goes on
    // (it has nothing left to restore).
    let _ = check_trap_handler();
    let mut garbage = Vec::new();
    let table = write_side();
    let last: Vec<(usize, &Site)> = items
        .iter()
        .filter_map(|(addr, consumer)| detach_one(*addr, consumer, &mut garbage))
        .collect();
    let mut retry = Vec::new();
    let result = unpublish(&last, &Snapshot::read(), &mut garbage, &mut retry);
    reoptimize(retry);
    if items.iter().any(|(_, c)| c.switch.is_some()) {
        // Timing probes' switches are off: restart every sequence that may
        // have read one on.
        pcpu::rseq::fence_all();
    }
    let with_returns = items.iter().filter(|(_, c)| c.returns).count();
    collect(garbage, &table, with_returns > 0);
    // Past the grace period no hit of these consumers takes a lease: with
    // the last return consumer gone, the service threads may end.
    returns::consumers_detached(with_returns);
    // A fork child gets its service thread back here (it inherits none).
    let _ = returns::ensure_service();
    result
}

/// Removes `consumer` from the site at `addr`; returns the site (and its
/// table slot) if that was its last consumer, to [`unpublish`]. `WRITER`
/// is held.
fn detach_one<'s>(
    addr: usize,
    consumer: &Arc<Consumer>,
    garbage: &mut Vec<Garbage>,
) -> Option<(usize, &'s Site)> {
    if let Some(ret) = &consumer.ret {
        // No return handler of it runs once the grace period below is over.
        ret.detach();
    }
    if let Some(switch) = consumer.switch {
        // No return of it records once the fence and the grace period
        // below are over (see `crate::site::timing`).
        switch.off();
    }
    let (slot, site) = table::find(addr)?;
    if !site.current_list().iter().any(|c| Arc::ptr_eq(c, consumer)) {
        // A site made anew at the address after this consumer's site went
        // stale (its code was unloaded): nothing of it is here.
        return None;
    }
    let list: Vec<_> = site
        .current_list()
        .iter()
        .filter(|c| !Arc::ptr_eq(c, consumer))
        .cloned()
        .collect();
    if list.is_empty() {
        return Some((slot, site));
    }
    garbage.push(Garbage::List(site.publish_list(list)));
    None
}

/// Sites whose last consumer left: the original bytes back first (one
/// batch of patches), then unpublished. A site whose bytes could not be
/// restored keeps its breakpoint with no consumer (hits just run the
/// instruction); the first such error is returned. Neighbours whose
/// jumps covered these sites go back to their breakpoints first, and
/// into `retry` (for `modes::reoptimize`). `WRITER` is held.
fn unpublish(
    sites: &[(usize, &Site)],
    maps: &Snapshot,
    garbage: &mut Vec<Garbage>,
    retry: &mut Vec<usize>,
) -> Result<(), DetachError> {
    {
        // Jumps back to breakpoints first; the trampolines' cells then
        // name no site (a thread still on its way through one runs no
        // handler once the grace period that follows is over).
        let all: Vec<&Site> = sites.iter().map(|&(_, s)| s).collect();
        for site in &all {
            site.clear_cell();
        }
        retry.extend(to_traps(&all, &NotOptimized::TrapOnly));
    }
    let mut failed = breakpoints::disarm(sites.iter().map(|&(_, site)| site), maps);
    let mut first_error = None;
    for (i, &(slot, site)) in sites.iter().enumerate() {
        if let Some(at) = failed.iter().position(|(f, _)| *f == i) {
            let (_, source) = failed.swap_remove(at);
            first_error.get_or_insert(DetachError::CodeNotRestored {
                addr: site.addr,
                source,
            });
            garbage.push(Garbage::List(site.publish_list(Vec::new())));
            continue;
        }
        table::remove(slot);
        garbage.push(Garbage::Site(core::ptr::from_ref(site).cast_mut()));
    }
    first_error.map_or(Ok(()), Err)
}

/// Whether the engine's SIGTRAP handler is still the installed one. If
/// the program replaced it (`sigaction`, `signal`), a hit would reach the
/// program's handler and resume in the middle of the probed instruction:
/// every site is disarmed (its original bytes restored) and the error
/// says so. `WRITER` is held.
fn check_trap_handler() -> Result<(), AttachError> {
    if trap::is_installed() {
        return Ok(());
    }
    let sites = table::sites();
    // A jump punned over a breakpoint that goes would land elsewhere: such
    // jumps go back to their breakpoints first, and out with the others.
    let breakpoints: Vec<usize> = sites
        .iter()
        .filter(|s| s.armed.load(Ordering::Relaxed) && !s.is_jump())
        .map(|s| s.addr)
        .collect();
    let _ = take_back_covering_jumps(&breakpoints);
    let was_armed = sites
        .iter()
        .filter(|s| s.armed.load(Ordering::Relaxed) && !s.is_jump())
        .count();
    let not_restored = breakpoints::disarm(sites.into_iter(), &Snapshot::read()).len();
    let disarmed = was_armed - not_restored;
    Err(AttachError::TrapHandlerReplaced { disarmed })
}
