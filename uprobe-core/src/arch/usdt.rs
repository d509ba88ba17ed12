//! What a USDT probe's argument is: its width, sign and [`UsdtLocation`]
//! (a register, memory relative to registers, or a constant), as each
//! architecture's spec parser ([`parse_location`]) reads it, and how a
//! handler's raw value is extended. The vocabulary is the same on every
//! architecture; only the registers differ.

use super::Reg;

/// Parses the location part of an argument (after `@`) in the syntax
/// `<sys/sdt.h>` emits for this architecture, or says why it cannot.
pub(crate) use super::imp::usdt::parse_location;

/// One argument of a USDT probe: how wide, signed or not, and where it is
/// when the probe fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsdtArg {
    /// Bytes: 1, 2, 4 or 8.
    pub size: u8,
    /// Whether the value is signed (sign-extended when read).
    pub signed: bool,
    /// Where the value is.
    pub location: UsdtLocation,
}

/// Why a USDT argument's spec (`-4@%edi`, say) could not be read: the
/// spec, and what in it is not understood.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtArgError {
    arg: String,
    why: &'static str,
}

impl UsdtArgError {
    pub(crate) fn new(arg: &str, why: &'static str) -> Self {
        Self {
            arg: arg.to_string(),
            why,
        }
    }

    /// The argument's spec.
    #[must_use]
    pub fn arg(&self) -> &str {
        &self.arg
    }

    /// What in it is not understood.
    #[must_use]
    pub fn why(&self) -> &'static str {
        self.why
    }
}

impl core::fmt::Display for UsdtArgError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "USDT argument {:?}: {}", self.arg, self.why)
    }
}

impl std::error::Error for UsdtArgError {}

/// Where a USDT argument is when the probe fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsdtLocation {
    /// In a register (its low `size` bytes).
    Register(Reg),
    /// In memory at `base + offset (+ index * scale)`.
    Memory {
        /// The base register.
        base: Reg,
        /// The displacement.
        offset: i64,
        /// An index register and its scale, if any.
        index: Option<(Reg, u8)>,
    },
    /// A constant.
    Constant(i64),
}

impl UsdtArg {
    /// Sign- or zero-extends the low `size` bytes of `raw`.
    pub(crate) fn extend(&self, raw: u64) -> i64 {
        let bits = u32::from(self.size) * 8;
        if bits == 64 {
            return raw as i64;
        }
        let shift = 64 - bits;
        if self.signed {
            ((raw << shift) as i64) >> shift
        } else {
            ((raw << shift) >> shift) as i64
        }
    }
}

/// A decimal or `0x` hexadecimal integer, maybe negative, as the specs
/// write displacements and constants.
pub(crate) fn parse_int(text: &str) -> Option<i64> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, text),
    };
    let value = match digits.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok()?,
        None => digits.parse::<i64>().ok()?,
    };
    Some(if negative { -value } else { value })
}
