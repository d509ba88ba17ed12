//! aarch64: the breakpoint, simulation and out-of-line slots, and trap-free jumps.
//!
//! What differs from x86-64 ([`super::hits`]).
//!
//! The breakpoint is `BRK #5` written over the 4-byte instruction with one
//! aligned store, then `DC CVAU` / `DSB ISH` / `IC IVAU` / `DSB ISH` /
//! `ISB` as `CTR_EL0` requires and `membarrier(SYNC_CORE)` for the other
//! threads. Position-dependent instructions are **simulated** on the
//! signal frame (`b`, `bl`, `b.cond`, `cbz`/`cbnz`, `tbz`/`tbnz`,
//! `adr`/`adrp`, `br`/`blr`/`ret`, literal loads including the SIMD forms,
//! `nop`, `bti`), leaving PSTATE.BTYPE as the branch would (`br`: 0b01,
//! the value every landing pad that accepts 0b11 accepts too). Everything
//! else that is safe runs **out of line** (`paciasp`, `stp x29, x30, [sp,
//! #-16]!`, loads and stores, `mrs`, ...) from a slot that ends in `B` back
//! when it lies within 128 MB of the code, or in a second `BRK` (signals
//! deferred meanwhile) anywhere. **Refused**: exclusive loads and stores
//! (and `casp`, which shares their encoding class), exception-generating
//! instructions, system register writes and system instructions. Return
//! probes hijack the link register at entry; the trampoline returns with
//! `ret`. Pages mapped with `PROT_BTI` stay guarded when patched (the
//! flag is read from `smaps`; under qemu-user, whose `smaps` does not show
//! it, a patched guarded page loses its guard).
//!
//! **Concurrent modification.** The architecture guarantees concurrent
//! modification and execution only when both the old and the new
//! instruction are among `B`, `BL`, `BRK`, `NOP`, `ISB`, `SVC`, `HVC`,
//! `SMC`; a `BRK` over an arbitrary instruction is outside that list. The
//! engine does what the kernel's own uprobes do on arm64: one single-copy
//! atomic 32-bit store, cache maintenance, and a `SYNC_CORE` barrier before
//! `attach` returns, so a thread fetches the old or the new instruction,
//! never a mix; this is safe on real cores in practice, and it is what the
//! tests exercise (attach and detach while other threads run the code,
//! under qemu-user, which notices stores to code it has translated).
//!
//! # Trap-free probes
//! With the same API and rules as on x86-64 ([`Probe::mode`],
//! [`Uprobe::trap_only`]), `attach` replaces a site's `BRK` by a `B` into
//! a trampoline of its own once the breakpoint is in: one aligned 32-bit
//! store (`BRK` -> `B` is on the architecture's list above), cache
//! maintenance, `membarrier(SYNC_CORE)`; detaching goes back through
//! `BRK`. A probe replaces exactly one instruction, so no thread can be
//! stopped inside the replaced range and no thread check is needed. A
//! site qualifies when a trampoline fits within `B`'s +-128 MB
//! ([`NotOptimized::NoTrampolineRoom`] otherwise) and the trap path
//! accepts its instruction; a branch's target must be within reach of the
//! trampoline too. **Landing pads** (`bti`, `paciasp`, `pacibsp`) stay in
//! place, since a `B` is no valid target of an indirect call on a
//! BTI-guarded page (a `BRK` is): the jump goes over the instruction after
//! the landing pad, which needs the function's extent (found through a
//! symbol with a size), no direct branch in the function to that
//! instruction, and no indirect `br` in it ([`NotOptimized::LandingPad`],
//! [`NotOptimized::BranchIntoRange`], [`NotOptimized::IndirectJump`]).
//! After `paciasp` the trampoline authenticates the link register before
//! the handlers run and signs it again after, so handlers see the plain
//! return address and a return probe's hijack is signed like the original.
//!
//! The trampoline pushes x16 and x30 and `blr`s to a common routine that
//! builds a `ucontext_t` on the stack (x0-x30, sp, NZCV, all of
//! `q0`-`q31`, FPSR, FPCR), so handlers get the same [`EntryContext`] as
//! on a trap; it restores all of them but FPCR (handlers must not change
//! the rounding mode; SVE's upper `z` bits and SME state are not saved,
//! the engine's code does not touch them), then pops x16 and x30 and runs
//! the displaced instruction: copied where it runs anywhere (what the trap
//! path runs out of line), or as equivalent code (`b`/`b.cond`/`cbz`/`tbz`
//! with their targets, `bl`/`blr` with the original return address in
//! x30, `adr`/`adrp` and literal loads with their values), then `B` back.
//! A handler that moves the PC or the stack pointer is honoured exactly,
//! through `rt_sigreturn` on that frame (the one case with system calls).
//! Performance on arm64 hardware is unmeasured here (the tests run under
//! qemu-user); the `bench` scenarios build for aarch64.

#[allow(unused_imports)] // the names the links above resolve to
use crate::{
    AttachError, CountCell, EntryContext, LatencyCell, Mode, NotOptimized, Probe, ReturnContext,
    Tactic, Uprobe, code_memory, functions, latency_cells, set_thread_observed, unwind, usdt,
};
