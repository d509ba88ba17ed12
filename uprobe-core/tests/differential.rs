//! Differential test over a corpus of instruction forms: each instruction
//! runs inside a harness that loads a known register file (and a known data
//! area), executes it, and stores every general register, the flags, the
//! stack pointer's change and the data area back. Run without a probe and
//! with one on the instruction (emulated or out of line), for several
//! initial flag values: everything observable must be identical.
#![cfg(target_arch = "x86_64")]

mod common;

use common::probe_at;

/// rax, rcx, rdx, rbx, rsp (unused), rbp, rsi, rdi, r8..r15, then flags
/// and the stack pointer's change.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
struct Regs {
    gpr: [u64; 16],
    flags: u64,
    rsp_delta: u64,
}

const DATA_LEN: usize = 512;

/// Loads `Regs` (rdi points to it), runs the instruction, stores it back.
/// The instruction follows a marker (a 7-byte nop with displacement
/// 0xaa55aa55) that the test finds by scanning, and a `nop`, which the
/// tail pass probes: a jump punned over that `nop` runs the instruction
/// in its trampoline's tail.
macro_rules! prologue {
    () => {
        concat!(
            "push rbx\n push rbp\n push r12\n push r13\n push r14\n push r15\n",
            // A known value on top of the stack (for `pop`), not the
            // caller's r15.
            "push 0x5a5a\n",
            "mov [rip + d_regs_ptr], rdi\n",
            "mov [rip + d_saved_rsp], rsp\n",
            "push qword ptr [rdi + 128]\n popfq\n",
            "mov rax, [rdi]\n mov rcx, [rdi + 8]\n mov rdx, [rdi + 16]\n mov rbx, [rdi + 24]\n",
            "mov rbp, [rdi + 40]\n mov rsi, [rdi + 48]\n",
            "mov r8, [rdi + 64]\n mov r9, [rdi + 72]\n mov r10, [rdi + 80]\n mov r11, [rdi + 88]\n",
            "mov r12, [rdi + 96]\n mov r13, [rdi + 104]\n mov r14, [rdi + 112]\n mov r15, [rdi + 120]\n",
            "mov rdi, [rdi + 56]\n",
            ".byte 0x0f, 0x1f, 0x80, 0x55, 0xaa, 0x55, 0xaa\n",
            "nop\n",
        )
    };
}

macro_rules! epilogue {
    () => {
        concat!(
            "\nmov [rip + d_scratch], rdi\n",
            "mov [rip + d_rsp_after], rsp\n",
            "pushfq\n pop rdi\n mov [rip + d_flags], rdi\n",
            "mov rdi, [rip + d_regs_ptr]\n",
            "mov [rdi], rax\n mov [rdi + 8], rcx\n mov [rdi + 16], rdx\n mov [rdi + 24], rbx\n",
            "mov [rdi + 40], rbp\n mov [rdi + 48], rsi\n",
            "mov [rdi + 64], r8\n mov [rdi + 72], r9\n mov [rdi + 80], r10\n mov [rdi + 88], r11\n",
            "mov [rdi + 96], r12\n mov [rdi + 104], r13\n mov [rdi + 112], r14\n mov [rdi + 120], r15\n",
            "mov rax, [rip + d_scratch]\n mov [rdi + 56], rax\n",
            "mov rax, [rip + d_flags]\n mov [rdi + 128], rax\n",
            "mov rax, [rip + d_rsp_after]\n sub rax, [rip + d_saved_rsp]\n mov [rdi + 136], rax\n",
            "mov rsp, [rip + d_saved_rsp]\n add rsp, 8\n",
            "pop r15\n pop r14\n pop r13\n pop r12\n pop rbp\n pop rbx\n ret\n",
        )
    };
}

core::arch::global_asm!(
    ".data",
    ".balign 8",
    "d_regs_ptr: .quad 0",
    "d_saved_rsp: .quad 0",
    "d_rsp_after: .quad 0",
    "d_scratch: .quad 0",
    "d_flags: .quad 0",
    ".balign 64",
    ".globl d_data",
    "d_data: .fill 512, 1, 0",
);

macro_rules! corpus {
    ($($name:ident => $insn:literal),* $(,)?) => {
        $(
            core::arch::global_asm!(concat!(
                ".text\n.globl ", stringify!($name), "\n", stringify!($name), ":\n",
                prologue!(), $insn, epilogue!()
            ));
        )*
        unsafe extern "C" {
            $( fn $name(regs: *mut Regs); )*
            static mut d_data: [u8; DATA_LEN];
        }
        const CORPUS: &[(&str, unsafe extern "C" fn(*mut Regs))] = &[$( ($insn, $name) ),*];
    };
}

corpus! {
    c_nop => "nop",
    c_nop5 => "nop dword ptr [rax + rax]",
    c_xchg_ax => ".byte 0x66, 0x90",
    c_endbr => "endbr64",
    c_add => "add rax, rcx",
    c_sub_imm => "sub rdx, 5",
    c_adc => "adc rax, rbx",
    c_sbb32 => "sbb ecx, edx",
    c_imul3 => "imul rax, rcx, 7",
    c_mul => "mul rcx",
    c_div => "div r8",
    c_xor32 => "xor eax, eax",
    c_inc => "inc r9",
    c_dec32 => "dec r10d",
    c_neg => "neg r11",
    c_not => "not r12",
    c_shl => "shl rax, 3",
    c_sar_cl => "sar r13, cl",
    c_rol => "rol rdx, 1",
    c_rcr => "rcr r14, 1",
    c_bt => "bt rax, 3",
    c_bts_mem => "bts qword ptr [rbx], 5",
    c_bswap => "bswap rcx",
    c_movzx => "movzx eax, cl",
    c_movsx => "movsx rax, dx",
    c_movsxd => "movsxd r15, eax",
    c_lea_sib => "lea rax, [rcx + rdx * 4 + 16]",
    c_lea_rip => "lea rax, [rip + 0x40]",
    c_load_rip => "mov rax, [rip + d_data]",
    c_store_rip => "mov [rip + d_data + 8], rcx",
    c_add_rip => "add qword ptr [rip + d_data + 16], 3",
    c_load => "mov rax, [rbx]",
    c_store => "mov [rbx + 8], rcx",
    c_add_mem => "add [rbx], rax",
    c_cmpxchg => "cmpxchg [rbx + 24], rcx",
    c_xadd => "xadd [rbx + 32], rdx",
    c_xchg_mem => "xchg [rbx + 40], rax",
    c_cmovz => "cmovz rax, rcx",
    c_cmovb => "cmovb rdx, r8",
    c_sete => "sete al",
    c_setb => "setb cl",
    c_cmp => "cmp rax, rcx",
    c_test => "test rdx, rdx",
    c_push => "push rax",
    c_push_imm => "push 0x1234",
    c_pop => "pop rcx",
    c_push_mem => "push qword ptr [rbx]",
    c_pushfq => "pushfq",
    c_add_rsp => "add rsp, 8",
    c_mov_rsp => "mov rax, rsp",
    c_leave => "leave",
    c_xchg => "xchg rax, rcx",
    c_cqo => "cqo",
    c_cdq => "cdq",
    c_cwde => "cwde",
    c_popcnt => "popcnt rax, rcx",
    c_lzcnt => "lzcnt rax, rdx",
    c_tzcnt => "tzcnt r8, rax",
    c_andn => "andn rax, rcx, rdx",
    c_shlx => "shlx rax, rcx, rdx",
    c_crc32 => "crc32 eax, cl",
    c_movq_xmm => "movq xmm1, rcx",
    c_rep_stosb => "rep stosb",
    c_movsq => "movsq",
    c_cld => "cld",
    c_stc => "stc",
    c_cmc => "cmc",
    c_lahf => "lahf",
    c_sahf => "sahf",
    c_jz0 => ".byte 0x74, 0x00",
    c_jb0 => ".byte 0x72, 0x00",
    c_jmp0 => ".byte 0xeb, 0x00",
    c_jmp32 => ".byte 0xe9, 0, 0, 0, 0",
    c_call0 => ".byte 0xe8, 0, 0, 0, 0",
    c_loop0 => ".byte 0xe2, 0x00",
    c_jrcxz0 => ".byte 0xe3, 0x00",
    c_push_r12 => "push r12",
}

const MARKER: [u8; 7] = [0x0f, 0x1f, 0x80, 0x55, 0xaa, 0x55, 0xaa];

/// The address of the instruction under test in harness `f`.
fn insn_addr(f: unsafe extern "C" fn(*mut Regs)) -> usize {
    let start = f as *const () as usize;
    (0..512)
        .find(|&i| {
            // SAFETY: scanning the harness's own code, which is longer
            // than the marker's offset plus its length.
            let bytes = unsafe { core::slice::from_raw_parts((start + i) as *const u8, 7) };
            bytes == MARKER
        })
        .map(|i| start + i + MARKER.len() + 1)
        .expect("marker in harness")
}

fn data_ptr() -> *mut u8 {
    (&raw mut d_data).cast()
}

fn initial(flags: u64) -> Regs {
    let data = data_ptr() as u64;
    let mut r = Regs::default();
    let values = [
        0x1111_2222_3333_4444, // rax
        5,                     // rcx (small: shifts, loops, rep)
        0x10,                  // rdx
        data,                  // rbx: the data area
        0,                     // rsp: not loaded
        data + 64,             // rbp: inside the data area (leave)
        data + 256,            // rsi
        data + 128,            // rdi
        0x8888,
        0x9999,
        0xaaaa,
        0xbbbb,
        0xcccc,
        0xdddd,
        0xeeee,
        0xffff,
    ];
    r.gpr = values;
    r.flags = flags;
    r
}

/// Runs harness `f` from a fresh data area; the registers and data after.
fn run(f: unsafe extern "C" fn(*mut Regs), flags: u64) -> (Regs, Vec<u8>) {
    let data = data_ptr();
    for i in 0..DATA_LEN {
        // SAFETY: the data area is ours (single-threaded test).
        unsafe { data.add(i).write_volatile((i as u8).wrapping_mul(37)) };
    }
    let mut regs = initial(flags);
    // SAFETY: the harness reads and writes `regs` and the data area only,
    // and restores every callee-saved register and the stack pointer.
    unsafe { f(&raw mut regs) };
    // Only the architectural arithmetic flags and DF are compared.
    regs.flags &= 0x8d5 | 0x400;
    // SAFETY: as above.
    let after = unsafe { core::slice::from_raw_parts(data, DATA_LEN) }.to_vec();
    (regs, after)
}

/// One test (the harness keeps its state in statics): through a jump
/// where the form takes one, then on the trap path with both slot
/// endings.
#[test]
fn every_form_behaves_the_same_probed() {
    // A probe with no handler is counted by the trampoline itself (saving
    // only what the count needs); one with a handler builds the full frame.
    compare_all(
        "trap-free where the site qualifies, counted in the trampoline",
        &[],
        Kind::Count,
    );
    compare_all(
        "trap-free where the site qualifies, with a handler",
        &[],
        Kind::Handler,
    );
    compare_all(
        "the instruction after a probed one-byte nop, in its punned jump's tail",
        &[],
        Kind::Tail,
    );
    compare_all("out-of-line slots that jump back", &[], Kind::Trap);
    // Forcing trap-ended slots takes the benchmark switch.
    #[cfg(feature = "bench-variants")]
    {
        uprobe_core::testing::force_trap_back_slots(true);
        // `leave` points rsp into the data area here; the slot's second
        // trap then needs a signal frame below it, which only a real stack
        // has (the program's own code always leaves rsp on its stack).
        compare_all("trap-ended out-of-line slots", &["leave"], Kind::Trap);
    }
}

/// The EFLAGS bits instruction `at` leaves undefined (they may differ
/// between runs whatever the probe does: `bt`, `lzcnt`, ..., as iced-x86's
/// tables say).
fn undefined_flags(at: usize) -> u64 {
    use iced_x86::RflagsBits as F;
    // SAFETY: the harness's code, at least 15 bytes past the instruction.
    let bytes = unsafe { core::slice::from_raw_parts(at as *const u8, 15) };
    let insn = iced_x86::Decoder::with_ip(64, bytes, at as u64, 0).decode();
    let undefined = insn.rflags_undefined();
    [
        (F::OF, 1 << 11),
        (F::SF, 1 << 7),
        (F::ZF, 1 << 6),
        (F::AF, 1 << 4),
        (F::CF, 1),
        (F::PF, 1 << 2),
    ]
    .iter()
    .filter(|(bit, _)| undefined & bit != 0)
    .map(|(_, flag)| flag)
    .sum()
}

/// Which probe the corpus runs under.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// No handler: a counting probe.
    Count,
    /// A handler (that changes nothing).
    Handler,
    /// A handler, kept on the breakpoint.
    Trap,
    /// No handler, on the `nop` before the instruction: punned (where a
    /// stub can be placed), the instruction runs in the jump's tail.
    Tail,
}

fn compare_all(how: &str, skip: &[&str], kind: Kind) {
    const CF: u64 = 1;
    const ZF: u64 = 1 << 6;
    const SF: u64 = 1 << 7;
    const PF: u64 = 1 << 2;
    const AF: u64 = 1 << 4;
    const OF: u64 = 1 << 11;
    let mut compared = 0;
    let mut jumps = 0;
    let mut puns = 0;
    for &(text, f) in CORPUS {
        if skip.contains(&text) {
            continue;
        }
        let at = insn_addr(f);
        // The last set has OF, AF and PF: the jump path restores the
        // status flags with `sahf` and an overflowing `add` for OF.
        let flag_sets = [0x202, 0x202 | CF, 0x202 | ZF | SF, 0x202 | OF | AF | PF];
        let plain: Vec<_> = flag_sets.iter().map(|&fl| run(f, fl)).collect();
        let probe = match kind {
            Kind::Count => probe_at(at),
            Kind::Handler => probe_at(at).on_entry(|_| {}),
            Kind::Trap => probe_at(at).on_entry(|_| {}).trap_only(),
            Kind::Tail => probe_at(at - 1),
        };
        let probe = probe
            .attach()
            .unwrap_or_else(|e| panic!("`{text}` refused: {e}"));
        jumps += usize::from(probe.mode().is_jump());
        puns += usize::from(matches!(
            probe.mode(),
            uprobe_core::Mode::Jump(uprobe_core::Tactic::Pun { .. })
        ));
        let probed: Vec<_> = flag_sets.iter().map(|&fl| run(f, fl)).collect();
        assert_eq!(
            probe.hits(),
            flag_sets.len() as u64,
            "`{text}`: hits ({how})"
        );
        probe.detach().unwrap();
        let undefined = undefined_flags(at);
        for (i, (a, b)) in plain.iter().zip(&probed).enumerate() {
            let (mut a0, mut b0) = (a.0, b.0);
            a0.flags &= !undefined;
            b0.flags &= !undefined;
            assert_eq!(a0, b0, "`{text}` (flags set {i}): registers differ ({how})");
            assert!(a.1 == b.1, "`{text}` (flags set {i}): memory differs");
        }
        compared += 1;
    }
    assert_eq!(compared, CORPUS.len() - skip.len());
    if kind == Kind::Tail {
        // A pun's target is fixed by the bytes after the `nop`: where it is
        // mapped the `nop` stays on its breakpoint. Most are free.
        assert!(
            puns > compared / 2,
            "only {puns} of {compared} tails ran through a punned jump"
        );
    }
    println!(
        "{compared} instruction forms identical with and without a probe ({how}; {jumps} through a jump, {puns} of them punned)"
    );
}
