//! Function extents from an object's unwind information, for code no
//! symbol covers: glibc's IFUNC implementations in a stripped libc
//! (`__memmove_avx_unaligned_erms`, `__strlen_avx2`), the internal
//! functions of a stripped program. Every function the toolchain emitted
//! call-frame information for has a frame description entry (FDE) in
//! `.eh_frame`: its start and length. An FDE is found through
//! `.eh_frame_hdr`'s sorted table where the object has one, else through
//! a scan of `.eh_frame` (made once, then searched). Parsed with `gimli`;
//! a malformed section only means no extent. Not async-signal-safe.

use std::sync::OnceLock;

use gimli::{BaseAddresses, EhFrame, EhFrameHdr, EndianSlice, RunTimeEndian, UnwindSection as _};
use object::read::elf::ElfFile64;
use object::{Object as _, ObjectSection as _};

/// One object's `.eh_frame` (and `.eh_frame_hdr`), copied out of its
/// file, with the addresses the sections have in the file (before the
/// load bias).
pub(crate) struct Frames {
    endian: RunTimeEndian,
    eh_frame: Vec<u8>,
    eh_frame_addr: u64,
    /// `.eh_frame_hdr` and its address, where there is one.
    hdr: Option<(Vec<u8>, u64)>,
    /// Every FDE's `(start, len)`, sorted by start: the scan, made on
    /// first use where the header has no usable table.
    scanned: OnceLock<Vec<(u64, u64)>>,
}

impl Frames {
    /// The unwind sections of `elf`; `None` if it has no `.eh_frame`.
    pub(crate) fn read(elf: &ElfFile64<'_, object::Endianness>) -> Option<Self> {
        let section = |name: &str| {
            let s = elf.section_by_name(name)?;
            Some((s.data().ok()?.to_vec(), s.address()))
        };
        let (eh_frame, eh_frame_addr) = section(".eh_frame")?;
        Some(Self {
            endian: if elf.is_little_endian() {
                RunTimeEndian::Little
            } else {
                RunTimeEndian::Big
            },
            eh_frame,
            eh_frame_addr,
            hdr: section(".eh_frame_hdr"),
            scanned: OnceLock::new(),
        })
    }

    /// The `(start, len)` of the FDE covering file address `addr`.
    pub(crate) fn extent(&self, addr: u64) -> Option<(u64, u64)> {
        let eh_frame = self.eh_frame();
        let bases = self.bases();
        if let Some((hdr, hdr_addr)) = &self.hdr
            && let Ok(parsed) = EhFrameHdr::new(hdr, self.endian)
                .parse(&bases.clone().set_eh_frame_hdr(*hdr_addr), 8)
            && let Some(table) = parsed.table()
        {
            let bases = bases.set_eh_frame_hdr(*hdr_addr);
            return table
                .fde_for_address(&eh_frame, &bases, addr, EhFrame::cie_from_offset)
                .ok()
                .map(|fde| (fde.initial_address(), fde.len()))
                .filter(|&(_, len)| len > 0);
        }
        let scanned = self.scanned.get_or_init(|| self.scan());
        let after = scanned.partition_point(|e| e.0 <= addr);
        let &(start, len) = scanned[..after].last()?;
        (addr - start < len).then_some((start, len))
    }

    /// The `(start, len)` of the last FDE that ends at or before file
    /// address `addr`, if no FDE covers `addr` (it lies between the
    /// code that unwind information describes: padding, or code
    /// without any). Not async-signal-safe (the first call scans the
    /// whole section).
    pub(crate) fn before(&self, addr: u64) -> Option<(u64, u64)> {
        let scanned = self.scanned.get_or_init(|| self.scan());
        let after = scanned.partition_point(|e| e.0 <= addr);
        let &(start, len) = scanned[..after].last()?;
        (addr - start >= len).then_some((start, len))
    }

    fn eh_frame(&self) -> EhFrame<EndianSlice<'_, RunTimeEndian>> {
        let mut eh_frame = EhFrame::new(&self.eh_frame, self.endian);
        eh_frame.set_address_size(8);
        eh_frame
    }

    fn bases(&self) -> BaseAddresses {
        BaseAddresses::default().set_eh_frame(self.eh_frame_addr)
    }

    /// Every FDE of `.eh_frame` up to the first malformed entry.
    fn scan(&self) -> Vec<(u64, u64)> {
        let eh_frame = self.eh_frame();
        let bases = self.bases();
        let mut entries = eh_frame.entries(&bases);
        let mut out = Vec::new();
        while let Ok(Some(entry)) = entries.next() {
            if let gimli::CieOrFde::Fde(partial) = entry
                && let Ok(fde) = partial.parse(EhFrame::cie_from_offset)
                && fde.len() > 0
            {
                out.push((fde.initial_address(), fde.len()));
            }
        }
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use object::read::elf::ElfFile64;
    use object::{Object as _, ObjectSymbol as _};

    use super::Frames;

    /// A function of this test binary, with a symbol and compiled unwind
    /// information.
    #[inline(never)]
    extern "C" fn compiled(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(3) ^ 7
    }

    /// The file's unwind sections, and its text symbols with a size:
    /// `(name, address, size)`.
    fn read(path: &str) -> (Frames, Vec<(String, u64, u64)>) {
        let data = std::fs::read(path).unwrap();
        let elf = ElfFile64::<object::Endianness>::parse(&*data).unwrap();
        let symbols = elf
            .symbols()
            .chain(elf.dynamic_symbols())
            .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
            .map(|s| (s.name().unwrap_or("").to_string(), s.address(), s.size()))
            .collect();
        (Frames::read(&elf).unwrap(), symbols)
    }

    fn libc_path() -> String {
        // SAFETY: dladdr of a libc function fills `info`; its file name
        // lives as long as libc stays loaded (for good).
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert!(libc::dladdr(libc::getpid as *const libc::c_void, &raw mut info) != 0);
            std::ffi::CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned()
        }
    }

    /// The same frames read without `.eh_frame_hdr`: the scan.
    fn scanning(frames: &Frames) -> Frames {
        Frames {
            endian: frames.endian,
            eh_frame: frames.eh_frame.clone(),
            eh_frame_addr: frames.eh_frame_addr,
            hdr: None,
            scanned: std::sync::OnceLock::new(),
        }
    }

    #[test]
    fn the_fde_of_a_symbolled_function_is_its_symbol() {
        // libc's getpid (a `.dynsym` symbol with a size), and a compiled
        // function of this binary (its `.symtab`; at a file address: the
        // load bias taken off).
        let (frames, symbols) = read(&libc_path());
        let &(_, start, size) = symbols.iter().find(|s| s.0 == "getpid").unwrap();
        for frames in [&frames, &scanning(&frames)] {
            for addr in [start, start + size / 2, start + size - 1] {
                assert_eq!(frames.extent(addr), Some((start, size)), "{addr:#x}");
            }
            assert_ne!(frames.extent(start + size), Some((start, size)));
        }
        assert_eq!(compiled(1), 4);
        let (frames, symbols) = read("/proc/self/exe");
        // Its mangled name: `..6frames5tests8compiled17h<hash>E`.
        let &(_, start, size) = symbols
            .iter()
            .find(|s| s.0.contains("6frames5tests8compiled"))
            .unwrap();
        for frames in [&frames, &scanning(&frames)] {
            assert_eq!(frames.extent(start + 1), Some((start, size)));
        }
    }

    #[test]
    fn the_table_and_the_scan_agree() {
        let (frames, _) = read(&libc_path());
        let scan = scanning(&frames);
        let all = scan.scanned.get_or_init(|| scan.scan()).clone();
        assert!(all.len() > 100, "{} FDEs", all.len());
        for &(start, len) in &all {
            assert_eq!(frames.extent(start), Some((start, len)));
            assert_eq!(frames.extent(start + len - 1), Some((start, len)));
        }
        assert_eq!(frames.extent(0), None);
        assert_eq!(frames.extent(u64::MAX), None);
    }

    #[test]
    fn malformed_sections_mean_no_extent() {
        let (frames, _) = read(&libc_path());
        let (start, _) = frames.extent(libc_getpid_file_addr()).unwrap();
        // Cut short, bit-flipped, or garbage: never a panic.
        let mut broken = Vec::new();
        for cut in [0, 3, 17, frames.eh_frame.len() / 2] {
            let mut f = scanning(&frames);
            f.eh_frame.truncate(cut);
            broken.push(f);
            let mut f = scanning(&frames);
            f.hdr = frames.hdr.clone();
            f.eh_frame.truncate(cut);
            broken.push(f);
        }
        let mut f = scanning(&frames);
        f.hdr = frames.hdr.clone().map(|(mut h, a)| {
            h.iter_mut().skip(4).for_each(|b| *b ^= 0x5a);
            (h, a)
        });
        broken.push(f);
        let mut f = scanning(&frames);
        f.eh_frame.iter_mut().for_each(|b| *b = 0xff);
        broken.push(f);
        for f in &broken {
            for addr in [0, start, start + 1, u64::MAX] {
                let _ = f.extent(addr);
            }
        }
    }

    fn libc_getpid_file_addr() -> u64 {
        let (_, symbols) = read(&libc_path());
        symbols.iter().find(|s| s.0 == "getpid").unwrap().1
    }
}
