//! The site model: a probed address, the instruction its breakpoint
//! displaced, how it runs ([`SiteMode`]: breakpoint or jump) and its
//! consumers ([`consumer`], their [`handler`]s), with the record of a jump
//! ([`jump`]), a consumer's return side ([`returns`]) and what counting
//! and timing probes count into ([`count`], [`timing`]).
//!
//! The hit path reads a site inside a read section of the table's SRCU
//! domain (`crate::table::DOMAIN`): its consumer list is published with
//! one pointer swap and the old list freed after a grace period, so a
//! reader never locks. Everything else (the mode, `armed`) is the
//! writer's, under the attach lock.

pub(crate) mod consumer;
pub(crate) mod context;
pub(crate) mod count;
pub(crate) mod handler;
pub(crate) mod jump;
pub(crate) mod returns;
pub(crate) mod switch;
pub(crate) mod timing;

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pcpu::PerCpuCounter;

use crate::arch::{BREAKPOINT, Emulation};
use crate::base::mode::NotOptimized;
use crate::process::maps::Mapping;
use consumer::Consumer;
use jump::Jump;

/// How a site runs now (writer only).
pub(crate) enum SiteMode {
    /// Its breakpoint, for this reason.
    Trap(NotOptimized),
    /// Its breakpoint, with a trampoline made and the jump to write
    /// once the breakpoint is in (during an attach only).
    Ready(Jump),
    /// A jump into its trampoline.
    Jump(Jump),
}

/// A probed address: the displaced instruction and its consumers.
pub(crate) struct Site {
    pub(crate) addr: usize,
    /// The instruction bytes the breakpoint covers.
    pub(crate) original: [u8; BREAKPOINT.len()],
    pub(crate) map: Mapping,
    pub(crate) emulation: Emulation,
    pub(crate) consumers: AtomicPtr<Vec<Arc<Consumer>>>,
    /// Hits that ran no handler (the thread was already in the engine),
    /// per CPU.
    pub(crate) missed: PerCpuCounter,
    /// Whether the breakpoint is in the code (false once every probe was
    /// disarmed because the program replaced the SIGTRAP handler).
    /// Writer only.
    pub(crate) armed: AtomicBool,
    /// Where a trap hit continues instead of the emulation (0: none):
    /// the trampoline's relocated copy, once the site has one.
    pub(crate) resume_at: AtomicUsize,
    /// Where the range of a jump placed after the landing pad at `addr`
    /// (`endbr64`, `bti`, `paciasp`) starts while a breakpoint there
    /// belongs to this site (0: none).
    pub(crate) landing: AtomicUsize,
    /// Where a trap at that breakpoint continues, without running the
    /// consumers there: the trampoline's entry (aarch64, where the landing
    /// pad may have signed the link register, which the entry undoes);
    /// 0: the consumers run in the trap handler (x86-64).
    pub(crate) landing_entry: AtomicUsize,
    /// How the site runs (writer only; the handler never looks).
    pub(crate) mode: Mutex<SiteMode>,
    /// The cell of the trampoline that serves the site, once it has one
    /// (kept when the site goes back to its breakpoint: threads may still
    /// be on their way through the trampoline). Writer only.
    pub(crate) cell: AtomicPtr<jump::JumpCell>,
}

impl Site {
    /// The probed address.
    pub(crate) fn addr(&self) -> usize {
        self.addr
    }

    /// The mapping the site was attached in.
    pub(crate) fn mapping(&self) -> Mapping {
        self.map
    }

    /// The original bytes the breakpoint covers.
    pub(crate) fn original_bytes(&self) -> &[u8] {
        &self.original
    }

    /// Makes a breakpoint at `at` (the start of a jump's range after the
    /// site's landing pad) this site's, a trap there continuing at
    /// `entry` (see `landing_entry`); `at` 0: none. Writer only.
    ///
    /// Clearing keeps the entry: a trap handler that read the landing
    /// before it was cleared must still find where to go (a trampoline is
    /// never freed, so the old entry stays valid code).
    pub(crate) fn set_landing(&self, at: usize, entry: usize) {
        if at != 0 {
            self.landing_entry.store(entry, Ordering::Release);
        }
        self.landing.store(at, Ordering::Release);
    }

    /// Sends trap hits to `at` (see `resume_at`). Writer only.
    pub(crate) fn set_resume_at(&self, at: usize) {
        self.resume_at.store(at, Ordering::Release);
    }

    pub(crate) fn mode(&self) -> std::sync::MutexGuard<'_, SiteMode> {
        self.mode
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the site runs through a jump now.
    pub(crate) fn is_jump(&self) -> bool {
        match *self.mode() {
            SiteMode::Trap(_) | SiteMode::Ready(_) => false,
            SiteMode::Jump(_) => true,
        }
    }

    /// Whether the site runs (or is about to run) through a direct jump,
    /// which never goes back to a breakpoint.
    pub(crate) fn direct_jump(&self) -> bool {
        match &*self.mode() {
            SiteMode::Ready(j) | SiteMode::Jump(j) => j.direct,
            SiteMode::Trap(_) => false,
        }
    }

    /// Whether the site's breakpoint or jump is still in the code (false
    /// after an unload, when other code or nothing is there now). The
    /// address must be mapped.
    pub(crate) fn in_code(&self) -> bool {
        match &*self.mode() {
            SiteMode::Jump(j) => j.in_code(),
            // SAFETY: the caller's contract.
            _ => unsafe { crate::arch::is_breakpoint_at(self.addr) },
        }
    }

    /// The consumer list; the caller holds the attach lock (the list is
    /// not freed meanwhile).
    pub(crate) fn current_list(&self) -> &Vec<Arc<Consumer>> {
        // SAFETY: the writer lock is held: the list is not freed meanwhile.
        unsafe { &*self.consumers.load(Ordering::Acquire) }
    }

    /// Publishes `list`; returns the previous one, to free after a grace
    /// period. The attach lock is held.
    pub(crate) fn publish_list(&self, list: Vec<Arc<Consumer>>) -> *mut Vec<Arc<Consumer>> {
        let cell = self.cell.load(Ordering::Relaxed);
        if !cell.is_null() {
            // SAFETY: cells are never freed.
            sync_cell(unsafe { &*cell }, &list);
        }
        self.consumers
            .swap(Box::into_raw(Box::new(list)), Ordering::AcqRel)
    }

    /// Makes `cell` (its trampoline's) name this site, with the fast path
    /// its consumers allow. A cell the site had before (a jump planned
    /// again after a neighbour changed, with another trampoline) is
    /// cleared first: only the current cell is kept in step with the
    /// consumers and cleared at detach, so an old one left naming the
    /// site would outlive it. Writer only.
    pub(crate) fn take_cell(&self, cell: &'static jump::JumpCell) {
        let new = core::ptr::from_ref(cell).cast_mut();
        if self.cell.load(Ordering::Relaxed) != new {
            self.clear_cell();
        }
        self.cell.store(new, Ordering::Relaxed);
        sync_cell(cell, self.current_list());
        cell.site
            .store(core::ptr::from_ref(self).cast_mut(), Ordering::Release);
    }

    /// Clears the cell of the site's trampoline, if it has one: trampoline
    /// hits from now on run no handler and count nothing. The caller waits
    /// for a grace period before freeing the site. Writer only.
    pub(crate) fn clear_cell(&self) {
        let cell = self.cell.swap(core::ptr::null_mut(), Ordering::Relaxed);
        if cell.is_null() {
            return;
        }
        // SAFETY: cells are never freed.
        let cell = unsafe { &*cell };
        sync_cell(cell, &[]);
        cell.site.store(core::ptr::null_mut(), Ordering::Release);
    }
}

/// Points `cell`'s fast paths at what `list` (the site's consumers now)
/// allows: its only consumer without a thread filter, if it has one
/// ([`jump::JumpCell::lone_consumer`]); the [`count::TrampolineCounter`] of its only
/// consumer if that one only counts, else nothing; after taking a
/// counter away, waits until no thread can still add to it (see
/// [`count`]). The attach lock is held.
fn sync_cell(cell: &jump::JumpCell, list: &[Arc<Consumer>]) {
    let one = match list {
        [only] if only.only_thread.is_none() => Arc::as_ptr(only).cast_mut(),
        _ => core::ptr::null_mut(),
    };
    cell.lone_consumer.store(one, Ordering::Release);
    let want = match list {
        [only] if only.counting => only
            .counter
            .as_ref()
            .filter(|f| f.trampolines_count())
            .map_or(core::ptr::null_mut(), count::TrampolineCounter::base),
        _ => core::ptr::null_mut(),
    };
    let old = cell.counter.swap(want, Ordering::AcqRel);
    if !old.is_null() && old != want {
        pcpu::rseq::fence_all();
    }
    sync_routes(cell, list);
}

/// Points `cell`'s own entry paths at what its only consumer lets the
/// architecture's routines do by themselves: time a timing probe's calls
/// (its switch, see [`timing`]) or track a return probe's calls (its
/// switch and hit counters, see [`returns`]), routing its trampoline to
/// that routine; else at nothing, routing it back to the engine. After
/// taking a pointer away, waits until no thread can still count a call
/// through it. The attach lock is held.
fn sync_routes(cell: &jump::JumpCell, list: &[Arc<Consumer>]) {
    let alone = match list {
        [only] if jump::trampolines_time() => Some(only),
        _ => None,
    };
    let timed = alone.filter(|c| c.only_times).and_then(|c| c.switch);
    let lean = alone.and_then(|c| Some((c.lean_return?, c.counter.as_ref()?.base())));
    let route = match (timed, lean) {
        (Some(_), _) => jump::Route::Timed,
        (None, Some(_)) => jump::Route::Returns,
        (None, None) => jump::Route::Engine,
    };
    let ptr = |s: Option<&'static switch::Switch>| {
        s.map_or(core::ptr::null_mut(), |s| core::ptr::from_ref(s).cast_mut())
    };
    let (timed, returns) = (ptr(timed), ptr(lean.map(|(s, _)| s)));
    let hits = lean.map_or(core::ptr::null_mut(), |(_, hits)| hits);
    if route == jump::Route::Engine {
        jump::route(cell, route);
    }
    let taken = [
        (
            cell.timed.swap(timed, Ordering::AcqRel).cast::<()>(),
            timed.cast::<()>(),
        ),
        (
            cell.returns.swap(returns, Ordering::AcqRel).cast(),
            returns.cast(),
        ),
        (
            cell.return_hits.swap(hits, Ordering::AcqRel).cast(),
            hits.cast(),
        ),
    ];
    if route != jump::Route::Engine {
        jump::route(cell, route);
    }
    if taken.iter().any(|&(old, new)| !old.is_null() && old != new) {
        pcpu::rseq::fence_all();
    }
}
