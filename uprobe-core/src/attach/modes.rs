//! Which way each site runs: the jumps of sites just attached written
//! (`crate::patch::jump`), sites taken back to their breakpoints (a
//! trap-only probe joined, another probe landed inside a jump's range, a
//! detach), and the neighbours taken back on the way optimized again.
//!
//! **Neighbours.** A punned jump's displacement ends in the bytes after
//! its instruction (x86-64, `crate::patch::pun`), and those bytes may be
//! another site's breakpoint or jump: as in `E9Patch`, the later
//! instruction is patched first and the earlier one punned over what it
//! holds. Such a jump depends on its neighbour's bytes, so any change of
//! bytes at a site (a new site's breakpoint, a jump written or taken
//! back, a detach) takes back first every jump that covers it
//! ([`take_back_covering_jumps`]), and the jumps taken back are planned
//! again once the change is made ([`reoptimize`]): punned over the new
//! bytes where a window has room, and where none has, over the next
//! site's jump with that jump's stub moved to where one does
//! (`make_room_before`; a jump that went straight to its trampoline over
//! a long instruction is written whole through a stub for it). The sites
//! before a change that are on their breakpoints for want of a pun
//! target are planned again with it: the new bytes may give their
//! windows room. The attach lock is held.

use std::collections::{HashMap, HashSet};

use crate::arch::JUMP_LEN;
use crate::arch::MAX_INSN_LEN;
use crate::base::mode::NotOptimized;
use crate::patch::jump;
use crate::process::maps::{Mapping, Snapshot};
use crate::site::jump::Jump;
use crate::site::{Site, SiteMode};
use crate::table::site_at;

/// Writes the jumps of the sites just made that are ready for one (each
/// site's mode then says how it runs); `to_trap` (optimized sites a
/// trap-only probe joined) go back to their breakpoints. Returns the
/// sites taken back on the way, for [`reoptimize`]. `WRITER` is held;
/// every new site's breakpoint is in the code and synced.
pub(crate) fn choose_modes(made: &[usize], to_trap: &[usize]) -> Vec<usize> {
    let mut ready = Vec::new();
    for &addr in made {
        let Some(site) = site_at(addr) else { continue };
        let mut guard = site.mode();
        if matches!(*guard, SiteMode::Ready(_)) {
            let SiteMode::Ready(jump) =
                core::mem::replace(&mut *guard, SiteMode::Trap(NotOptimized::CodeChanged))
            else {
                unreachable!("matched above");
            };
            ready.push((site, jump));
        }
    }
    let mut taken = write_jumps(ready);
    let back: Vec<&Site> = to_trap.iter().filter_map(|&a| site_at(a)).collect();
    taken.extend(to_traps(&back, &NotOptimized::TrapOnly));
    taken
}

/// Writes the prepared jumps (`crate::patch::jump::optimize`) and sets
/// each site's mode to the jump or why not; the jumps punned over their
/// breakpoints go back to their own first. Returns those, for
/// [`reoptimize`]. `WRITER` is held.
fn write_jumps(ready: Vec<(&Site, Jump)>) -> Vec<usize> {
    let addrs: Vec<usize> = ready.iter().map(|(s, _)| s.addr).collect();
    let taken = take_back_covering_jumps(&addrs);
    let sites: Vec<(&Site, bool)> = ready.iter().map(|(s, j)| (*s, j.direct)).collect();
    for ((site, direct), result) in sites.into_iter().zip(jump::optimize(ready)) {
        *site.mode() = match result {
            Ok(jump) => SiteMode::Jump(jump),
            Err(why) => {
                if direct {
                    // No breakpoint was ever written: the code changed
                    // under the attach, and the probe sees no hit.
                    site.armed
                        .store(false, core::sync::atomic::Ordering::Relaxed);
                }
                SiteMode::Trap(why)
            }
        };
    }
    taken
}

/// Takes back to its breakpoint every jump (ready or written), but those
/// of `addrs`' own sites, whose bytes, fixed bytes or copied tail cover
/// one of `addrs`, where bytes are about to change (a new site's
/// breakpoint, or a site's jump written or taken back); and with them the
/// jumps that cover those in turn. Each goes back to
/// [`NotOptimized::OtherProbeInRange`] and sends its trap hits through the
/// emulation again (its relocated copy would skip a new breakpoint).
/// Returns their addresses, for [`reoptimize`] once the change is made.
/// `WRITER` is held.
pub(crate) fn take_back_covering_jumps(addrs: &[usize]) -> Vec<usize> {
    back_with_covering(&[], &NotOptimized::TrapOnly, addrs)
}

/// Off jumps and back to breakpoints, with `why` as the new mode; with
/// them, the jumps of other sites that cover theirs (the caller may go
/// on to take these sites' breakpoints out), as
/// [`take_back_covering_jumps`] does. Returns those others' addresses,
/// for [`reoptimize`] once the caller has made its change. `WRITER` is
/// held.
pub(crate) fn to_traps(sites: &[&Site], why: &NotOptimized) -> Vec<usize> {
    let addrs: Vec<usize> = sites.iter().map(|s| s.addr).collect();
    back_with_covering(sites, why, &addrs)
}

/// `sites` back to their breakpoints (`why`) with the jumps covering
/// `addrs`, in one batch of patches; the covering sites' addresses, and
/// the sites before them on their breakpoints for want of a pun target
/// (see [`Before`]).
fn back_with_covering(sites: &[&Site], why: &NotOptimized, addrs: &[usize]) -> Vec<usize> {
    let before = look_before(addrs);
    back_to_breakpoints(sites, why, &before.covering);
    let mut again: Vec<usize> = before.covering.iter().map(|(s, _)| s.addr).collect();
    again.extend(before.without_pun_target);
    again
}

/// How far below an address a site whose jump covers it may lie: a range
/// starts at its site or after the site's landing pad (4 bytes), and
/// ends before the end of the last instruction that the jump's bytes
/// reach into.
const COVER_REACH: usize = 4 + JUMP_LEN + MAX_INSN_LEN;

/// The sites, other than those at `addrs`, whose jumps (ready or
/// written) cover one of `addrs` or, in turn, one of theirs; each with
/// the address it covers. `WRITER` is held.
fn covering(addrs: &[usize]) -> Vec<(&'static Site, usize)> {
    look_before(addrs).covering
}

/// What lies before addresses whose bytes are about to change.
struct Before {
    /// The jumps that cover them, transitively ([`covering`]).
    covering: Vec<(&'static Site, usize)>,
    /// The sites within a pun's reach below them, or below a covering
    /// jump, that are on their breakpoints for want of a pun target (their
    /// windows lay in bytes about to change: the new ones may give them
    /// room).
    without_pun_target: Vec<usize>,
}

/// [`Before`] `addrs`, in one look at the sites below each. `WRITER` is
/// held.
fn look_before(addrs: &[usize]) -> Before {
    let mut seen: HashSet<usize> = addrs.iter().copied().collect();
    let mut before = Before {
        covering: Vec::new(),
        without_pun_target: Vec::new(),
    };
    let mut queue = addrs.to_vec();
    while let Some(addr) = queue.pop() {
        for k in 1..COVER_REACH {
            let Some(site) = addr.checked_sub(k).and_then(site_at) else {
                continue;
            };
            if seen.contains(&site.addr) {
                continue;
            }
            let covers = match &*site.mode() {
                SiteMode::Ready(j) | SiteMode::Jump(j) => j.covers(addr),
                SiteMode::Trap(NotOptimized::NoPunTarget { .. }) if k < PUN_REACH => {
                    before.without_pun_target.push(site.addr);
                    false
                }
                SiteMode::Trap(_) => false,
            };
            if covers {
                seen.insert(site.addr);
                before.covering.push((site, addr));
                queue.push(site.addr);
            }
        }
    }
    before
}

/// `sites` off their jumps, to `why`, and the `covering` sites (each with
/// the address it covers) off their jumps or planned jumps, to
/// [`NotOptimized::OtherProbeInRange`], their trap hits through the
/// emulation again: one batch of patches for all. `WRITER` is held.
fn back_to_breakpoints(sites: &[&Site], why: &NotOptimized, covering: &[(&Site, usize)]) {
    let all: Vec<(&Site, NotOptimized, bool)> = sites
        .iter()
        .map(|s| (*s, why.clone(), false))
        .chain(
            covering
                .iter()
                .map(|&(s, at)| (s, NotOptimized::OtherProbeInRange { at }, true)),
        )
        .collect();
    let mut modes: Vec<_> = all.iter().map(|(s, _, _)| s.mode()).collect();
    let jumps: Vec<(&Jump, Mapping)> = modes
        .iter()
        .zip(&all)
        .filter_map(|(m, (s, _, _))| match &**m {
            SiteMode::Jump(j) => Some((j, s.map)),
            _ => None,
        })
        .collect();
    jump::unoptimize(&jumps);
    drop(jumps);
    for (m, (site, why, covers)) in modes.iter_mut().zip(all) {
        let back = match **m {
            SiteMode::Jump(_) => true,
            SiteMode::Ready(_) => covers,
            SiteMode::Trap(_) => false,
        };
        if back {
            **m = SiteMode::Trap(why);
            site.set_landing(0, 0);
        }
        if covers {
            site.set_resume_at(0);
        }
    }
}

/// Plans and writes again the jumps of sites taken back for a neighbour
/// (`addrs`, from [`take_back_covering_jumps`] and [`to_traps`]) or
/// refused for one in the same batch, now that the neighbours' bytes are
/// what they stay. One sweep, highest address first, writing the jumps
/// planned so far in one group before planning a site within a pun's
/// reach below one of them: each site is planned once every site above
/// it is as it stays, so that it is punned over its neighbour's jump
/// rather than over a breakpoint about to change. Jumps that writing
/// takes back (punned over a breakpoint that became a jump) get another
/// sweep. What is still blocked stays on its breakpoint. Sites detached
/// meanwhile, disarmed, with a trap-only consumer, or with a direct
/// jump's consumer are left alone. `WRITER` is held; each site's
/// breakpoint is in the code and synced.
pub(crate) fn reoptimize(mut addrs: Vec<usize>) {
    let maps = Snapshot::read();
    // Sites whose next site's stub moved for them (once each).
    let mut moved_for = HashSet::new();
    // Sites planned so far, and how often: a site that still finds no
    // pun target is sent back each time a jump after it is written, and
    // planned again at most `PLANS` times.
    let mut planned: HashMap<usize, usize> = HashMap::new();
    while !addrs.is_empty() {
        addrs.sort_unstable_by(|a, b| b.cmp(a));
        addrs.dedup();
        let mut taken = Vec::new();
        let mut group: Vec<(&Site, Jump)> = Vec::new();
        for &addr in &addrs {
            let Some(site) = site_at(addr) else { continue };
            let consumers = site.current_list();
            let wants_jump = site.armed.load(core::sync::atomic::Ordering::Relaxed)
                && !consumers.is_empty()
                && consumers
                    .iter()
                    .all(|c| !c.trap_only && c.blocked.is_none())
                && matches!(*site.mode(), SiteMode::Trap(_));
            let plans = planned.entry(addr).or_default();
            *plans += 1;
            if !wants_jump || *plans > PLANS {
                continue;
            }
            // The group's lowest site is its last.
            if group.last().is_some_and(|(s, _)| s.addr < addr + PUN_REACH) {
                taken.extend(write_jumps(core::mem::take(&mut group)));
            }
            let function = consumers.iter().find_map(|c| c.function);
            let mut prepared = jump::prepare(site, function, &maps, false, false, None);
            if matches!(prepared, Err(NotOptimized::NoPunTarget { .. }))
                && moved_for.insert(addr)
                && make_room_before(site, &maps, &mut taken)
            {
                prepared = jump::prepare(site, function, &maps, false, false, None);
            }
            match prepared {
                Ok(j) => group.push((site, j)),
                Err(why) => *site.mode() = SiteMode::Trap(why),
            }
        }
        taken.extend(write_jumps(group));
        addrs = taken;
    }
}

/// For `site`, whose pun found no room where its displacement ends in
/// the jump of a site after it (each whose stub could move, in turn): that
/// jump planned again with its stub where the bytes it writes give `site`
/// a window with room, and every jump punned over them too (as `E9Patch`
/// chooses a jump's target for the pun of the instruction before it). A
/// punned jump's stub moves within its window; a jump that replaces a
/// long instruction alone, and went straight to its trampoline, is
/// written whole through a stub placed anywhere it reaches. Whether it
/// moved; the sites taken back on the way go to `taken`. `WRITER` is
/// held.
fn make_room_before(site: &Site, maps: &Snapshot, taken: &mut Vec<usize>) -> bool {
    (1..JUMP_LEN)
        .filter_map(|k| site_at(site.addr + k))
        .any(|next| move_for(site, next, maps, taken))
}

/// [`make_room_before`] with the jump of `next`, if its stub could move.
fn move_for(site: &Site, next: &'static Site, maps: &Snapshot, taken: &mut Vec<usize>) -> bool {
    let next_start = match &*next.mode() {
        SiteMode::Jump(j) if j.stub_could_move() => j.start,
        _ => return false,
    };
    let consumers = next.current_list();
    if consumers.iter().any(|c| c.trap_only || c.blocked.is_some()) {
        return false;
    }
    // The bytes must give room to `site` and to every jump that already
    // ends in them (a chain of short instructions: `pop rbx; pop rbp;
    // pop r12`, the first two punned over the third's free byte), which
    // moving them takes back and plans again. Not where a jump ends in
    // those jumps' bytes in turn, or cannot be taken back.
    let punned_over = covering(&[next.addr]);
    if punned_over
        .iter()
        .any(|(c, at)| *at != next.addr || is_direct(c))
    {
        return false;
    }
    let mut tests = Vec::new();
    for addr in std::iter::once(site.addr).chain(punned_over.iter().map(|(c, _)| c.addr)) {
        let Some(test) = crate::patch::pun::room_before(addr, next.addr, next_start, maps) else {
            return false;
        };
        tests.push(test);
    }
    let room = |bytes: &[u8]| tests.iter().all(|test| test(bytes));
    let function = consumers.iter().find_map(|c| c.function);
    taken.extend(to_traps(
        &[next],
        &NotOptimized::OtherProbeInRange { at: site.addr },
    ));
    let moved = jump::prepare(next, function, maps, false, false, Some(&room));
    // Where no stub of the next site's window gives room, it goes back
    // to where it can.
    let (jump, moved) = match moved {
        Ok(j) => (Ok(j), true),
        Err(_) => (
            jump::prepare(next, function, maps, false, false, None),
            false,
        ),
    };
    match jump {
        Ok(j) => taken.extend(write_jumps(vec![(next, j)])),
        Err(why) => *next.mode() = SiteMode::Trap(why),
    }
    moved && next.is_jump()
}

/// Whether `site` runs through a jump that is never taken back (a
/// one-byte jump written with no breakpoint).
fn is_direct(site: &Site) -> bool {
    matches!(&*site.mode(), SiteMode::Ready(j) | SiteMode::Jump(j) if j.direct)
}

/// How many times one `reoptimize` plans a site at most.
const PLANS: usize = 3;

/// How far past a site a punned jump's bytes may reach: the jump, after
/// as many prefixes as the instruction has bytes.
const PUN_REACH: usize = 2 * JUMP_LEN;
