//! Which way each site runs: the jumps of sites just attached written
//! (`crate::patch::jump`), and sites taken back to their breakpoints (a
//! trap-only probe joined, another probe landed inside a jump's range, a
//! detach). The attach lock is held.

use crate::arch::JUMP_LEN;
use crate::arch::MAX_INSN_LEN;
use crate::base::mode::NotOptimized;
use crate::patch::jump;
use crate::process::maps::Mapping;
use crate::site::jump::Jump;
use crate::site::{Site, SiteMode};
use crate::table::site_at;

/// Writes the jumps of the sites just made that are ready for one (each
/// site's mode then says how it runs); `to_trap` (optimized sites a
/// trap-only probe joined) go back to their breakpoints. `WRITER` is
/// held; every new site's breakpoint is in the code and synced.
pub(crate) fn choose_modes(made: &[usize], to_trap: &[usize]) {
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
    let back: Vec<&Site> = to_trap.iter().filter_map(|&a| site_at(a)).collect();
    to_traps(&back, &NotOptimized::TrapOnly);
}

/// A site attached inside the range of another site's jump (ready or
/// written): that site goes back to its breakpoint for good, and sends
/// its trap hits through the emulation again (its relocated copy would
/// skip the new breakpoint). `WRITER` is held.
pub(crate) fn take_back_covering_jump(addr: usize) {
    // A range starts at its site or after the site's landing pad (4
    // bytes), and ends before the end of the last instruction that the
    // jump's bytes reach into.
    let reach = 4 + JUMP_LEN + MAX_INSN_LEN;
    for k in 1..reach {
        let Some(site) = addr.checked_sub(k).and_then(site_at) else {
            continue;
        };
        let covers = match &*site.mode() {
            SiteMode::Ready(j) | SiteMode::Jump(j) => j.covers(addr),
            SiteMode::Trap(_) => false,
        };
        if covers {
            to_traps(&[site], &NotOptimized::OtherProbeInRange { at: addr });
            let mut mode = site.mode();
            if matches!(*mode, SiteMode::Ready(_)) {
                *mode = SiteMode::Trap(NotOptimized::OtherProbeInRange { at: addr });
            }
            site.set_resume_at(0);
        }
    }
}

/// Off jumps and back to breakpoints, with `why` as the new mode.
/// `WRITER` is held.
pub(crate) fn to_traps(sites: &[&Site], why: &NotOptimized) {
    let mut modes: Vec<_> = sites.iter().map(|s| s.mode()).collect();
    let jumps: Vec<(&Jump, Mapping)> = modes
        .iter()
        .zip(sites)
        .filter_map(|(m, s)| match &**m {
            SiteMode::Jump(j) => Some((j, s.map)),
            _ => None,
        })
        .collect();
    jump::unoptimize(&jumps);
    drop(jumps);
    for (m, site) in modes.iter_mut().zip(sites) {
        if matches!(**m, SiteMode::Jump(_)) {
            **m = SiteMode::Trap(why.clone());
            site.set_landing(0, 0);
        }
    }
}
