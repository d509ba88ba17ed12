//! In-process uprobes: breakpoints patched over instructions of the running
//! process, handled by a SIGTRAP engine assembled from the workspace's
//! primitives (`srcu`, `percpu-rwsem`, `pcpu-freelist`, `sigpending`).
//!
//! ```no_run
//! # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
//! # fn main() -> Result<(), uprobe_core::AttachError> {
//! use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
//! use uprobe_core::Uprobe;
//!
//! static BYTES: AtomicU64 = AtomicU64::new(0);
//! let probe = Uprobe::in_object("libc.so.6", "malloc")?
//!     .on_entry(|cx| {
//!         BYTES.fetch_add(cx.arg(0).unwrap_or(0), Relaxed);
//!     })
//!     .attach()?;
//! let v = std::hint::black_box(Vec::<u8>::with_capacity(4096));
//! drop(v);
//! println!("{} mallocs, {} bytes", probe.hits(), BYTES.load(Relaxed));
//! # Ok(())
//! # }
//! # #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
//! # fn main() {}
//! ```
//!
//! **Status**: entry and return probes on x86-64 and aarch64 (see
//! [below](#aarch64) for what differs); on both, probes run without a
//! trap wherever the site allows ([trap-free probes](#trap-free-probes-x86-64),
//! [on aarch64](#trap-free-probes-on-aarch64)); on other architectures the
//! crate builds with its error type only.
//!
//! # Attaching
//! [`Uprobe::function`] (the executable, then every loaded library),
//! [`Uprobe::in_object`] (`"libc.so.6"`, or a path), [`Uprobe::file_offset`]
//! (as kernel uprobes take it) and [`Uprobe::at`] look the code up in the
//! ELF symbol tables and check that the address starts an instruction
//! (decoding from the function's start); exported names are resolved
//! through the dynamic linker, so an IFUNC like `memcpy` reaches the
//! implementation the program calls. The `unsafe` [`Uprobe::address`] is
//! the opt-in for code no symbol covers. [`Uprobe::attach_all`] and
//! [`Probe::detach_all`] pay one grace period for a batch, one look at
//! the memory map, the threads and the loaded objects, and one
//! instruction-stream sync (breakpoints are written page by page): a
//! batch of 100,000 probes attaches in about a tenth of a second. The
//! probe table grows as needed (readers never lock and never see a
//! half-built table; an outgrown table is freed after a grace period).
//!
//! **Code that goes away.** Detaching a probe whose code was unmapped
//! (`dlclose`) succeeds: there is nothing to restore. A probe attached
//! where other code has been loaded since finds its own breakpoint
//! missing and starts afresh, so an old probe never swallows a new one.
//!
//! **The SIGTRAP handler is the engine's.** A program that replaces it
//! after probes are attached (`sigaction`, `signal`) would have hits
//! reach its handler and resume in the middle of the probed
//! instruction. The engine checks the disposition at every attach and
//! detach: if it was replaced, every probe is disarmed (original bytes
//! restored; [`Probe::is_armed`] turns false) and attach fails with
//! [`AttachError::TrapHandlerReplaced`] until the engine's handler is
//! back. Hits between the replacement and the next check still reach
//! the program's handler: a program that manages SIGTRAP itself should
//! do so before attaching, or detach first.
//!
//! Refused at attach, with a typed [`AttachError`]: addresses outside
//! executable mappings, inside an instruction, inside an rseq critical
//! section (the kernel would move a trapping thread to the abort handler),
//! over someone else's breakpoint; instructions from the kernel's refusal
//! tables (and transactional memory, far branches); any attach while a
//! thread of the process blocks SIGTRAP; and, in the functions glibc runs
//! with every signal blocked (thread start and exit, `posix_spawn` and its
//! child, among them `free`, `madvise`, `strlen`, `dup2` and `execve`),
//! where a breakpoint hit would kill the process or the child being
//! spawned, the sites that take no one-byte jump (x86-64: see below)
//! ([`AttachError::SignalsBlocked`]); [`Uprobe::allow_blocked_signal_paths`]
//! says how they were found and is the opt-out.
//!
//! # How a hit works (x86-64; aarch64 [below](#aarch64))
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
//! # Trap-free probes (x86-64)
//! A trap costs a signal round trip (~2.5 us on a 2-core VM, and the
//! process-wide `siglock` twice). So after the breakpoint is in, `attach`
//! rewrites a site that qualifies into a 5-byte `jmp rel32` to a
//! trampoline of its own, placed within +-2 GB of the code: no signal, no
//! system call, 20-35 ns a hit with one consumer, depending on the host
//! (where measured, a hit waits mostly on its chain of dependent loads,
//! from the trampoline to the handler). Which way a probe runs is
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
//!   first instructions that make up 5 bytes, it has no indirect jump (a
//!   jump table could), and none of those instructions but the last
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
//! jump there. A punned jump's bytes after the instruction, and its
//! tail, must stay as they are: a later probe attached there takes it
//! back to its breakpoint first ([`NotOptimized::OtherProbeInRange`]). Where the
//! window is taken (other mappings, the room the stack and the heap keep)
//! the site stays on its breakpoint ([`NotOptimized::NoPunTarget`]).
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
//! registers, the x87 stack and MXCSR (a full `xsave` costs ~170 ns;
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
//!
//! # Many functions at once
//! [`functions::matching`] lists the functions of a loaded object (or of
//! all of them) whose names a filter accepts, as `bpftrace`'s
//! `uprobe:libc:str*` does; [`functions::Function::uprobe`] probes one.
//!
//! # Stacks
//! [`EntryContext::user_stack`] walks the calling frames of a hit with
//! the objects' call-frame information (no frame pointers needed), through
//! the engine's trampolines and return stubs, without allocating: see
//! [`unwind`].
//!
//! # USDT probes
//! The [`usdt`] module lists the statically defined tracepoints of a
//! loaded object (`.note.stapsdt`, as `<sys/sdt.h>` declares them);
//! [`Uprobe::usdt`] probes them, holding each probe's semaphore while
//! attached, and handlers read the arguments with
//! [`EntryContext::usdt_arg`]. A USDT site is a 1-byte `nop` (a punned
//! jump, where its window has room) or, from newer `<sys/sdt.h>`, a
//! 5-byte one: trap-free either way.
//!
//! # Return probes
//! [`Uprobe::on_return`] runs a handler when the probed function returns
//! ([`ReturnContext`]: integer and floating-point return values, the
//! function, the original return address, the thread, a cookie the entry
//! handler set: a *session*). At the entry trap the engine replaces the
//! return address with that of a **stub** of its return trampoline, one
//! stub per call site; the function returns into plain code (no second
//! trap) that saves the registers, runs the return handlers, restores
//! them and jumps to the original return address, which the stub itself
//! names. Each pending return is an instance on the thread's stack
//! (at most 64; more are counted in [`Probe::missed_returns`], as are
//! returns past [`Uprobe::max_active`]); a tail call or a second consumer
//! finds the stub already in place and chains onto the same return.
//!
//! - **Lifetime** (seed 002): a pending return holds an `srcu` *lease* on
//!   its consumer, not a reference count; leases older than 100 ms expire
//!   into references, so a function that never returns delays nothing.
//!   [`Probe::detach`] returns once no handler of the probe runs or will
//!   run, without waiting for pending returns: those return normally,
//!   without the handler.
//! - **Frames left without returning**: after `longjmp`, an instance
//!   whose stack slot the stack pointer has risen above is dropped at the
//!   thread's next probe hit or probed return (counted as missed).
//!   **Unwinding** (a Rust panic, a C++ exception, `pthread_exit`) through
//!   a hijacked frame works: the stubs have DWARF unwind information that
//!   gives the original return address, so the unwinder reaches the real
//!   caller; the instance is then dropped the same way. Backtraces through
//!   a pending return show the stub, then the real caller.
//! - **Threads** that exit with returns pending (even by `exit(2)` in the
//!   middle of a probed call) release them: a service thread notices that
//!   the thread is gone within about 20 ms. Each thread's stack of
//!   pending returns comes from a pool that the trap handler only pops
//!   from (no allocation there); the pool grows in ordinary context: an
//!   attach of a return probe makes room for twice the threads the process
//!   has, and the service thread adds a chunk whenever fewer than a
//!   quarter of the stacks are free (up to 65,280 threads). A thread that
//!   finds the pool empty in a burst of new threads has that return
//!   counted as missed. A fork child keeps the forking thread's pending
//!   returns. The service thread, the lease set's expiry thread and the
//!   return domain's reclaimer run only while return probes are attached
//!   (and leases are left to expire): a program that detached every
//!   return probe keeps no thread of the engine's; the next return probe
//!   starts them again (the stacks of threads that died meanwhile are
//!   released then).
//! - **Refused**: a return handler on a probe that is not at a function's
//!   first instruction ([`AttachError::ReturnProbeNotAtEntry`]), and any
//!   return probe while the thread runs with an x86 shadow stack or an
//!   arm64 guarded control stack ([`AttachError::ShadowStack`]: a hijacked
//!   return would fault).
//! - **Limits**: a return probe hit on a signal alternate stack placed
//!   above the thread's stack can make older pending returns look
//!   abandoned (their handlers then do not run; the program still returns
//!   correctly); the trampoline preserves the caller-saved general
//!   registers, the flags and the caller-saved vector registers (x86-64:
//!   `xmm0`-`xmm15`; aarch64: `q0`-`q7`, `q16`-`q31`, but x16, which it
//!   uses as a veneer may), not the upper halves of `ymm`/`zmm`/SVE `z`
//!   registers or the x87 stack (the engine's code does not touch them).
//!
//! # Timing probes
//! [`Uprobe::time_into`] makes a probe at a function's entry that counts
//! its calls and adds each call's time to return (nanoseconds) to a log2
//! histogram, in [`LatencyCell`]s the caller provides (one per possible
//! CPU and one more, [`latency_cells`]; a `MAP_SHARED` mapping another
//! process reads works). No handler runs, so nothing needs the register
//! frame, the read section or the lease of a return probe:
//!
//! - **On x86-64, where the site runs through a jump and the timing probe
//!   is its only probe**, the trampoline calls a routine of its own that
//!   counts the call in its CPU's cell (a restartable sequence), pushes
//!   the call on the thread's stack of timed calls with the TSC, and
//!   swaps the return address for the call site's stub; the stub calls a
//!   routine that pops it, reads the TSC again and adds one to the
//!   bucket in its CPU's cell (another restartable sequence). Each saves only the
//!   registers it uses (and the status flags with `lahf`/`seto`, not
//!   `pushfq`). It needs the TSC as the kernel's clocksource (its scale
//!   is measured once against `CLOCK_MONOTONIC_RAW`), BMI2 and `lzcnt`,
//!   and glibc's rseq registration; anything it does not handle (a
//!   thread inside the engine or not observed, a thread's first return
//!   probe hit, a call site without a stub yet, a full stack, a chained
//!   or abandoned call, a return probe's instance on the same frame) goes
//!   to the engine's routines with every register as it was.
//! - **Elsewhere** (a breakpoint site, another probe on the same address,
//!   aarch64, no TSC) the engine does the same work on its ordinary path.
//!
//! A call that cannot be tracked (32 timed calls pending on the thread,
//! more than 16384 call sites, left by `longjmp` or unwinding, nested in
//! the engine) is counted, not timed. Once the probe's detach returns,
//! nothing writes to its cells, not even a call that was pending then
//! (each pending call names the probe's *switch*, which the detach turns
//! off; see the source's `site::timing`). Measured with `bench
//! uretprobe-entry` (its `uprobe-core+time` row).
//!
//! # aarch64
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
//! # Trap-free probes on aarch64
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
//!
//! # What handlers may do
//! They run **inside the signal handler (a trap) or called from the
//! trampoline (a jump), on the interrupted thread's stack** (not on an
//! alternate stack: Rust threads' are small, and a signal frame is ~3.4
//! KB), in the middle of whatever the thread was doing, so they must be
//! async-signal-safe either way: no
//! allocation, no lock the interrupted code may hold, no `println!`. A
//! probe hit while the thread is already inside the engine (a handler
//! calling a probed function, or the engine's own code) runs no handler,
//! is counted as missed, and still executes the instruction. A handler
//! that panics aborts the process with a message (unwinding through a
//! signal frame or a trampoline is not possible). Detaching waits until no handler of the
//! probe runs; it must not be called from a handler.
//!
//! # Rules for the program
//! - A thread that blocks SIGTRAP must never run probed code: the kernel
//!   turns such a trap into the default action and the process dies.
//!   `attach` refuses while one exists and refuses glibc's own
//!   signal-blocked paths, but code of the program (or of another C
//!   library) that blocks SIGTRAP around calls to probed functions is the
//!   program's responsibility.
//! - A thread's stack pointer must leave room for a signal frame below it
//!   whenever it runs probed code, as for any signal.
//! - After `fork`, the child keeps the probes (breakpoints, table and
//!   handler are inherited) and runs probed code normally.
//! - A kernel uprobe (`perf`, `bpftrace`) on the same instruction of the
//!   same file is not compatible: attached first, it is someone else's
//!   breakpoint and attach refuses the address; attached while a probe of
//!   ours is there, its detach writes the file's original byte back over
//!   our breakpoint or jump. Probe different code, or one at a time.
#![cfg_attr(not(test), warn(missing_docs))]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "uprobe-core supports Linux only: it patches code through /proc/self/maps and membarrier \
     and handles SIGTRAP as Linux delivers it"
);

// The engine runs on x86-64 and aarch64; elsewhere the crate builds with
// just its error type. The modules form layers, each using only those
// listed before it (see ARCHITECTURE.md); the architecture's modules
// (`arch`) sit among them, each at the layer of what it does.
#[cfg(uprobe_engine)]
mod attach;
#[cfg(uprobe_engine)]
mod clock;
#[cfg(uprobe_engine)]
mod code;
#[cfg(uprobe_engine)]
mod context;
#[cfg(uprobe_engine)]
mod deferral;
#[cfg(uprobe_engine)]
mod entry;
mod error;
#[cfg(uprobe_engine)]
pub mod functions;
#[cfg(uprobe_engine)]
mod hit;
#[cfg(uprobe_engine)]
pub mod memory;
#[cfg(uprobe_engine)]
mod mode;
#[cfg(uprobe_engine)]
mod patch;
#[cfg(uprobe_engine)]
mod probe;
#[cfg(uprobe_engine)]
mod process;
#[cfg(uprobe_engine)]
mod site;
#[cfg(uprobe_engine)]
mod table;
#[cfg(uprobe_engine)]
mod thread;
#[cfg(uprobe_engine)]
pub mod unwind;
#[cfg(uprobe_engine)]
pub mod usdt;
#[cfg(uprobe_arch = "x86_64")]
mod x86_64;
#[cfg(uprobe_arch = "x86_64")]
use x86_64 as arch;
#[cfg(uprobe_arch = "aarch64")]
mod aarch64;
#[cfg(uprobe_arch = "aarch64")]
use aarch64 as arch;

#[cfg(uprobe_engine)]
pub use arch::Reg;
#[cfg(uprobe_engine)]
pub use context::{EntryContext, ReturnContext};
pub use error::{AttachError, BlockedPath};
#[cfg(uprobe_engine)]
pub use memory::{CodeMemory, code_memory};
#[cfg(uprobe_engine)]
pub use mode::{Mode, NotOptimized, Tactic};
#[cfg(uprobe_engine)]
pub use probe::{Probe, Uprobe};
#[cfg(uprobe_engine)]
pub use site::count::{CountCell, count_cells};
#[cfg(uprobe_engine)]
pub use site::timing::{LATENCY_BUCKETS, LatencyCell, latency_cells};

/// Makes probe hits of the calling thread observed or not, and returns
/// whether they were. A hit in a thread that is not observed runs no
/// handler, entry or return, and counts nothing (not even as missed): for
/// a tool's own threads, whose calls to probed functions (`malloc` while
/// it reports) are not the program's. The engine's own service threads
/// are not observed. Threads start observed; a fork child's thread
/// inherits its parent's setting. **Async-signal-safe** (one
/// thread-local store); from a handler, it takes effect at the thread's
/// next hit after the handler.
///
/// ```
/// # #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))] {
/// use uprobe_core::{Uprobe, set_thread_observed};
/// #[inline(never)]
/// extern "C" fn tick(x: u64) -> u64 { std::hint::black_box(x + 1) }
/// // SAFETY: a function's address is an instruction's first byte.
/// let probe = unsafe { Uprobe::address(tick as usize) }.attach()?;
/// tick(1);
/// assert!(set_thread_observed(false));
/// tick(2);
/// assert!(!set_thread_observed(true));
/// tick(3);
/// assert_eq!(probe.hits(), 2);
/// # }
/// # Ok::<(), uprobe_core::AttachError>(())
/// ```
#[cfg(uprobe_engine)]
#[allow(clippy::must_use_candidate)] // called for its effect; the old setting is a convenience
pub fn set_thread_observed(observed: bool) -> bool {
    thread::set_observed(observed)
}

/// Frees what the engine keeps only to make later attaches faster: the
/// symbol indexes of the objects it looked at and their rseq critical
/// sections (read again when needed). For a program, or a tool's agent,
/// that detached its probes and will not attach for a while. Generated
/// code (trampolines, slots, return stubs) stays: a thread may still run
/// it. Not async-signal-safe.
#[cfg(uprobe_engine)]
pub fn release_caches() {
    process::symbols::forget_indexes();
    process::threads::forget_rseq_sections();
}

/// Switches for the workspace's benchmarks and tests; not part of the
/// stable API. The switches that select a "before" variant of a
/// mechanism (`set_*`, `force_trap_back_slots`) exist only with the
/// `bench-variants` feature; without it each mechanism is a constant, so
/// the default build pays nothing for them.
#[cfg(uprobe_engine)]
#[doc(hidden)]
pub mod bench_only {
    /// The aarch64 classifier, for the tests that check it against an
    /// independent decoder.
    #[cfg(uprobe_arch = "aarch64")]
    pub use crate::arch::{Class, classify};
    pub use crate::site::returns::{Pinning, ReturnHold};
    pub use crate::table::lookup::Lookup;

    /// Chooses how the trap handler protects its table lookup. Only call
    /// it while no probe is attached (it is not synchronised with hits
    /// in flight). With a lock, a handler may wait for attach/detach: the
    /// SRCU default never does.
    #[cfg(feature = "bench-variants")]
    pub fn set_lookup(lookup: Lookup) {
        crate::table::lookup::set_mode(lookup);
    }

    /// Chooses how pending returns keep their probe alive: an SRCU lease
    /// (the default, seed 002) or a reference count per pending return
    /// (the kernel before it). Only call it while no return is pending.
    #[cfg(feature = "bench-variants")]
    pub fn set_return_hold(hold: ReturnHold) {
        crate::site::returns::set_hold(hold);
    }

    /// Chooses how an in-flight charge ([`Uprobe::max_active`](crate::Uprobe::max_active))
    /// keeps its probe alive: a reference taken by the account on 0 -> 1
    /// (the default, seed 003) or one per charge (the kernel before it).
    /// Applies to probes attached from now on.
    #[cfg(feature = "bench-variants")]
    pub fn set_in_flight_pinning(pinning: Pinning) {
        crate::site::returns::set_pinning(pinning);
    }

    /// Makes the signal deferral of trap-ended slots take one process-wide
    /// lock around its flag operations (the kernel's `siglock` before seed
    /// 000) instead of none. Only while no probe is hit.
    #[cfg(feature = "bench-variants")]
    pub fn set_locked_deferral(on: bool) {
        crate::deferral::set_locked(on);
    }

    /// The calling thread's pending returns (for tests).
    /// Async-signal-safe.
    #[must_use]
    pub fn pending_returns() -> usize {
        crate::hit::returns::pending()
    }

    /// Per-thread stacks of pending returns made so far (the pool grows
    /// as threads need them; for tests). Not async-signal-safe.
    #[must_use]
    pub fn return_stacks() -> usize {
        crate::hit::returns::stacks()
    }

    /// The lookup in use.
    #[must_use]
    #[cfg(feature = "bench-variants")]
    pub fn lookup() -> Lookup {
        crate::table::lookup::mode()
    }

    /// Makes out-of-line slots created from now on end in a trap (two
    /// traps per hit, asynchronous signals deferred in between) instead
    /// of a jump back: the path used where no slot can be had near the
    /// code, forced everywhere to measure it.
    #[cfg(feature = "bench-variants")]
    pub fn force_trap_back_slots(on: bool) {
        crate::code::slots::force_trap_back(on);
    }

    /// The file and file offset that executable address `addr` of this
    /// process was mapped from (what a kernel uprobe on the same code is
    /// attached to), if any.
    #[must_use]
    pub fn file_offset_of(addr: usize) -> Option<(std::path::PathBuf, u64)> {
        crate::process::maps::file_offset_of(addr)
    }

    /// Makes trampolines made from now on fail as if no free gap were
    /// within reach of the probed code (`on`): the probes stay on their
    /// breakpoints ([`NotOptimized::NoTrampolineRoom`](crate::NotOptimized::NoTrampolineRoom)).
    /// Sites that already have a trampoline keep it. Not
    /// async-signal-safe.
    pub fn no_trampoline_room(on: bool) {
        crate::code::trampolines::refuse_room(on);
    }

    /// Whether `ip` is inside an out-of-line slot (for tests that check
    /// where signals find a thread). Async-signal-safe.
    #[must_use]
    pub fn in_xol_slot(ip: usize) -> bool {
        crate::code::slots::origin_of(ip).is_some()
    }
}
