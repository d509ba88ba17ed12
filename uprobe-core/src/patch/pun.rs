//! Punned jumps (x86-64; `crate::base::mode::Tactic::Pun`): which of the ways
//! to pun a jump over a site (`arch::pun::puns`) has room for a stub in
//! its window, the stubs made so far, and the landing pads.
//!
//! A punned jump changes only the probed instruction's bytes (and the
//! alignment padding after a return or jump, which nothing runs), so no
//! thread can be stopped inside what it replaces and no branch elsewhere
//! can land inside it: the checks a jump over several instructions needs
//! (no indirect jump in the function, no branch into the range, threads
//! moved out of it) have nothing to do. What it needs instead is that its
//! fixed bytes, the code after the instruction, stay as they are while
//! it is in. Another site may lie there, its bytes taken as they stay
//! (its breakpoint, or its written jump: as in `E9Patch`, the later
//! instruction patched first); any change to them (a new site, a jump
//! written or taken back, a detach) takes this jump back first, and plans
//! it again after (`crate::site::jump::Jump::covers`,
//! `crate::attach::modes`). The patching checks them before each write.
//!
//! A stub is made once per (trampoline, pun) and reused by every later
//! attach of the same site and bytes; like the trampoline it jumps to, it
//! is never freed (`crate::code::pinned`). Where a window is one address
//! inside loaded code, in the alignment padding after a function that
//! unwind information describes, the stub is written there instead: a
//! landing pad, never changed either.

use std::collections::HashMap;
use std::sync::Mutex;

use super::original::{code_as_it_stays, code_as_original, code_for_pun};
use crate::arch::JUMP_LEN;
use crate::arch::jump::Plan;
use crate::base::mode::NotOptimized;
use crate::code::pinned;
use crate::process::maps::{Patch, Snapshot, write_patches};
use crate::process::symbols::Symbols;
use crate::site::SiteMode;
use crate::site::jump::{Pun, Trampoline};
use crate::table::site_at;

/// A test of the bytes a punned jump would write (see [`choose`]).
pub(crate) type Accept<'a> = &'a dyn Fn(&[u8]) -> bool;

/// Stubs by (trampoline, prefixes, bytes written, fixed bytes).
type ByKey = HashMap<(usize, usize, usize, Vec<u8>), usize>;

/// Stubs made so far.
static STUBS: Mutex<Option<ByKey>> = Mutex::new(None);

/// Whether a site at `addr` keeps a pun's fixed bytes from lying there:
/// one whose jump is planned but not written (its bytes are about to
/// change). A written jump, or a breakpoint, stays as long as its site
/// stays as it is, and any change to its bytes takes this pun back first
/// (`crate::attach::modes`). For a one-byte jump in code that runs with
/// signals blocked (`direct`), which can never be taken back, any site
/// blocks.
fn blocks(addr: usize, direct: bool) -> bool {
    site_at(addr).is_some_and(|site| direct || matches!(*site.mode(), SiteMode::Ready(_)))
}

/// The pun for `plan` (one instruction; `code` is the code from its
/// start, as it stays around the written bytes, a neighbour's breakpoint
/// or written jump included, to at most the end of its mapping) whose
/// window could take a stub jumping to `trampoline`, and the bytes it
/// writes. `one_byte`: only the opcode is written over an instruction of
/// 5 bytes or more. `accept`, if given, must take the bytes written (a
/// stub placed where the pun of the site before can end in them). Fails
/// with the site that blocks every pun, or `None` when no window had
/// room. `WRITER` is held. Not async-signal-safe.
pub(crate) fn choose(
    plan: &Plan,
    code: &[u8],
    trampoline: &Trampoline,
    maps: &Snapshot,
    one_byte: bool,
    accept: Option<Accept<'_>>,
) -> Result<(Pun, [u8; JUMP_LEN]), Option<NotOptimized>> {
    let Some(punning) = crate::arch::PUNNING else {
        return Err(None);
    };
    let target = trampoline.base + crate::arch::jump::ENTRY_AT;
    let mut blocked = None;
    let mut stubs = STUBS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let stubs = stubs.get_or_insert_with(HashMap::new);
    let padding = padding_free(plan.start + plan.len);
    for pun in (punning.puns)(plan.start, plan.len, code, one_byte, padding) {
        let end = pun.start + pun.written + pun.fixed.len();
        // (Bytes written past the instruction are padding with no site:
        // `padding_free`.)
        if let Some(at) = (pun.start + 1..end).find(|&a| blocks(a, one_byte)) {
            blocked.get_or_insert(NotOptimized::OtherProbeInRange { at });
            continue;
        }
        let key = (
            trampoline.base,
            pun.prefixes,
            pun.written,
            pun.fixed.clone(),
        );
        let takes = |at: usize| {
            accept.is_none_or(|accept| accept(&(punning.pun_bytes)(&pun, at)[..pun.written]))
        };
        if let Some(&at) = stubs.get(&key)
            && takes(at)
        {
            let bytes = (punning.pun_bytes)(&pun, at);
            return Ok((pun, bytes));
        }
        if pun.fixed.is_empty()
            && accept.is_none()
            && pun.lo <= target
            && target - pun.lo < pun.size
        {
            // The whole jump written, nothing asked of its bytes: straight
            // to the trampoline.
            let bytes = (punning.pun_bytes)(&pun, target);
            return Ok((pun, bytes));
        }
        let free = |start, end| maps.free(start, end, pinned::HEAP_ROOM);
        let stub = |at| (punning.stub)(at, target);
        if pun.fixed.is_empty()
            && let Some(accept) = accept
        {
            // The whole jump written: any target it reaches, chosen for
            // `accept` first, the stub then placed there exactly.
            let end = pun.start + JUMP_LEN;
            let found = (1..WHOLE_TRIES)
                .filter_map(|i| end.checked_add_signed(spread(i) as isize))
                .filter(|&at| at >= pun.lo && at - pun.lo < pun.size)
                .filter(|&at| accept(&(punning.pun_bytes)(&pun, at)))
                .find_map(|at| pinned::place(at, 1, &free, stub, &|_| true));
            if let Some(at) = found {
                stubs.insert(key, at);
                let bytes = (punning.pun_bytes)(&pun, at);
                return Ok((pun, bytes));
            }
            continue;
        }
        if let Some(at) = pinned::place(pun.lo, pun.size, &free, stub, &takes) {
            stubs.insert(key, at);
            let bytes = (punning.pun_bytes)(&pun, at);
            return Ok((pun, bytes));
        }
        // One target, mapped: a landing pad, if it lies in padding.
        if pun.size == 1 && takes(pun.lo) && landing_pad(pun.lo, &stub(pun.lo), pun.start, maps) {
            stubs.insert(key, pun.lo);
            let bytes = (punning.pun_bytes)(&pun, pun.lo);
            return Ok((pun, bytes));
        }
    }
    Err(blocked)
}

/// Whether the padding from `at` on (if any) may be written: no site
/// lies within a jump's length of it (a probe on a `nop` there keeps its
/// bytes, which a pun then takes as fixed ones). `WRITER` is held.
/// Not async-signal-safe.
fn padding_free(at: usize) -> bool {
    (at..at + JUMP_LEN).all(|a| site_at(a).is_none())
}

/// Landing pads written so far: where, and their bytes.
static PADS: Mutex<Vec<(usize, Vec<u8>)>> = Mutex::new(Vec::new());

/// How far below a landing pad no site may lie: a jump's bytes, fixed
/// bytes and copied tail reach no further ahead of its site.
const PAD_CLEARANCE: usize = 4 * JUMP_LEN;

/// Writes `stub` at `at`, the one target of a pun, where that lies in
/// the alignment padding after code that unwind information describes
/// (`arch::Punning::padding_after_code`: after its last instruction,
/// which never falls through, `nop`s up to a 16-byte boundary): no
/// thread runs those bytes and no branch lands there, so the stub is
/// written with one sync before the pun's jump goes in. A landing pad,
/// like a stub, is never changed or taken out (a thread may be on its
/// way through it); a later pun with the same target and bytes shares
/// it. Whether `at` holds the stub now. Not where a site other than the
/// pun's own (at `from`) lies on it or close enough below for its jump
/// to reach it. `WRITER` is held. Not async-signal-safe.
fn landing_pad(at: usize, stub: &[u8], from: usize, maps: &Snapshot) -> bool {
    let Some(punning) = crate::arch::PUNNING else {
        return false;
    };
    let end = at + stub.len();
    let mut pads = PADS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((a, b)) = pads.iter().find(|(a, b)| *a < end && at < a + b.len()) {
        return *a == at && b == stub;
    }
    let Some(map) = maps.code_mapping_of(at).filter(|m| end <= m.end) else {
        return false;
    };
    if (at.saturating_sub(PAD_CLEARANCE)..end).any(|a| a != from && site_at(a).is_some()) {
        return false;
    }
    let Some((start, code_end)) = Symbols::now().unwound_before(at) else {
        return false;
    };
    if start < map.start || at - code_end > PAD_CLEARANCE {
        return false;
    }
    // The code as it was (a probe's breakpoint on its last `ret` is no
    // part of it), and the padding still as it was.
    let code = code_as_original(start, (code_end + 64).min(map.end) - start);
    let padding = (punning.padding_after_code)(start, code_end, &code);
    if end > code_end + padding || code_as_it_stays(at, stub.len()) != code[at - start..end - start]
    {
        return false;
    }
    let patch = Patch {
        map,
        addr: at,
        bytes: stub,
    };
    // SAFETY: `at .. end` is alignment padding inside `map`: no thread
    // runs it, no branch lands in it, and no site's bytes reach it.
    if unsafe { write_patches(&[patch]) }.is_err() {
        return false;
    }
    pads.push((at, stub.to_vec()));
    true
}

/// Whether `addr` lies in a landing pad the engine wrote (not the
/// program's code: no probe may go there). Not async-signal-safe.
pub(crate) fn in_landing_pad(addr: usize) -> bool {
    let pads = PADS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    pads.iter().any(|(a, b)| (*a..a + b.len()).contains(&addr))
}

/// Targets tried for a jump written whole (its window all it reaches)
/// whose bytes must pass a test: the test looks at a few of its
/// displacement's bytes (what the pun of the site before it ends in), so
/// the targets tried spread over them.
const WHOLE_TRIES: u32 = 256;

/// The `i`th displacement tried for such a jump: Fibonacci hashing
/// spreads every byte of it from one try to the next.
fn spread(i: u32) -> i32 {
    i.wrapping_mul(0x9e37_79b9).cast_signed()
}

/// For the site at `addr`, whose pun found no room: a test of the bytes
/// that the punned jump of the next site (its probed address `next`, its
/// jump's bytes from `next_start`) could write, saying whether with them
/// some pun of this site would have room for its stub. `None` where this
/// site takes no pun, or its pun's bytes do not reach the next site's.
/// Not async-signal-safe.
pub(crate) fn room_before(
    addr: usize,
    next: usize,
    next_start: usize,
    maps: &Snapshot,
) -> Option<impl Fn(&[u8]) -> bool> {
    let punning = crate::arch::PUNNING?;
    let n = (maps.code_end(addr)? - addr).min(4 * JUMP_LEN);
    let here = code_as_original(addr, n);
    let plan = crate::arch::jump::single(addr, &here, next).ok()?;
    let (start, len) = (plan.start, plan.len);
    if next_start < start + len || next_start >= start + JUMP_LEN + len {
        return None;
    }
    let stays = code_for_pun(start, len, n - (start - addr));
    Some(move |written: &[u8]| {
        let mut code = stays.clone();
        for (k, &b) in written.iter().enumerate() {
            if let Some(c) = code.get_mut(next_start - start + k) {
                *c = b;
            }
        }
        let free = |s, e| maps.free(s, e, pinned::HEAP_ROOM);
        (punning.puns)(start, len, &code, false, padding_free(start + len))
            .iter()
            .any(|p| pinned::could_place(p.lo, p.size, &free))
    })
}
