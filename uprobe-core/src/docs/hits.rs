//! How a hit works on x86-64: the trap, emulation and out-of-line slots, and the jumps that replace the trap.
//!
//! What [`Probe::mode`] reports and why; aarch64 is [`super::aarch64`].
//!
//! # The trap
//! `attach` decodes the instruction (iced-x86), publishes its analysis in a
//! probe table, then writes `int3` over its first byte (execute permission
//! kept, then `membarrier(SYNC_CORE)`). A thread that executes it traps;
//! the engine's SIGTRAP handler (installed once, `SA_SIGINFO |
//! SA_NODEFER`, chaining every trap that is not its own to the handler
//! installed before it) looks the address up inside an SRCU read section
//! (no lock, no allocation), runs the consumers' handlers with the
//! thread's registers ([`EntryContext`]), then does what the instruction
//! would have done. While it runs, the thread's asynchronous signals are
//! blocked (they are delivered as soon as it returns), so the program's
//! own signal handlers, nested ones included, never run inside the
//! engine's and may call probed code themselves:
//! - **emulated** on the signal frame: every `nop` form, `endbr64`, `push
//!   reg`, `jmp`/`call`/`jcc` with relative targets, `call`/`jmp` through
//!   a register or memory, `loop`/`jrcxz`, `ret`;
//! - **out of line**, anything else: relocated at attach into an immutable
//!   slot within +-2 GB of the code (RIP-relative operands re-targeted)
//!   followed by a jump back, so one trap per hit. Where no slot can be
//!   had near the code (and the instruction does not address relative to
//!   RIP), the slot ends in a second trap instead, and the thread's
//!   asynchronous signals are deferred while it runs the slot (a swapped
//!   `uc_sigmask`, recorded with `sigpending::TaskFlags`). A fault raised
//!   in a slot reaches the program at the probed address.
//!
//! # Trap-free probes
//! A trap costs a signal round trip (two kernel entries, a signal frame,
//! and the process-wide `siglock` twice). So after the breakpoint is in, `attach`
//! rewrites a site that qualifies into a 5-byte `jmp rel32` to a
//! trampoline of its own, placed within +-2 GB of the code: no signal, no
//! system call, a hit about a hundred times cheaper (it waits mostly on
//! its chain of dependent loads, from the trampoline to the handler). Which way a probe runs is
//! [`Probe::mode`]: [`Mode::Jump`] with the [`Tactic`] that fitted the
//! jump in, or
//! [`Mode::Trap`] with the reason ([`NotOptimized`]).
//! [`Uprobe::trap_only`] keeps a probe on its breakpoint. The jump
//! replaces whole instructions ([`Tactic::Replace`]) when:
//! - its instruction is 5 bytes or longer (the 5-byte nop of USDT and
//!   `-fpatchable-function-entry` sites, `mov r32, imm32`, `sub rsp,
//!   imm32`, `call rel32`, RIP-relative loads, ...), anywhere; or
//! - it is a function's first instruction, the function's extent is known
//!   (found through a symbol with a size: [`Uprobe::function`],
//!   [`Uprobe::in_object`], [`Uprobe::at`], not [`Uprobe::address`]), the
//!   whole function decodes, no direct branch in it lands inside the
//!   first instructions that make up 5 bytes, no indirect jump in it can
//!   (a jump table could: each must leave from a stack depth that none
//!   of those instructions past the first has, as a sibling call made
//!   after the epilogue does; the depths are followed from the entry
//!   through every `push`, `pop` and constant move of `rsp`), and none of
//!   those instructions but the last
//!   branches, calls or returns; a last `call rel32` runs as a push of the
//!   original return address and a `jmp`, so the callee returns to the
//!   probed code;
//! - a function that starts with `endbr64` keeps it (indirect calls stay
//!   valid where IBT is enforced) and takes the jump right after it.
//!
//! Everywhere else (an instruction shorter than the jump in the middle
//! of a function, a function too short or with a jump table, a branch
//! into the first bytes, a function of unknown extent, a USDT `nop`) the
//! jump is **punned** ([`Tactic::Pun`], `E9Patch`'s instruction punning):
//! only the probed instruction's own bytes change; the `jmp rel32`
//! written over them runs into the bytes that follow, left as they are,
//! which fix the high bytes of its displacement (redundant prefixes in
//! front of the jump give other choices). So the jump can only land
//! inside a window those bytes choose, and a 5- or 14-byte stub placed
//! there (a page mapped with `MAP_FIXED_NOREPLACE`, shared by the stubs
//! that land on it, never freed) jumps on to the trampoline. No thread
//! can be stopped inside a single instruction and no other instruction
//! moves, so a branch or a jump table landing after it still finds the
//! original code. The trampoline also runs, relocated, the instructions
//! that start inside the jump's bytes (its *tail*, up to a return, a
//! jump or a call, or an instruction that cannot run relocated): a hit
//! that went back into the middle of the jump would cost as much again,
//! the CPU's branch predictor and decoded-instruction cache holding the
//! jump there. The tail stops before the next probed instruction.
//!
//! **Neighbours.** A punned jump's bytes after its instruction must stay
//! as they are while it is in, yet they may be another probe's
//! breakpoint or jump: as `E9Patch` does statically, the later
//! instruction is patched first and the earlier one punned over what it
//! holds, its displacement ending in the neighbour's bytes. Whenever a
//! site's bytes change (a probe attached inside another's bytes or
//! tail, a jump written or taken back, a detach), every jump that ends
//! in them goes back to its breakpoint first and is planned again once
//! the change is made, highest address first (each one over its
//! neighbour's bytes as they stay). So probes on adjacent instructions,
//! attached in one batch or one by one in any order, all take jumps
//! where their windows have room. Where a site's windows have none, the
//! stub of the next site's jump, whose bytes they end in, moves within
//! its own window to where they do (as `E9Patch` chooses a jump's target
//! for the instruction before it), with room kept for every jump that
//! already ends in those bytes (a chain of `pop`s). A return or jump is
//! punned over the alignment padding after it too, which no thread runs
//! (a `ret` at a function's end takes a whole jump), and a one-byte
//! patch whose one target lies in such padding after a function lands on
//! a stub written there (a landing pad). Every instruction of libz's
//! exported functions probed at once: all through a jump, in one batch
//! and attached one by one (`tests/interior.rs`). Where the window is
//! still taken (other
//! mappings, the room the stack and the heap keep) the site stays on its
//! breakpoint ([`NotOptimized::NoPunTarget`]), and so does one whose
//! neighbour's jump is planned and not yet written when the planning
//! ends ([`NotOptimized::OtherProbeInRange`]).
//! [`code_memory`] tells what generated code takes.
//!
//! **One-byte jumps where signals are blocked.** Over any instruction,
//! `E9` alone written on its first byte is a jump whose displacement is
//! the next four bytes: one store, like the breakpoint it replaces, with
//! no window in which a thread could trap. In the functions glibc runs
//! with every signal blocked, attach writes only that (never a
//! breakpoint) and detach writes the original byte back the same way;
//! where the address the four bytes choose is taken (glibc's system call
//! wrappers, `mov eax, N`, jump into their own library), the probe is
//! refused ([`AttachError::SignalsBlocked`]).
//!
//! Not on x86-64 with a shadow stack, or for instructions that cannot run
//! relocated (the kernel's refusal tables, far branches,
//! `loop`/`jrcxz`).
//!
//! **The trampoline** steps over the red zone (`lea rsp, [rsp-128]`: a
//! `call` at the site would overwrite the 128 bytes below the stack
//! pointer), saves the flags, every general-purpose register and
//! `xmm0`-`xmm15` (restoring the flags with `sahf` rather than the
//! microcoded `popfq` unless a handler changed more than the status
//! flags), and calls the engine with the site built in (no table
//! lookup): handlers get the same [`EntryContext`] as on a trap, and a
//! handler that sets RIP sends the thread there instead of the displaced
//! instructions. Not saved: the upper halves of `ymm`/`zmm`, the mask
//! registers, the x87 stack and MXCSR (a full `xsave` would cost more than the rest of the hit;
//! handlers must not touch them); a handler's write to RSP is honoured
//! upwards, and downwards by at most 40 bytes (five pushes: enough to
//! emulate a call). Then the displaced instructions run, relocated, and a jump
//! goes back. Trampolines are immutable and never freed: a thread
//! preempted inside one always finds the same code. A return probe's
//! entry runs through the jump too, and its return through the plain-code
//! trampoline: no trap at all.
//!
//! **Counting probes.** A probe with no handler ([`Uprobe::on_entry`],
//! [`Uprobe::on_return`]) and no thread filter only counts its hits
//! ([`Probe::hits`]). Where its site takes a jump and it is the only probe
//! there, the trampoline counts each hit itself before anything else: a
//! restartable sequence loads the probe's per-CPU counter from the
//! trampoline's cell and adds one to the current CPU's slot, with
//! `jrcxz`, `lea` and BMI2 shifts only (no flag changes, so nothing but
//! three registers is saved), and the thread goes straight on to the
//! displaced instructions: a few nanoseconds a hit, no register frame, no
//! call into Rust. The counts are exact under preemption, migration,
//! signals (a signal handler that hits the probe mid-count restarts the
//! interrupted count) and fork. When a handler probe joins the address,
//! the cell's counter is taken away (and every count in flight restarted
//! by a `membarrier` rseq fence) and hits run the engine, which counts
//! for both; when it leaves, the trampoline counts again. Threads whose
//! rseq area is not registered take the engine's path. x86-64 with BMI2
//! and glibc's rseq registration; elsewhere a counting probe's hits run
//! the engine. The counts may live in memory the caller provides
//! ([`Uprobe::count_into`], [`CountCell`]: a mapping shared with a
//! reporting process, or with fork children), and a tool's own threads
//! can be left out of every count and handler
//! ([`set_thread_observed`]).
//!
//! **Patching** follows the kernel's `text_poke_bp`: with the breakpoint
//! on the first byte and every thread's instruction stream synced, the
//! jump's tail is written, synced, then its first byte, synced; bytes are
//! checked before each write. For a range of several instructions, every
//! other thread is first asked where it stopped (a real-time signal,
//! the highest one the program leaves at its default, queued with a
//! marker): one stopped between two of the range's instructions is moved
//! to the same point of the trampoline's copy; a thread that does not
//! answer (it blocks the signal) leaves the site on its breakpoint
//! ([`NotOptimized::ThreadsUnchecked`]). The signal interrupts system
//! calls the kernel never restarts (`nanosleep`, `poll`, ...: `EINTR`),
//! as any signal does. Detaching (or a trap-only probe joining the
//! address) puts the breakpoint back over the jump, restores the tail,
//! then the rest as for any probe. One limit remains: a thread that a
//! signal of the program interrupted between two instructions of a range,
//! and that is still inside that signal handler while the site is
//! optimized, returns into the middle of the jump.
//!
//! **Where signals cannot help**, an optimized probe still works: in a
//! thread that blocks every signal, in the child of `posix_spawn`
//! (`std::process::Command`), and after the program replaced the SIGTRAP
//! handler (only breakpoint probes are disarmed then). The functions
//! glibc runs with signals blocked get one-byte jumps (above), never a
//! breakpoint.

#[allow(unused_imports)] // the names the links above resolve to
use crate::{
    AttachError, CountCell, EntryContext, LatencyCell, Mode, NotOptimized, Probe, ReturnContext,
    Tactic, Uprobe, code_memory, functions, latency_cells, set_thread_observed, unwind, usdt,
};
