//! The return trampoline's stubs: one per call site, in a region mapped
//! once, with DWARF unwind information registered for it. The
//! architecture-independent part; each arch's `trampoline` module
//! provides the common trampoline (assembly), the stub encoding and the
//! DWARF register numbers.
//!
//! A hijacked return address points at a **stub**, one per distinct
//! original return address (call site), that enters the common
//! trampoline. The common trampoline saves the registers a function
//! returns in (and every other caller-saved one, and the flags), calls
//! `crate::hit::returns::on_return`, restores them, and returns to the
//! original return address: on x86-64 through the stub, whose `jmp`
//! after its `call` reads it from [`TARGETS`] (the region is mapped
//! within `rel32` reach of that table), on aarch64 directly (written
//! where the trampoline returns through). So the thread is back in its
//! caller with exactly the registers the function returned with.
//!
//! **Why a stub per call site.** The stub's index names the original
//! return address in [`TARGETS`], so returning never depends on per-thread
//! bookkeeping (an instance dropped by a `longjmp` cleanup, a full return
//! stack: the thread still returns to the right place), and the unwinder
//! can find the original return address too: the stubs have one DWARF
//! frame description, registered with `__register_frame`, whose return
//! address rule reads `TARGETS[(pc - first stub) / stub size]`. A Rust
//! panic or a C++ exception raised below a hijacked frame therefore
//! unwinds through it to the real caller, and so do backtraces. (The
//! instance left behind is cleaned up by the stack-pointer comparison, as
//! after `longjmp`.)
//!
//! Stubs are never freed: a call site keeps its stub for the life of the
//! process, and a thread that returns through it at any time later finds
//! the same target.

use core::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::AttachError;
use crate::arch::trampoline::{CIE_INSTRUCTIONS, CODE_ALIGN, FIRST_STUB, RA_COLUMN, SP_COLUMN};
use crate::arch::trampoline::{STUB_SIZE, STUBS_NEAR_TARGETS, write_region};
use crate::base::error::os_error;

pub(crate) use crate::base::abi::{MAX_STUBS, STUB_HASH, STUB_TARGETS as TARGETS};
/// The stub region: the arch's entry pad, then the stubs.
const REGION_SIZE: usize = FIRST_STUB + STUB_SIZE * MAX_STUBS;

/// The first stub's address, once the region is mapped (0 before): what
/// the x86-64 timing routines index stubs from.
pub(crate) static FIRST_STUB_AT: AtomicUsize = AtomicUsize::new(0);

/// The mapped stub region's base address.
static REGION: OnceLock<Result<usize, AttachError>> = OnceLock::new();

unsafe extern "C" {
    /// libgcc's (and LLVM libunwind's) registration of runtime-generated
    /// unwind information: `begin` points at `.eh_frame`-format data
    /// (a CIE, an FDE, a zero terminator) that must stay alive.
    fn __register_frame(begin: *const u8);
}

/// Maps the stub region, its stubs calling the return trampoline at
/// `trampoline`, and registers its unwind information, once. Not
/// async-signal-safe.
pub(crate) fn init(trampoline: usize) -> Result<(), AttachError> {
    REGION
        .get_or_init(|| map_region(trampoline))
        .clone()
        .map(|_| ())
}

fn map_region(trampoline: usize) -> Result<usize, AttachError> {
    let targets = TARGETS.as_ptr() as usize;
    let base = if STUBS_NEAR_TARGETS {
        super::map_near(targets, REGION_SIZE.next_power_of_two())?
    } else {
        super::map_anywhere(REGION_SIZE, "mmap(return trampoline stubs)")?
    };
    // SAFETY: our fresh mapping, no thread runs it yet.
    if unsafe {
        libc::mprotect(
            base as *mut _,
            REGION_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    } != 0
    {
        return Err(os_error("mprotect(return trampoline stubs)"));
    }
    // SAFETY: the region is ours, writable, REGION_SIZE bytes.
    let bytes = unsafe { core::slice::from_raw_parts_mut(base as *mut u8, REGION_SIZE) };
    write_region(bytes, base, MAX_STUBS, trampoline, targets);
    // SAFETY: our mapping; from now on it is only executed and read.
    if unsafe {
        libc::mprotect(
            base as *mut _,
            REGION_SIZE,
            libc::PROT_READ | libc::PROT_EXEC,
        )
    } != 0
    {
        return Err(os_error("mprotect(return trampoline stubs)"));
    }
    crate::arch::flush_code(base, REGION_SIZE);
    FIRST_STUB_AT.store(base + FIRST_STUB, Ordering::Release);
    let eh_frame = Box::leak(unwind_info(base).into_boxed_slice());
    // SAFETY: well-formed `.eh_frame` data (see `unwind_info`), leaked so
    // it stays alive as long as the unwinder may read it.
    unsafe { __register_frame(eh_frame.as_ptr()) };
    Ok(base)
}

/// `.eh_frame` data for the stub region: one CIE, one FDE covering the
/// region, a terminator. In every stub, CFA = sp + 8, the caller's sp is
/// the stub's own (CFA - 8), and the return address is
/// `TARGETS[(pc - first stub) / STUB_SIZE]`, read by a DWARF expression
/// (the stub's "caller" is the original caller; no register is saved).
/// `pc` is the return address register's value in the stub's frame: the
/// stub's address, or an address inside it.
///
/// **Why not CFA = sp.** The stub frame has no size of its own, but an
/// unwinder tells frames apart by their CFA: libgcc's second phase finds
/// the frame that catches by comparing each frame's CFA with the one the
/// first phase recorded. With CFA = sp the stub and its caller would have
/// the same identity, so when the caller itself catches (a
/// `catch_unwind` inlined into the caller, as release builds do) the
/// stub frame is taken for the handler, it has no personality, and
/// libgcc aborts. A CFA 8 bytes above and an explicit rule for the sp
/// keep the two apart while the caller still resumes with the sp it had
/// after the call.
fn unwind_info(base: usize) -> Vec<u8> {
    const DW_CFA_DEF_CFA: u8 = 0x0c;
    const DW_CFA_VAL_OFFSET: u8 = 0x14;
    const DW_CFA_VAL_EXPRESSION: u8 = 0x16;
    const DW_OP_BREG0: u8 = 0x70;
    const DW_OP_CONST8U: u8 = 0x0e;
    const DW_OP_CONST1U: u8 = 0x08;
    const DW_OP_MINUS: u8 = 0x1c;
    const DW_OP_DIV: u8 = 0x1b;
    const DW_OP_LIT3: u8 = 0x33;
    const DW_OP_SHL: u8 = 0x24;
    const DW_OP_PLUS: u8 = 0x22;
    const DW_OP_DEREF: u8 = 0x06;

    let mut out = Vec::new();
    // CIE: version 1, augmentation "zR", code alignment, data alignment
    // -8, the return address column, absolute pointers.
    let mut cie = vec![
        0, 0, 0, 0, 1, b'z', b'R', 0, CODE_ALIGN, 0x78, RA_COLUMN, 1, 0x00,
    ];
    cie.extend_from_slice(CIE_INSTRUCTIONS);
    push_record(&mut out, &cie);

    let first = (base + FIRST_STUB) as u64;
    let targets = TARGETS.as_ptr() as u64;
    let mut expr = vec![DW_OP_BREG0 + RA_COLUMN, 0, DW_OP_CONST8U];
    expr.extend_from_slice(&first.to_le_bytes());
    expr.extend_from_slice(&[DW_OP_MINUS, DW_OP_CONST1U, STUB_SIZE as u8, DW_OP_DIV]);
    expr.extend_from_slice(&[DW_OP_LIT3, DW_OP_SHL, DW_OP_CONST8U]);
    expr.extend_from_slice(&targets.to_le_bytes());
    expr.extend_from_slice(&[DW_OP_PLUS, DW_OP_DEREF]);

    // FDE: CIE pointer (filled below), pc begin, pc range, no
    // augmentation data, then the rules.
    let fde_start = out.len();
    let mut fde = vec![0, 0, 0, 0];
    fde.extend_from_slice(&(base as u64).to_le_bytes());
    fde.extend_from_slice(&(REGION_SIZE as u64).to_le_bytes());
    fde.push(0);
    // CFA = sp + 8; the caller's sp = CFA + 1 * (data alignment -8).
    fde.extend_from_slice(&[DW_CFA_DEF_CFA, SP_COLUMN, 8]);
    fde.extend_from_slice(&[DW_CFA_VAL_OFFSET, SP_COLUMN, 1]);
    fde.extend_from_slice(&[DW_CFA_VAL_EXPRESSION, RA_COLUMN, expr.len() as u8]);
    fde.extend_from_slice(&expr);
    push_record(&mut out, &fde);
    // The CIE pointer: bytes from the FDE's CIE-pointer field back to the
    // CIE's start (offset 0).
    let field = fde_start + 4;
    out[field..field + 4].copy_from_slice(&(field as u32).to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out
}

/// Appends a CIE or FDE: a 4-byte length, `body` padded with `DW_CFA_nop`
/// to a multiple of 8 bytes overall.
fn push_record(out: &mut Vec<u8>, body: &[u8]) {
    let padded = (body.len() + 4).next_multiple_of(8) - 4;
    out.extend_from_slice(&(padded as u32).to_le_bytes());
    out.extend_from_slice(body);
    out.resize(out.len() + padded - body.len(), 0);
}

/// The stub that returns to `ret`: the existing one, or a new one. `None`
/// if every stub is taken by other call sites (or the region could not be
/// mapped). Lock-free, no allocation: async-signal-safe.
pub(crate) fn stub_for(ret: usize) -> Option<usize> {
    let base = *REGION.get()?.as_ref().ok()?;
    let start = (ret.wrapping_mul(STUB_HASH) >> 40) % MAX_STUBS;
    for i in 0..MAX_STUBS {
        let k = (start + i) % MAX_STUBS;
        let t = TARGETS[k].load(Ordering::Acquire);
        let found = t == ret
            || (t == 0
                && match TARGETS[k].compare_exchange(0, ret, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => true,
                    Err(now) => now == ret,
                });
        if found {
            return Some(base + FIRST_STUB + STUB_SIZE * k);
        }
    }
    None
}

/// The original return address of the stub at `addr` (or of the stub
/// `addr` lies inside, as the address its branch to the trampoline left),
/// if `addr` lies in a stub. Async-signal-safe.
pub(crate) fn target_of(addr: usize) -> Option<usize> {
    let base = *REGION.get()?.as_ref().ok()?;
    let k = addr.checked_sub(base + FIRST_STUB)? / STUB_SIZE;
    if k >= MAX_STUBS {
        return None;
    }
    match TARGETS[k].load(Ordering::Acquire) {
        0 => None,
        t => Some(t),
    }
}
