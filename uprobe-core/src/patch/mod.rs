//! Patching live code: breakpoints in and out ([`breakpoints`]), jumps
//! written the way the kernel's `text_poke_bp` writes multi-byte code and
//! taken back ([`jump`]), over the range of instructions [`range`]
//! chooses, punned over the bytes that follow where whole instructions
//! cannot take them ([`pun`]), the other threads checked before a jump covers
//! several instructions ([`threads`]), and the view of the code as it was
//! before any of it ([`original`]). The attach lock is held throughout;
//! nothing here runs on the hit path but the thread check's signal
//! handler.

pub(crate) mod breakpoints;
pub(crate) mod jump;
pub(crate) mod original;
pub(crate) mod pun;
pub(crate) mod range;
pub(crate) mod threads;
