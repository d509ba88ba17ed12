//! Return probes: values seen at return, sessions, recursion and tail
//! calls, the depth and in-flight limits, frames left by `longjmp` and by
//! unwinding, and detaching while a return is pending.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
// The float values compared are exact (small integers and halves).
#![allow(clippy::float_cmp)]

mod common;

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use common::{call, fn_addr, probe_at};
use uprobe_core::testing::pending_returns;

// Each test probes functions of its own (tests of one binary may run in
// parallel threads, and a probe's handlers run for every caller). The same
// functions, under the same names, for each architecture.

#[cfg(target_arch = "x86_64")]
mod fixtures {
    /// add1(x) = x + 1, under the name `$name`.
    macro_rules! add1 {
        ($name:literal) => {
            concat!(
                ".globl ",
                $name,
                "\n",
                $name,
                ":\n",
                "lea rax, [rdi + 1]\n",
                "ret\n"
            )
        };
    }

    /// sum(n) = n + sum(n - 1), sum(0) = 0: real recursion, under `$name`.
    macro_rules! sum {
        ($name:literal) => {
            concat!(
                ".globl ",
                $name,
                "\n",
                $name,
                ":\n",
                "test rdi, rdi\n",
                "jz 2f\n",
                "push rdi\n",
                "dec rdi\n",
                "call ",
                $name,
                "\n",
                "pop rdi\n",
                "add rax, rdi\n",
                "ret\n",
                "2:\n",
                "xor eax, eax\n",
                "ret\n",
            )
        };
    }

    core::arch::global_asm!(
        ".text",
        add1!("r_add1_values"),
        add1!("r_add1_tail"),
        add1!("r_add1_skip"),
        add1!("r_add1_escape"),
        sum!("r_sum_change"),
        sum!("r_sum_order"),
        sum!("r_sum_limits"),
        // tail(x) = add1(x + 10), a tail call
        ".globl r_tail",
        "r_tail:",
        "lea rdi, [rdi + 10]",
        "jmp r_add1_tail",
        // outer(buf) calls inner(buf), which escapes to `buf` (longjmp)
        ".globl r_outer",
        "r_outer:",
        "push rbx",
        "call r_inner",
        "pop rbx",
        "ret",
        ".globl r_inner",
        "r_inner:",
        "sub rsp, 8",
        "call r_escape",
        "ud2",
        // escape_point(buf, f): saves the callee-saved registers, the stack
        // pointer and the return address in `buf`, calls f(buf); returns 0 if
        // f returned, 1 if something escaped to `buf`.
        ".globl r_escape_point",
        "r_escape_point:",
        "mov [rdi], rbx",
        "mov [rdi + 8], rbp",
        "mov [rdi + 16], r12",
        "mov [rdi + 24], r13",
        "mov [rdi + 32], r14",
        "mov [rdi + 40], r15",
        "lea rax, [rsp + 8]",
        "mov [rdi + 48], rax",
        "mov rax, [rsp]",
        "mov [rdi + 56], rax",
        "sub rsp, 8",
        "call rsi",
        "add rsp, 8",
        "xor eax, eax",
        "ret",
        // escape(buf): back to the escape point, returning 1 there
        ".globl r_escape",
        "r_escape:",
        "mov rbx, [rdi]",
        "mov rbp, [rdi + 8]",
        "mov r12, [rdi + 16]",
        "mov r13, [rdi + 24]",
        "mov r14, [rdi + 32]",
        "mov r15, [rdi + 40]",
        "mov rsp, [rdi + 48]",
        "mov eax, 1",
        "jmp qword ptr [rdi + 56]",
        // dies(x): the thread exits (exit(2), not exit_group) inside
        ".globl r_dies",
        "r_dies:",
        "push rbx",
        "xor edi, edi",
        "mov eax, 60",
        "syscall",
        "ud2",
    );
}

#[cfg(target_arch = "aarch64")]
mod fixtures {
    /// add1(x) = x + 1, under the name `$name`.
    macro_rules! add1 {
        ($name:literal) => {
            concat!(
                ".globl ",
                $name,
                "\n",
                $name,
                ":\n",
                "add x0, x0, #1\n",
                "ret\n"
            )
        };
    }

    /// sum(n) = n + sum(n - 1), sum(0) = 0, with a frame record.
    macro_rules! sum {
        ($name:literal) => {
            concat!(
                ".globl ",
                $name,
                "\n",
                $name,
                ":\n",
                "cbz x0, 2f\n",
                "stp x29, x30, [sp, #-32]!\n",
                "str x0, [sp, #16]\n",
                "sub x0, x0, #1\n",
                "bl ",
                $name,
                "\n",
                "ldr x1, [sp, #16]\n",
                "add x0, x0, x1\n",
                "ldp x29, x30, [sp], #32\n",
                "ret\n",
                "2:\n",
                "ret\n",
            )
        };
    }

    core::arch::global_asm!(
        ".text",
        add1!("r_add1_values"),
        add1!("r_add1_tail"),
        add1!("r_add1_skip"),
        add1!("r_add1_escape"),
        sum!("r_sum_change"),
        sum!("r_sum_order"),
        sum!("r_sum_limits"),
        // tail(x) = add1(x + 10): a tail call (b), LR untouched.
        ".globl r_tail",
        "r_tail:",
        "add x0, x0, #10",
        "b r_add1_tail",
        // A function as Debian 13 builds them: PAC-signed return address,
        // a BTI landing pad.
        ".globl r_pac",
        "r_pac:",
        "hint #25", // paciasp
        "stp x29, x30, [sp, #-16]!",
        "add x0, x0, #3",
        "ldp x29, x30, [sp], #16",
        "hint #29", // autiasp
        "ret",
        ".globl r_bti",
        "r_bti:",
        "hint #34", // bti c
        "add x0, x0, #4",
        "ret",
        // outer(buf) calls inner(buf), which escapes to buf.
        ".globl r_outer",
        "r_outer:",
        "stp x29, x30, [sp, #-16]!",
        "bl r_inner",
        "ldp x29, x30, [sp], #16",
        "ret",
        ".globl r_inner",
        "r_inner:",
        "stp x29, x30, [sp, #-16]!",
        "bl r_escape",
        "brk #1",
        // escape_point(buf, f): saves x19-x30 and sp in buf, calls f(buf);
        // 0 if f returned, 1 if something escaped to buf.
        ".globl r_escape_point",
        "r_escape_point:",
        "stp x19, x20, [x0, #0]",
        "stp x21, x22, [x0, #16]",
        "stp x23, x24, [x0, #32]",
        "stp x25, x26, [x0, #48]",
        "stp x27, x28, [x0, #64]",
        "stp x29, x30, [x0, #80]",
        "mov x2, sp",
        "str x2, [x0, #96]",
        "stp x29, x30, [sp, #-16]!",
        "blr x1",
        "ldp x29, x30, [sp], #16",
        "mov x0, #0",
        "ret",
        ".globl r_escape",
        "r_escape:",
        "ldp x19, x20, [x0, #0]",
        "ldp x21, x22, [x0, #16]",
        "ldp x23, x24, [x0, #32]",
        "ldp x25, x26, [x0, #48]",
        "ldp x27, x28, [x0, #64]",
        "ldp x29, x30, [x0, #80]",
        "ldr x2, [x0, #96]",
        "mov sp, x2",
        "mov x0, #1",
        "ret",
        // dies(x): the thread exits (exit(2)) inside.
        ".globl r_dies",
        "r_dies:",
        "stp x29, x30, [sp, #-16]!",
        "mov x0, #0",
        "mov x8, #93",
        "svc #0",
        "brk #1",
    );
}

/// What `r_escape_point` saves (the callee-saved registers, the stack
/// pointer, the way back).
type EscapeBuf = [u64; 16];

unsafe extern "C" {
    fn r_add1_values(x: u64) -> u64;
    fn r_add1_tail(x: u64) -> u64;
    fn r_add1_skip(x: u64) -> u64;
    fn r_add1_escape(x: u64) -> u64;
    fn r_sum_change(n: u64) -> u64;
    fn r_sum_order(n: u64) -> u64;
    fn r_sum_limits(n: u64) -> u64;
    fn r_tail(x: u64) -> u64;
    fn r_outer(buf: *mut EscapeBuf);
    fn r_inner();
    fn r_escape_point(buf: *mut EscapeBuf, f: unsafe extern "C" fn(*mut EscapeBuf)) -> u64;
    fn r_dies(x: u64) -> u64;
}

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

/// Waits (bounded, so a broken build fails instead of hanging) until
/// `done` holds.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn integer_returns_and_session_cookies() {
    static RET: AtomicU64 = AtomicU64::new(0);
    static COOKIE: AtomicU64 = AtomicU64::new(0);
    static RET_ADDR: AtomicU64 = AtomicU64::new(0);
    let probe = probe_at(fn_addr(r_add1_values))
        .on_entry(|cx| cx.set_cookie(cx.arg(0).unwrap().wrapping_mul(3)))
        .on_return(|cx| {
            RET.store(cx.return_value(), SeqCst);
            COOKIE.store(cx.cookie(), SeqCst);
            RET_ADDR.store(cx.return_addr() as u64, SeqCst);
            assert_eq!(cx.func_addr(), fn_addr(r_add1_values));
        })
        .attach()
        .unwrap();
    for x in [0u64, 5, 41, u64::MAX - 1] {
        assert_eq!(call(r_add1_values, x), x + 1);
        assert_eq!(RET.load(SeqCst), x + 1);
        assert_eq!(COOKIE.load(SeqCst), x.wrapping_mul(3));
        assert_ne!(RET_ADDR.load(SeqCst), 0);
    }
    assert_eq!(
        (probe.hits(), probe.returns(), probe.missed_returns()),
        (4, 4, 0)
    );
    assert_eq!(pending_returns(), 0);
    probe.detach().unwrap();
    assert_eq!(call(r_add1_values, 1), 2);
}

#[test]
fn a_return_handler_can_change_the_value_the_caller_sees() {
    let probe = probe_at(fn_addr(r_sum_change))
        .on_return(|cx| {
            if cx.return_value() == 6 {
                cx.set_return_value(600);
            }
        })
        .attach()
        .unwrap();
    assert_eq!(
        call(r_sum_change, 3),
        600,
        "sum(3) = 3 + sum(2) = 3 + 3 -> 600"
    );
    assert_eq!(call(r_sum_change, 4), 604, "the inner sum(3) is 6 -> 600");
    drop(probe);
}

// `r_flags(f)` returns with its status flags set to `f` (`popfq`);
// `r_flags_after(f)` calls it and returns the flags it sees just after
// the return: what a caller that keeps a condition across a call (code
// that assumes no convention) would test.
#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".globl r_flags",
    ".type r_flags, @function",
    "r_flags:",
    "push rdi",
    "popfq",
    "ret",
    ".size r_flags, . - r_flags",
    ".globl r_flags_after",
    "r_flags_after:",
    "call r_flags",
    "pushfq",
    "pop rax",
    "ret",
);

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    fn r_flags(flags: u64) -> u64;
    fn r_flags_after(flags: u64) -> u64;
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_status_flags_a_function_returns_with_reach_its_caller() {
    // CF PF AF ZF SF OF, each alone and together (bit 1 is always set).
    const STATUS: u64 = 0x8d5;
    let probe = probe_at(fn_addr(r_flags))
        .on_return(|cx| assert_eq!(cx.func_addr(), fn_addr(r_flags)))
        .attach()
        .unwrap();
    let cases = [0, 0x1, 0x4, 0x10, 0x40, 0x80, 0x800, STATUS, 0x841, 0x094];
    for f in cases {
        // SAFETY: sets only status flags (and the reserved bit 1).
        let seen = unsafe { r_flags_after(f | 2) };
        assert_eq!(seen & STATUS, f, "flags {f:#x} came back as {seen:#x}");
    }
    assert_eq!(probe.returns(), cases.len() as u64);
    drop(probe);
}

#[inline(never)]
extern "C" fn scaled(x: f64, factor: f64) -> f64 {
    std::hint::black_box(x * factor)
}

#[test]
fn floating_point_returns() {
    static BITS: AtomicU64 = AtomicU64::new(0);
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(scaled as *const () as usize) }
        .on_return(|cx| {
            BITS.store(cx.float_return().to_bits(), SeqCst);
            if cx.float_return() == 1.5 {
                cx.set_float_return(-1.0);
            }
        })
        .attach()
        .unwrap();
    assert_eq!(scaled(std::hint::black_box(2.5), 4.0), 10.0);
    assert_eq!(f64::from_bits(BITS.load(SeqCst)), 10.0);
    assert_eq!(scaled(std::hint::black_box(0.5), 3.0), -1.0);
    assert_eq!(probe.returns(), 2);
}

#[test]
fn recursion_runs_one_return_per_call() {
    static SEEN: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());
    let probe = probe_at(fn_addr(r_sum_order))
        .on_return(|cx| {
            // Test only: the lock is never held by probed code.
            SEEN.lock().unwrap().push(cx.return_value());
        })
        .attach()
        .unwrap();
    assert_eq!(call(r_sum_order, 5), 15);
    // Innermost first: sum(0), sum(1), ..., sum(5).
    assert_eq!(*SEEN.lock().unwrap(), [0, 1, 3, 6, 10, 15]);
    assert_eq!(probe.returns(), 6);
    assert_eq!(pending_returns(), 0);
}

#[test]
fn tail_calls_chain_onto_the_callers_return() {
    static ORDER: std::sync::Mutex<Vec<(usize, u64)>> = std::sync::Mutex::new(Vec::new());
    let record = |cx: &mut uprobe_core::ReturnContext<'_>| {
        ORDER
            .lock()
            .unwrap()
            .push((cx.func_addr(), cx.return_value()));
    };
    let probes = uprobe_core::Uprobe::attach_all([
        probe_at(fn_addr(r_tail)).on_return(record),
        probe_at(fn_addr(r_add1_tail)).on_return(record),
    ])
    .unwrap();
    assert_eq!(call(r_tail, 1), 12);
    // The tail-called add1 found its return address already hijacked: one
    // return, both handlers, the callee's first.
    assert_eq!(
        *ORDER.lock().unwrap(),
        [(fn_addr(r_add1_tail), 12), (fn_addr(r_tail), 12)]
    );
    assert_eq!(probes[0].returns() + probes[1].returns(), 2);
    assert_eq!(pending_returns(), 0);
}

#[test]
fn depth_and_in_flight_limits_count_missed_returns() {
    let deep = probe_at(fn_addr(r_sum_limits))
        .on_return(|_| {})
        .attach()
        .unwrap();
    // 101 nested calls: the first 64 are tracked, the deeper ones are not.
    assert_eq!(call(r_sum_limits, 100), 5050);
    assert_eq!((deep.returns(), deep.missed_returns()), (64, 37));
    drop(deep);

    let limited = probe_at(fn_addr(r_sum_limits))
        .on_return(|_| {})
        .max_active(nz(2))
        .attach()
        .unwrap();
    assert_eq!(call(r_sum_limits, 4), 10);
    assert_eq!((limited.returns(), limited.missed_returns()), (2, 3));
    assert_eq!(limited.in_flight(), Some(0));
}

#[test]
fn skip_return_leaves_a_call_untracked() {
    let probe = probe_at(fn_addr(r_add1_skip))
        .on_entry(|cx| {
            if cx.arg(0) == Some(7) {
                cx.skip_return();
            }
        })
        .on_return(|_| {})
        .attach()
        .unwrap();
    assert_eq!(call(r_add1_skip, 7), 8);
    assert_eq!(call(r_add1_skip, 8), 9);
    assert_eq!((probe.hits(), probe.returns()), (2, 1));
}

#[test]
fn longjmp_across_probed_frames() {
    let probes = uprobe_core::Uprobe::attach_all([
        probe_at(r_outer as *const () as usize).on_return(|_| {}),
        probe_at(fn_addr(r_add1_escape)).on_return(|_| {}),
        // SAFETY: inner is an asm function of this file.
        unsafe { uprobe_core::Uprobe::address(r_inner as *const () as usize) }.on_return(|_| {}),
    ])
    .unwrap();
    let mut buf = [0u64; 16];
    // SAFETY: the asm pair saves and restores exactly what the C ABI
    // preserves; the frames it skips are asm frames without destructors.
    let escaped = unsafe { r_escape_point(&raw mut buf, r_outer) };
    assert_eq!(escaped, 1);
    // Two frames were left without returning: their instances are still
    // on the stack (the thread's stack pointer is not above them yet).
    assert_eq!(pending_returns(), 2);
    // The same again: at outer's entry, its slot is the old outer's, so
    // both old instances are dropped (missed) before the new ones go on.
    // SAFETY: as above.
    assert_eq!(unsafe { r_escape_point(&raw mut buf, r_outer) }, 1);
    assert_eq!(pending_returns(), 2);
    assert_eq!(probes[0].missed_returns() + probes[2].missed_returns(), 2);
    // A probed call at the level of the abandoned frames drops them, and
    // its own return is handled.
    // SAFETY: add1 ignores the buffer (it returns its address + 1).
    let f: unsafe extern "C" fn(*mut EscapeBuf) =
        unsafe { core::mem::transmute(r_add1_escape as *const ()) };
    // SAFETY: as above.
    assert_eq!(unsafe { r_escape_point(&raw mut buf, f) }, 0);
    assert_eq!(pending_returns(), 0);
    assert_eq!(probes[0].missed_returns() + probes[2].missed_returns(), 4);
    assert_eq!((probes[1].returns(), probes[0].returns()), (1, 0));
}

#[inline(never)]
fn panics_on_seven(x: u64) -> u64 {
    assert!(std::hint::black_box(x) != 7, "seven");
    x * 2
}

#[test]
fn a_panic_unwinds_through_a_hijacked_frame() {
    let f: fn(u64) -> u64 = panics_on_seven;
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(f as *const () as usize) }
        .on_return(|_| {})
        .attach()
        .unwrap();
    assert_eq!(f(3), 6);
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    // The unwinder meets the trampoline's stub as the return address and
    // is led to the real caller by the stub's unwind information.
    let caught = std::panic::catch_unwind(|| f(std::hint::black_box(7)));
    std::panic::set_hook(hook);
    assert!(caught.is_err());
    assert_eq!(pending_returns(), 1, "the unwound frame's instance is left");
    assert_eq!(f(4), 8);
    assert_eq!(pending_returns(), 0, "dropped by the next hit");
    assert_eq!((probe.returns(), probe.missed_returns()), (2, 1));
}

/// The canonical frame addresses of the frames above the caller, as the
/// unwinder walks them (innermost first).
#[inline(never)]
fn unwinder_frames(_x: u64) -> u64 {
    unsafe extern "C" {
        fn _Unwind_Backtrace(
            trace: extern "C" fn(*mut core::ffi::c_void, *mut core::ffi::c_void) -> i32,
            arg: *mut core::ffi::c_void,
        ) -> i32;
        fn _Unwind_GetCFA(ctx: *mut core::ffi::c_void) -> usize;
    }
    extern "C" fn each(ctx: *mut core::ffi::c_void, arg: *mut core::ffi::c_void) -> i32 {
        // SAFETY: `arg` is the vector below; `ctx` is the unwinder's.
        unsafe { (*arg.cast::<Vec<usize>>()).push(_Unwind_GetCFA(ctx)) };
        0
    }
    let mut cfas: Vec<usize> = Vec::with_capacity(256);
    // SAFETY: the callback only pushes to `cfas`, within its capacity.
    unsafe { _Unwind_Backtrace(each, (&raw mut cfas).cast()) };
    // Frames (the outermost ones may report no CFA) and consecutive
    // frames that share a CFA, encoded as `frames << 16 | shared`.
    let frames = cfas.len() as u64;
    let shared = cfas
        .windows(2)
        .filter(|w| w[0] == w[1] && w[0] != 0)
        .count() as u64;
    std::hint::black_box(frames << 16 | shared)
}

#[test]
fn every_frame_through_a_hijacked_return_has_its_own_identity() {
    // An unwinder tells frames apart by their CFA (libgcc's second phase
    // stops at the frame whose CFA the first phase recorded): the stub
    // frame must not share its caller's, or a panic caught right in the
    // stub's caller aborts the process.
    let f: fn(u64) -> u64 = unwinder_frames;
    let plain = f(0);
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(f as *const () as usize) }
        .on_return(|_| {})
        .attach()
        .unwrap();
    let hijacked = f(0);
    assert_eq!(
        hijacked & 0xffff,
        plain & 0xffff,
        "a frame through the stub shares its caller's CFA"
    );
    assert_eq!(
        hijacked >> 16,
        (plain >> 16) + 1,
        "the stub is one frame more"
    );
    assert_eq!(probe.returns(), 1);
}

/// Panics below a hijacked frame and catches it in the stub's own caller
/// (a C-ABI function that unwinds).
#[inline(never)]
extern "C-unwind" fn c_unwind_panics_on_seven(x: u64) -> u64 {
    assert!(std::hint::black_box(x) != 7, "seven");
    x * 2
}

#[test]
fn a_panic_through_a_hijacked_c_unwind_frame_is_caught_by_its_caller() {
    let f: extern "C-unwind" fn(u64) -> u64 = c_unwind_panics_on_seven;
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(f as *const () as usize) }
        .on_return(|_| {})
        .attach()
        .unwrap();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let caught = std::panic::catch_unwind(|| f(std::hint::black_box(7)));
    std::panic::set_hook(hook);
    assert!(caught.is_err());
    assert_eq!(f(5), 10);
    assert_eq!(probe.returns(), 1);
}

/// A call pending on another thread when its probe is detached: by
/// default the detach frees the return handler at once and the call
/// returns normally, running nothing; with `return_after_detach` the
/// pending return keeps the handler (its lease expires into a reference
/// meanwhile) and runs it at the return, then lets it go.
#[test]
fn detach_while_a_return_is_pending_on_another_thread() {
    static INSIDE: AtomicBool = AtomicBool::new(false);
    static RELEASE: AtomicBool = AtomicBool::new(false);
    static HANDLER_DROPPED: AtomicBool = AtomicBool::new(false);

    #[inline(never)]
    extern "C" fn blocks(x: u64) -> u64 {
        INSIDE.store(true, SeqCst);
        while !RELEASE.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        x + 100
    }

    struct DropFlag;
    impl Drop for DropFlag {
        fn drop(&mut self) {
            HANDLER_DROPPED.store(true, SeqCst);
        }
    }

    for after_detach in [false, true] {
        for flag in [&INSIDE, &RELEASE, &HANDLER_DROPPED] {
            flag.store(false, SeqCst);
        }
        let ran = Arc::new(AtomicU64::new(0));
        let (ran2, flag) = (Arc::clone(&ran), DropFlag);
        // SAFETY: a function's address starts an instruction.
        let probe = unsafe { uprobe_core::Uprobe::address(blocks as *const () as usize) }
            .on_return(move |_| {
                let _keep = &flag;
                ran2.fetch_add(1, SeqCst);
            });
        let probe = if after_detach {
            probe.return_after_detach()
        } else {
            probe
        }
        .attach()
        .unwrap();
        let caller = std::thread::spawn(|| blocks(std::hint::black_box(1)));
        eventually("the caller is inside", || INSIDE.load(SeqCst));
        // Longer than the lease timeout: a pending return's lease expires
        // into a reference meanwhile.
        std::thread::sleep(Duration::from_millis(300));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(probe.detach()).unwrap());
        rx.recv_timeout(Duration::from_secs(30))
            .expect("detach waited for the pending return")
            .unwrap();
        if after_detach {
            assert!(
                !HANDLER_DROPPED.load(SeqCst),
                "freed under a pending return that runs it"
            );
        } else {
            eventually("the detached handler is dropped at once", || {
                HANDLER_DROPPED.load(SeqCst)
            });
        }
        RELEASE.store(true, SeqCst);
        assert_eq!(
            caller.join().unwrap(),
            101,
            "the blocked call returned wrong"
        );
        assert_eq!(
            ran.load(SeqCst),
            u64::from(after_detach),
            "return handlers run after detach (after_detach: {after_detach})"
        );
        eventually("the detached handler is dropped", || {
            HANDLER_DROPPED.load(SeqCst)
        });
    }
}

/// A pending return that holds nothing names its probe's switch and
/// generation: once the probe is detached, the switch serves the next
/// probe attached, and the old call's return reaches nothing of it.
#[test]
fn a_return_pending_from_a_detached_probe_reaches_nothing_of_the_next() {
    static INSIDE: AtomicBool = AtomicBool::new(false);
    static RELEASE: AtomicBool = AtomicBool::new(false);

    #[inline(never)]
    extern "C" fn waits(x: u64) -> u64 {
        INSIDE.store(true, SeqCst);
        while !RELEASE.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        x + 1
    }

    let first = Arc::new(AtomicU64::new(0));
    let first2 = Arc::clone(&first);
    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(waits as *const () as usize) }
        .on_return(move |_| {
            first2.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    let caller = std::thread::spawn(|| waits(std::hint::black_box(1)));
    eventually("the caller is inside", || INSIDE.load(SeqCst));
    probe.detach().unwrap();
    // The next probe on the same function (the first one's switch is
    // free again, and likely its).
    let next = Arc::new(AtomicU64::new(0));
    let next2 = Arc::clone(&next);
    // SAFETY: as above.
    let probe = unsafe { uprobe_core::Uprobe::address(waits as *const () as usize) }
        .on_return(move |_| {
            next2.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    RELEASE.store(true, SeqCst);
    assert_eq!(caller.join().unwrap(), 2);
    assert_eq!(
        (first.load(SeqCst), next.load(SeqCst)),
        (0, 0),
        "the old call's return ran a handler"
    );
    assert_eq!(waits(5), 6);
    assert_eq!(next.load(SeqCst), 1, "the next probe's own return");
    assert_eq!(probe.returns(), 1);
}

#[test]
fn a_thread_that_exits_with_returns_pending_releases_them() {
    extern "C" fn thread_main(_: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: r_dies ends this thread inside, with exit(2).
        unsafe { r_dies(0) };
        unreachable!()
    }
    let probe = probe_at(fn_addr(r_dies))
        .on_return(|_| {})
        .max_active(nz(4))
        .attach()
        .unwrap();
    for _ in 0..3 {
        // SAFETY: a plain pthread running a C-ABI function; joined below.
        unsafe {
            let mut t: libc::pthread_t = core::mem::zeroed();
            assert_eq!(
                libc::pthread_create(
                    &raw mut t,
                    core::ptr::null(),
                    thread_main,
                    core::ptr::null_mut()
                ),
                0
            );
            assert_eq!(libc::pthread_join(t, core::ptr::null_mut()), 0);
        }
    }
    assert_eq!(probe.hits(), 3);
    // The service thread notices the threads are gone and releases their
    // leases and in-flight charges.
    eventually("the dead threads' returns are released", || {
        probe.in_flight() == Some(0)
    });
    assert_eq!(probe.missed_returns(), 3);
}

#[test]
fn a_fork_child_with_pending_returns_continues() {
    static RETURNS: AtomicU64 = AtomicU64::new(0);

    /// Forks inside the probed call: the child inherits the pending
    /// return (the hijacked return address and the thread's stack).
    #[inline(never)]
    extern "C" fn forks() -> i64 {
        // SAFETY: the child only returns through the trampoline, checks
        // atomics and calls _exit.
        i64::from(unsafe { libc::fork() })
    }

    // SAFETY: a function's address starts an instruction.
    let probe = unsafe { uprobe_core::Uprobe::address(forks as *const () as usize) }
        .on_return(|cx| {
            RETURNS.fetch_add(1, SeqCst);
            let _ = cx.return_value();
        })
        .attach()
        .unwrap();
    let pid = std::hint::black_box(forks());
    if pid == 0 {
        // The child: back from the probed call, its return handler ran
        // here (in the child's copy of the counters), nothing is left.
        let ok = RETURNS.load(SeqCst) == 1 && pending_returns() == 0;
        // SAFETY: _exit is async-signal-safe and ends the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 3 }) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    assert_eq!(
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid as i32, &raw mut status, 0) },
        pid as i32
    );
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child did not return correctly (status {status:#x})"
    );
    assert_eq!(RETURNS.load(SeqCst), 1);
    assert_eq!(probe.returns(), 1);
}

// Functions as Debian 13 builds them, for the aarch64 tests below.
#[cfg(target_arch = "aarch64")]
unsafe extern "C" {
    fn r_pac(x: u64) -> u64;
    fn r_bti(x: u64) -> u64;
}

#[cfg(target_arch = "aarch64")]
#[test]
fn pointer_authentication_and_bti_entries() {
    static RETS: AtomicU64 = AtomicU64::new(0);
    let probes = uprobe_core::Uprobe::attach_all([
        probe_at(fn_addr(r_pac))
            .on_entry(|cx| assert_eq!(cx.arg(0), Some(10)))
            .on_return(|cx| {
                RETS.fetch_add(cx.return_value(), SeqCst);
            }),
        probe_at(fn_addr(r_bti)).on_return(|cx| {
            RETS.fetch_add(cx.return_value(), SeqCst);
        }),
    ])
    .unwrap();
    // Under CI's emulator the CPU model must implement what is tested.
    if std::env::var_os("QEMU_CPU").is_some() {
        // SAFETY: getauxval has no preconditions.
        let (hwcap, hwcap2) = unsafe {
            (
                libc::getauxval(libc::AT_HWCAP),
                libc::getauxval(libc::AT_HWCAP2),
            )
        };
        assert!(
            hwcap >> 30 & 1 == 1,
            "the CPU model has no pointer authentication"
        );
        assert!(hwcap2 >> 17 & 1 == 1, "the CPU model has no BTI");
    }
    // paciasp runs out of line and signs the hijacked return address;
    // autiasp authenticates it; ret goes through the trampoline.
    assert_eq!(call(r_pac, 10), 13);
    assert_eq!(call(r_bti, 10), 14);
    assert_eq!(RETS.load(SeqCst), 27);
    assert_eq!((probes[0].hits(), probes[1].returns()), (1, 1));
}

#[cfg(target_arch = "aarch64")]
/// A function on a BTI-guarded page (`PROT_BTI`), entered by `blr` as
/// any call through a pointer: its `bti c` is simulated, its return goes
/// through the trampoline (which returns with `ret`), and the page stays
/// guarded where the kernel shows it.
#[test]
fn a_function_on_a_bti_guarded_page() {
    let f = common::bti_guarded_function(&[
        0xd503_245f, // bti c
        0x9100_1000, // add x0, x0, #4
        0xd65f_03c0, // ret
    ]);
    static RET: AtomicU64 = AtomicU64::new(0);
    let probe = probe_at(f as *const () as usize)
        .on_return(|cx| RET.store(cx.return_value(), SeqCst))
        .attach()
        .unwrap();
    assert_eq!(call(f, 38), 42);
    assert_eq!((probe.hits(), RET.load(SeqCst)), (1, 42));
    drop(probe);
    assert_eq!(call(f, 1), 5);
}
