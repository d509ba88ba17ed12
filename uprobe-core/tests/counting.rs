//! Counting probes (no handler): where the site takes a jump, the
//! trampoline counts each hit itself on its CPU. The counts must be
//! exact: from several threads that migrate between CPUs mid-run, from
//! signal handlers that interrupt a count and hit the probe themselves,
//! in a forked child, and across a handler probe joining and leaving the
//! address (which turns the trampoline's counting off and on again).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use common::{StopOnDrop, call, churn_under_callers, fn_addr, probe_at};

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl counted_fn",
    ".type counted_fn, @function",
    "counted_fn:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "lea rax, [rdi + 1]",
    "ret",
    ".size counted_fn, . - counted_fn",
);

#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".text",
    ".globl counted_fn",
    ".type counted_fn, %function",
    "counted_fn:",
    "nop",
    "add x0, x0, #1",
    "ret",
    ".size counted_fn, . - counted_fn",
);

unsafe extern "C" {
    fn counted_fn(x: u64) -> u64;
}

/// Serialises the tests of this file: each counts every call of the same
/// function.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn counting_probe() -> uprobe_core::Probe {
    let probe = probe_at(fn_addr(counted_fn)).attach().unwrap();
    #[cfg(target_arch = "x86_64")]
    assert!(probe.mode().is_jump(), "{:?}", probe.mode());
    probe
}

#[test]
fn counts_are_exact_from_threads_that_migrate() {
    let _s = serial();
    let probe = counting_probe();
    let calls = common::calls_from_migrating_threads(
        counted_fn,
        4,
        if common::emulated() { 10_000 } else { 100_000 },
    );
    assert_eq!(probe.hits(), calls);
    probe.detach().unwrap();
}

/// Calls made by the signal handler below.
static IN_HANDLER: AtomicU64 = AtomicU64::new(0);

extern "C" fn hit_in_handler(_: libc::c_int) {
    assert_eq!(call(counted_fn, 41), 42);
    IN_HANDLER.fetch_add(1, SeqCst);
}

#[test]
fn counts_are_exact_when_signal_handlers_hit_the_probe_mid_count() {
    let _s = serial();
    // A handler for SIGUSR2, which nothing else in this
    // test binary uses; the handler only calls the probed function and
    // adds to an atomic (async-signal-safe).
    common::install(libc::SIGUSR2, hit_in_handler, libc::SA_RESTART);
    IN_HANDLER.store(0, SeqCst);
    let probe = counting_probe();
    let stop = AtomicBool::new(false);
    let thread = std::sync::atomic::AtomicUsize::new(0);
    let calls = std::thread::scope(|s| {
        let worker = s.spawn(|| {
            // SAFETY: pthread_self has no preconditions.
            thread.store(unsafe { libc::pthread_self() } as usize, SeqCst);
            let mut calls = 0u64;
            while !stop.load(SeqCst) {
                assert_eq!(call(counted_fn, calls), calls + 1);
                calls += 1;
            }
            calls
        });
        let _stop = StopOnDrop(&stop);
        // Signals until a few hundred were handled (or a few seconds went
        // by: an emulator delivers them slowly).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while IN_HANDLER.load(SeqCst) < 300 && std::time::Instant::now() < deadline {
            let t = thread.load(SeqCst);
            if t != 0 {
                // SAFETY: the worker runs until `stop` (it is joined below).
                unsafe { libc::pthread_kill(t as libc::pthread_t, libc::SIGUSR2) };
            }
            std::thread::yield_now();
        }
        stop.store(true, SeqCst);
        worker.join().expect("the worker")
    });
    // The worker is joined: every signal it got was handled by then.
    let handled = IN_HANDLER.load(SeqCst);
    assert!(handled > 0, "no signal was handled");
    assert_eq!(
        probe.hits(),
        calls + handled,
        "{calls} calls, {handled} in handlers"
    );
    probe.detach().unwrap();
}

#[test]
fn a_forked_child_counts_on_from_the_parents_count() {
    let _s = serial();
    if common::emulated() {
        println!("under an emulator: fork is not tested");
        return;
    }
    let probe = counting_probe();
    for i in 0..1_000 {
        call(counted_fn, i);
    }
    // SAFETY: the child only calls the probed function, reads the count
    // and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        for i in 0..500 {
            call(counted_fn, i);
        }
        let ok = probe.hits() == 1_500;
        // SAFETY: leaves the child without running the parent's tests.
        unsafe { libc::_exit(i32::from(!ok)) };
    }
    assert!(pid > 0, "fork failed");
    let mut status = 0;
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's count was not 1,500 (status {status:#x})"
    );
    assert_eq!(probe.hits(), 1_000, "the child's calls reached the parent");
    probe.detach().unwrap();
}

#[test]
fn a_handler_joining_and_leaving_loses_no_count() {
    let _s = serial();
    let probe = counting_probe();
    let stop = AtomicBool::new(false);
    let calls = AtomicU64::new(0);
    let handled = std::sync::Arc::new(AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..2 {
            let (stop, calls) = (&stop, &calls);
            s.spawn(move || {
                let mut i = t;
                while !stop.load(SeqCst) {
                    assert_eq!(call(counted_fn, i), i + 1);
                    calls.fetch_add(1, SeqCst);
                    i += 2;
                }
            });
        }
        let _stop = StopOnDrop(&stop);
        for _ in 0..50 {
            // A handler at the same address: every hit now runs the
            // engine (which counts for both), until it leaves.
            let seen = std::sync::Arc::clone(&handled);
            let with_handler = probe_at(fn_addr(counted_fn))
                .on_entry(move |_| {
                    seen.fetch_add(1, SeqCst);
                })
                .attach()
                .unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2));
            let its_hits = with_handler.hits();
            with_handler.detach().unwrap();
            assert!(its_hits <= handled.load(SeqCst));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    });
    assert_eq!(probe.hits(), calls.load(SeqCst));
    assert!(handled.load(SeqCst) > 0);
    probe.detach().unwrap();
}

#[test]
fn counting_probes_attach_and_detach_under_callers() {
    let _s = serial();
    let rounds = if common::emulated() { 50 } else { 300 };
    churn_under_callers(counted_fn, |x| x + 1, 2, rounds);
}

/// `count_cells()` cells in a shared anonymous mapping (a fork child
/// writes to the parent's), leaked: probes may count into them for the
/// rest of the process.
fn shared_cells() -> &'static [uprobe_core::CountCell] {
    let n = uprobe_core::count_cells();
    let len = n * size_of::<uprobe_core::CountCell>();
    // SAFETY: a fresh shared anonymous mapping, zeroed, page-aligned.
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
    // SAFETY: `len` zeroed bytes, aligned (a page), never unmapped; zero
    // is a `CountCell` at zero.
    unsafe { core::slice::from_raw_parts(p.cast::<uprobe_core::CountCell>(), n) }
}

#[test]
fn counts_into_caller_cells_are_exact_from_threads_and_a_child() {
    let _s = serial();
    let memory = shared_cells();
    let probe = probe_at(fn_addr(counted_fn))
        .count_into(memory)
        .attach()
        .unwrap();
    #[cfg(target_arch = "x86_64")]
    assert!(probe.mode().is_jump(), "{:?}", probe.mode());
    let mut expected = common::calls_from_migrating_threads(
        counted_fn,
        3,
        if common::emulated() { 5_000 } else { 50_000 },
    );
    assert_eq!(probe.hits(), expected);
    assert_eq!(uprobe_core::CountCell::sum(memory), expected);
    if !common::emulated() {
        // SAFETY: the child only calls the probed function and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            for i in 0..500 {
                call(counted_fn, i);
            }
            // SAFETY: leaves the child without running the parent's tests.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
        // The child's counts are in the shared cells.
        expected += 500;
        assert_eq!(uprobe_core::CountCell::sum(memory), expected);
    }
    // A probe with a handler at the same address: every hit runs the
    // engine, which counts the counting probe's in the last cell.
    let with_handler = probe_at(fn_addr(counted_fn))
        .on_entry(|_| {})
        .attach()
        .unwrap();
    for i in 0..100 {
        call(counted_fn, i);
    }
    with_handler.detach().unwrap();
    expected += 100;
    assert_eq!(probe.hits(), expected);
    probe.detach().unwrap();
    // Detached: nothing counts any more.
    call(counted_fn, 1);
    assert_eq!(uprobe_core::CountCell::sum(memory), expected);
}

#[test]
fn a_handler_probe_counts_the_hits_it_ran_into_caller_cells() {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let _s = serial();
    let cells = shared_cells();
    let probe = probe_at(fn_addr(counted_fn))
        .count_into(cells)
        .on_entry(|_| {
            SEEN.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    for i in 0..1_000 {
        call(counted_fn, i);
    }
    assert_eq!(SEEN.load(SeqCst), 1_000);
    assert_eq!(uprobe_core::CountCell::sum(cells), 1_000);
    assert_eq!(probe.hits(), 1_000);
    probe.detach().unwrap();
}

#[test]
fn too_few_count_cells_are_refused_at_attach() {
    let cells: &'static [uprobe_core::CountCell] = Box::leak(Box::new([]));
    let e = probe_at(fn_addr(counted_fn))
        .count_into(cells)
        .attach()
        .expect_err("refused");
    assert!(
        matches!(
            e,
            uprobe_core::AttachError::TooFewCountCells { given: 0, needed } if needed == uprobe_core::count_cells()
        ),
        "{e}"
    );
}

#[cfg(target_arch = "x86_64")]
core::arch::global_asm!(
    ".text",
    ".globl handled_fn",
    ".type handled_fn, @function",
    "handled_fn:",
    ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00",
    "lea rax, [rdi + 2]",
    "ret",
    ".size handled_fn, . - handled_fn",
);

#[cfg(target_arch = "aarch64")]
core::arch::global_asm!(
    ".text",
    ".globl handled_fn",
    ".type handled_fn, %function",
    "handled_fn:",
    "nop",
    "add x0, x0, #2",
    "ret",
    ".size handled_fn, . - handled_fn",
);

unsafe extern "C" {
    fn handled_fn(x: u64) -> u64;
}

#[test]
fn a_thread_not_observed_runs_no_handler_and_counts_nothing() {
    static RAN: AtomicU64 = AtomicU64::new(0);
    static TRAPPED: AtomicU64 = AtomicU64::new(0);
    let _s = serial();
    // A counting probe, and a handler probe whose handler calls the
    // counted function (a hit nested in the engine, which counts).
    let counting = counting_probe();
    let handled = probe_at(fn_addr(handled_fn))
        .on_entry(|_| {
            RAN.fetch_add(1, SeqCst);
            call(counted_fn, 0);
        })
        .attach()
        .unwrap();
    // The handler probe's second instruction on a breakpoint: the other
    // way in.
    let second = if cfg!(target_arch = "x86_64") { 5 } else { 4 };
    let on_trap = probe_at(fn_addr(handled_fn) + second)
        .trap_only()
        .on_entry(|_| {
            TRAPPED.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(uprobe_core::set_thread_observed(false));
            for i in 0..1_000 {
                assert_eq!(call(counted_fn, i), i + 1);
                assert_eq!(call(handled_fn, i), i + 2);
            }
            assert!(!uprobe_core::set_thread_observed(true));
            // Observed again.
            call(counted_fn, 0);
            call(handled_fn, 0);
        });
    });
    // The observed calls only: one of each, and the nested call of the
    // counted function from the handler.
    assert_eq!(RAN.load(SeqCst), 1);
    assert_eq!(TRAPPED.load(SeqCst), 1);
    assert_eq!(counting.hits(), 2);
    assert_eq!(handled.missed(), 0);
    for p in [counting, handled, on_trap] {
        p.detach().unwrap();
    }
}
