//! What the engine reads of an object file, on bytes alone: its symbol
//! index and unwind extents ([`Object`]) and its USDT notes
//! ([`usdt_notes`]). The engine reads the objects of whatever process it
//! is loaded into; the fuzz targets hand these mutated files. Not
//! async-signal-safe (they allocate).

use crate::process::symbols::SymbolIndex;

/// An ELF object's functions as the engine indexes them.
pub struct Object {
    index: SymbolIndex,
}

impl core::fmt::Debug for Object {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Object").finish_non_exhaustive()
    }
}

impl Object {
    /// The index of the ELF object `bytes`; `None` if it is not one the
    /// engine reads (a 64-bit ELF file).
    #[must_use]
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        SymbolIndex::parse(bytes).map(|index| Self { index })
    }

    /// The symbol covering file address `addr`: its start, size and
    /// name.
    #[must_use]
    pub fn covering(&self, addr: usize) -> Option<(usize, usize, &str)> {
        self.index.covering(addr)
    }

    /// The size of the unwind table entry (FDE) that starts at file
    /// address `addr`, if one does.
    #[must_use]
    pub fn frame_at(&self, addr: usize) -> Option<usize> {
        self.index.frame_at(addr)
    }
}

/// A USDT probe's note as the object says it (addresses before the
/// load bias).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtNote {
    /// The provider.
    pub provider: String,
    /// The probe's name.
    pub name: String,
    /// The probe site's address.
    pub addr: u64,
    /// The semaphore's address, 0 for none.
    pub semaphore: u64,
    /// The argument specs, as `<sys/sdt.h>` wrote them.
    pub spec: String,
}

/// The USDT notes of the ELF object `bytes`, or why they cannot be read.
pub fn usdt_notes(bytes: &[u8]) -> Result<Vec<UsdtNote>, String> {
    Ok(crate::api::usdt::notes_in(bytes)?
        .into_iter()
        .map(|n| UsdtNote {
            provider: n.provider,
            name: n.name,
            addr: n.addr,
            semaphore: n.semaphore,
            spec: n.spec,
        })
        .collect())
}
