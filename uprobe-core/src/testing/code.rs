//! The engine's decisions about machine code, on bytes alone: what a
//! probe on an instruction does at a hit ([`analyze`]), the trampoline a
//! jump leads to ([`trampoline`], [`punned_trampoline`]), and the ways to
//! pun a jump over a short instruction ([`puns`]). For the fuzz targets
//! and their regression tests, which check that moved code does what the
//! original does; nothing here writes to the process's code.
//!
//! None of these is async-signal-safe (they allocate).

use core::cell::RefCell;

use crate::arch::{self, Emulation, SlotEnd};
use crate::base::error::AttachError;
use crate::base::mode::NotOptimized;

/// What a hit on a probed instruction does instead of running it:
/// emulate it on the thread's registers, or send the thread to an
/// out-of-line slot whose code ([`slot_code`](Self::slot_code)) runs a
/// relocated copy and jumps back.
#[derive(Debug)]
pub struct Analysis {
    emulation: Emulation,
    slot_code: Option<Vec<u8>>,
}

impl Analysis {
    /// The code of the out-of-line slot, written for the `slot` address
    /// [`analyze`] was given; `None` for an emulated instruction.
    #[must_use]
    pub fn slot_code(&self) -> Option<&[u8]> {
        self.slot_code.as_deref()
    }

    /// Does to the registers (and the memory they address) what a hit
    /// does before the thread resumes: the emulation, or the move to the
    /// slot.
    ///
    /// # Safety
    /// `uc` must describe a thread whose memory is this process's, as
    /// running the instruction would touch it: a `push` or `call` writes
    /// below its stack pointer, a `ret` or an indirect branch through
    /// memory reads its operand.
    pub unsafe fn apply(&self, uc: &mut libc::ucontext_t) {
        // SAFETY: the caller's promise is `apply`'s contract.
        unsafe { arch::apply(&self.emulation, uc) };
    }
}

std::thread_local! {
    /// The slot address [`analyze`] hands the architecture, and the code
    /// the architecture made for it.
    static SLOT: RefCell<(usize, Option<Vec<u8>>)> = const { RefCell::new((0, None)) };
}

/// The slot source [`analyze`] gives the architecture: the address in
/// [`SLOT`], ending in a jump back.
fn test_slot(
    _addr: usize,
    _bytes: &[u8],
    _near: bool,
    code: arch::SlotCode<'_>,
) -> Result<(usize, SlotEnd), AttachError> {
    let slot = SLOT.with(|s| s.borrow().0);
    let made = code(slot, SlotEnd::JumpBack)?;
    SLOT.with(|s| s.borrow_mut().1 = Some(made));
    Ok((slot, SlotEnd::JumpBack))
}

/// How hits on the instruction at `addr`, whose bytes start `bytes`
/// (up to 15 on x86-64, 4 on aarch64), run it; an instruction run out of
/// line gets its slot at `slot` (which must lie within reach of `addr`
/// for one that addresses relative to the PC). The error says why it
/// cannot be probed.
pub fn analyze(addr: usize, bytes: &[u8], slot: usize) -> Result<Analysis, AttachError> {
    SLOT.with(|s| *s.borrow_mut() = (slot, None));
    let emulation = arch::analyze(addr, bytes, test_slot)?;
    let slot_code = SLOT.with(|s| s.borrow_mut().1.take());
    Ok(Analysis {
        emulation,
        slot_code,
    })
}

/// A trampoline as the engine builds it, and what it covers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trampoline {
    /// Its code, to be placed at the base it was built for.
    pub code: Vec<u8>,
    /// The first address the jump replaces.
    pub start: usize,
    /// The bytes the jump replaces (at least a jump's length, unless
    /// punned).
    pub len: usize,
    /// The end of the original code the plan covers: the replaced
    /// range, or a punned jump's tail. The trampoline copies it all, or,
    /// where the tail cannot be relocated, the range alone ([`copies`]
    /// says which), and returns after the last instruction it copied.
    ///
    /// [`copies`]: Self::copies
    pub end: usize,
    /// For each copied instruction, its address and where its copy
    /// starts (a thread stopped at the one moves to the other).
    pub copies: Vec<(usize, usize)>,
}

/// The function around a site, as [`trampoline`] is told of it.
#[derive(Clone, Copy, Debug)]
pub struct FunctionCode<'a> {
    /// Its first address.
    pub start: usize,
    /// Its whole code.
    pub code: &'a [u8],
    /// Whether nothing else branches into it (symbols say it starts
    /// here, not only unwind tables).
    pub sole_entry: bool,
}

/// The trampoline of a jump over whole instructions at `addr` (whose code
/// is `code`, from `addr` on), built for `base` with cell address `cell`,
/// or why there can be none.
pub fn trampoline(
    addr: usize,
    code: &[u8],
    function: Option<FunctionCode<'_>>,
    base: usize,
    cell: usize,
) -> Result<Trampoline, NotOptimized> {
    let function = function.map(|f| arch::Function {
        start: f.start,
        code: f.code,
        sole_entry: f.sole_entry,
    });
    let plan = arch::jump::plan(addr, code, function)?;
    built(&plan, base, cell)
}

/// The trampoline of a jump punned over the instruction at `addr` alone
/// (its tail copied, up to `limit`), built for `base` with cell `cell`.
pub fn punned_trampoline(
    addr: usize,
    code: &[u8],
    limit: usize,
    base: usize,
    cell: usize,
) -> Result<Trampoline, NotOptimized> {
    let plan = arch::jump::single(addr, code, limit)?;
    built(&plan, base, cell)
}

fn built(plan: &arch::jump::Plan, base: usize, cell: usize) -> Result<Trampoline, NotOptimized> {
    let (code, copies) = arch::jump::build(plan, base, cell)?;
    Ok(Trampoline {
        code,
        start: plan.start,
        len: plan.len,
        end: plan.end(),
        copies,
    })
}

/// One way to pun a jump over an instruction: `prefixes` padding
/// prefixes, the opcode and the displacement's low bytes are written
/// (`written` bytes in all); its high bytes are `fixed`, the code after
/// them, so the jump lands in `[lo, lo + size)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PunWindow {
    /// The instruction's first address.
    pub start: usize,
    /// Padding prefixes written before the opcode.
    pub prefixes: usize,
    /// Bytes written.
    pub written: usize,
    /// The code after them that the jump's displacement ends with.
    pub fixed: Vec<u8>,
    /// The window's first address.
    pub lo: usize,
    /// The window's size.
    pub size: usize,
}

/// The ways to pun a jump over the instruction of `len` bytes at `start`
/// (code `code` from `start` on; `one_byte`: only its first byte is
/// written; otherwise the alignment padding after a return or jump may
/// be written too), most free bytes first; `None` where the architecture
/// does not pun.
#[must_use]
pub fn puns(start: usize, len: usize, code: &[u8], one_byte: bool) -> Option<Vec<PunWindow>> {
    let punning = arch::PUNNING?;
    Some(
        (punning.puns)(start, len, code, one_byte, true)
            .into_iter()
            .map(|p| PunWindow {
                start: p.start,
                prefixes: p.prefixes,
                written: p.written,
                fixed: p.fixed,
                lo: p.lo,
                size: p.size,
            })
            .collect(),
    )
}

/// The bytes a punned jump in `window` to `target` writes (its first
/// `window.written`); `None` where the architecture does not pun or
/// `target` is outside the window.
#[must_use]
pub fn pun_bytes(window: &PunWindow, target: usize) -> Option<Vec<u8>> {
    let punning = arch::PUNNING?;
    if target < window.lo || target - window.lo >= window.size {
        return None;
    }
    let pun = arch::Pun {
        start: window.start,
        prefixes: window.prefixes,
        written: window.written,
        fixed: window.fixed.clone(),
        lo: window.lo,
        size: window.size,
    };
    Some((punning.pun_bytes)(&pun, target)[..window.written].to_vec())
}

/// The stub at `at` that a punned jump lands on, going on to `target`;
/// `None` where the architecture does not pun.
#[must_use]
pub fn pun_stub(at: usize, target: usize) -> Option<Vec<u8>> {
    Some((arch::PUNNING?.stub)(at, target))
}
