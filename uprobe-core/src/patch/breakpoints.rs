//! Writing the engine's breakpoints into the code and taking them out:
//! a batch goes in page by page with one instruction-stream sync
//! (`crate::process::maps::write_patches`); taking one out restores the
//! instruction's own bytes where our breakpoint is still there.

use std::sync::atomic::Ordering;

use crate::AttachError;
use crate::arch::{BREAKPOINT, is_breakpoint_at};
use crate::process::maps::{Mapping, Patch, Snapshot, write_patches};
use crate::site::Site;

/// Writes a breakpoint at each `(mapping, address)`: an instruction's
/// first byte inside that mapping. On failure, the writes (their indexes)
/// that did not happen, with why.
///
/// # Safety
/// Each address starts an instruction, inside the mapping given.
pub(crate) unsafe fn write(at: &[(Mapping, usize)]) -> Result<(), Vec<(usize, AttachError)>> {
    let patches: Vec<Patch<'_>> = at
        .iter()
        .map(|&(map, addr)| Patch {
            map,
            addr,
            bytes: &BREAKPOINT,
        })
        .collect();
    // SAFETY: the caller's contract.
    unsafe { write_patches(&patches) }
}

/// Restores the original bytes of each armed site whose breakpoint is
/// still there (code that was unmapped since, `dlclose`, or replaced by
/// other code has nothing to restore) and marks them disarmed. Returns
/// the sites (their indexes in the iteration) whose bytes could not be
/// restored, still armed. `WRITER` is held.
pub(crate) fn disarm<'s>(
    sites: impl Iterator<Item = &'s Site>,
    maps: &Snapshot,
) -> Vec<(usize, AttachError)> {
    let mut armed = Vec::new();
    let mut patches = Vec::new();
    for (i, site) in sites.enumerate() {
        // A site running through a jump needs no signal: it stays.
        if !site.armed.load(Ordering::Relaxed) || site.is_jump() {
            continue;
        }
        let still_ours = maps.code_mapping_of(site.addr).is_some()
            // SAFETY: `site.addr` is in an executable mapping.
            && unsafe { is_breakpoint_at(site.addr) };
        if still_ours {
            patches.push(Patch {
                map: site.map,
                addr: site.addr,
                bytes: &site.original,
            });
        }
        armed.push((i, site, still_ours.then(|| patches.len() - 1)));
    }
    // SAFETY: each patch restores an instruction's own bytes over our
    // breakpoint.
    let failed = unsafe { write_patches(&patches) }.err().unwrap_or_default();
    let mut not_restored = Vec::new();
    for (i, site, patch) in armed {
        match failed.iter().find(|(k, _)| Some(*k) == patch) {
            Some((_, e)) => not_restored.push((i, e.clone())),
            None => site.armed.store(false, Ordering::Relaxed),
        }
    }
    not_restored
}
