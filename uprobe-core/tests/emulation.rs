//! Entry probes on functions with exactly known bytes: every emulated
//! instruction class gives the same results with and without the probe,
//! handlers see the registers and may change them, refusals say why.
#![cfg(target_arch = "x86_64")]

mod common;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};

use common::{HitsPerCall, byte_at, call, fn_addr, probe_at, same_with_probe};
use uprobe_core::{AttachError, Reg};

core::arch::global_asm!(
    ".text",
    // nop; rax = rdi + 1
    ".globl t_nop",
    "t_nop:",
    "nop",
    "lea rax, [rdi + 1]",
    "ret",
    // endbr64; rax = rdi + 2
    ".globl t_endbr",
    "t_endbr:",
    "endbr64",
    "lea rax, [rdi + 2]",
    "ret",
    // push rbp ... pop rbp; rax = rdi + 3 (and rbp survives)
    ".globl t_push",
    "t_push:",
    "push rbp",
    "mov rbp, 7",
    "lea rax, [rdi + 3]",
    "pop rbp",
    "ret",
    // push r15 (REX form)
    ".globl t_push_r15",
    "t_push_r15:",
    "push r15",
    "mov r15, 9",
    "lea rax, [rdi + 4]",
    "pop r15",
    "ret",
    // jmp rel8 over a ud2
    ".globl t_jmp8",
    "t_jmp8:",
    "jmp 2f",
    "ud2",
    "2:",
    "lea rax, [rdi + 5]",
    "ret",
    // jmp rel32
    ".globl t_jmp32",
    "t_jmp32:",
    ".byte 0xe9",
    ".long 2",
    "ud2",
    "lea rax, [rdi + 6]",
    "ret",
    // call rel32 to a helper; the helper sees the right return address
    ".globl t_call",
    "t_call:",
    "call 3f",
    "add rax, 1",
    "ret",
    "3:",
    "lea rax, [rdi + 6]",
    "ret",
    // a conditional branch in the middle of a function: rax = rdi < 10 ? 100 : 200
    ".globl t_jcc",
    "t_jcc:",
    "cmp rdi, 10",
    ".globl t_jcc_branch",
    "t_jcc_branch:",
    "jb 4f",
    "mov eax, 200",
    "ret",
    "4:",
    "mov eax, 100",
    "ret",
    // ret itself: rax = rdi
    ".globl t_ret",
    "t_ret:",
    "mov rax, rdi",
    ".globl t_ret_insn",
    "t_ret_insn:",
    "ret",
    // ret imm16 (pops 16 more bytes): called through a wrapper that pushes them
    ".globl t_ret16_caller",
    "t_ret16_caller:",
    "push rdi",
    "push rdi",
    "call t_ret16",
    "ret",
    ".globl t_ret16",
    "t_ret16:",
    "lea rax, [rdi + 8]",
    ".globl t_ret16_insn",
    "t_ret16_insn:",
    "ret 16",
    // cs nop word [rax + rax] (the 10-byte padding compilers emit), then
    // a segment-prefixed nop of another length; rax = rdi + 9
    ".globl t_cs_nop",
    "t_cs_nop:",
    ".byte 0x66, 0x2e, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00",
    ".globl t_cs_nop_short",
    "t_cs_nop_short:",
    ".byte 0x2e, 0x0f, 0x1f, 0x40, 0x00",
    "lea rax, [rdi + 9]",
    "ret",
    // refused (never called): hlt first
    ".globl t_hlt",
    "t_hlt:",
    "hlt",
    "ret",
    // a foreign breakpoint
    ".globl t_int3",
    "t_int3:",
    "int3",
    "mov rax, rdi",
    "ret",
);

unsafe extern "C" {
    fn t_nop(x: u64) -> u64;
    fn t_endbr(x: u64) -> u64;
    fn t_push(x: u64) -> u64;
    fn t_push_r15(x: u64) -> u64;
    fn t_jmp8(x: u64) -> u64;
    fn t_jmp32(x: u64) -> u64;
    fn t_call(x: u64) -> u64;
    fn t_jcc(x: u64) -> u64;
    static t_jcc_branch: u8;
    fn t_ret(x: u64) -> u64;
    static t_ret_insn: u8;
    fn t_ret16_caller(x: u64) -> u64;
    static t_ret16_insn: u8;
    fn t_hlt(x: u64) -> u64;
    fn t_int3(x: u64) -> u64;
    fn t_cs_nop(x: u64) -> u64;
    static t_cs_nop_short: u8;
}

#[test]
fn every_emulated_class_behaves_as_unprobed() {
    // Its own process: it probes and calls the functions other tests probe
    // with handlers that change what they return (results, hits and restored
    // bytes are exact here).
    test_support::in_own_process("every_emulated_class_behaves_as_unprobed", || {
        for f in [t_nop, t_endbr, t_push, t_push_r15, t_jmp8, t_jmp32, t_call] {
            same_with_probe(f, fn_addr(f), HitsPerCall::One);
        }
        same_with_probe(t_jcc, (&raw const t_jcc_branch) as usize, HitsPerCall::One);
        same_with_probe(t_ret, (&raw const t_ret_insn) as usize, HitsPerCall::One);
        same_with_probe(t_cs_nop, fn_addr(t_cs_nop), HitsPerCall::One);
        same_with_probe(
            t_cs_nop,
            (&raw const t_cs_nop_short) as usize,
            HitsPerCall::One,
        );
        same_with_probe(
            t_ret16_caller,
            (&raw const t_ret16_insn) as usize,
            HitsPerCall::One,
        );
    });
}

#[test]
fn handlers_read_arguments_and_registers() {
    static ARG: AtomicU64 = AtomicU64::new(0);
    static RSP_ALIGNED: AtomicU64 = AtomicU64::new(0);
    let probe = probe_at(fn_addr(t_push))
        .on_entry(|cx| {
            ARG.store(cx.arg(0).unwrap(), SeqCst);
            // At a function's entry rsp is 8 mod 16 (the return address).
            RSP_ALIGNED.store(cx.reg(Reg::Rsp) % 16, SeqCst);
            assert_eq!(cx.reg(Reg::Rip), cx.probe_addr() as u64);
            assert!(cx.arg(6).is_none());
        })
        .attach()
        .unwrap();
    assert_eq!(call(t_push, 1234), 1237);
    assert_eq!((ARG.load(SeqCst), RSP_ALIGNED.load(SeqCst)), (1234, 8));
    assert_eq!(probe.hits(), 1);
}

#[test]
fn a_handler_may_redirect_the_thread() {
    // Skip the function: return straight to the caller with rax = 77.
    let _probe = probe_at(fn_addr(t_endbr))
        .on_entry(|cx| {
            let rsp = cx.reg(Reg::Rsp);
            // SAFETY: at entry, [rsp] is the return address.
            let ret = unsafe { (rsp as *const u64).read() };
            cx.set_reg(Reg::Rax, 77);
            cx.set_reg(Reg::Rsp, rsp + 8);
            cx.set_reg(Reg::Rip, ret);
        })
        .attach()
        .unwrap();
    assert_eq!(call(t_endbr, 1), 77);
}

#[test]
fn several_consumers_thread_filters_and_remove_me() {
    static A: AtomicUsize = AtomicUsize::new(0);
    static B: AtomicUsize = AtomicUsize::new(0);
    let a = probe_at(fn_addr(t_jmp8))
        .on_entry(|_| {
            A.fetch_add(1, SeqCst);
        })
        .attach()
        .unwrap();
    let b = probe_at(fn_addr(t_jmp8))
        .on_entry(|cx| {
            if B.fetch_add(1, SeqCst) == 1 {
                cx.remove_me();
            }
        })
        .attach()
        .unwrap();
    assert!(matches!(
        probe_at(fn_addr(t_jmp8)).only_thread(-1).attach(),
        Err(AttachError::InvalidThreadId { tid: -1 })
    ));
    // A live thread that never calls the function: its filter never passes.
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let idle = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }).unwrap();
        let _ = done_rx.recv();
    });
    let other_thread = probe_at(fn_addr(t_jmp8))
        .only_thread(tid_rx.recv().unwrap())
        .attach()
        .unwrap();
    for x in 0..4 {
        assert_eq!(call(t_jmp8, x), x + 5);
    }
    assert_eq!(
        (A.load(SeqCst), B.load(SeqCst)),
        (4, 2),
        "b removed itself after 2"
    );
    assert_eq!((a.hits(), b.hits(), other_thread.hits()), (4, 2, 0));
    drop(b);
    assert_eq!(call(t_jmp8, 1), 6);
    assert_eq!(a.hits(), 5);
    drop(other_thread);
    done_tx.send(()).unwrap();
    idle.join().unwrap();
}

#[test]
fn a_probe_hit_inside_a_handler_runs_no_handler() {
    static INNER: AtomicU64 = AtomicU64::new(0);
    let probe = probe_at(fn_addr(t_jmp32))
        .on_entry(|cx| {
            // Calls the probed function from its own handler.
            if cx.arg(0) == Some(1) {
                INNER.store(call(t_jmp32, 100), SeqCst);
            }
        })
        .attach()
        .unwrap();
    assert_eq!(call(t_jmp32, 1), 7);
    assert_eq!(
        INNER.load(SeqCst),
        106,
        "the nested call still ran correctly"
    );
    assert_eq!((probe.hits(), probe.missed()), (1, 1));
}

#[test]
fn refusals_name_the_instruction_and_the_reason() {
    static DATA: u64 = 0;
    let err = probe_at(fn_addr(t_hlt)).attach().unwrap_err();
    match &err {
        AttachError::Unsupported { insn, why, .. } => {
            assert_eq!(insn, "hlt");
            assert!(!why.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("hlt"));
    assert_eq!(byte_at(fn_addr(t_hlt)), 0xf4, "nothing was patched");
    let data = (&raw const DATA) as usize;
    assert_eq!(
        probe_at(data).attach().unwrap_err(),
        AttachError::NotCode { addr: data }
    );
    assert_eq!(
        probe_at(fn_addr(t_int3)).attach().unwrap_err(),
        AttachError::ForeignBreakpoint {
            addr: fn_addr(t_int3)
        }
    );
}

/// An instruction that straddles two mappings of one code segment (the
/// kernel splits a segment's mapping where a page was patched) decodes
/// whole: the bytes on the next mapping are code too.
#[test]
fn an_instruction_across_two_code_mappings() {
    const PAGE: usize = 4096;
    // SAFETY: a fresh anonymous mapping of two pages.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let base = base as usize;
    // mov rax, 42 (7 bytes) starting 3 bytes before the second page; ret.
    let f = base + PAGE - 3;
    let code = [0x48, 0xc7, 0xc0, 0x2a, 0x00, 0x00, 0x00, 0xc3];
    // SAFETY: inside the mapping, which is writable.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), f as *mut u8, code.len()) };
    // The first page read-execute only: two mappings now.
    // SAFETY: our own mapping's first page.
    let split = unsafe { libc::mprotect(base as *mut _, PAGE, libc::PROT_READ | libc::PROT_EXEC) };
    assert_eq!(split, 0);
    // SAFETY: the code above: one instruction, then ret.
    let g: unsafe extern "C" fn(u64) -> u64 = unsafe { std::mem::transmute(f) };
    let probe = probe_at(f)
        .attach()
        .unwrap_or_else(|e| panic!("refused across the mapping boundary: {e}"));
    assert_eq!(call(g, 0), 42);
    assert_eq!(probe.hits(), 1);
    probe.detach().unwrap();
    assert_eq!(call(g, 0), 42);
}

/// Maps one page of code at `at` (anywhere if null): `lea rax, [rdi +
/// add]; ret`. Returns the page.
fn map_code(at: usize, add: u8) -> usize {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if at == 0 { 0 } else { libc::MAP_FIXED };
    // SAFETY: an anonymous mapping, at a page the test owns if fixed.
    let page = unsafe {
        libc::mmap(
            at as *mut _,
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    let code = [0x48, 0x8d, 0x47, add, 0xc3];
    // SAFETY: the page is ours and writable.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), page.cast::<u8>(), code.len()) };
    // SAFETY: as above.
    let exec = unsafe { libc::mprotect(page, 4096, libc::PROT_READ | libc::PROT_EXEC) };
    assert_eq!(exec, 0);
    page as usize
}

/// Code unloaded and other code loaded at the same address (`dlclose`,
/// then `dlopen`): the old site must not swallow the new attach, and
/// detaching a probe whose code is gone succeeds.
#[test]
fn unloaded_code_leaves_no_stale_site() {
    let page = map_code(0, 1);
    // SAFETY: the code above.
    let f: unsafe extern "C" fn(u64) -> u64 = unsafe { std::mem::transmute(page) };
    let old = probe_at(page).attach().unwrap();
    assert_eq!(call(f, 1), 2);
    assert_eq!(old.hits(), 1);
    // Unloaded, and new code at the same address.
    // SAFETY: our own page.
    assert_eq!(unsafe { libc::munmap(page as *mut _, 4096) }, 0);
    assert_eq!(map_code(page, 10), page);
    assert_eq!(call(f, 1), 11, "the new code runs");
    let new = probe_at(page).attach().unwrap();
    let written = if new.mode().is_jump() { 0xe9 } else { 0xcc };
    assert_eq!(byte_at(page), written, "the new attach wrote its code");
    assert_eq!(call(f, 1), 11);
    assert_eq!((new.hits(), old.hits()), (1, 1));
    // The stale probe detaches without touching the new one.
    old.detach().unwrap();
    assert_eq!(call(f, 2), 12);
    assert_eq!(new.hits(), 2);
    // Unloaded for good: detaching has nothing to restore.
    // SAFETY: our own page.
    assert_eq!(unsafe { libc::munmap(page as *mut _, 4096) }, 0);
    new.detach().unwrap();
    // New code there later is probed afresh.
    assert_eq!(map_code(page, 20), page);
    let again = probe_at(page).attach().unwrap();
    assert_eq!(call(f, 1), 21);
    assert_eq!(again.hits(), 1);
    again.detach().unwrap();
    assert_eq!(byte_at(page), 0x48, "the original byte is back");
}

/// A breakpoint inside a restartable sequence could never be handled (the
/// kernel moves the thread to the abort handler first): refused. The
/// workspace's own `pcpu` critical sections are linked into this test.
#[test]
fn rseq_critical_sections_are_refused() {
    use object::{Object as _, ObjectSection as _};
    let exe = std::fs::read("/proc/self/exe").unwrap();
    let file = object::File::parse(&*exe).unwrap();
    // The engine's own SRCU read side is an rseq section of `pcpu`, so the
    // test binary always has some.
    let section = file
        .section_by_name("__rseq_cs")
        .expect("pcpu's critical sections are linked into this test");
    // The first descriptor, as loaded: its start_ip is relocated in memory.
    let bias = fn_addr(t_nop) - symbol_value(&file, "t_nop");
    let descriptor = (bias + section.address() as usize) as *const u64;
    // SAFETY: the section is loaded and holds at least one descriptor.
    let start = unsafe { descriptor.add(1).read() } as usize;
    let err = probe_at(start).attach().unwrap_err();
    assert!(
        matches!(err, AttachError::RseqCriticalSection { addr, .. } if addr == start),
        "{err:?}"
    );
}

fn symbol_value(file: &object::File<'_>, name: &str) -> usize {
    use object::{Object as _, ObjectSymbol as _};
    file.symbols()
        .find(|s| s.name() == Ok(name))
        .map(|s| s.address() as usize)
        .unwrap()
}

#[test]
fn batches_attach_and_detach_together() {
    // Its own process: other tests probe and call t_jmp8 (hits and restored
    // bytes are exact here).
    test_support::in_own_process("batches_attach_and_detach_together", || {
        let addrs = [fn_addr(t_push_r15), fn_addr(t_jmp8), fn_addr(t_push_r15)];
        let probes = uprobe_core::Uprobe::attach_all(addrs.map(probe_at)).unwrap();
        assert_eq!(call(t_push_r15, 1), 5);
        assert_eq!(call(t_jmp8, 1), 6);
        assert_eq!(
            probes
                .iter()
                .map(uprobe_core::Probe::hits)
                .collect::<Vec<_>>(),
            [1, 1, 1]
        );
        uprobe_core::Probe::detach_all(probes).unwrap();
        assert_eq!(byte_at(addrs[0]), 0x41, "push r15 restored");
        assert_eq!(byte_at(addrs[1]), 0xeb, "jmp restored");
        // All or nothing: a refused probe in the batch undoes the others.
        let err =
            uprobe_core::Uprobe::attach_all([probe_at(fn_addr(t_jmp8)), probe_at(fn_addr(t_hlt))]);
        assert!(matches!(err, Err(AttachError::Unsupported { .. })));
        assert_eq!(byte_at(fn_addr(t_jmp8)), 0xeb, "the batch was undone");
    });
}

/// Found by fuzzing (`x86_exec`): an emulated `jmp [r9]` with `r9 = 0` read
/// its target through a Rust pointer, undefined behaviour for a null or
/// dangling address (a debug build stopped on it with a panic, inside a
/// signal handler). It must fault as the instruction itself would:
/// SIGSEGV, in a child here.
#[test]
fn an_emulated_read_of_a_bad_address_faults_as_the_instruction_would() {
    use uprobe_core::testing::code::analyze;
    let addr = 0x5555_0000_1000_usize;
    // jmp qword [r9]; push rax; ret
    for (code, reg) in [
        (&[0x41, 0xff, 0x21][..], libc::REG_R9),
        (&[0x50], libc::REG_RSP),
        (&[0xc3], libc::REG_RSP),
    ] {
        let analysis = analyze(addr, code, addr + 0x1000).expect("emulated");
        assert!(analysis.slot_code().is_none());
        // SAFETY: the child only applies the emulation and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: plain data; the emulation reads or writes address
            // 0 (or 8 below it), which faults in this child.
            unsafe {
                libc::signal(libc::SIGSEGV, libc::SIG_DFL);
                let mut uc: libc::ucontext_t = core::mem::zeroed();
                uc.uc_mcontext.gregs[reg as usize] = if reg == libc::REG_RSP { 8 } else { 0 };
                uc.uc_mcontext.gregs[libc::REG_RIP as usize] = addr as i64;
                analysis.apply(&mut uc);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: our child.
        assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
            "{code:02x?}: status {status:#x}"
        );
    }
}
