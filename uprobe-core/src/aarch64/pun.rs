//! No punned jumps on aarch64: every instruction is 4 bytes, as long as
//! the `B` that replaces it, so a jump always replaces whole
//! instructions (`crate::mode::Tactic::Replace`).

use super::JUMP_LEN;
use crate::site::jump::Pun;

/// Whether jumps can be punned on this architecture.
pub(crate) const AVAILABLE: bool = false;

/// The ways to pun a jump: none.
pub(crate) fn puns(_start: usize, _len: usize, _code: &[u8], _one_byte: bool) -> Vec<Pun> {
    Vec::new()
}

/// Never called: [`puns`] makes none.
pub(crate) fn pun_bytes(_pun: &Pun, _target: usize) -> [u8; JUMP_LEN] {
    unreachable!("no punned jumps on aarch64")
}

/// Never called: [`puns`] makes none, so no stub is placed.
pub(crate) fn stub(_at: usize, _target: usize) -> Vec<u8> {
    Vec::new()
}
