//! Jumps into alignment padding: a punned jump whose one target lies in
//! the padding after a function (the `nop`s before the next 16-byte
//! boundary, which no thread runs) lands on a stub the engine writes
//! there, a landing pad; and a return or jump followed by padding is
//! punned over the padding too.
#![cfg(target_arch = "x86_64")]

mod common;

use common::{byte_at, call, fn_addr, probe_at};
use uprobe_core::{AttachError, Mode, Tactic};

core::arch::global_asm!(
    ".text",
    ".p2align 4",
    ".globl lp_short",
    // `push rbx` is probed: its `jmp rel32` pun ends in `04 00 5b c3`
    // (an exact address 1 GiB below, which the test maps), its
    // `jmp rel8` pun in `04`: 4 bytes past `add al, 0`, inside the
    // padding after `ret`.
    "lp_short:",
    ".cfi_startproc",
    "mov rax, rdi",
    "push rbx",
    "add al, 0",
    "pop rbx",
    "ret",
    ".cfi_endproc",
    ".p2align 4",
    ".globl lp_ret",
    // `ret` followed by 11 bytes of padding: a whole jump written over
    // it.
    "lp_ret:",
    "lea rax, [rdi + 1]",
    "ret",
    ".p2align 4",
    "nop",
);

unsafe extern "C" {
    fn lp_short(x: u64) -> u64;
    fn lp_ret(x: u64) -> u64;
}

/// Maps the page holding `addr` (inaccessible), unless something is
/// mapped there already: no stub can be placed at `addr` then.
fn occupy(addr: usize) {
    let page = addr & !0xfff;
    // SAFETY: a new anonymous mapping where nothing is mapped
    // (MAP_FIXED_NOREPLACE fails otherwise), never unmapped.
    unsafe {
        libc::mmap(
            page as *mut libc::c_void,
            0x1000,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        );
    }
}

#[test]
fn a_pun_whose_one_target_is_padding_lands_on_a_pad_there() {
    let f = fn_addr(lp_short);
    let site = f + 3;
    assert_eq!(byte_at(site), 0x53, "push rbx");
    // The `jmp rel32` pun's one target, taken: only the padding is left.
    let disp = i32::from_le_bytes([0x04, 0x00, 0x5b, 0xc3]);
    occupy((site + 5).wrapping_add_signed(disp as isize));
    let pad = site + 2 + 4;
    let padding: Vec<u8> = (pad..pad + 5).map(byte_at).collect();
    for round in 0..3 {
        let probe = probe_at(site).attach().unwrap();
        assert!(
            common::one_byte_jump(&probe.mode()),
            "round {round}: {:?}",
            probe.mode()
        );
        assert_eq!(byte_at(site), 0xeb, "jmp rel8");
        assert_eq!(byte_at(pad), 0xe9, "the landing pad: jmp rel32");
        for x in 0..100 {
            assert_eq!(call(lp_short, x), x);
        }
        assert_eq!(probe.hits(), 100);
        // No probe goes on the pad: it is not the program's code.
        let err = probe_at(pad + 1).attach().unwrap_err();
        assert!(matches!(err, AttachError::Unsupported { .. }), "{err}");
        probe.detach().unwrap();
        assert_eq!(byte_at(site), 0x53);
        // The pad stays, never changed (a thread may be on its way
        // through it), and the next attach lands on it again.
        assert_ne!((pad..pad + 5).map(byte_at).collect::<Vec<u8>>(), padding);
        assert_eq!(call(lp_short, 7), 7);
    }
}

#[test]
fn a_return_followed_by_padding_takes_a_whole_jump() {
    let f = fn_addr(lp_ret);
    let site = f + 4;
    assert_eq!(byte_at(site), 0xc3, "ret");
    let probe = probe_at(site).attach().unwrap();
    assert!(
        matches!(probe.mode(), Mode::Jump(Tactic::Pun { written: 5, .. })),
        "{:?}",
        probe.mode()
    );
    for x in 0..100 {
        assert_eq!(call(lp_ret, x), x + 1);
    }
    assert_eq!(probe.hits(), 100);
    // A probe on the padding's first `nop` (never run): the jump no
    // longer writes over it, and writes over it again once it is gone.
    let on_nop = probe_at(site + 1).attach().unwrap();
    assert!(
        !matches!(probe.mode(), Mode::Jump(Tactic::Pun { written: 5, .. })),
        "{:?}",
        probe.mode()
    );
    assert_eq!(call(lp_ret, 1), 2);
    assert_eq!((probe.hits(), on_nop.hits()), (101, 0));
    on_nop.detach().unwrap();
    assert!(
        matches!(probe.mode(), Mode::Jump(Tactic::Pun { written: 5, .. })),
        "{:?}",
        probe.mode()
    );
    assert_eq!(call(lp_ret, 2), 3);
    probe.detach().unwrap();
    assert_eq!(byte_at(site), 0xc3);
    assert_eq!(call(lp_ret, 1), 2);
}
