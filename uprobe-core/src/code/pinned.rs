//! Code at addresses the probed code chooses. A punned jump (x86-64,
//! `crate::base::mode::Tactic::Pun`) can only land inside a window that the
//! bytes after the probed instruction choose (1 to 16 Mi addresses,
//! anywhere within +-2 GB): a short stub placed there jumps on to the
//! probe's trampoline.
//!
//! Stubs share pages: a page is mapped (`MAP_FIXED_NOREPLACE`: never
//! over anything, and never where the main stack or the `brk` heap keep
//! room to grow) the first time a stub lands on it, and later stubs take
//! the bytes still free there. The heap's room is smaller here
//! ([`HEAP_ROOM`]) than for trampoline regions (which can go anywhere
//! within reach): a window is fixed, and a program's own code lies just
//! below its heap, so a pun with a positive displacement often lands in
//! the first GiB above it. A heap that grows past a stub goes on in
//! memory `malloc` maps elsewhere (glibc does so whenever `brk` fails). A stub is written once and never changed
//! or freed, like every other piece of generated code: a thread may be
//! inside one at any time, however long ago its probe was detached (the
//! caller reuses a stub for the same site and bytes, so reattaching costs
//! nothing new). Memory: one page per stub at worst (a 1-byte instruction
//! fixes the exact address), a few bytes per stub where windows overlap.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{map_fixed, write_code};

/// The lowest address a page may be mapped at (the kernel's default
/// `vm.mmap_min_addr`).
const LOWEST: usize = 0x10000;
/// The end of the user address space with 4-level page tables (the
/// kernel maps nothing above it for a hint-less process).
const USER_END: usize = (1 << 47) - 4096;
/// Address space kept free above the `brk` heap for it to grow into.
/// Small: a non-PIE program's code lies just below its heap, and the
/// windows of its punned jumps (python3's USDT sites among them) often
/// land a few hundred MiB above it.
pub(crate) const HEAP_ROOM: usize = 64 << 20;
/// The most new pages one placement tries to map.
const MAP_TRIES: usize = 64;
/// Addresses of a window that [`place`]'s `accept` may refuse before the
/// window is given up (each look may ask the kernel about pages).
const REFUSALS: usize = 64;

/// Pages mapped so far: base -> which of its bytes are taken (one bit a
/// byte).
static PAGES: Mutex<BTreeMap<usize, Vec<u64>>> = Mutex::new(BTreeMap::new());
/// How many pages are mapped (for the memory report).
static MAPPED: AtomicUsize = AtomicUsize::new(0);

/// The pages of ours, locked.
fn lock() -> std::sync::MutexGuard<'static, BTreeMap<usize, Vec<u64>>> {
    PAGES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The part of `[lo, lo + size)` where a stub may go (above the lowest
/// address mapped, below the end of user space), if any.
fn window(lo: usize, size: usize) -> Option<(usize, usize)> {
    let lo_ok = lo.max(LOWEST);
    let hi = lo.saturating_add(size).min(USER_END);
    (lo_ok < hi).then_some((lo_ok, hi))
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Bytes of address space (and at most of memory) that stubs take.
/// Async-signal-safe: one load.
pub(crate) fn mapped_bytes() -> usize {
    MAPPED.load(Ordering::Relaxed) * page_size()
}

/// Places a stub at an address in `[lo, lo + size)`: `build(at)` makes
/// its code for address `at`. `free(start, end)` says whether nothing
/// is mapped in a range, nor may be (the stack's room and [`HEAP_ROOM`]),
/// or else where what takes it ends (`crate::process::maps::Snapshot::free`).
/// Only addresses `accept` takes are tried (a stub whose address is what
/// a neighbour's pun ends in: `crate::attach::modes`). Returns where it
/// was written, or `None` if no address of the window can hold it. Not
/// async-signal-safe.
pub(crate) fn place(
    lo: usize,
    size: usize,
    free: &dyn Fn(usize, usize) -> Result<(), usize>,
    build: impl Fn(usize) -> Vec<u8>,
    accept: &dyn Fn(usize) -> bool,
) -> Option<usize> {
    let page = page_size();
    let (lo_ok, hi) = window(lo, size)?;
    // `accept` may look at the pages itself (`could_place`): it runs with
    // the lock released (the caller holds the attach lock, so no one else
    // places a stub meanwhile); after `REFUSALS` refusals the window is
    // given up.
    let refused = core::cell::Cell::new(0);
    let accept = |at: usize| {
        let ok = refused.get() < REFUSALS && accept(at);
        refused.set(refused.get() + usize::from(!ok));
        ok
    };
    let given_up = || refused.get() >= REFUSALS;
    let mut pages = lock();
    // Pages of ours first: no new memory. A window of one address has one
    // place to try; a wider one, on each page, the first byte past the
    // page's last stub (stubs are never freed: a page fills up from its
    // start, but for stubs at exact addresses).
    let ours: Vec<(usize, usize)> = pages
        .range((lo_ok & !(page - 1))..hi)
        .map(|(&p, bits)| (p, top(bits)))
        .collect();
    for (p, top) in ours {
        let from = if size == 1 { lo_ok } else { lo_ok.max(p + top) };
        drop(pages);
        let found = (from..hi.min(p + page)).find(|&at| accept(at));
        pages = lock();
        let Some(at) = found else {
            if given_up() {
                return None;
            }
            continue;
        };
        if !fits(&pages, page, at, 1) {
            continue;
        }
        let code = build(at);
        if fits(&pages, page, at, code.len()) {
            return write(&mut pages, page, at, &code);
        }
    }
    // Then a new page: the first one in the window that nothing takes.
    let mut tries = 0;
    let mut p = lo_ok & !(page - 1);
    while p < hi && tries < MAP_TRIES {
        if pages.contains_key(&p) {
            p += page;
            continue;
        }
        if let Err(taken_to) = free(p, p + page) {
            // Past what takes the page, in one step.
            p = (p + page).max(taken_to.next_multiple_of(page));
            continue;
        }
        drop(pages);
        let found = (lo_ok.max(p)..hi.min(p + page)).find(|&at| accept(at));
        pages = lock();
        let Some(at) = found else {
            if given_up() {
                return None;
            }
            p += page;
            continue;
        };
        let code = build(at);
        let end = at + code.len();
        // The stub may run into the next page: ours with room, or free.
        let next = p + page;
        if end > next && !pages.contains_key(&next) && free(next, next + page).is_err() {
            p += page;
            continue;
        }
        tries += 1;
        if !map_fixed(p, page) {
            p += page;
            continue;
        }
        pages.insert(p, vec![0; page / 64]);
        MAPPED.fetch_add(1, Ordering::Relaxed);
        if end > next && !pages.contains_key(&next) {
            if !map_fixed(next, page) {
                // The first page stays ours, empty, for later stubs.
                p += page;
                continue;
            }
            pages.insert(next, vec![0; page / 64]);
            MAPPED.fetch_add(1, Ordering::Relaxed);
        }
        if fits(&pages, page, at, code.len()) {
            return write(&mut pages, page, at, &code);
        }
        p += page;
    }
    drop(pages);
    place_in_gap(lo_ok, hi, &build, &accept, &given_up)
}

/// Last, for [`place`]: a gap of `[lo_ok, hi)` below a page's last stub
/// (left by stubs at exact addresses): only where nothing else fits, as
/// the first gap would often be the one exact address a later window
/// needs.
fn place_in_gap(
    lo_ok: usize,
    hi: usize,
    build: &impl Fn(usize) -> Vec<u8>,
    accept: &dyn Fn(usize) -> bool,
    given_up: &dyn Fn() -> bool,
) -> Option<usize> {
    let page = page_size();
    let mut pages = lock();
    let ours: Vec<usize> = pages
        .range((lo_ok & !(page - 1))..hi)
        .map(|(&p, _)| p)
        .collect();
    for p in ours {
        for at in lo_ok.max(p)..hi.min(p + page) {
            // Every stub is at least a jump long.
            if !fits(&pages, page, at, crate::arch::JUMP_LEN) {
                continue;
            }
            drop(pages);
            let accepted = accept(at);
            pages = lock();
            if !accepted {
                if given_up() {
                    return None;
                }
                continue;
            }
            let code = build(at);
            if fits(&pages, page, at, code.len()) {
                return write(&mut pages, page, at, &code);
            }
        }
    }
    None
}

/// Whether [`place`] could put a stub (of the shortest kind, a jump) in
/// `[lo, lo + size)`, without placing it: room on a page of ours, or a
/// page nothing takes (`free`, as for `place`). Not async-signal-safe.
pub(crate) fn could_place(
    lo: usize,
    size: usize,
    free: &dyn Fn(usize, usize) -> Result<(), usize>,
) -> bool {
    let page = page_size();
    let Some((lo_ok, hi)) = window(lo, size) else {
        return false;
    };
    let pages = lock();
    let len = crate::arch::JUMP_LEN;
    let mut p = lo_ok & !(page - 1);
    // The first few pages of the window: a look, not a search.
    for _ in 0..4 {
        if p >= hi {
            return false;
        }
        let room = if pages.contains_key(&p) {
            (lo_ok.max(p)..hi.min(p + page)).any(|at| fits(&pages, page, at, len))
        } else {
            free(p, p + page).is_ok()
        };
        if room {
            return true;
        }
        p += page;
    }
    false
}

/// The offset past the last byte a stub takes on a page (0: empty).
fn top(bits: &[u64]) -> usize {
    bits.iter()
        .rposition(|&w| w != 0)
        .map_or(0, |k| k * 64 + 64 - bits[k].leading_zeros() as usize)
}

/// Whether `[at, at + len)` lies in pages of ours, on bytes no stub
/// takes.
fn fits(pages: &BTreeMap<usize, Vec<u64>>, page: usize, at: usize, len: usize) -> bool {
    (at..at + len).all(|a| {
        let base = a & !(page - 1);
        pages
            .get(&base)
            .is_some_and(|bits| bits[(a - base) / 64] & (1 << ((a - base) % 64)) == 0)
    })
}

/// Writes `code` at `at` (pages of ours, bytes free) and marks its bytes
/// taken.
fn write(
    pages: &mut BTreeMap<usize, Vec<u64>>,
    page: usize,
    at: usize,
    code: &[u8],
) -> Option<usize> {
    // One write per page the stub touches (each keeps its page
    // executable while other stubs there may run).
    let mut done = 0;
    while done < code.len() {
        let a = at + done;
        let base = a & !(page - 1);
        let n = (base + page - a).min(code.len() - done);
        write_code(a, &code[done..done + n]).ok()?;
        done += n;
    }
    for a in at..at + code.len() {
        let base = a & !(page - 1);
        let bits = pages.get_mut(&base).expect("checked by fits");
        bits[(a - base) / 64] |= 1 << ((a - base) % 64);
    }
    Some(at)
}
