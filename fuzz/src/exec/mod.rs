//! Moved x86-64 code run and compared with the original: the original
//! and the moved copy each run once in a child process of their own, from
//! the same registers and memory, and every general register, the flags
//! the instructions define, every byte of the pages they may touch, where
//! they went on to, and the signal that ended a run that faulted must be
//! the same (the differential corpus's check, with the fuzzer choosing
//! the instructions, registers and memory).
//!
//! A run starts from [`Regs`] at an address and ends at a *stub*: code at
//! the address the original goes on to (the instruction after it, or a
//! branch's target) that stores the registers and hands them, with the
//! pages, to the parent through shared memory. Both runs see the same
//! pages at the same addresses: the original code with its stubs, the
//! moved code, the stubs of branch targets, the page a RIP-relative
//! operand addresses, a data area and a stack.

use iced_x86::{Instruction, Mnemonic, OpKind, Register, RflagsBits};

mod child;
mod layout;

use child::Run;
pub use layout::Layout;

/// General registers in encoding order (`rax rcx rdx rbx rsp rbp rsi rdi
/// r8`-`r15`), then the flags.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    /// `rax` .. `r15`.
    pub gpr: [u64; 16],
    /// `rflags`.
    pub flags: u64,
}

/// What a hit does to the registers and the instruction pointer before
/// the thread resumes (run in the child, where it may touch memory).
pub type Hit<'a> = dyn Fn(&mut Regs, &mut u64) + 'a;

/// `gregs` indexes of [`Regs::gpr`], in order.
const GREGS: [libc::c_int; 16] = [
    libc::REG_RAX,
    libc::REG_RCX,
    libc::REG_RDX,
    libc::REG_RBX,
    libc::REG_RSP,
    libc::REG_RBP,
    libc::REG_RSI,
    libc::REG_RDI,
    libc::REG_R8,
    libc::REG_R9,
    libc::REG_R10,
    libc::REG_R11,
    libc::REG_R12,
    libc::REG_R13,
    libc::REG_R14,
    libc::REG_R15,
];

const PAGE: u64 = 4096;
/// Where the code goes: above the address sanitizer's shadow memory.
pub const CODE_AREA: u64 = 0x2000_0000_0000;
/// The data area the registers may point into (2 pages).
pub const DATA: u64 = 0x3000_0000_0000;
const DATA_PAGES: u64 = 2;
/// The stack (4 pages; `rsp` starts in the middle).
pub const STACK: u64 = 0x3000_0010_0000;
const STACK_PAGES: u64 = 4;
/// At most this many pages are compared.
const MAX_PAGES: usize = 24;
/// Distinct places a run may end at: the next instruction, and branch
/// targets.
const ENDS: usize = 4;

/// The flags a run may start with and that are compared: CF PF AF ZF SF
/// DF OF (never TF, which traps, nor AC, which faults unaligned
/// accesses).
const STATUS: u64 = 0x0cd5;

/// Why an input was not run (nothing wrong with the code under test).
#[derive(Debug)]
pub enum Skip {
    /// Two pieces of the layout overlap, or a page is taken.
    Layout,
    /// The code cannot be run deterministically or safely.
    Unrunnable,
}

/// Registers to start from, drawn from `pick` (one byte each: into the
/// data area, a small number, or any value); `rsp` in the stack.
#[must_use]
pub fn registers(pick: &[u8], values: &[u8], flags: u8) -> Regs {
    let mut regs = Regs::default();
    for (i, r) in regs.gpr.iter_mut().enumerate() {
        let p = pick.get(i).copied().unwrap_or(0);
        let v = values
            .get(8 * i..8 * i + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        *r = match p % 4 {
            0 | 1 => DATA + (v % (DATA_PAGES * PAGE - 64)),
            2 => v as i8 as i64 as u64,
            _ => v,
        };
    }
    regs.gpr[4] =
        STACK + STACK_PAGES * PAGE / 2 - 8 * (u64::from(pick.get(16).copied().unwrap_or(0)) % 32);
    regs.flags = 0x2 | (u64::from(flags) << 4 | u64::from(flags)) & STATUS;
    regs
}

/// Whether the instruction cannot run the same twice, or may not be run:
/// it reads the time, a random number or the CPU it runs on, waits,
/// changes segment state the child needs, or stores the x87 state (whose
/// last-instruction pointer says where the code ran: moved code differs
/// there by nature, as it would under the kernel's uprobes), or loads the
/// flags whole (`popf` may set TF, whose single steps count the jump
/// back from moved code, and AC, which faults the stubs' unaligned
/// loads).
#[must_use]
pub fn unrunnable(insn: &Instruction) -> bool {
    matches!(
        insn.mnemonic(),
        Mnemonic::Rdtsc
            | Mnemonic::Rdtscp
            | Mnemonic::Rdrand
            | Mnemonic::Rdseed
            | Mnemonic::Rdpid
            | Mnemonic::Rdpmc
            | Mnemonic::Cpuid
            | Mnemonic::Wrfsbase
            | Mnemonic::Wrgsbase
            | Mnemonic::Umwait
            | Mnemonic::Tpause
            | Mnemonic::Umonitor
            | Mnemonic::Xbegin
            | Mnemonic::Syscall
            | Mnemonic::Sysenter
            | Mnemonic::Int
            | Mnemonic::Int1
            | Mnemonic::Int3
            | Mnemonic::Into
            | Mnemonic::Ud0
            | Mnemonic::Ud1
            | Mnemonic::Ud2
            | Mnemonic::Popf
            | Mnemonic::Popfq
            | Mnemonic::Fnstenv
            | Mnemonic::Fstenv
            | Mnemonic::Fnsave
            | Mnemonic::Fsave
            | Mnemonic::Fxsave
            | Mnemonic::Fxsave64
            | Mnemonic::Xsave
            | Mnemonic::Xsave64
            | Mnemonic::Xsaveopt
            | Mnemonic::Xsaveopt64
            | Mnemonic::Xsavec
            | Mnemonic::Xsavec64
            | Mnemonic::Xsaves
            | Mnemonic::Xsaves64
    ) || (0..insn.op_count())
        .any(|i| insn.op_kind(i) == OpKind::Register && insn.op_register(i).is_segment_register())
        || insn.memory_segment() == Register::FS
        || insn.memory_segment() == Register::GS
}

/// The flags any of `insns` leaves undefined.
fn undefined_flags(insns: &[Instruction]) -> u64 {
    let mut u = 0;
    for i in insns {
        let bits = i.rflags_undefined();
        for (bit, flag) in [
            (RflagsBits::CF, 1u64),
            (RflagsBits::PF, 1 << 2),
            (RflagsBits::AF, 1 << 4),
            (RflagsBits::ZF, 1 << 6),
            (RflagsBits::SF, 1 << 7),
            (RflagsBits::OF, 1 << 11),
        ] {
            if bits & bit != 0 {
                u |= flag;
            }
        }
    }
    u
}

/// Places the original code (`insns`, decoded from `bytes` at the
/// addresses they run at) in the layout, with its end and its branch
/// targets, and the pages its RIP-relative operands address.
///
/// # Errors
/// Where it cannot be laid out or run.
pub fn lay_out_original(
    layout: &mut Layout,
    insns: &[Instruction],
    bytes: &[u8],
) -> Result<(), Skip> {
    let first = insns.first().ok_or(Skip::Unrunnable)?;
    let (start, end) = (first.ip(), insns.last().expect("one").next_ip());
    if insns.iter().any(unrunnable) {
        return Err(Skip::Unrunnable);
    }
    layout.code(start, &bytes[..(end - start) as usize])?;
    layout.end(end)?;
    for i in insns {
        if (0..i.op_count()).any(|k| {
            matches!(
                i.op_kind(k),
                OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
            )
        }) {
            let target = i.near_branch_target();
            // A branch back into the code loops: not run.
            if target >= start && target < end {
                return Err(Skip::Unrunnable);
            }
            if target != end {
                layout.end(target)?;
            }
        }
        if i.is_ip_rel_memory_operand() {
            layout.touch(i.ip_rel_memory_address(), 64);
        }
    }
    Ok(())
}

/// Runs the original (from `start` at the first instruction) and the
/// moved code (from the same registers, at `moved_at`, after `apply` if
/// given) and compares them.
///
/// # Panics
/// On any difference: registers, defined flags, pages, where the run
/// went on, or the signal that ended it.
///
/// # Errors
/// Where the layout cannot be mapped here.
pub fn compare(
    layout: &Layout,
    insns: &[Instruction],
    start: Regs,
    moved_at: u64,
    apply: Option<&Hit<'_>>,
) -> Result<(), Skip> {
    let _mapped = layout::map(layout)?;
    let original = child::run(layout, 0, start, insns[0].ip(), None);
    let moved = child::run(layout, 1, start, moved_at, apply);
    let shown = || {
        insns
            .iter()
            .map(|i| format!("{:#x}: {}", i.ip(), crate::x86::text(i)))
            .collect::<Vec<_>>()
            .join("; ")
    };
    match (&original, &moved) {
        (
            Run::Ended {
                at: a,
                regs: ra,
                pages: pa,
            },
            Run::Ended {
                at: b,
                regs: rb,
                pages: pb,
            },
        ) => {
            assert_eq!(a, b, "[{}] went on to different places", shown());
            let mask = STATUS & !undefined_flags(insns);
            assert_eq!(
                ra.gpr,
                rb.gpr,
                "[{}] from {start:x?}: registers differ",
                shown()
            );
            assert_eq!(
                ra.flags & mask,
                rb.flags & mask,
                "[{}] from {start:x?}: flags differ",
                shown()
            );
            assert_eq!(pa, pb, "[{}] from {start:x?}: memory differs", shown());
        }
        // A memory fault is a memory fault: which of SIGSEGV (#GP, #PF)
        // and SIGBUS (#SS: a non-canonical address formed from `rsp` or
        // `rbp`) comes may differ where moved code faults on another of
        // the instruction's accesses first (a moved `call [mem]` pushes
        // before it reads its operand) or an emulated operand is read
        // with another base register. The program dies either way.
        (Run::Signal(libc::SIGBUS | libc::SIGSEGV), Run::Signal(libc::SIGBUS | libc::SIGSEGV)) => {}
        _ => assert_eq!(original, moved, "[{}] from {start:x?}", shown()),
    }
    Ok(())
}

/// A hit's change to the registers, as [`compare`]'s `apply` takes it:
/// the analysis applied to a signal frame made of the registers.
///
/// # Safety
/// Only in the child, whose memory the emulation may touch.
pub unsafe fn apply_analysis(
    analysis: &uprobe_core::testing::code::Analysis,
    regs: &mut Regs,
    at: &mut u64,
) {
    // SAFETY: plain data.
    let mut uc: libc::ucontext_t = unsafe { core::mem::zeroed() };
    let g = &mut uc.uc_mcontext.gregs;
    for (i, &k) in GREGS.iter().enumerate() {
        g[k as usize] = regs.gpr[i] as i64;
    }
    g[libc::REG_EFL as usize] = regs.flags as i64;
    g[libc::REG_RIP as usize] = *at as i64;
    // SAFETY: the caller's promise: the child's own memory, laid out as
    // the original run sees it.
    unsafe { analysis.apply(&mut uc) };
    let g = &uc.uc_mcontext.gregs;
    for (i, &k) in GREGS.iter().enumerate() {
        regs.gpr[i] = g[k as usize] as u64;
    }
    regs.flags = g[libc::REG_EFL as usize] as u64;
    *at = g[libc::REG_RIP as usize] as u64;
}
