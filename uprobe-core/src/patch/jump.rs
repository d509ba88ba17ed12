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
//! A punned jump (x86-64, `crate::patch::pun`) writes only the probed
//! instruction's bytes, by the same steps; its fixed bytes are checked
//! too. A *direct* jump (one byte, where glibc runs with every signal
//! blocked) has no breakpoint before it: its one byte goes over the
//! original in one store, and back the same way.
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
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use super::original::{code_as_original, code_for_pun};
use super::pun;
use super::threads::check_threads;
use crate::arch::BREAKPOINT;
use crate::arch::JUMP_LEN;
use crate::arch::jump::{self as arch_jump, Plan};
use crate::base::mode::{NotOptimized, Tactic};
use crate::code::trampolines;
use crate::process::maps::{Mapping, Patch, Snapshot, write_patches};
use crate::process::symbols::Extent;
use crate::site::Site;
use crate::site::jump::{Jump, JumpCell, Trampoline, read_code};
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
/// made. `direct`: only a one-byte punned jump, to be written with no
/// breakpoint before it (code that runs with signals blocked). `accept`:
/// a punned jump's written bytes must pass it (see `pun::choose`); a jump
/// over the probed instruction alone is then written whole through a
/// stub, so that its bytes can pass it too. `WRITER` is held. Not
/// async-signal-safe.
pub(crate) fn prepare(
    site: &Site,
    function: Option<Extent>,
    maps: &Snapshot,
    trap_only: bool,
    direct: bool,
    accept: Option<pun::Accept<'_>>,
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
    let (plan, instead) =
        super::range::choose(addr, &here, code_end, function, direct, accept.is_some())?;
    if trap_only && !plan.has_interior() {
        return Err(NotOptimized::TrapOnly);
    }
    if instead.is_none() && plan.start + JUMP_LEN > code_end {
        return Err(NotOptimized::CrossesMapping);
    }
    if let Some(at) = (addr + 1..plan.end()).find(|&a| site_at(a).is_some()) {
        return Err(NotOptimized::OtherProbeInRange { at });
    }
    let original = &here[plan.start - addr..plan.start - addr + plan.len];
    // Keyed on every byte from the site to the end of what the trampoline
    // copies: the landing pad (and so what the trampoline undoes and
    // redoes) included.
    let trampoline = trampoline_for(&plan, &here[..plan.end() - addr], addr)?;
    if plan.has_interior() {
        site.set_resume_at(arch_jump::copy_start(trampoline.base));
    }
    let Some(instead) = instead else {
        return Ok(Jump {
            site: addr,
            start: plan.start,
            len: plan.len,
            bytes: arch_jump::jump_bytes(plan.start, trampoline.base),
            original: core::array::from_fn(|i| original[i]),
            written: JUMP_LEN,
            fixed: Vec::new(),
            tactic: Tactic::Replace,
            direct: false,
            trampoline,
        });
    };
    // The fixed bytes as they stay: a neighbour's breakpoint or written
    // jump among them stays (`pun::choose`), its bytes what the
    // displacement ends in. What the patch replaces is the original code.
    let stays = code_for_pun(plan.start, plan.len, here.len() - (plan.start - addr));
    let (pun, bytes) = pun::choose(&plan, &stays, trampoline, maps, direct, accept)
        .map_err(|e| e.unwrap_or(instead_of(plan.len, instead)))?;
    let after = &here[plan.start - addr..];
    Ok(Jump {
        site: addr,
        start: plan.start,
        len: plan.len,
        bytes,
        original: core::array::from_fn(|i| after.get(i).copied().unwrap_or(0)),
        written: pun.written,
        tactic: Tactic::Pun {
            written: pun.written as u8,
            prefixes: pun.prefixes as u8,
        },
        fixed: pun.fixed,
        direct,
        trampoline,
    })
}

/// Why a site whose jump fits neither over whole instructions (`why`)
/// nor punned over its `len` bytes stays on its breakpoint.
fn instead_of(len: usize, why: NotOptimized) -> NotOptimized {
    NotOptimized::NoPunTarget {
        len,
        instead: Box::new(why),
    }
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
        lone_consumer: AtomicPtr::new(core::ptr::null_mut()),
        counter: AtomicPtr::new(core::ptr::null_mut()),
        timed: AtomicPtr::new(core::ptr::null_mut()),
        trampoline: AtomicUsize::new(0),
        returns: AtomicPtr::new(core::ptr::null_mut()),
        return_hits: AtomicPtr::new(core::ptr::null_mut()),
    });
    let cell_addr = core::ptr::from_ref(&*cell) as usize;
    let (base, moves) =
        trampolines::place(plan.start, |base| arch_jump::build(plan, base, cell_addr))?;
    let cell: &'static JumpCell = Box::leak(cell);
    cell.trampoline.store(base, Ordering::Release);
    let t: &'static Trampoline = Box::leak(Box::new(Trampoline {
        base,
        cell,
        moves,
        copied_end: plan.end(),
    }));
    by_key.insert(key, t);
    Ok(t)
}

/// Optimizes the prepared sites (each holds the engine's breakpoint on
/// its first byte, and every thread has synced since it was written; a
/// direct jump's site holds its original code instead). Returns, per
/// site, the jump or why not. `WRITER` is held.
pub(crate) fn optimize(ready: Vec<(&Site, Jump)>) -> Vec<Result<Jump, NotOptimized>> {
    let sites: Vec<&Site> = ready.iter().map(|(s, _)| *s).collect();
    let mut results: Vec<Result<Jump, NotOptimized>> = ready
        .into_iter()
        .map(|(_, j)| {
            if as_prepared(&j) {
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
            site.take_cell(j.trampoline.cell);
            if j.after_landing_pad() && !j.direct {
                site.set_landing(j.start, arch_jump::landing_entry(j.trampoline.base));
            }
        }
    }
    // After a landing pad, the range's own first byte gets a breakpoint
    // too (a thread may have run the `endbr64` before the site's
    // breakpoint was written); the trap handler knows it as the site's.
    patch_step(&sites, &mut results, |_, j| {
        if !j.after_landing_pad() || j.direct {
            return Step::Skip;
        }
        Step::Write(j.start, BREAKPOINT.to_vec())
    });
    // Those landing breakpoints, to take back should a later step fail.
    let landings: Vec<(usize, usize, Vec<u8>)> = results
        .iter()
        .enumerate()
        .filter_map(|(k, r)| r.as_ref().ok().map(|j| (k, j)))
        .filter(|(_, j)| j.after_landing_pad() && !j.direct)
        .map(|(k, j)| (k, j.start, j.original().1.to_vec()))
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
    // Step 3: the tail behind the breakpoint (x86-64; none for a
    // one-byte patch), then the breakpoint's bytes (a direct jump's one
    // byte over the original), each step checked first (a punned jump's
    // fixed bytes too).
    for before in [true, false] {
        patch_step(&sites, &mut results, |_, j| {
            let w = j.written;
            if before && w <= BP {
                return Step::Skip;
            }
            // SAFETY: mapped (planned inside executable mappings).
            let now = unsafe { read_code(j.start) };
            let head: &[u8] = if j.direct {
                &j.original[..BP]
            } else {
                &BREAKPOINT
            };
            let tail = if before { &j.original } else { &j.bytes };
            if now[..BP] != *head || now[BP..w] != tail[BP..w] || !fixed_in_place(j) {
                return Step::Mismatch;
            }
            let (from, to) = if before { (BP, w) } else { (0, BP) };
            Step::Write(j.start + from, j.bytes[from..to].to_vec())
        });
    }
    // The landing pads back in place: `endbr64`, then the jump. (Should
    // this fail, the jump stands behind the site's breakpoint: still
    // correct, as trap hits go to the copy.)
    patch_step(&sites, &mut results, |site, j| {
        if !j.after_landing_pad() || j.direct {
            return Step::Skip;
        }
        Step::Write(j.site, site.original_bytes().to_vec())
    });
    take_back_landings(&sites, &results, &landings);
    // A site left on its breakpoint keeps sending trap hits to the
    // trampoline's copy (always correct: the copy never changes, and a
    // failed step may have left the jump's tail behind the breakpoint).
    results
}

/// Whether the code is what `j` was prepared against: the site's
/// breakpoint in (or, for a direct jump, its original code), the bytes
/// the jump replaces still original behind it, the fixed bytes in place.
fn as_prepared(j: &Jump) -> bool {
    // SAFETY: planned inside executable mappings.
    let (at_site, at_start) = unsafe { (read_code(j.site), read_code(j.start)) };
    let w = j.written;
    if j.direct {
        return at_start[..w] == j.original[..w] && fixed_in_place(j);
    }
    let expected = if j.after_landing_pad() {
        at_start[..w] == j.original[..w]
    } else {
        at_start[BP.min(w)..w] == j.original[BP.min(w)..w]
    };
    at_site[..BP] == BREAKPOINT && expected && fixed_in_place(j)
}

/// A landing breakpoint (`(index, address, original bytes)`) of a site
/// that stays on its own breakpoint goes (the range's original bytes
/// back, tail first, behind the breakpoint), or a later detach would
/// leave it.
fn take_back_landings(
    sites: &[&Site],
    results: &[Result<Jump, NotOptimized>],
    landings: &[(usize, usize, Vec<u8>)],
) {
    let undo: Vec<&(usize, usize, Vec<u8>)> = landings
        .iter()
        .filter(|(k, _, _)| results[*k].is_err())
        .collect();
    for tail in [true, false] {
        let patches: Vec<Patch<'_>> = undo
            .iter()
            .filter(|(_, _, original)| !tail || original.len() > BP)
            .map(|(k, start, original)| {
                let (from, to) = if tail { (BP, original.len()) } else { (0, BP) };
                Patch {
                    map: sites[*k].mapping(),
                    addr: start + from,
                    bytes: &original[from..to],
                }
            })
            .collect();
        // SAFETY: the range's original bytes over our own: the tail behind
        // the landing breakpoint, then the breakpoint itself.
        let _ = unsafe { write_patches(&patches) };
    }
    for (k, _, _) in undo {
        sites[*k].set_landing(0, 0);
    }
}

/// Whether a punned jump's fixed bytes are still what its displacement
/// was made from (always, for a jump that replaces whole instructions).
fn fixed_in_place(j: &Jump) -> bool {
    let at = j.start + j.written;
    // SAFETY: planned inside executable mappings: the fixed bytes are
    // code of the same mapping.
    j.fixed
        .iter()
        .enumerate()
        .all(|(k, &b)| unsafe { core::ptr::read_volatile((at + k) as *const u8) } == b)
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
    if jumps.is_empty() {
        return;
    }
    // Only jumps whose code is still mapped can be read (and restored).
    let maps = Snapshot::read();
    let live: Vec<&(&Jump, Mapping)> = jumps
        .iter()
        .filter(|(j, _)| {
            maps.code_end(j.start)
                .is_some_and(|end| end >= j.start + JUMP_LEN)
        })
        .filter(|(j, _)| j.in_code())
        .collect();
    let mut first: Vec<Patch<'_>> = Vec::new();
    for (j, map) in &live {
        // A direct jump's one byte goes straight back to the original:
        // its code runs with signals blocked, where a breakpoint kills.
        first.push(Patch {
            map: *map,
            addr: j.start,
            bytes: if j.direct {
                &j.original[..BP]
            } else {
                &BREAKPOINT
            },
        });
        if j.after_landing_pad() && !j.direct {
            first.push(Patch {
                map: *map,
                addr: j.site,
                bytes: &BREAKPOINT,
            });
        }
    }
    // SAFETY: breakpoints over the first bytes of instructions (the jump,
    // the landing pad): a thread fetches the old byte or the breakpoint;
    // a direct jump's original byte over its one byte: a thread fetches
    // the jump or the original instruction, whose other bytes never
    // changed.
    let _ = unsafe { write_patches(&first) };
    let tails: Vec<Patch<'_>> = live
        .iter()
        .filter(|(j, _)| BP < j.written)
        .map(|(j, map)| Patch {
            map: *map,
            addr: j.start + BP,
            bytes: &j.original[BP..j.written],
        })
        .collect();
    // SAFETY: the breakpoint keeps threads out of the tail; no thread can
    // be stopped inside a single jump instruction.
    let _ = unsafe { write_patches(&tails) };
    let heads: Vec<Patch<'_>> = live
        .iter()
        .filter(|(j, _)| j.after_landing_pad() && !j.direct)
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
