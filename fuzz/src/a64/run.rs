//! One run: a signal starts it (its handler loads the registers into the
//! signal frame, and for a hit lets the engine apply its analysis there,
//! as the engine's trap handler does), `sigreturn` runs the code, and the
//! first signal after that ends it (its handler writes down the
//! registers, the signal and the memory's hash, and returns to the frame
//! the start signal came with).

use core::mem::MaybeUninit;
use core::ptr;

use uprobe_core::testing::code::Analysis;

use super::{Regs, STATUS};

/// What one run came to.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Outcome {
    /// 0 until the run ended; then 1.
    pub done: u32,
    /// The signal that ended it.
    pub signal: i32,
    /// `si_addr` of that signal.
    pub addr: u64,
    /// The registers in its frame.
    pub regs: Regs,
    /// The hash of the pages the code may write (data and stack).
    pub memory: u64,
}

/// Signal frame records: `FPSIMD_MAGIC` (the V registers) and `SVE_MAGIC`
/// (the Z registers, with data when the SVE state is live, as qemu-user
/// always makes it; `sigreturn` then restores the Z registers from it).
const FPSIMD_MAGIC: u32 = 0x4650_8001;
const SVE_MAGIC: u32 = 0x5356_4501;
/// Where `__reserved` starts in `struct sigcontext`, and its size.
const RESERVED_OFFSET: usize = 288;
const RESERVED_SIZE: usize = 4096;

/// The record of `magic` in the frame: its offset in `__reserved` and
/// its size.
fn record(uc: *mut libc::ucontext_t, magic: u32) -> Option<(*mut u8, usize)> {
    // SAFETY: `__reserved` lies inside the frame's `mcontext_t`.
    let reserved = unsafe {
        (&raw mut (*uc).uc_mcontext)
            .cast::<u8>()
            .add(RESERVED_OFFSET)
    };
    let mut at = 0;
    while at + 16 <= RESERVED_SIZE {
        // SAFETY: records lie inside `__reserved`, each starting with
        // (magic, size) u32s; the walk stops at its end or a zero record.
        let (m, size) = unsafe {
            (
                reserved.add(at).cast::<u32>().read(),
                reserved.add(at + 4).cast::<u32>().read() as usize,
            )
        };
        if m == 0 || size == 0 || at + size > RESERVED_SIZE {
            return None;
        }
        if m == magic {
            // SAFETY: inside `__reserved`.
            return Some((unsafe { reserved.add(at) }, size));
        }
        at += size;
    }
    None
}

/// Loads `regs` into the frame: general registers, SP, PC, the flags
/// (NZCV; BTYPE cleared), the V registers (and the Z registers' low 128
/// bits, the rest zero) and FPSR.
///
/// # Safety
/// `uc` is the frame a signal handler was given.
unsafe fn load(uc: *mut libc::ucontext_t, regs: &Regs, pc: u64) {
    // SAFETY: the caller's frame; records checked by `record`.
    unsafe {
        let m = &mut (*uc).uc_mcontext;
        m.regs = regs.x;
        m.sp = regs.sp;
        m.pc = pc;
        m.pstate = m.pstate & !STATUS | regs.pstate & STATUS;
        if let Some((r, _)) = record(uc, FPSIMD_MAGIC) {
            // fpsimd_context: head (8), fpsr (4), fpcr (4), vregs[32].
            r.add(8).cast::<u32>().write(regs.fpsr);
            for (i, v) in regs.v.iter().enumerate() {
                r.add(16 + 16 * i).cast::<u128>().write_unaligned(*v);
            }
        }
        if let Some((r, size)) = record(uc, SVE_MAGIC) {
            // sve_context: head (8), vl (2), flags (2), reserved (4); then
            // Z0..Z31 of vl bytes each (when there is data).
            let vl = usize::from(r.add(8).cast::<u16>().read());
            for (i, v) in regs.v.iter().enumerate() {
                let z = 16 + vl * i;
                if vl >= 16 && z + vl <= size {
                    r.add(z).cast::<u128>().write_unaligned(*v);
                    for b in 16..vl {
                        r.add(z + b).write(0);
                    }
                }
            }
        }
    }
}

/// The registers in the frame (V registers from the FPSIMD record).
///
/// # Safety
/// As for [`load`].
unsafe fn save(uc: *mut libc::ucontext_t) -> Regs {
    // SAFETY: the caller's frame.
    unsafe {
        let m = &(*uc).uc_mcontext;
        let mut regs = Regs {
            x: m.regs,
            sp: m.sp,
            pc: m.pc,
            pstate: m.pstate & STATUS,
            v: [0; 32],
            fpsr: 0,
        };
        if let Some((r, _)) = record(uc, FPSIMD_MAGIC) {
            regs.fpsr = r.add(8).cast::<u32>().read();
            for (i, v) in regs.v.iter_mut().enumerate() {
                *v = r.add(16 + 16 * i).cast::<u128>().read_unaligned();
            }
        }
        regs
    }
}

// ---- The run's side (set before the run starts; one run at a time) -----

static mut START: Regs = Regs::ZERO;
static mut START_PC: u64 = 0;
static mut HIT: *const Analysis = ptr::null();
/// The pages hashed at the end: (address, length).
static mut WRITABLE: [(u64, usize); 2] = [(0, 0); 2];
/// The frame the start signal came with: the end's handler returns to
/// it, so the run ends where it was started.
static mut HOME: MaybeUninit<libc::ucontext_t> = MaybeUninit::uninit();
static mut OUTCOME: Outcome = Outcome {
    done: 0,
    signal: 0,
    addr: 0,
    regs: Regs::ZERO,
    memory: 0,
};
/// An alternate signal stack (the code runs on its own stack pointer).
static mut ALT_STACK: [u8; 1 << 16] = [0; 1 << 16];
/// The signals that end a run.
const ENDS: [libc::c_int; 6] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGTRAP,
    libc::SIGVTALRM,
];

extern "C" fn on_start(_: libc::c_int, _: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    let uc = uc.cast::<libc::ucontext_t>();
    // SAFETY: the statics are set before the signal and read by one run;
    // the frame is the one the kernel gave us.
    unsafe {
        (&raw mut HOME).write(MaybeUninit::new(uc.read()));
        load(uc, &(&raw const START).read(), START_PC);
        if let Some(hit) = HIT.as_ref() {
            hit.apply(&mut *uc);
        }
    }
}

extern "C" fn on_end(sig: libc::c_int, info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    let uc = uc.cast::<libc::ucontext_t>();
    // SAFETY: the frame and siginfo the kernel gave us; the writable
    // pages are mapped; `HOME` was saved by this run's start.
    unsafe {
        // FNV-1a over 64-bit words (a byte at a time costs a run as much
        // as the rest under qemu-user).
        let mut h = 0xcbf2_9ce4_8422_2325_u64;
        let pages: [(u64, usize); 2] = WRITABLE;
        for (at, len) in pages {
            for i in 0..len / 8 {
                let w = (at as *const u64).add(i).read_volatile();
                h = (h ^ w).wrapping_mul(0x0100_0000_01b3);
            }
        }
        (&raw mut OUTCOME).write(Outcome {
            done: 1,
            signal: sig,
            addr: (*info).si_addr() as u64,
            regs: save(uc),
            memory: h,
        });
        // Back to where the start signal was raised, with the registers,
        // the signal mask and the SIMD state of then.
        uc.write((&raw const HOME).read().assume_init());
    }
}

/// A `SA_SIGINFO` handler.
type Handler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

/// Sets `handler` for `sig` (on the alternate stack, every signal blocked
/// while it runs); returns the action it replaces.
///
/// # Safety
/// As `sigaction`.
unsafe fn set(sig: libc::c_int, handler: Handler) -> libc::sigaction {
    // SAFETY: plain system calls on local structures.
    unsafe {
        let mut act: libc::sigaction = core::mem::zeroed();
        act.sa_sigaction = handler as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigfillset(&raw mut act.sa_mask);
        let mut old: libc::sigaction = core::mem::zeroed();
        libc::sigaction(sig, &raw const act, &raw mut old);
        old
    }
}

/// Sets the virtual-time limit of a run (0: none).
fn limit(usec: i64) {
    let t = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: 0,
            tv_usec: usec,
        },
    };
    // SAFETY: a plain system call.
    unsafe { libc::setitimer(libc::ITIMER_VIRTUAL, &raw const t, ptr::null_mut()) };
}

/// Runs from `start` at `pc`, or (`hit`) first applies the analysis to
/// the frame, as a hit does; `writable`: the pages whose bytes are hashed
/// at the end. In this process: a signal starts the run and the first
/// one after it ends it and comes back here (a fork per run costs ten
/// times as much under qemu-user). The code can only write the data area
/// and the stack, or fault: its registers point there, or at small
/// addresses, or at any 64-bit value (one that lands in the harness's own
/// memory would need bits 63:47 clear and to hit its few mapped
/// megabytes).
pub(super) fn run(
    start: &Regs,
    pc: u64,
    hit: Option<&Analysis>,
    writable: [(u64, usize); 2],
) -> Outcome {
    // SAFETY: the statics are ours between runs (the fuzz target runs one
    // input at a time, on one thread); the handlers replaced are put back.
    unsafe {
        START = *start;
        START_PC = pc;
        HIT = hit.map_or(ptr::null(), ptr::from_ref);
        WRITABLE = writable;
        OUTCOME.done = 0;
        let stack = libc::stack_t {
            ss_sp: (&raw mut ALT_STACK).cast(),
            ss_flags: 0,
            ss_size: size_of::<[u8; 1 << 16]>(),
        };
        let mut old_stack: libc::stack_t = core::mem::zeroed();
        libc::sigaltstack(&raw const stack, &raw mut old_stack);
        let old_start = set(libc::SIGUSR1, on_start);
        let old: [libc::sigaction; ENDS.len()] = ENDS.map(|sig| set(sig, on_end));
        // Only the signals of the run itself get through while it runs:
        // another (libFuzzer's timer) would push its frame on the code's
        // stack, which is compared.
        let mut mask: libc::sigset_t = core::mem::zeroed();
        libc::sigfillset(&raw mut mask);
        for sig in ENDS.iter().chain(&[libc::SIGUSR1]) {
            libc::sigdelset(&raw mut mask, *sig);
        }
        let mut old_mask: libc::sigset_t = core::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const mask, &raw mut old_mask);
        // CPU time, not wall-clock time: a loaded machine must not end a
        // run that merely waits to be scheduled (qemu translating the
        // code counts, hence the margin).
        limit(300_000);
        libc::raise(libc::SIGUSR1);
        limit(0);
        libc::pthread_sigmask(libc::SIG_SETMASK, &raw const old_mask, ptr::null_mut());
        for (sig, act) in ENDS.iter().zip(old.iter()) {
            libc::sigaction(*sig, act, ptr::null_mut());
        }
        libc::sigaction(libc::SIGUSR1, &raw const old_start, ptr::null_mut());
        libc::sigaltstack(&raw const old_stack, ptr::null_mut());
        let out = (&raw const OUTCOME).read();
        assert_eq!(out.done, 1, "the run came back without an outcome");
        out
    }
}
