//! `file:line` of an address in an object with DWARF line tables
//! (`addr2line` over `gimli`); nothing for one without them.

use std::rc::Rc;

use gimli::{EndianRcSlice, RunTimeEndian};
use object::{Object as _, ObjectSection as _};

/// An object's line tables.
pub struct Lines {
    context: addr2line::Context<EndianRcSlice<RunTimeEndian>>,
}

impl Lines {
    /// The line tables of the object file `data`, if it has any (its
    /// `.debug_line`, uncompressed).
    pub fn read(file: &object::File<'_>) -> Option<Self> {
        let has_lines = file
            .section_by_name(".debug_line")
            .and_then(|s| s.uncompressed_data().ok())
            .is_some_and(|d| !d.is_empty());
        if !has_lines {
            return None;
        }
        let endian = if file.is_little_endian() {
            RunTimeEndian::Little
        } else {
            RunTimeEndian::Big
        };
        let load = |id: gimli::SectionId| -> Result<_, gimli::Error> {
            let data = file
                .section_by_name(id.name())
                .and_then(|s| s.uncompressed_data().ok())
                .unwrap_or_default();
            Ok(EndianRcSlice::new(Rc::from(&*data), endian))
        };
        let dwarf = gimli::Dwarf::load(load).ok()?;
        let context = addr2line::Context::from_dwarf(dwarf).ok()?;
        Some(Self { context })
    }

    /// `file:line` of the code at `addr` (an address in the file), the
    /// file by its name alone.
    pub fn at(&self, addr: u64) -> Option<String> {
        let location = self.context.find_location(addr).ok()??;
        let file = location.file?;
        let name = file.rsplit('/').next().unwrap_or(file);
        Some(format!("{name}:{}", location.line?))
    }
}
