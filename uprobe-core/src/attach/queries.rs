//! What a `Probe` asks about its site: whether it is armed, how it runs,
//! the hits it missed, and the code as it was before any patch.

use std::sync::atomic::Ordering;

use super::writer::writer;
use crate::base::mode::{Mode, NotOptimized};
use crate::patch::original::code_as_original;
use crate::site::SiteMode;
use crate::table::lookup::with_read_side;
use crate::table::site_at;

/// Whether a breakpoint of the engine is in the code at `addr` (false if
/// nothing is attached there, or every site was disarmed because the
/// program replaced the SIGTRAP handler).
pub(crate) fn armed(addr: usize) -> bool {
    let _w = writer();
    site_at(addr).is_some_and(|s| s.armed.load(Ordering::Relaxed))
}

/// The code at `[addr, addr + len)` as it was before the engine patched
/// it (`crate::patch::original`), taking the writer lock. Not async-signal-safe.
pub(crate) fn original_code(addr: usize, len: usize) -> Vec<u8> {
    let _w = writer();
    code_as_original(addr, len)
}

/// Whether `addr` lies in a landing pad the engine wrote into alignment
/// padding (`crate::patch::pun`): not the program's code, so no probe
/// may go there. Takes the writer lock. Not async-signal-safe.
pub(crate) fn in_landing_pad(addr: usize) -> bool {
    let _w = writer();
    crate::patch::pun::in_landing_pad(addr)
}

/// How the site at `addr` runs (`None` if nothing is attached there).
pub(crate) fn mode(addr: usize) -> Option<Mode> {
    let _w = writer();
    site_at(addr).map(|s| match &*s.mode() {
        SiteMode::Trap(why) => Mode::Trap(why.clone()),
        SiteMode::Ready(_) => Mode::Trap(NotOptimized::CodeChanged),
        SiteMode::Jump(j) => Mode::Jump(j.tactic),
    })
}

/// Which routine the trampoline of the jump at `addr` calls (`None`: not
/// a jump, or no routines of the architecture's own). For tests.
#[cfg(feature = "test-hooks")]
pub(crate) fn route(addr: usize) -> Option<crate::site::jump::Route> {
    let _w = writer();
    site_at(addr).and_then(|s| match &*s.mode() {
        SiteMode::Jump(j) => crate::site::jump::route_of(j.trampoline.cell),
        SiteMode::Trap(_) | SiteMode::Ready(_) => None,
    })
}

/// Hits that ran no handler at `addr` (0 if nothing is attached there).
pub(crate) fn missed(addr: usize) -> u64 {
    with_read_side(|| site_at(addr).map_or(0, |s| s.missed.sum()))
}
