//! Timing probes (`Uprobe::time_into`): every call counted, every return
//! timed into the right log2 bucket (but for calls nested in the engine,
//! counted as missed), exactly, from threads that migrate,
//! from signal handlers that interrupt a timed call, through recursion,
//! tail calls and unwinding, and with a handler probe sharing the site
//! (which sends hits through the engine's path instead of the
//! trampoline's own).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use common::{call, fn_addr, probe_at, waits};
use uprobe_core::{AttachError, LatencyCell, Uprobe, latency_cells};

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl timed_fn",
    ".type timed_fn, @function",
    "timed_fn:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "lea rax, [rdi + 1]",
    "ret",
    ".size timed_fn, . - timed_fn",
    // A tail call into `timed_fn`: both probes' calls end at one return.
    ".globl tail_fn",
    ".type tail_fn, @function",
    "tail_fn:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "jmp timed_fn",
    ".size tail_fn, . - tail_fn",
);

#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".text",
    ".globl timed_fn",
    ".type timed_fn, %function",
    "timed_fn:",
    "nop",
    "add x0, x0, #1",
    "ret",
    ".size timed_fn, . - timed_fn",
    ".globl tail_fn",
    ".type tail_fn, %function",
    "tail_fn:",
    "nop",
    "b timed_fn",
    ".size tail_fn, . - tail_fn",
);

unsafe extern "C" {
    fn timed_fn(x: u64) -> u64;
    fn tail_fn(x: u64) -> u64;
}

/// Serialises the tests of this file: several time the same function.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn cells() -> &'static [LatencyCell] {
    Box::leak((0..latency_cells()).map(|_| LatencyCell::new()).collect())
}

fn returns(cells: &[LatencyCell]) -> u64 {
    LatencyCell::histogram(cells).iter().sum()
}

fn timing_probe(
    f: unsafe extern "C" fn(u64) -> u64,
    cells: &'static [LatencyCell],
) -> uprobe_core::Probe {
    probe_at(fn_addr(f)).time_into(cells).attach().unwrap()
}

#[test]
fn calls_and_returns_are_exact_from_threads_that_migrate() {
    let _s = serial();
    let cells = cells();
    let probe = timing_probe(timed_fn, cells);
    #[cfg(target_arch = "x86_64")]
    assert!(probe.mode().is_jump(), "{:?}", probe.mode());
    let made = common::calls_from_migrating_threads(
        timed_fn,
        4,
        if common::emulated() { 5_000 } else { 50_000 },
    );
    assert_eq!(probe.hits(), made);
    assert_eq!(LatencyCell::total_calls(cells), made);
    assert_eq!((returns(cells), probe.returns()), (made, made));
    probe.detach().unwrap();
    assert_eq!(call(timed_fn, 1), 2);
    assert_eq!(
        LatencyCell::total_calls(cells),
        made,
        "counted after detach"
    );
}

#[inline(never)]
extern "C" fn sleeps(ms: u64) -> u64 {
    std::thread::sleep(Duration::from_millis(ms));
    std::hint::black_box(ms)
}

#[test]
fn a_call_lands_in_the_bucket_of_its_duration() {
    let _s = serial();
    let cells = cells();
    let probe = probe_at(sleeps as *const () as usize)
        .time_into(cells)
        .attach()
        .unwrap();
    for _ in 0..3 {
        assert_eq!(sleeps(4), 4);
    }
    let hist = LatencyCell::histogram(cells);
    // A 4 ms sleep takes at least 4 ms, and (however loaded the machine)
    // well under 4 s: between the buckets of those two.
    let (lo, hi) = (
        LatencyCell::bucket_of(4_000_000),
        LatencyCell::bucket_of(4_000_000_000),
    );
    assert_eq!(hist[lo..hi].iter().sum::<u64>(), 3, "{hist:?}");
    assert_eq!(probe.hits(), 3);
    drop(probe);
}

#[inline(never)]
extern "C" fn recurses(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        std::hint::black_box(recurses(std::hint::black_box(n - 1))) + 1
    }
}

#[test]
fn recursive_calls_are_each_timed() {
    let _s = serial();
    let cells = cells();
    let probe = probe_at(recurses as *const () as usize)
        .time_into(cells)
        .attach()
        .unwrap();
    // 21 calls each: within the 32 a thread may have pending.
    for _ in 0..100 {
        assert_eq!(recurses(20), 20);
    }
    assert_eq!(probe.hits(), 2_100);
    assert_eq!(returns(cells), 2_100);
    // Deeper than that: every call counted, the deepest not timed.
    assert_eq!(recurses(40), 40);
    assert_eq!(probe.hits(), 2_141);
    assert!(returns(cells) < 2_141);
    drop(probe);
}

#[test]
fn a_tail_call_ends_both_timed_calls_at_one_return() {
    let _s = serial();
    let (outer, inner) = (cells(), cells());
    let probes = [timing_probe(tail_fn, outer), timing_probe(timed_fn, inner)];
    for i in 0..1_000 {
        assert_eq!(call(tail_fn, i), i + 1);
    }
    assert_eq!((returns(outer), returns(inner)), (1_000, 1_000));
    assert_eq!((probes[0].hits(), probes[1].hits()), (1_000, 1_000));
}

#[inline(never)]
extern "C-unwind" fn panics(x: u64) -> u64 {
    assert!(
        std::hint::black_box(x) != 7,
        "unwinding through a timed call"
    );
    x + 1
}

#[test]
fn a_call_left_by_unwinding_is_counted_not_timed() {
    let _s = serial();
    let cells = cells();
    let probe = probe_at(panics as *const () as usize)
        .time_into(cells)
        .attach()
        .unwrap();
    for i in 0..10 {
        let r = std::panic::catch_unwind(|| panics(i));
        assert_eq!(r.is_err(), i == 7);
    }
    assert_eq!(probe.hits(), 10);
    assert_eq!(returns(cells), 9);
    drop(probe);
}

/// Calls made by the signal handler below.
static IN_HANDLER: AtomicU64 = AtomicU64::new(0);

extern "C" fn time_in_handler(_: libc::c_int) {
    assert_eq!(call(timed_fn, 41), 42);
    IN_HANDLER.fetch_add(1, SeqCst);
}

#[test]
fn signal_handlers_timing_the_same_function_mid_call_lose_nothing() {
    let _s = serial();
    // A handler for SIGUSR1, which nothing else in this
    // test binary uses; the handler only calls the timed function and
    // adds to an atomic (async-signal-safe).
    common::install(libc::SIGUSR1, time_in_handler, libc::SA_RESTART);
    let cells = cells();
    let probe = timing_probe(timed_fn, cells);
    let done = AtomicBool::new(false);
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() } as usize;
    let made = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(SeqCst) {
                // SAFETY: the calling test's thread is alive until `done`.
                unsafe { libc::pthread_kill(target as libc::pthread_t, libc::SIGUSR1) };
                std::thread::sleep(Duration::from_micros(50));
            }
        });
        let n = if common::emulated() { 20_000 } else { 200_000 };
        for i in 0..n {
            assert_eq!(call(timed_fn, i), i + 1);
        }
        done.store(true, SeqCst);
        n
    });
    let total = made + IN_HANDLER.load(SeqCst);
    assert!(IN_HANDLER.load(SeqCst) > 0);
    assert_eq!(probe.hits(), total);
    // A handler's call while the thread was inside the engine is counted
    // (and missed), not timed; every other call is timed.
    assert_eq!(returns(cells) + probe.missed(), total);
    drop(probe);
}

#[test]
fn a_handler_probe_on_the_site_keeps_the_counts_exact() {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let _s = serial();
    let cells = cells();
    let timing = timing_probe(timed_fn, cells);
    for i in 0..1_000 {
        call(timed_fn, i);
    }
    let handler = probe_at(fn_addr(timed_fn))
        .on_entry(|_| {
            SEEN.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    for i in 0..1_000 {
        call(timed_fn, i);
    }
    drop(handler);
    for i in 0..1_000 {
        call(timed_fn, i);
    }
    assert_eq!(SEEN.load(SeqCst), 1_000);
    assert_eq!((timing.hits(), returns(cells)), (3_000, 3_000));
    drop(timing);
}

#[test]
fn a_thread_not_observed_counts_no_call() {
    let _s = serial();
    let cells = cells();
    let probe = timing_probe(timed_fn, cells);
    std::thread::spawn(|| {
        uprobe_core::set_thread_observed(false);
        for i in 0..100 {
            call(timed_fn, i);
        }
    })
    .join()
    .unwrap();
    assert_eq!((probe.hits(), returns(cells)), (0, 0));
    drop(probe);
}

#[test]
fn bad_timing_probes_are_refused_at_attach() {
    let _s = serial();
    let few: &'static [LatencyCell] = Box::leak(Box::new([LatencyCell::new()]));
    assert!(matches!(
        probe_at(fn_addr(timed_fn)).time_into(few).attach(),
        Err(AttachError::TooFewLatencyCells { given: 1, .. })
    ));
    let counts: &'static [uprobe_core::CountCell] = Box::leak(
        (0..uprobe_core::count_cells())
            .map(|_| uprobe_core::CountCell::new())
            .collect(),
    );
    assert_eq!(
        probe_at(fn_addr(timed_fn))
            .count_into(counts)
            .time_into(cells())
            .attach()
            .err(),
        Some(AttachError::CountAndTime)
    );
    let inside = Uprobe::at(fn_addr(timed_fn) + if cfg!(target_arch = "x86_64") { 5 } else { 4 })
        .unwrap()
        .time_into(cells())
        .attach();
    assert!(
        matches!(inside, Err(AttachError::ReturnProbeNotAtEntry { .. })),
        "{inside:?}"
    );
}

#[test]
fn timing_probes_attach_and_detach_under_callers() {
    let _s = serial();
    let stop = AtomicBool::new(false);
    let rounds = if common::emulated() { 40 } else { 300 };
    std::thread::scope(|s| {
        for t in 0..2 {
            let stop = &stop;
            s.spawn(move || {
                let mut x = t;
                while !stop.load(SeqCst) {
                    assert_eq!(call(timed_fn, x), x + 1);
                    x = (x + 2) % 1_000_000;
                }
            });
        }
        let _stop = common::StopOnDrop(&stop);
        for round in 0..rounds {
            let cells = cells();
            let probe = timing_probe(timed_fn, cells);
            // Every other round, a handler probe joins and leaves again:
            // the trampoline goes to the engine's routine and back.
            if round % 2 == 1 {
                drop(
                    probe_at(fn_addr(timed_fn))
                        .on_entry(|_| {})
                        .attach()
                        .unwrap(),
                );
            }
            let before = probe.hits();
            assert_eq!(call(timed_fn, 1), 2);
            assert!(
                probe.hits() > before,
                "a call while attached was not counted"
            );
            probe.detach().unwrap();
            let counted = LatencyCell::total_calls(cells);
            std::thread::yield_now();
            assert_eq!(
                LatencyCell::total_calls(cells),
                counted,
                "counted after detach"
            );
            // Calls pending at the detach return untimed.
            assert!(returns(cells) <= counted);
        }
    });
}

/// Every general register and status flag comes back from a timed call
/// (and from a call a return probe tracks) as the callee left it: the
/// timed entry, return entry and return routines, and the engine's
/// routines they hand over to, save what they use.
#[cfg(target_arch = "x86_64")]
mod registers {
    use super::{cells, serial, timing_probe};
    use common::{fn_addr, probe_at};

    use super::common;

    /// rax, rcx, rdx, rbx, rsp (unused), rbp, rsi, rdi, r8..r15, flags.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct Regs {
        gpr: [u64; 16],
        flags: u64,
    }

    core::arch::global_asm!(
        ".text",
        // `preserving_fn`: touches nothing (a 5-byte nop, then `ret`).
        ".globl preserving_fn",
        ".type preserving_fn, @function",
        "preserving_fn:",
        ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
        "ret",
        ".size preserving_fn, . - preserving_fn",
        // `call_with_regs(regs)`: loads every register and the flags from
        // `regs`, calls `preserving_fn`, stores them back.
        ".globl call_with_regs",
        ".type call_with_regs, @function",
        "call_with_regs:",
        "push rbx\n push rbp\n push r12\n push r13\n push r14\n push r15",
        "mov [rip + cwr_ptr], rdi",
        "push qword ptr [rdi + 128]\n popfq",
        "mov rax, [rdi]\n mov rcx, [rdi + 8]\n mov rdx, [rdi + 16]\n mov rbx, [rdi + 24]",
        "mov rbp, [rdi + 40]\n mov rsi, [rdi + 48]",
        "mov r8, [rdi + 64]\n mov r9, [rdi + 72]\n mov r10, [rdi + 80]\n mov r11, [rdi + 88]",
        "mov r12, [rdi + 96]\n mov r13, [rdi + 104]\n mov r14, [rdi + 112]\n mov r15, [rdi + 120]",
        "mov rdi, [rdi + 56]",
        "call preserving_fn",
        "mov [rip + cwr_scratch], rdi",
        "pushfq\n pop rdi\n mov [rip + cwr_flags], rdi",
        "mov rdi, [rip + cwr_ptr]",
        "mov [rdi], rax\n mov [rdi + 8], rcx\n mov [rdi + 16], rdx\n mov [rdi + 24], rbx",
        "mov [rdi + 40], rbp\n mov [rdi + 48], rsi",
        "mov [rdi + 64], r8\n mov [rdi + 72], r9\n mov [rdi + 80], r10\n mov [rdi + 88], r11",
        "mov [rdi + 96], r12\n mov [rdi + 104], r13\n mov [rdi + 112], r14\n mov [rdi + 120], r15",
        "mov rax, [rip + cwr_scratch]\n mov [rdi + 56], rax",
        "mov rax, [rip + cwr_flags]\n mov [rdi + 128], rax",
        "pop r15\n pop r14\n pop r13\n pop r12\n pop rbp\n pop rbx",
        "ret",
        ".size call_with_regs, . - call_with_regs",
        ".data",
        "cwr_ptr: .quad 0",
        "cwr_scratch: .quad 0",
        "cwr_flags: .quad 0",
        ".text",
    );

    unsafe extern "C" {
        fn preserving_fn(x: u64) -> u64;
        fn call_with_regs(regs: *mut Regs);
    }

    fn run(flags: u64) -> Regs {
        let mut regs = Regs {
            gpr: core::array::from_fn(|i| {
                0x0101_0101_0101_0101u64.wrapping_mul(i as u64 + 1) ^ 0x8000_0000_0000_0001
            }),
            flags,
        };
        // SAFETY: loads and stores `regs` only, calls a function that
        // touches nothing; the callee-saved registers are restored.
        unsafe { call_with_regs(&raw mut regs) };
        regs.gpr[4] = 0;
        regs
    }

    /// Status flags in several combinations (OF alone, all of them, none),
    /// with IF and the reserved bit as user code always has them.
    const FLAGS: [u64; 4] = [0x202, 0x202 | 0x8d5, 0x202 | 0x800, 0x202 | 0x41];

    #[test]
    fn timed_calls_preserve_every_register_and_flag() {
        let _s = serial();
        let plain: Vec<Regs> = FLAGS.iter().map(|&f| run(f)).collect();
        let probe = timing_probe(preserving_fn, cells());
        assert!(probe.mode().is_jump(), "{:?}", probe.mode());
        // Through the timed routines (the first call makes the stub).
        for _ in 0..2 {
            let timed: Vec<Regs> = FLAGS.iter().map(|&f| run(f)).collect();
            assert_eq!(timed, plain);
        }
        // Through the engine's routines (a handler probe shares the site).
        let other = probe_at(fn_addr(preserving_fn))
            .on_entry(|_| {})
            .attach()
            .unwrap();
        let engine: Vec<Regs> = FLAGS.iter().map(|&f| run(f)).collect();
        assert_eq!(engine, plain);
        drop(other);
        assert_eq!(probe.hits(), 3 * FLAGS.len() as u64);
        drop(probe);
    }

    /// The same through a return probe with no entry handler: the return
    /// entry routine, then the stub's return routine and the engine's
    /// return trampoline, which runs the handler.
    #[test]
    fn return_probe_calls_preserve_every_register_and_flag() {
        let _s = serial();
        let plain: Vec<Regs> = FLAGS.iter().map(|&f| run(f)).collect();
        let probe = probe_at(fn_addr(preserving_fn))
            .on_return(|_| {})
            .attach()
            .unwrap();
        assert!(probe.mode().is_jump(), "{:?}", probe.mode());
        assert_eq!(
            uprobe_core::testing::entry_route(fn_addr(preserving_fn)),
            Some(uprobe_core::testing::EntryRoute::Returns)
        );
        for _ in 0..2 {
            let tracked: Vec<Regs> = FLAGS.iter().map(|&f| run(f)).collect();
            assert_eq!(tracked, plain);
        }
        assert_eq!(
            (probe.hits(), probe.returns()),
            (2 * FLAGS.len() as u64, 2 * FLAGS.len() as u64)
        );
        drop(probe);
    }
}

/// A call pending when its probe is detached returns normally and writes
/// nothing into the cells, which the caller may unmap once the detach
/// returned (as a tool does with a shared report).
#[test]
fn a_call_pending_at_detach_writes_nothing_after_it() {
    let _s = serial();
    let n = latency_cells();
    let len = n * size_of::<LatencyCell>();
    // SAFETY: a fresh anonymous mapping, zeroed (a zero `LatencyCell`).
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: `n` zeroed cells, page-aligned; unmapped only once the
    // probe is detached, and not read after.
    let cells: &'static [LatencyCell] = unsafe { core::slice::from_raw_parts(p.cast(), n) };
    let probe = probe_at(fn_addr(waits)).time_into(cells).attach().unwrap();
    let caller = common::call_waiting(41);
    assert_eq!(probe.hits(), 1);
    probe.detach().unwrap();
    // SAFETY: the probe is detached: nothing writes to the cells now.
    assert_eq!(unsafe { libc::munmap(p, len) }, 0);
    common::release_waiting();
    assert_eq!(caller.join().unwrap(), 42);
}
