//! The view of original code: what the bytes of a range were before the
//! engine patched them, each breakpoint and jump of a site replaced by
//! the bytes it covers. Analysis and planning always look at this view,
//! never at the patched code; a punned jump's fixed bytes alone are
//! taken from the code as it stays ([`code_as_it_stays`]).

use crate::arch::{BREAKPOINT, MAX_INSN_LEN};
use crate::site::SiteMode;
use crate::table::find;

/// The code at `[addr, addr + len)` (inside executable mappings) as it
/// was before the engine patched it: each breakpoint and jump of a site
/// replaced by the bytes it covers. `WRITER` is held.
pub(crate) fn code_as_original(addr: usize, len: usize) -> Vec<u8> {
    // SAFETY: the caller's contract.
    let mut code = unsafe { core::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // A jump's range starts at most a landing pad and an instruction
    // before the bytes it covers.
    let reach = MAX_INSN_LEN + 4;
    for at in addr.saturating_sub(reach)..addr + len {
        let Some((_, site)) = find(at) else {
            continue;
        };
        // The breakpoint's bytes (those inside the window) back to the
        // instruction's.
        let n = code.len();
        let inside = |k: usize| (at + k).checked_sub(addr).filter(|&i| i < n);
        let ours =
            (0..BREAKPOINT.len()).all(|k| inside(k).is_none_or(|i| code[i] == BREAKPOINT[k]));
        if ours {
            for k in 0..BREAKPOINT.len() {
                if let Some(i) = inside(k) {
                    code[i] = site.original[k];
                }
            }
        }
        if let SiteMode::Jump(j) = &*site.mode() {
            let (start, bytes) = j.original();
            for (k, &o) in bytes.iter().enumerate() {
                if let Some(c) = (start + k)
                    .checked_sub(addr)
                    .and_then(|at| code.get_mut(at))
                {
                    *c = o;
                }
            }
        }
    }
    code
}

/// The code at `[addr, addr + len)` (inside executable mappings) as it
/// stays while the sites there stay as they are: written jumps as they
/// are, and every other armed site's first bytes its breakpoint (written
/// already, or about to be in this batch). What a punned jump's
/// displacement may take as its fixed bytes (`crate::patch::pun`).
/// `WRITER` is held.
pub(crate) fn code_as_it_stays(addr: usize, len: usize) -> Vec<u8> {
    // SAFETY: the caller's contract.
    let mut code = unsafe { core::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    for (i, at) in (addr..addr + len).enumerate() {
        let Some((_, site)) = find(at) else {
            continue;
        };
        let breakpoint = site.armed.load(core::sync::atomic::Ordering::Relaxed)
            && !matches!(&*site.mode(), SiteMode::Jump(_));
        if breakpoint {
            for (k, &b) in BREAKPOINT.iter().enumerate() {
                if let Some(c) = code.get_mut(i + k) {
                    *c = b;
                }
            }
        }
    }
    code
}

/// The code at `[addr, addr + len)` as a punned jump over the instruction
/// of `own` bytes at `addr` sees it: that instruction as it was (what
/// the jump replaces: the site's own breakpoint is no part of it, and
/// whether it falls through decides whether the padding after it may be
/// written too), the rest as it stays ([`code_as_it_stays`]). `WRITER`
/// is held. Not async-signal-safe.
pub(crate) fn code_for_pun(addr: usize, own: usize, len: usize) -> Vec<u8> {
    let mut code = code_as_it_stays(addr, len);
    let own = own.min(len);
    code[..own].copy_from_slice(&code_as_original(addr, own));
    code
}
