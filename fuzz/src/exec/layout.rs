//! The pages both runs see, and what is placed on them: the original
//! code and its ends, the moved code, the pages RIP-relative operands
//! address, a data area and a stack ([`Layout`]); mapped into this
//! process for a comparison ([`map`]), which the children inherit.

use core::ptr;

use super::{DATA, DATA_PAGES, ENDS, MAX_PAGES, PAGE, STACK, STACK_PAGES, Skip};

/// The pages both runs see, and what is written on them.
#[derive(Debug, Default)]
pub struct Layout {
    /// Page addresses, executable (code) or not (data, stack).
    pages: Vec<(u64, bool)>,
    /// Byte ranges written, to refuse overlaps.
    written: Vec<(u64, u64)>,
    /// `(address, bytes)` to write.
    writes: Vec<(u64, Vec<u8>)>,
    /// The ends (stubs) placed, by address.
    ends: Vec<u64>,
    /// The pattern data pages are filled with.
    seed: u64,
}

impl Layout {
    /// A layout with the data area and the stack, filled from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        let mut l = Self {
            seed,
            ..Self::default()
        };
        for p in 0..DATA_PAGES {
            l.pages.push((DATA + p * PAGE, false));
        }
        for p in 0..STACK_PAGES {
            l.pages.push((STACK + p * PAGE, false));
        }
        l
    }

    fn page(&mut self, addr: u64, exec: bool) {
        let page = addr & !(PAGE - 1);
        match self.pages.iter_mut().find(|(p, _)| *p == page) {
            // A page with code on it is executable, whatever else is there.
            Some((_, x)) => *x |= exec,
            None => self.pages.push((page, exec)),
        }
    }

    /// Places `bytes` at `addr` (on executable pages).
    ///
    /// # Errors
    /// If they overlap what is already placed.
    pub fn code(&mut self, addr: u64, bytes: &[u8]) -> Result<(), Skip> {
        let end = addr.checked_add(bytes.len() as u64).ok_or(Skip::Layout)?;
        if self.written.iter().any(|&(a, e)| addr < e && a < end) {
            return Err(Skip::Layout);
        }
        let mut p = addr & !(PAGE - 1);
        while p < end {
            self.page(p, true);
            p += PAGE;
        }
        self.written.push((addr, end));
        self.writes.push((addr, bytes.to_vec()));
        Ok(())
    }

    /// Places an end (a stub) at `addr`, once per address.
    ///
    /// # Errors
    /// If it overlaps code, or there are too many ends.
    pub fn end(&mut self, addr: u64) -> Result<(), Skip> {
        if self.ends.contains(&addr) {
            return Ok(());
        }
        if self.ends.len() == ENDS {
            return Err(Skip::Unrunnable);
        }
        let routine = routines()[self.ends.len()];
        let mut stub = vec![0xff, 0x25, 0, 0, 0, 0];
        stub.extend_from_slice(&routine.to_le_bytes());
        self.code(addr, &stub)?;
        self.ends.push(addr);
        Ok(())
    }

    /// Makes sure the page of `addr` is there (a RIP-relative operand's).
    pub fn touch(&mut self, addr: u64, len: u64) {
        let mut p = addr & !(PAGE - 1);
        while p < addr.saturating_add(len) {
            self.page(p, false);
            p += PAGE;
        }
    }
}

impl Layout {
    /// The pages, in order.
    pub(super) fn pages(&self) -> Vec<u64> {
        self.pages.iter().map(|p| p.0).collect()
    }

    /// The end placed `n`th.
    pub(super) fn end_at(&self, n: usize) -> u64 {
        self.ends[n]
    }
}

/// A layout mapped into this process (children inherit it); unmapped
/// when dropped.
pub(super) struct Mapped(Vec<u64>);

impl Drop for Mapped {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: pages this process mapped for the run.
            unsafe { libc::munmap(p as *mut libc::c_void, PAGE as usize) };
        }
    }
}

pub(super) fn map(layout: &Layout) -> Result<Mapped, Skip> {
    if layout.pages.len() > MAX_PAGES {
        return Err(Skip::Layout);
    }
    let mut mapped = Mapped(Vec::new());
    let mut fill = layout.seed | 1;
    for &(page, exec) in &layout.pages {
        let prot = libc::PROT_READ | libc::PROT_WRITE | if exec { libc::PROT_EXEC } else { 0 };
        // SAFETY: a fixed mapping that replaces nothing (refused where
        // anything is mapped).
        let p = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                PAGE as usize,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Skip::Layout);
        }
        if p as u64 != page {
            // SAFETY: what mmap just returned (an old kernel's hint).
            unsafe { libc::munmap(p, PAGE as usize) };
            return Err(Skip::Layout);
        }
        mapped.0.push(page);
        // Data pages hold a pattern; code pages int3 around the code.
        // SAFETY: the page just mapped, writable.
        let bytes = unsafe { core::slice::from_raw_parts_mut(page as *mut u8, PAGE as usize) };
        if exec {
            bytes.fill(0xcc);
        } else {
            for chunk in bytes.chunks_exact_mut(8) {
                fill ^= fill << 13;
                fill ^= fill >> 7;
                fill ^= fill << 17;
                chunk.copy_from_slice(&fill.to_le_bytes());
            }
        }
    }
    for (addr, bytes) in &layout.writes {
        // SAFETY: inside pages mapped above (`Layout::code` listed them).
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), *addr as *mut u8, bytes.len()) };
    }
    Ok(mapped)
}

unsafe extern "C" {
    // The end routines (`super::child`), one per end: a stub jumps to
    // the routine of its end.
    fn kscale_exec_end0();
    fn kscale_exec_end1();
    fn kscale_exec_end2();
    fn kscale_exec_end3();
}

fn routines() -> [u64; ENDS] {
    [
        kscale_exec_end0 as *const () as u64,
        kscale_exec_end1 as *const () as u64,
        kscale_exec_end2 as *const () as u64,
        kscale_exec_end3 as *const () as u64,
    ]
}
