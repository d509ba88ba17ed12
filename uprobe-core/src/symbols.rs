//! Functions of the loaded objects, from their ELF symbol tables.
//!
//! The loaded objects and their load biases come from `dl_iterate_phdr`
//! (the executable's empty name is `/proc/self/exe`); each object's file
//! is read with the `object` crate, `.symtab` first (when not stripped),
//! then `.dynsym`. Exported functions are resolved with `dlsym` on the
//! object, which picks the default symbol version and, for a GNU IFUNC
//! (`memcpy`, `strlen`...), whose symbol names a resolver rather than code
//! the program runs, returns the implementation the resolver selected.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use object::read::elf::ElfFile64;
use object::{Object as _, ObjectSymbol as _, SymbolKind};

use crate::AttachError;

/// A function of a loaded object: where it starts and how long it is (0
/// when unknown, as for an IFUNC implementation that only has a local
/// symbol in a stripped library).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Function {
    pub(crate) name: String,
    pub(crate) start: usize,
    pub(crate) size: usize,
}

/// A loaded object: its file and load bias.
#[derive(Clone, Debug)]
pub(crate) struct Loaded {
    pub(crate) path: PathBuf,
    pub(crate) bias: usize,
    /// The name `dl_iterate_phdr` gave (empty for the executable).
    pub(crate) name: String,
}

/// Every loaded object with a file, the executable first.
pub(crate) fn loaded_objects() -> Vec<Loaded> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the vector passed below; `info` is valid for the
        // call, and its name a C string (maybe empty).
        unsafe {
            let out = &mut *data.cast::<Vec<Loaded>>();
            let info = &*info;
            let name = if info.dlpi_name.is_null() {
                String::new()
            } else {
                CStr::from_ptr(info.dlpi_name)
                    .to_string_lossy()
                    .into_owned()
            };
            let path = if name.is_empty() {
                std::fs::read_link("/proc/self/exe").unwrap_or_default()
            } else {
                PathBuf::from(&name)
            };
            out.push(Loaded {
                path,
                bias: info.dlpi_addr as usize,
                name,
            });
        }
        0
    }
    let mut out: Vec<Loaded> = Vec::new();
    // SAFETY: the callback only appends to `out`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&raw mut out).cast()) };
    // Opened, not `stat`ed: an emulator that maps the program's paths onto
    // a sysroot (qemu-user's `-L`) does so for `open`, not for `statx`.
    out.retain(|l| {
        std::fs::File::open(&l.path)
            .and_then(|f| f.metadata())
            .is_ok_and(|m| m.is_file())
    });
    out
}

/// The dynamic linker's counts of objects loaded and unloaded so far
/// (`dlpi_adds`, `dlpi_subs`): equal counts mean the same objects.
/// `None` where the dynamic linker does not keep them.
pub(crate) fn load_generation() -> Option<(u64, u64)> {
    unsafe extern "C" fn first(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the pair passed below; `info` is valid for
        // the call and has the counters when `size` covers them.
        unsafe {
            if size >= core::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) + 8 {
                *data.cast::<Option<(u64, u64)>>() = Some(((*info).dlpi_adds, (*info).dlpi_subs));
            }
        }
        1
    }
    let mut generation = None;
    // SAFETY: the callback writes only `generation`, then stops the walk.
    unsafe { libc::dl_iterate_phdr(Some(first), (&raw mut generation).cast()) };
    generation
}

/// Whether `object` (a file name like `libc.so.6`, or a path) names `l`.
fn names(l: &Loaded, object: &str) -> bool {
    l.path == Path::new(object)
        || l.path.file_name().is_some_and(|f| f == object)
        || (!l.name.is_empty() && l.name == object)
}

/// The function `name` in `object` (or, for `None`, in the executable
/// and then every loaded library in load order).
pub(crate) fn find_function(object: Option<&str>, name: &str) -> Result<Function, AttachError> {
    let objects = loaded_objects();
    let candidates: Vec<&Loaded> = match object {
        None => objects.iter().collect(),
        Some(o) => {
            let found: Vec<&Loaded> = objects.iter().filter(|l| names(l, o)).collect();
            if found.is_empty() {
                return Err(AttachError::NoSuchObject {
                    object: o.to_string(),
                });
            }
            found
        }
    };
    for l in candidates {
        let Ok(data) = std::fs::read(&l.path) else {
            continue;
        };
        let Ok(elf) = ElfFile64::<object::Endianness>::parse(&*data) else {
            continue;
        };
        let is_function = |sym: &object::read::elf::ElfSymbol64<'_, '_, object::Endianness>| {
            sym.name() == Ok(name) && !sym.is_undefined() && sym.kind() == SymbolKind::Text
        };
        // Exported (or IFUNC): ask the dynamic linker, which picks the
        // default symbol version and runs IFUNC resolvers, i.e. returns
        // what the program's calls reach.
        let exported = elf.dynamic_symbols().any(|s| is_function(&s));
        let ifunc = elf
            .symbols()
            .any(|s| is_function(&s) && s.elf_symbol().st_type() == object::elf::STT_GNU_IFUNC);
        if exported || ifunc {
            let start = resolve(l, name)?;
            let size = covering_function(start).map_or(0, |f| f.size);
            return Ok(Function {
                name: name.to_string(),
                start,
                size,
            });
        }
        if let Some(sym) = elf.symbols().find(|s| is_function(s)) {
            return Ok(Function {
                name: name.to_string(),
                start: l.bias.wrapping_add(sym.address() as usize),
                size: sym.size() as usize,
            });
        }
    }
    Err(AttachError::SymbolNotFound {
        object: object.unwrap_or("any loaded object").to_string(),
        name: name.to_string(),
    })
}

/// What the dynamic linker resolves `name` of `l` to (the default
/// version; for an IFUNC, the implementation its resolver selected).
fn resolve(l: &Loaded, name: &str) -> Result<usize, AttachError> {
    let not_found = || AttachError::SymbolNotFound {
        object: l.path.display().to_string(),
        name: name.to_string(),
    };
    let cname = CString::new(name).map_err(|_| not_found())?;
    let path = CString::new(l.path.as_os_str().as_encoded_bytes()).map_err(|_| not_found())?;
    // SAFETY: dlopen with RTLD_NOLOAD only finds an already loaded object
    // (the executable for a null name); dlsym resolves on that handle;
    // dlclose drops the reference dlopen added.
    unsafe {
        let handle = if l.name.is_empty() {
            libc::dlopen(core::ptr::null(), libc::RTLD_LAZY)
        } else {
            libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD)
        };
        if handle.is_null() {
            return Err(not_found());
        }
        let addr = libc::dlsym(handle, cname.as_ptr());
        libc::dlclose(handle);
        if addr.is_null() {
            Err(not_found())
        } else {
            Ok(addr as usize)
        }
    }
}

/// The function whose symbol covers `addr`, if any.
pub(crate) fn covering_function(addr: usize) -> Option<Function> {
    let map_path = crate::maps::path_of(addr)?;
    let objects = loaded_objects();
    let l = objects.iter().find(|l| {
        l.path == map_path || std::fs::canonicalize(&l.path).is_ok_and(|p| p == map_path)
    })?;
    let data = std::fs::read(&l.path).ok()?;
    let elf = ElfFile64::<object::Endianness>::parse(&*data).ok()?;
    elf.symbols()
        .chain(elf.dynamic_symbols())
        .filter(|s| s.kind() == SymbolKind::Text && !s.is_undefined() && s.size() > 0)
        .find_map(|s| {
            let start = l.bias.wrapping_add(s.address() as usize);
            let size = s.size() as usize;
            (start..start + size).contains(&addr).then(|| Function {
                name: s.name().unwrap_or("?").to_string(),
                start,
                size,
            })
        })
}
