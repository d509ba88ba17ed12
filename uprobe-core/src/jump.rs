//! Trap-free probes: rewriting a probed site from a breakpoint into a
//! jump to a trampoline of its own, and back (the architecture's part,
//! which sites qualify and the trampoline's code, is `arch::jump`). On
//! aarch64 the jump is one instruction, exactly the breakpoint's size:
//! the steps below that write a jump's tail or check threads inside a
//! range of several instructions have nothing to do there, and the jump
//! replaces the breakpoint in one aligned store.
//!
//! **Trampolines** live in regions mapped within reach of the code (as
//! out-of-line slots do). One is made per (range start, replaced bytes),
//! written once, never changed and never freed: a thread preempted
//! anywhere inside one, however long ago its probe was detached, always
//! finds the same code there. Its first word points at a [`JumpCell`],
//! also never freed, that names the site the trampoline serves now (null
//! once the site is detached); the trampoline's call into the engine
//! reads it inside an SRCU read section of the table's domain, so a hit
//! costs no table lookup, and no handler runs once a detach has cleared
//! the cell and waited for a grace period.
//!
//! **Patching** follows the kernel's `text_poke_bp`. The site already
//! holds the engine's breakpoint on its first byte (attach writes it as
//! for any probe, followed by `membarrier(SYNC_CORE)`), so a thread that
//! reaches the range meanwhile traps and is handled as usual. Then:
//! 1. trap hits of the site are sent to the trampoline's relocated copy
//!    instead of the out-of-line slot or the emulation (so that from now
//!    on no hit can leave a thread at an instruction boundary inside the
//!    range), and the cell names the site;
//! 2. for a range of several instructions, every other thread is
//!    signalled (a real-time signal queued with a marker,
//!    `rt_tgsigqueueinfo`; see [`check_signal`]) and its handler looks at
//!    where the thread stopped: one stopped at an
//!    instruction boundary inside the range is moved to the matching
//!    instruction of the relocated copy. A thread that does not answer
//!    in time, or is inside the engine's trap handler in every round,
//!    leaves the site on the trap path
//!    ([`NotOptimized::ThreadsUnchecked`]);
//! 3. the jump's last four bytes are written, then
//!    `membarrier(SYNC_CORE)`; then its first byte, then again.
//!
//! Before each write the bytes are checked to be what the previous step
//! left. Unoptimizing (detach, or a later trap-only probe at the
//! address) writes the breakpoint back over the jump's first byte, syncs,
//! restores the original tail, syncs; no thread can be inside a single
//! `jmp`, and threads inside the trampoline run on through it. A batch
//! shares each step's sync.
//!
//! **Limit**: a thread interrupted by a signal of the program at an
//! instruction boundary inside a multi-instruction range, and still
//! inside that signal handler while the site is optimized, returns into
//! the middle of the jump (its handler's stack holds the interrupted
//! context, which no signal can see). The kernel has the same problem
//! for user threads and does not optimize multi-instruction uprobes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use crate::arch::BREAKPOINT;
pub(crate) use crate::arch::jump::JUMP_LEN;
use crate::arch::jump::{self as arch_jump, Plan};
use crate::engine::Site;
use crate::maps::{Patch, Snapshot, write_patches};

pub(crate) use crate::mode::NotOptimized;

/// Every trampoline starts with the same header, on both architectures:
/// the pointer to its [`JumpCell`], then the pointer to the architecture's
/// common entry routine; its code follows.
pub(crate) const CELL_AT: usize = 0;
pub(crate) const ENTRY_PTR_AT: usize = 8;
pub(crate) const CODE_AT: usize = 16;
/// Bytes a trampoline may take (header, prologue and relocated code).
pub(crate) const TRAMPOLINE_SIZE: usize = 128;

/// The function around a site, when a plan needs it (a range of several
/// instructions at its start, or a landing pad there): its start and its
/// whole code, as it was before any patch.
pub(crate) struct Function<'a> {
    pub(crate) start: usize,
    pub(crate) code: &'a [u8],
}

/// For each instruction of a range, its address and that of its
/// relocated copy.
pub(crate) type Moves = Vec<(usize, usize)>;

/// Bytes of the engine's breakpoint: the jump's first byte on x86-64
/// (its tail is written behind it), the whole jump on aarch64.
const BP: usize = BREAKPOINT.len();

/// Which site a trampoline serves now. Never freed.
pub(crate) struct JumpCell {
    /// The probed address.
    addr: usize,
    /// The site (null: detached).
    site: AtomicPtr<Site>,
}

/// A trampoline: where it is, its cell, and where each instruction of
/// the range runs relocated.
pub(crate) struct Trampoline {
    pub(crate) base: usize,
    cell: &'static JumpCell,
    /// (address of a range instruction, its relocated copy).
    moves: Moves,
}

/// A site that runs through a jump: the range the jump covers and what
/// was there.
pub(crate) struct Jump {
    /// The probed address: `start`, or the `endbr64` before it.
    site: usize,
    /// Where the jump goes.
    pub(crate) start: usize,
    /// Bytes of whole instructions the trampoline runs (>= the jump).
    len: usize,
    /// The jump's bytes and the original bytes under them.
    bytes: [u8; JUMP_LEN],
    original: [u8; JUMP_LEN],
    trampoline: &'static Trampoline,
}

impl Jump {
    /// Whether the jump is in the code (false after an unload: other
    /// code, or nothing, is there now). `start` must be mapped.
    pub(crate) fn in_code(&self) -> bool {
        // SAFETY: the caller's contract.
        unsafe { read_code(self.start) == self.bytes }
    }

    /// Whether the range holds several instructions (a thread may be
    /// stopped between them).
    pub(crate) fn has_interior(&self) -> bool {
        self.trampoline.moves.len() > 1
    }
}

/// Prepares `site` for a jump, before its breakpoint is written: plans
/// the range (the function around the site, if known: its start and
/// size) and makes the trampoline. Refused if another probe's site lies
/// inside the range. For a range of several instructions, trap hits of
/// the site are sent to the trampoline's relocated copy from the start
/// (`resume_at`), even when `trap_only`: the trap path then never leaves
/// a thread at an instruction boundary inside a range that a jump may
/// later cover. With `trap_only` and a single instruction nothing is
/// made. `WRITER` is held. Not async-signal-safe.
pub(crate) fn prepare(
    site: &Site,
    function: Option<(usize, usize)>,
    maps: &Snapshot,
    trap_only: bool,
) -> Result<Jump, NotOptimized> {
    if crate::arch::trampoline::shadow_stack_enabled() {
        return Err(NotOptimized::ShadowStack);
    }
    if let Some(why) = arch_jump::unsaved_vector_state() {
        return Err(NotOptimized::VectorState { why });
    }
    let addr = site.addr();
    let code_end = maps.code_end(addr).unwrap_or(addr);
    let here = crate::engine::code_as_original(addr, (code_end - addr).min(64));
    let function_code = function.and_then(|(start, size)| {
        (size > 0 && start == addr)
            .then(|| crate::engine::code_as_original(start, (start + size).min(code_end) - start))
    });
    let plan = arch_jump::plan(
        addr,
        &here,
        function_code
            .as_deref()
            .map(|code| Function { start: addr, code }),
    )?;
    if trap_only && !plan.has_interior() {
        return Err(NotOptimized::TrapOnly);
    }
    if plan.start + JUMP_LEN > code_end {
        return Err(NotOptimized::CrossesMapping);
    }
    if let Some(at) = (addr + 1..plan.start + plan.len).find(|&a| crate::table::find(a).is_some()) {
        return Err(NotOptimized::OtherProbeInRange { at });
    }
    let original = &here[plan.start - addr..plan.start - addr + plan.len];
    // Keyed on every byte from the site to the range's end: the landing
    // pad (and so what the trampoline undoes and redoes) included.
    let trampoline = trampoline_for(&plan, &here[..plan.start - addr + plan.len], addr)?;
    if plan.has_interior() {
        site.set_resume_at(arch_jump::copy_start(trampoline.base));
    }
    Ok(Jump {
        site: addr,
        start: plan.start,
        len: plan.len,
        bytes: arch_jump::jump_bytes(plan.start, trampoline.base),
        original: core::array::from_fn(|i| original[i]),
        trampoline,
    })
}

impl Jump {
    /// Whether `addr` lies inside the range, past the probed address.
    pub(crate) fn covers(&self, addr: usize) -> bool {
        addr > self.site && addr < self.start + self.len
    }

    /// The original bytes under the jump, and where they start.
    pub(crate) fn original(&self) -> (usize, &[u8]) {
        (self.start, &self.original)
    }

    /// Whether the jump comes after an `endbr64` that stays in place (the
    /// probed address is the landing pad's).
    fn after_landing_pad(&self) -> bool {
        self.start != self.site
    }
}

/// Trampolines made so far, by (range start, original bytes), and the
/// regions they are carved from: `(base, bytes used)`.
#[derive(Default)]
struct Trampolines {
    /// By (probed address, the range's original bytes).
    by_key: HashMap<(usize, Vec<u8>), &'static Trampoline>,
    regions: Vec<(usize, usize)>,
}

static TRAMPOLINES: Mutex<Option<Trampolines>> = Mutex::new(None);

/// Bytes per region of trampolines.
const REGION_SIZE: usize = 64 * 1024;

/// The trampoline for `plan` of the probe at `site`, made (and written)
/// if new. `key_bytes` are the original bytes from the site to the end of
/// the range (what the trampoline is made from). Not async-signal-safe.
fn trampoline_for(
    plan: &Plan,
    key_bytes: &[u8],
    site: usize,
) -> Result<&'static Trampoline, NotOptimized> {
    let mut guard = TRAMPOLINES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let all = guard.get_or_insert_with(Trampolines::default);
    let key = (site, key_bytes.to_vec());
    if let Some(&t) = all.by_key.get(&key) {
        return Ok(t);
    }
    if NO_ROOM.load(Ordering::Relaxed) {
        return Err(NotOptimized::NoTrampolineRoom);
    }
    let reach = crate::arch::xol::REACH_LIMIT - 2 * REGION_SIZE;
    let found = all.regions.iter().position(|&(base, used)| {
        base.abs_diff(plan.start) < reach && used + TRAMPOLINE_SIZE <= REGION_SIZE
    });
    let region = if let Some(k) = found {
        k
    } else {
        if all.regions.len() == MAX_REGIONS {
            return Err(NotOptimized::NoTrampolineRoom);
        }
        let base = crate::xol::map_near(plan.start, REGION_SIZE)
            .map_err(|_| NotOptimized::NoTrampolineRoom)?;
        publish_region(all.regions.len(), base);
        all.regions.push((base, 0));
        // Faults raised by a relocated instruction reach the program at
        // the original one.
        crate::engine::install_fault_handlers().map_err(|_| NotOptimized::NoTrampolineRoom)?;
        all.regions.len() - 1
    };
    let (region_base, used) = all.regions[region];
    let base = region_base + used;
    // The cell is leaked (never freed) only once the trampoline is made:
    // a plan that cannot be built costs no room.
    let cell = Box::new(JumpCell {
        addr: site,
        site: AtomicPtr::new(core::ptr::null_mut()),
    });
    let (code, moves) = arch_jump::build(plan, base, core::ptr::from_ref(&*cell) as usize)?;
    crate::xol::write_code(base, &code).map_err(|_| NotOptimized::NoTrampolineRoom)?;
    all.regions[region].1 += TRAMPOLINE_SIZE;
    let cell: &'static JumpCell = Box::leak(cell);
    let t: &'static Trampoline = Box::leak(Box::new(Trampoline { base, cell, moves }));
    // SAFETY: published with the region, never freed.
    let slots = unsafe { &*REGION_TRAMPOLINES[region].load(Ordering::Acquire) };
    slots[used / TRAMPOLINE_SIZE].store(core::ptr::from_ref(t).cast_mut(), Ordering::Release);
    all.by_key.insert(key, t);
    Ok(t)
}

/// Whether new trampolines are refused as if no gap were within reach
/// (for tests; see `bench_only::no_trampoline_room`).
static NO_ROOM: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

/// Makes new trampolines fail as if no gap were within reach of the code
/// (`on`), or not. Not async-signal-safe (attach-time only).
pub(crate) fn refuse_trampoline_room(on: bool) {
    NO_ROOM.store(on, Ordering::Relaxed);
}

/// The most regions of trampolines a process maps (64 MiB, 524,288
/// trampolines).
const MAX_REGIONS: usize = 1024;
/// Trampolines per region.
const PER_REGION: usize = REGION_SIZE / TRAMPOLINE_SIZE;
/// Region bases, for the fault handler (0: unused); written once each.
static REGION_BASES: [AtomicUsize; MAX_REGIONS] = [const { AtomicUsize::new(0) }; MAX_REGIONS];
/// Per region, its trampolines by slot (leaked, like the regions).
static REGION_TRAMPOLINES: [AtomicPtr<[AtomicPtr<Trampoline>; PER_REGION]>; MAX_REGIONS] =
    [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_REGIONS];

/// Publishes region `i` at `base` for the fault handler.
fn publish_region(i: usize, base: usize) {
    let slots: &'static [AtomicPtr<Trampoline>; PER_REGION] = Box::leak(Box::new(
        [const { AtomicPtr::new(core::ptr::null_mut()) }; PER_REGION],
    ));
    REGION_TRAMPOLINES[i].store(core::ptr::from_ref(slots).cast_mut(), Ordering::Release);
    REGION_BASES[i].store(base, Ordering::Release);
}

/// If `pc` runs a relocated instruction of a trampoline: the original
/// instruction's address, and the relocated copy's. Async-signal-safe:
/// loads only, index loops.
pub(crate) fn relocated_origin(pc: usize) -> Option<(usize, usize)> {
    for i in 0..MAX_REGIONS {
        let base = REGION_BASES[i].load(Ordering::Acquire);
        if base == 0 {
            return None;
        }
        if pc < base || pc >= base + REGION_SIZE {
            continue;
        }
        // SAFETY: published before the base, never freed.
        let slots = unsafe { &*REGION_TRAMPOLINES[i].load(Ordering::Acquire) };
        let t = slots[(pc - base) / TRAMPOLINE_SIZE].load(Ordering::Acquire);
        // SAFETY: trampolines are leaked once published.
        let t = unsafe { t.as_ref() }?;
        let mut found = None;
        for k in 0..t.moves.len() {
            let (orig, copy) = t.moves[k];
            if copy <= pc {
                found = Some((orig, copy));
            }
        }
        return found;
    }
    None
}

/// Reads the `JUMP_LEN` bytes at `addr`.
///
/// # Safety
/// They are mapped.
unsafe fn read_code(addr: usize) -> [u8; JUMP_LEN] {
    // SAFETY: the caller's contract.
    core::array::from_fn(|i| unsafe { core::ptr::read_volatile((addr + i) as *const u8) })
}

/// Optimizes the prepared sites (each holds the engine's breakpoint on
/// its first byte, and every thread has synced since it was written).
/// Returns, per site, the jump or why not. `WRITER` is held.
pub(crate) fn optimize(ready: Vec<(&Site, Jump)>) -> Vec<Result<Jump, NotOptimized>> {
    let sites: Vec<&Site> = ready.iter().map(|(s, _)| *s).collect();
    let mut results: Vec<Result<Jump, NotOptimized>> = ready
        .into_iter()
        .map(|(_, j)| {
            // SAFETY: planned inside executable mappings.
            let (at_site, at_start) = unsafe { (read_code(j.site), read_code(j.start)) };
            let expected = if j.after_landing_pad() {
                at_start == j.original
            } else {
                at_start[BP..] == j.original[BP..]
            };
            if at_site[..BP] == BREAKPOINT && expected {
                Ok(j)
            } else {
                Err(NotOptimized::CodeChanged)
            }
        })
        .collect();
    // Step 1: trap hits continue in the trampoline; the cell names the
    // site.
    for (site, r) in sites.iter().zip(&results) {
        if let Ok(j) = r {
            site.set_resume_at(arch_jump::copy_start(j.trampoline.base));
            j.trampoline
                .cell
                .site
                .store(core::ptr::from_ref(*site).cast_mut(), Ordering::Release);
            if j.after_landing_pad() {
                site.set_landing(j.start, arch_jump::landing_entry(j.trampoline.base));
            }
        }
    }
    // After a landing pad, the range's own first byte gets a breakpoint
    // too (a thread may have run the `endbr64` before the site's
    // breakpoint was written); the trap handler knows it as the site's.
    patch_step(&sites, &mut results, |_, j| {
        if !j.after_landing_pad() {
            return Step::Skip;
        }
        Step::Write(j.start, BREAKPOINT.to_vec())
    });
    // Those landing breakpoints, to take back should a later step fail.
    let landings: Vec<(usize, usize, [u8; JUMP_LEN])> = results
        .iter()
        .enumerate()
        .filter_map(|(k, r)| r.as_ref().ok().map(|j| (k, j)))
        .filter(|(_, j)| j.after_landing_pad())
        .map(|(k, j)| (k, j.start, j.original))
        .collect();
    // Step 2: no thread stopped inside a multi-instruction range.
    let interior: Vec<&Jump> = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter(|j| j.has_interior())
        .collect();
    if !interior.is_empty()
        && let Err(why) = check_threads(&interior)
    {
        for r in &mut results {
            if r.as_ref().is_ok_and(Jump::has_interior) {
                *r = Err(why.clone());
            }
        }
    }
    // Step 3: the tail behind the breakpoint (x86-64), then the
    // breakpoint's bytes, each step checked first.
    for (from, to, before) in [(BP, JUMP_LEN, true), (0, BP, false)] {
        if from == to {
            continue;
        }
        patch_step(&sites, &mut results, |_, j| {
            // SAFETY: mapped (planned inside executable mappings).
            let now = unsafe { read_code(j.start) };
            let tail = if before { &j.original } else { &j.bytes };
            if now[..BP] != BREAKPOINT || now[BP..] != tail[BP..] {
                return Step::Mismatch;
            }
            Step::Write(j.start + from, j.bytes[from..to].to_vec())
        });
    }
    // The landing pads back in place: `endbr64`, then the jump. (Should
    // this fail, the jump stands behind the site's breakpoint: still
    // correct, as trap hits go to the copy.)
    patch_step(&sites, &mut results, |site, j| {
        if !j.after_landing_pad() {
            return Step::Skip;
        }
        Step::Write(j.site, site.original_bytes().to_vec())
    });
    // A landing breakpoint of a site that stays on its own breakpoint goes
    // (the range's original bytes back, tail first, behind the breakpoint),
    // or a later detach would leave it.
    let undo: Vec<&(usize, usize, [u8; JUMP_LEN])> = landings
        .iter()
        .filter(|(k, _, _)| results[*k].is_err())
        .collect();
    for (from, to) in [(BP, JUMP_LEN), (0, BP)] {
        if from == to {
            continue;
        }
        let patches: Vec<Patch<'_>> = undo
            .iter()
            .map(|(k, start, original)| Patch {
                map: sites[*k].mapping(),
                addr: start + from,
                bytes: &original[from..to],
            })
            .collect();
        // SAFETY: the range's original bytes over our own: the tail behind
        // the landing breakpoint, then the breakpoint itself.
        let _ = unsafe { write_patches(&patches) };
    }
    for (k, _, _) in undo {
        sites[*k].set_landing(0, 0);
    }
    // A site left on its breakpoint keeps sending trap hits to the
    // trampoline's copy (always correct: the copy never changes, and a
    // failed step may have left the jump's tail behind the breakpoint).
    results
}

/// What one step of the patching does for one jump.
enum Step {
    /// Nothing (the step is not for this jump).
    Skip,
    /// Writes these bytes at this address.
    Write(usize, Vec<u8>),
    /// The code is not what the previous step left: give up on the jump.
    Mismatch,
}

/// One step of the patching for every jump still on its way: the writes
/// `step` asks for, with one instruction-stream sync for all of them. A
/// jump whose check or write fails is given up (its site stays on its
/// breakpoint, [`NotOptimized::CodeChanged`]).
fn patch_step(
    sites: &[&Site],
    results: &mut [Result<Jump, NotOptimized>],
    step: impl Fn(&Site, &Jump) -> Step,
) {
    let mut writes = Vec::new();
    for (k, (site, r)) in sites.iter().zip(results.iter()).enumerate() {
        let Ok(j) = r else { continue };
        match step(site, j) {
            Step::Skip => {}
            Step::Write(addr, bytes) => writes.push((k, site.mapping(), addr, bytes)),
            Step::Mismatch => writes.push((k, site.mapping(), 0, Vec::new())),
        }
    }
    let patches: Vec<Patch<'_>> = writes
        .iter()
        .filter(|w| !w.3.is_empty())
        .map(|(_, map, addr, bytes)| Patch {
            map: *map,
            addr: *addr,
            bytes,
        })
        .collect();
    // SAFETY: each step writes what the protocol allows at that point (a
    // breakpoint over an instruction's first byte, the jump's tail behind
    // one, the jump's first byte over one, a landing pad's first byte
    // over one), after checking the code is what the step before left.
    let failed = unsafe { write_patches(&patches) }.err().unwrap_or_default();
    let mut p = 0;
    for (k, _, _, bytes) in &writes {
        let bad = bytes.is_empty() || failed.iter().any(|(i, _)| *i == p);
        if !bytes.is_empty() {
            p += 1;
        }
        if bad {
            results[*k] = Err(NotOptimized::CodeChanged);
        }
    }
}

/// Puts the breakpoint back in place of each jump and restores the tail:
/// the site is a trap site again, its breakpoint on the probed address
/// (for a jump after a landing pad: on the `endbr64`, with the range's
/// first byte restored last). Jumps no longer in the code (unloaded) are
/// skipped. `WRITER` is held.
pub(crate) fn unoptimize(jumps: &[(&Jump, crate::maps::Mapping)]) {
    let live: Vec<&(&Jump, crate::maps::Mapping)> =
        jumps.iter().filter(|(j, _)| j.in_code()).collect();
    let mut first: Vec<Patch<'_>> = Vec::new();
    for (j, map) in &live {
        first.push(Patch {
            map: *map,
            addr: j.start,
            bytes: &BREAKPOINT,
        });
        if j.after_landing_pad() {
            first.push(Patch {
                map: *map,
                addr: j.site,
                bytes: &BREAKPOINT,
            });
        }
    }
    // SAFETY: breakpoints over the first bytes of instructions (the jump,
    // the landing pad): a thread fetches the old byte or the breakpoint.
    let _ = unsafe { write_patches(&first) };
    let tails: Vec<Patch<'_>> = live
        .iter()
        .filter(|_| BP < JUMP_LEN)
        .map(|(j, map)| Patch {
            map: *map,
            addr: j.start + BP,
            bytes: &j.original[BP..],
        })
        .collect();
    // SAFETY: the breakpoint keeps threads out of the tail; no thread can
    // be stopped inside a single jump instruction.
    let _ = unsafe { write_patches(&tails) };
    let heads: Vec<Patch<'_>> = live
        .iter()
        .filter(|(j, _)| j.after_landing_pad())
        .map(|(j, map)| Patch {
            map: *map,
            addr: j.start,
            bytes: &j.original[..BP],
        })
        .collect();
    // SAFETY: the range's first byte restored over our breakpoint, the
    // rest of the instruction being whole again.
    let _ = unsafe { write_patches(&heads) };
}

/// Clears a detached site's cell: trampoline hits from now on run no
/// handler. `WRITER` is held; the caller waits for a grace period before
/// freeing the site.
pub(crate) fn clear_cell(jump: &Jump) {
    jump.trampoline
        .cell
        .site
        .store(core::ptr::null_mut(), Ordering::Release);
}

/// A trampoline's call into the engine: the probed address's consumers,
/// with the saved registers `frame` (RIP is set to the probed address
/// here). Returns whether a handler moved RIP. Async-signal-safe.
pub(crate) fn on_jump(cell: usize, frame: &mut crate::arch::Frame) -> bool {
    // SAFETY: the trampoline's cell pointer, never freed.
    let cell = unsafe { &*(cell as *const JumpCell) };
    crate::arch::set_frame_pc(frame, cell.addr);
    crate::lookup::with_read_side(|| {
        let site = cell.site.load(Ordering::Acquire);
        if site.is_null() {
            return false;
        }
        // SAFETY: a site named by a cell is freed only after the cell was
        // cleared and a grace period passed; we are in a read section.
        crate::engine::run_consumers(unsafe { &*site }, frame)
    })
}

// ---------------------------------------------------------------------
// Where the other threads are.

/// The marker in a thread check's `si_value` (the round number is added).
const CHECK_MARKER: u64 = 0x7570_7262_0000_0000;
const ROUND_MASK: u64 = 0xffff_ffff;
/// Rounds of signals before giving up on a busy or silent thread.
const ROUNDS: usize = 4;
/// How long a round waits for every thread to answer.
const ROUND_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The ranges being checked, sorted by start (null between checks).
static RANGES: AtomicPtr<Vec<(usize, usize, &'static Trampoline)>> =
    AtomicPtr::new(core::ptr::null_mut());
/// Signal handlers reading `RANGES` now.
static READING: AtomicUsize = AtomicUsize::new(0);
static ROUND: AtomicU64 = AtomicU64::new(0);
static ANSWERED: AtomicUsize = AtomicUsize::new(0);
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// The layout of `siginfo_t` for a queued signal on x86-64 and aarch64.
#[repr(C)]
struct QueuedInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad: i32,
    pid: i32,
    uid: u32,
    value: u64,
    _rest: [u64; 12],
}

/// The signal thread checks use (0: none chosen yet; -1: none free).
static CHECK_SIGNAL: core::sync::atomic::AtomicI32 = core::sync::atomic::AtomicI32::new(0);

/// The signal of thread checks, chosen and its handler installed on
/// first use: the highest real-time signal whose disposition is the
/// default one. Not SIGTRAP: a standard signal does not queue behind
/// itself, so a thread that executed a breakpoint while a SIGTRAP check
/// was pending would lose its trap, and resume past the displaced
/// instruction without running it. `None` if every real-time signal is
/// taken, or the program has since replaced the handler (no thread can
/// be checked then). Not async-signal-safe.
fn check_signal() -> Option<i32> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in (libc::SIGRTMIN()..=libc::SIGRTMAX()).rev() {
            // SAFETY: querying, then installing a handler with the
            // SA_SIGINFO signature for a signal nobody handles.
            unsafe {
                let mut old: libc::sigaction = core::mem::zeroed();
                if libc::sigaction(sig, core::ptr::null(), &raw mut old) != 0
                    || old.sa_sigaction != libc::SIG_DFL
                {
                    continue;
                }
                let mut sa: libc::sigaction = core::mem::zeroed();
                sa.sa_sigaction = on_check_signal as *const () as libc::sighandler_t;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&raw mut sa.sa_mask);
                if libc::sigaction(sig, &raw const sa, core::ptr::null_mut()) == 0 {
                    CHECK_SIGNAL.store(sig, Ordering::Relaxed);
                    return;
                }
            }
        }
        CHECK_SIGNAL.store(-1, Ordering::Relaxed);
    });
    let sig = CHECK_SIGNAL.load(Ordering::Relaxed);
    // SAFETY: a query only.
    let ours = sig > 0
        && unsafe {
            let mut now: libc::sigaction = core::mem::zeroed();
            libc::sigaction(sig, core::ptr::null(), &raw mut now);
            now.sa_sigaction == on_check_signal as *const () as libc::sighandler_t
        };
    ours.then_some(sig)
}

extern "C" fn on_check_signal(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo and ucontext (SA_SIGINFO).
    let (info, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    if is_check(info) {
        on_check(info, uc, crate::engine::in_trap_handler());
    } else {
        // Someone else's: what the default disposition would have done.
        // SAFETY: resetting a disposition and re-raising are
        // async-signal-safe.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

/// Whether a signal is a thread check of the engine's. Async-signal-safe.
fn is_check(info: &libc::siginfo_t) -> bool {
    if info.si_code != libc::SI_QUEUE {
        return false;
    }
    // SAFETY: a queued signal's siginfo has the `QueuedInfo` layout.
    let q = unsafe { &*core::ptr::from_ref(info).cast::<QueuedInfo>() };
    // SAFETY: getpid has no preconditions.
    q.value & !ROUND_MASK == CHECK_MARKER && q.pid == unsafe { libc::getpid() }
}

/// A thread check, on the thread checked: if it stopped at an
/// instruction boundary inside a range being optimized, moves it to the
/// relocated copy; `in_trap_handler` says it was interrupted inside the
/// engine's trap handler (it must be asked again). Async-signal-safe.
fn on_check(info: &libc::siginfo_t, uc: &mut libc::ucontext_t, in_trap_handler: bool) {
    // SAFETY: `is_check` said so.
    let q = unsafe { &*core::ptr::from_ref(info).cast::<QueuedInfo>() };
    READING.fetch_add(1, Ordering::SeqCst);
    let ranges = RANGES.load(Ordering::SeqCst);
    if !ranges.is_null() && q.value & ROUND_MASK == ROUND.load(Ordering::SeqCst) & ROUND_MASK {
        if in_trap_handler {
            BUSY.fetch_add(1, Ordering::SeqCst);
        } else {
            // SAFETY: published by `check_threads`, freed only once no
            // handler reads it.
            let ranges = unsafe { &*ranges };
            let pc = crate::arch::pc(uc);
            let i = ranges.partition_point(|&(start, _, _)| start <= pc);
            if i > 0 {
                let (start, len, t) = ranges[i - 1];
                if pc > start && pc < start + len {
                    match t.moves.iter().find(|&&(at, _)| at == pc) {
                        Some(&(_, to)) => crate::arch::set_pc(uc, to),
                        None => {
                            BUSY.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            }
        }
        ANSWERED.fetch_add(1, Ordering::SeqCst);
    }
    READING.fetch_sub(1, Ordering::SeqCst);
}

/// Makes sure no thread but the caller is stopped at an instruction
/// boundary inside one of `jumps`' ranges (moving those that are), by
/// asking each thread where it is. Not async-signal-safe.
fn check_threads(jumps: &[&Jump]) -> Result<(), NotOptimized> {
    let mut ranges: Vec<(usize, usize, &'static Trampoline)> = jumps
        .iter()
        .map(|j| (j.start, j.len, j.trampoline))
        .collect();
    ranges.sort_unstable_by_key(|r| r.0);
    RANGES.store(Box::into_raw(Box::new(ranges)), Ordering::SeqCst);
    let mut result = Err(NotOptimized::ThreadsUnchecked { threads: 0 });
    for _ in 0..ROUNDS {
        match check_round() {
            Ok(()) => {
                result = Ok(());
                break;
            }
            Err(threads) => result = Err(NotOptimized::ThreadsUnchecked { threads }),
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let ranges = RANGES.swap(core::ptr::null_mut(), Ordering::SeqCst);
    while READING.load(Ordering::SeqCst) != 0 {
        std::hint::spin_loop();
    }
    // SAFETY: unpublished, and no handler reads it any more.
    drop(unsafe { Box::from_raw(ranges) });
    result
}

/// One round: signals every other thread and waits for the answers.
/// `Err(n)`: `n` threads did not answer or were busy.
fn check_round() -> Result<(), usize> {
    let Some(signal) = check_signal() else {
        return Err(crate::checks::thread_ids().len().saturating_sub(1));
    };
    let round = ROUND.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
    ANSWERED.store(0, Ordering::SeqCst);
    BUSY.store(0, Ordering::SeqCst);
    // SAFETY: getpid/getuid have no preconditions.
    let (pid, uid) = unsafe { (libc::getpid(), libc::getuid()) };
    let me = crate::engine::current_tid();
    let mut sent = 0;
    for tid in crate::checks::thread_ids() {
        if tid == me {
            continue;
        }
        let info = QueuedInfo {
            signo: signal,
            errno: 0,
            code: libc::SI_QUEUE,
            _pad: 0,
            pid,
            uid,
            value: CHECK_MARKER | (round & ROUND_MASK),
            _rest: [0; 12],
        };
        // SAFETY: a queued signal with a siginfo of ours to a thread of
        // this process.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                pid,
                tid,
                signal,
                &raw const info,
            )
        };
        if rc == 0 {
            sent += 1;
        }
    }
    let deadline = std::time::Instant::now() + ROUND_WAIT;
    while ANSWERED.load(Ordering::SeqCst) < sent && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    let answered = ANSWERED.load(Ordering::SeqCst);
    let busy = BUSY.load(Ordering::SeqCst);
    let bad = sent.saturating_sub(answered) + busy;
    if bad == 0 { Ok(()) } else { Err(bad) }
}
