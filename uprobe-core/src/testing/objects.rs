//! What the engine reads of an object file, on bytes alone: its symbol
//! index and unwind extents ([`Object`]) and its USDT notes
//! ([`usdt_notes`]); and, for tests and benchmarks, the instructions of
//! its exported functions (`exported_instructions`, x86-64). The engine reads the objects of whatever process it
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

/// Every instruction of every exported function of the ELF object
/// `bytes` (x86-64): `(function name, offset in the function, file
/// address)`, sorted by address, each function decoded from its symbol's
/// start until its size or an undecodable byte. What the tests and the
/// attach benchmark probe a library's interior with. Not
/// async-signal-safe.
#[cfg(target_arch = "x86_64")]
#[must_use]
pub fn exported_instructions(bytes: &[u8]) -> Vec<(String, usize, u64)> {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    let Ok(file) = object::File::parse(bytes) else {
        return Vec::new();
    };
    let Some(text) = file.section_by_name(".text") else {
        return Vec::new();
    };
    let mut seen = std::collections::HashSet::new();
    let mut all = Vec::new();
    for s in file.dynamic_symbols() {
        if s.kind() != object::SymbolKind::Text || s.is_undefined() || !s.is_global() {
            continue;
        }
        let (Ok(name), addr, size) = (s.name(), s.address(), s.size()) else {
            continue;
        };
        if size == 0 || !seen.insert(addr) {
            continue;
        }
        let Some(code) = text.data_range(addr, size).ok().flatten() else {
            continue;
        };
        let mut decoder = iced_x86::Decoder::with_ip(64, code, addr, 0);
        while decoder.can_decode() {
            let insn = decoder.decode();
            if insn.is_invalid() {
                break;
            }
            all.push((name.to_string(), (insn.ip() - addr) as usize, insn.ip()));
        }
    }
    all.sort_by_key(|b| b.2);
    all
}
