//! A cache of frame rules, by address: most stacks repeat the same call
//! sites, and a frame whose rules have the common shape (the CFA is the
//! stack or frame pointer plus an offset; the return address and the frame
//! pointer saved at offsets from it, or kept in their registers; other
//! registers saved at offsets, or kept) is then stepped without parsing
//! its frame description again. A cached step tracks only the stack
//! pointer, the frame pointer and the return address (what the frames
//! above need in compiled code); a frame above whose CFA is based on
//! another register ends the walk there.
//!
//! Lock-free and async-signal-safe: an entry is claimed by a
//! compare-and-swap of its address word to `BUSY`, its rule written, then
//! its address published; a reader checks the address before and after
//! reading the rule. A claim that fails leaves the entry alone (the rule
//! is not cached this time). [`clear`] empties it when the loaded objects
//! change.

use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};

use super::regs::{FP, RA, SP};

/// Entries (a power of two).
const ENTRIES: usize = 4096;
/// An entry being written.
const BUSY: usize = 1;

struct Entry {
    pc: AtomicUsize,
    rule: AtomicU64,
}

static CACHE: [Entry; ENTRIES] = [const {
    Entry {
        pc: AtomicUsize::new(0),
        rule: AtomicU64::new(0),
    }
}; ENTRIES];

/// Where a register of the caller is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Saved {
    /// In the same register.
    Kept,
    /// At the CFA plus this offset.
    At(i64),
}

/// The rules of a frame of the common shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rule {
    /// The CFA: this register ([`SP`] or [`FP`]) plus `cfa_off`.
    pub(super) cfa_reg: u16,
    pub(super) cfa_off: i64,
    pub(super) ra: Saved,
    pub(super) fp: Saved,
}

const OFF_BITS: u32 = 20;
const SAVED_BITS: u32 = 13;

fn fits(v: i64, bits: u32) -> bool {
    let lim = 1i64 << (bits - 1);
    (-lim..lim).contains(&v)
}

impl Rule {
    /// The rule in one word (bit 63 set: a rule), if its offsets fit.
    fn pack(self) -> Option<u64> {
        let saved = |s: Saved| -> Option<u64> {
            match s {
                Saved::Kept => Some(0),
                Saved::At(o) if fits(o, SAVED_BITS - 1) => {
                    Some(1 | ((o as u64) & ((1 << (SAVED_BITS - 1)) - 1)) << 1)
                }
                Saved::At(_) => None,
            }
        };
        let reg = match self.cfa_reg {
            r if r == SP => 0,
            r if r == FP => 1,
            _ => return None,
        };
        if !fits(self.cfa_off, OFF_BITS) {
            return None;
        }
        let off = (self.cfa_off as u64) & ((1 << OFF_BITS) - 1);
        Some(
            1 << 63
                | reg
                | off << 1
                | saved(self.ra)? << (1 + OFF_BITS)
                | saved(self.fp)? << (1 + OFF_BITS + SAVED_BITS),
        )
    }

    fn unpack(w: u64) -> Self {
        let signed = |v: u64, bits: u32| ((v << (64 - bits)) as i64) >> (64 - bits);
        let saved = |v: u64| {
            if v & 1 == 0 {
                Saved::Kept
            } else {
                Saved::At(signed(v >> 1, SAVED_BITS - 1))
            }
        };
        let mask = |bits: u32| (1u64 << bits) - 1;
        Self {
            cfa_reg: if w & 1 == 0 { SP } else { FP },
            cfa_off: signed((w >> 1) & mask(OFF_BITS), OFF_BITS),
            ra: saved((w >> (1 + OFF_BITS)) & mask(SAVED_BITS)),
            fp: saved((w >> (1 + OFF_BITS + SAVED_BITS)) & mask(SAVED_BITS)),
        }
    }
}

fn slot(pc: usize) -> &'static Entry {
    // Fibonacci hashing of the address.
    let h = (pc as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - ENTRIES.trailing_zeros());
    &CACHE[h as usize]
}

/// What a frame's cached rule says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cached {
    /// Step by this rule.
    Step(Rule),
    /// The frame is the outermost: the walk ends.
    End,
}

/// The word of an outermost frame.
const END: u64 = 1 << 62;

/// The cached rule of the frame at `pc`. Async-signal-safe.
pub(super) fn get(pc: usize) -> Option<Cached> {
    let e = slot(pc);
    if e.pc.load(Ordering::Acquire) != pc {
        return None;
    }
    let w = e.rule.load(Ordering::Relaxed);
    fence(Ordering::Acquire);
    if e.pc.load(Ordering::Relaxed) != pc {
        return None;
    }
    match w {
        END => Some(Cached::End),
        w if w >> 63 == 1 => Some(Cached::Step(Rule::unpack(w))),
        _ => None,
    }
}

/// Caches `rule` for `pc`, if the entry is free to take and the rule fits.
/// Async-signal-safe.
pub(super) fn put(pc: usize, rule: Rule) {
    if let Some(w) = rule.pack() {
        put_word(pc, w);
    }
}

/// Caches that the frame at `pc` is the outermost. Async-signal-safe.
pub(super) fn put_end(pc: usize) {
    put_word(pc, END);
}

fn put_word(pc: usize, w: u64) {
    let e = slot(pc);
    let old = e.pc.load(Ordering::Relaxed);
    if old == BUSY || pc <= BUSY {
        return;
    }
    if e.pc
        .compare_exchange(old, BUSY, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    e.rule.store(w, Ordering::Relaxed);
    e.pc.store(pc, Ordering::Release);
}

/// Empties the cache (the loaded objects changed). Not async-signal-safe
/// only in that it is slow; entries being written are left to their
/// writers (their address is then stale but their rule is the one read
/// for it, from the objects of before).
pub(super) fn clear() {
    for e in &CACHE {
        let pc = e.pc.load(Ordering::Relaxed);
        if pc != BUSY {
            let _ =
                e.pc.compare_exchange(pc, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// The rule of a parsed row, if it has the common shape.
pub(super) fn of_row<T: gimli::ReaderOffset, S: gimli::UnwindContextStorage<T>>(
    row: &gimli::UnwindTableRow<T, S>,
) -> Option<Rule> {
    let gimli::CfaRule::RegisterAndOffset { register, offset } = row.cfa() else {
        return None;
    };
    let mut ra = Saved::Kept;
    let mut fp = Saved::Kept;
    for (r, rule) in row.registers() {
        let saved = match rule {
            gimli::RegisterRule::Offset(o) => Saved::At(*o),
            gimli::RegisterRule::SameValue => Saved::Kept,
            _ => return None,
        };
        match r.0 {
            x if x == RA => ra = saved,
            x if x == FP => fp = saved,
            // Another callee-saved register: not tracked past this frame.
            _ => {}
        }
    }
    // x86-64's return address column must have its rule (without one the
    // frame is the last: not this shape).
    if !super::regs::RA_WITHOUT_RULE_IS_KEPT && ra == Saved::Kept {
        return None;
    }
    Some(Rule {
        cfa_reg: register.0,
        cfa_off: *offset,
        ra,
        fp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pack_and_unpack() {
        for rule in [
            Rule {
                cfa_reg: SP,
                cfa_off: 8,
                ra: Saved::At(-8),
                fp: Saved::Kept,
            },
            Rule {
                cfa_reg: FP,
                cfa_off: 16,
                ra: Saved::At(-8),
                fp: Saved::At(-16),
            },
            Rule {
                cfa_reg: SP,
                cfa_off: 4096,
                ra: Saved::Kept,
                fp: Saved::At(-2040),
            },
        ] {
            assert_eq!(Rule::unpack(rule.pack().unwrap()), rule);
        }
        let big = Rule {
            cfa_reg: SP,
            cfa_off: 1 << 30,
            ra: Saved::At(-8),
            fp: Saved::Kept,
        };
        assert_eq!(big.pack(), None);
    }

    #[test]
    fn cached_rules_are_found_by_address() {
        let rule = Rule {
            cfa_reg: SP,
            cfa_off: 24,
            ra: Saved::At(-8),
            fp: Saved::At(-16),
        };
        put(0x1234_5678, rule);
        assert_eq!(get(0x1234_5678), Some(Cached::Step(rule)));
        assert_eq!(get(0x1234_5679), None);
        put_end(0x2345_6789);
        assert_eq!(get(0x2345_6789), Some(Cached::End));
        clear();
        assert_eq!(get(0x1234_5678), None);
    }
}
