//! What the fuzz targets share: reading an input ([`Input`]) and the
//! checks that moved code means and does what the original does: on
//! x86-64, [`x86`] (decoded and compared) and [`exec`] (run and
//! compared); on aarch64, [`a64`] (a hit run against the original).
//!
//! Every check panics on a mismatch, with what differs: libFuzzer then
//! saves the input as a crash.

#[cfg(target_arch = "aarch64")]
pub mod a64;
#[cfg(target_arch = "x86_64")]
pub mod exec;
#[cfg(target_arch = "x86_64")]
pub mod x86;

/// A fuzz input read from the front: fixed-size fields, then the rest.
#[derive(Debug)]
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    /// Reads `data`.
    #[must_use]
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.data.split_first() else {
            return 0;
        };
        self.data = rest;
        b
    }

    /// The next 4 bytes, little-endian (zeros past the end).
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// The next 8 bytes, little-endian (zeros past the end).
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }

    /// The next `n` bytes, or fewer at the end.
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    /// What is left.
    #[must_use]
    pub fn rest(self) -> &'a [u8] {
        self.data
    }
}
