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
//!    `rt_tgsigqueueinfo`; see `super::threads`) and its handler looks at
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
use std::sync::atomic::{AtomicPtr, Ordering};

use super::original::code_as_original;
use super::threads::check_threads;
use crate::arch::BREAKPOINT;
use crate::arch::JUMP_LEN;
use crate::arch::jump::{self as arch_jump, Plan};
use crate::code::trampolines;
use crate::mode::NotOptimized;
use crate::process::maps::{Mapping, Patch, Snapshot, write_patches};
use crate::site::Site;
use crate::site::jump::{Function, Jump, JumpCell, Trampoline, read_code};
use crate::table::site_at;

/// Bytes of the engine's breakpoint: the jump's first byte on x86-64
/// (its tail is written behind it), the whole jump on aarch64.
const BP: usize = BREAKPOINT.len();

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
    let here = code_as_original(addr, (code_end - addr).min(64));
    let function_code = function.and_then(|(start, size)| {
        (size > 0 && start == addr)
            .then(|| code_as_original(start, (start + size).min(code_end) - start))
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
    if let Some(at) = (addr + 1..plan.start + plan.len).find(|&a| site_at(a).is_some()) {
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

/// Trampolines by (probed address, the original bytes from there to the
/// range's end).
type ByKey = HashMap<(usize, Vec<u8>), &'static Trampoline>;

/// Trampolines made so far.
static TRAMPOLINES: Mutex<Option<ByKey>> = Mutex::new(None);

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
    let by_key = guard.get_or_insert_with(HashMap::new);
    let key = (site, key_bytes.to_vec());
    if let Some(&t) = by_key.get(&key) {
        return Ok(t);
    }
    // The cell is leaked (never freed) only once the trampoline is made:
    // a plan that cannot be built costs no room.
    let cell = Box::new(JumpCell {
        addr: site,
        site: AtomicPtr::new(core::ptr::null_mut()),
    });
    let cell_addr = core::ptr::from_ref(&*cell) as usize;
    let (base, moves) =
        trampolines::place(plan.start, |base| arch_jump::build(plan, base, cell_addr))?;
    let cell: &'static JumpCell = Box::leak(cell);
    let t: &'static Trampoline = Box::leak(Box::new(Trampoline { base, cell, moves }));
    by_key.insert(key, t);
    Ok(t)
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
pub(crate) fn unoptimize(jumps: &[(&Jump, Mapping)]) {
    let live: Vec<&(&Jump, Mapping)> = jumps.iter().filter(|(j, _)| j.in_code()).collect();
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
