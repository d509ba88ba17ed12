//! Functions of the loaded objects, from their ELF symbol tables.
//!
//! The loaded objects and their load biases come from `dl_iterate_phdr`
//! (the executable's empty name is `/proc/self/exe`); each object's file
//! is read with the `object` crate, `.symtab` first (when not stripped),
//! then `.dynsym`. Exported functions are resolved with `dlsym` on the
//! object, which picks the default symbol version and, for a GNU IFUNC
//! (`memcpy`, `strlen`...), whose symbol names a resolver rather than code
//! the program runs, returns the implementation the resolver selected.
//! Where no symbol covers an address (that implementation in a stripped
//! libc, the internal functions of a stripped program), the function's
//! extent comes from the object's unwind information ([`super::frames`]).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use object::read::elf::ElfFile64;
use object::{Object as _, ObjectSymbol as _, SymbolKind};

use super::frames::Frames;
use crate::AttachError;

/// A function of a loaded object: where it starts and how long it is (0
/// when unknown: a symbol without a size and no unwind information
/// starting there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Function {
    pub(crate) name: String,
    pub(crate) start: usize,
    pub(crate) size: usize,
    /// Whether code outside the extent enters it only at its start, as
    /// a compiled function's symbol promises. `false` for an extent from
    /// unwind information alone: that is mostly hand-written code, whose
    /// other entry points may branch into its first bytes (glibc's
    /// `__mempcpy_avx_unaligned` jumps to the second instruction of
    /// `__memmove_avx_unaligned`).
    pub(crate) sole_entry: bool,
}

impl Function {
    /// The extent, for the jump planner.
    pub(crate) fn extent(&self) -> Extent {
        Extent {
            start: self.start,
            size: self.size,
            sole_entry: self.sole_entry,
        }
    }
}

/// A function's extent as the jump planner takes it (see [`Function`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    pub(crate) start: usize,
    /// 0: unknown.
    pub(crate) size: usize,
    pub(crate) sole_entry: bool,
}

/// A loaded object: its file, load bias and segments.
#[derive(Clone, Debug)]
pub(crate) struct Loaded {
    pub(crate) path: PathBuf,
    pub(crate) bias: usize,
    /// The name `dl_iterate_phdr` gave (empty for the executable).
    pub(crate) name: String,
    /// Every `PT_LOAD` segment: start and end, in this process.
    pub(crate) loads: Vec<(usize, usize)>,
    /// `PT_GNU_EH_FRAME` (the `.eh_frame_hdr` section): address and size.
    pub(crate) eh_frame_hdr: Option<(usize, usize)>,
}

impl Loaded {
    /// Its mapped range, every segment included (`None` without any).
    pub(crate) fn range(&self) -> Option<(usize, usize)> {
        let start = self.loads.iter().map(|s| s.0).min()?;
        let end = self.loads.iter().map(|s| s.1).max()?;
        Some((start, end))
    }
}

/// Every loaded object with a file, the executable first.
pub(crate) fn loaded_objects() -> Vec<Loaded> {
    let mut out = all_loaded();
    // Opened, not `stat`ed: an emulator that maps the program's paths onto
    // a sysroot (qemu-user's `-L`) does so for `open`, not for `statx`.
    out.retain(|l| {
        std::fs::File::open(&l.path)
            .and_then(|f| f.metadata())
            .is_ok_and(|m| m.is_file())
    });
    out
}

/// Every loaded object, the vDSO (which has no file) included.
pub(crate) fn all_loaded() -> Vec<Loaded> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the vector passed below; `info` and its program
        // headers are valid for the call, and its name a C string (maybe
        // empty).
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
            let bias = info.dlpi_addr as usize;
            let phdrs = core::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum));
            let mut loads = Vec::new();
            let mut eh_frame_hdr = None;
            for p in phdrs {
                let at = bias.wrapping_add(p.p_vaddr as usize);
                match p.p_type {
                    libc::PT_LOAD => loads.push((at, at + p.p_memsz as usize)),
                    libc::PT_GNU_EH_FRAME => eh_frame_hdr = Some((at, p.p_memsz as usize)),
                    _ => {}
                }
            }
            out.push(Loaded {
                path,
                bias,
                name,
                loads,
                eh_frame_hdr,
            });
        }
        0
    }
    let mut out: Vec<Loaded> = Vec::new();
    // SAFETY: the callback only appends to `out`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&raw mut out).cast()) };
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

/// The loaded object `object` (a file name like `libc.so.6`, or a path).
pub(crate) fn loaded_object(object: &str) -> Result<Loaded, AttachError> {
    loaded_objects()
        .into_iter()
        .find(|l| names(l, object))
        .ok_or_else(|| AttachError::NoSuchObject {
            object: object.to_string(),
        })
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
    Symbols::now().find_function(object, name)
}

/// The loaded objects, their symbol indexes and the memory map as they
/// are at one moment: for a run of look-ups (the signal-blocked list
/// resolves dozens of names) that should not each list the objects, open
/// every file and read the memory map again. Not async-signal-safe.
pub(crate) struct Symbols {
    objects: Vec<Loaded>,
    indexes:
        std::cell::RefCell<std::collections::HashMap<PathBuf, Option<std::sync::Arc<SymbolIndex>>>>,
    maps: std::cell::OnceCell<crate::process::maps::Snapshot>,
    canonical: std::cell::RefCell<std::collections::HashMap<PathBuf, Option<PathBuf>>>,
}

impl Symbols {
    /// The loaded objects now.
    pub(crate) fn now() -> Self {
        Self {
            objects: loaded_objects(),
            indexes: std::cell::RefCell::default(),
            maps: std::cell::OnceCell::new(),
            canonical: std::cell::RefCell::default(),
        }
    }

    fn index(&self, path: &Path) -> Option<std::sync::Arc<SymbolIndex>> {
        self.indexes
            .borrow_mut()
            .entry(path.to_path_buf())
            .or_insert_with(|| index_of(path))
            .clone()
    }

    fn canonical(&self, path: &Path) -> Option<PathBuf> {
        self.canonical
            .borrow_mut()
            .entry(path.to_path_buf())
            .or_insert_with(|| std::fs::canonicalize(path).ok())
            .clone()
    }

    /// The objects `object` names, or all of them for `None`.
    fn candidates(&self, object: Option<&str>) -> Result<Vec<&Loaded>, AttachError> {
        match object {
            None => Ok(self.objects.iter().collect()),
            Some(o) => {
                let found: Vec<&Loaded> = self.objects.iter().filter(|l| names(l, o)).collect();
                if found.is_empty() {
                    Err(AttachError::NoSuchObject {
                        object: o.to_string(),
                    })
                } else {
                    Ok(found)
                }
            }
        }
    }

    /// See [`find_function`].
    pub(crate) fn find_function(
        &self,
        object: Option<&str>,
        name: &str,
    ) -> Result<Function, AttachError> {
        let candidates = self.candidates(object)?;
        for l in candidates {
            let Some(index) = self.index(&l.path) else {
                continue;
            };
            let Some(found) = index.by_name.get(name) else {
                continue;
            };
            return self.function_in(l, &index, name, found);
        }
        Err(AttachError::SymbolNotFound {
            object: object.unwrap_or("any loaded object").to_string(),
            name: name.to_string(),
        })
    }

    /// The functions of `object` (or of every loaded object) whose names
    /// `filter` accepts, each with the object's path; a function known by
    /// several names (`malloc`, `__libc_malloc`) is listed once, by the
    /// name with the fewest leading underscores, then the shortest.
    pub(crate) fn matching(
        &self,
        object: Option<&str>,
        mut filter: impl FnMut(&str) -> bool,
    ) -> Result<Vec<(PathBuf, Function)>, AttachError> {
        let candidates = self.candidates(object)?;
        let preference = |name: &str| {
            let underscores = name.len() - name.trim_start_matches('_').len();
            (underscores, name.len(), name.to_string())
        };
        let mut out: Vec<(PathBuf, Function)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for l in candidates {
            let Some(index) = self.index(&l.path) else {
                continue;
            };
            let mut wanted: Vec<(&String, &Named)> =
                index.by_name.iter().filter(|(n, _)| filter(n)).collect();
            wanted.sort_by_cached_key(|(n, _)| preference(n));
            for (name, found) in wanted {
                let Ok(function) = self.function_in(l, &index, name, found) else {
                    continue;
                };
                // The preferred name came first; an alias adds nothing.
                if seen.insert(function.start) {
                    out.push((l.path.clone(), function));
                }
            }
        }
        Ok(out)
    }

    /// The function `name` of `l`, whose index entry is `found`.
    fn function_in(
        &self,
        l: &Loaded,
        index: &SymbolIndex,
        name: &str,
        found: &Named,
    ) -> Result<Function, AttachError> {
        // Exported (or IFUNC): ask the dynamic linker, which picks the
        // default symbol version and runs IFUNC resolvers, i.e. returns
        // what the program's calls reach.
        if found.resolve {
            let start = resolve(l, name)?;
            // Only an extent that starts there: one starting before would
            // leave its first part out of the planner's view.
            let (size, sole_entry) = self
                .covering_function(start)
                .filter(|f| f.start == start)
                .map_or((0, true), |f| (f.size, f.sole_entry));
            return Ok(Function {
                name: name.to_string(),
                start,
                size,
                sole_entry,
            });
        }
        // A symbol without a size: the FDE starting there, if any.
        let (size, sole_entry) = match index.frame_at(found.addr) {
            Some(size) if found.size == 0 => (size, false),
            _ => (found.size, true),
        };
        Ok(Function {
            name: name.to_string(),
            start: l.bias.wrapping_add(found.addr),
            size,
            sole_entry,
        })
    }

    /// See [`covering_function`].
    pub(crate) fn covering_function(&self, addr: usize) -> Option<Function> {
        let (l, index) = self.object_of(addr)?;
        let file_addr = addr.wrapping_sub(l.bias);
        if let Some((start, size, name)) = index.covering(file_addr) {
            return Some(Function {
                name: name.to_string(),
                start: l.bias.wrapping_add(start),
                size,
                sole_entry: true,
            });
        }
        // No symbol: the FDE covering it, named after the object and its
        // address there.
        let (start, size) = index.frames.as_ref()?.extent(file_addr as u64)?;
        let file = l.path.file_name().unwrap_or(l.path.as_os_str());
        Some(Function {
            name: format!("{}+{start:#x}", file.to_string_lossy()),
            start: l.bias.wrapping_add(start as usize),
            size: size as usize,
            sole_entry: false,
        })
    }

    /// The loaded object mapped at `addr`, and its index.
    fn object_of(&self, addr: usize) -> Option<(&Loaded, std::sync::Arc<SymbolIndex>)> {
        let map_path = self
            .maps
            .get_or_init(crate::process::maps::Snapshot::read)
            .path_of(addr)?;
        let l = self.objects.iter().find(|l| {
            l.path == map_path || self.canonical(&l.path).is_some_and(|p| p == map_path)
        })?;
        Some((l, self.index(&l.path)?))
    }

    /// The code that unwind information describes right before `addr`,
    /// where none describes `addr` itself: the last FDE's `(start, end)`
    /// before it, in the process's addresses. Not async-signal-safe.
    pub(crate) fn unwound_before(&self, addr: usize) -> Option<(usize, usize)> {
        let (l, index) = self.object_of(addr)?;
        let file_addr = addr.wrapping_sub(l.bias);
        let (start, len) = index.frames.as_ref()?.before(file_addr as u64)?;
        let start = l.bias.wrapping_add(start as usize);
        Some((start, start + len as usize))
    }
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

/// The function whose symbol covers `addr`, if a symbol of its object
/// says so; else the one its object's unwind information describes.
pub(crate) fn covering_function(addr: usize) -> Option<Function> {
    Symbols::now().covering_function(addr)
}

/// A name's entry in an object's [`SymbolIndex`].
struct Named {
    /// Its address in the file (before the load bias).
    addr: usize,
    size: usize,
    /// Exported or an IFUNC: resolved through the dynamic linker.
    resolve: bool,
}

/// One object file's defined text symbols (`.symtab` first, then
/// `.dynsym`), read once per file: attaching thousands of probes by name
/// looks each up here instead of reading the file again.
pub(crate) struct SymbolIndex {
    by_name: std::collections::HashMap<String, Named>,
    /// `(start, size, order)` of every symbol with a size, sorted by
    /// start; `order` is its place in the tables (the first of several
    /// covering an address wins, as a walk of the tables would find).
    by_addr: Vec<(usize, usize, usize)>,
    /// Names by `order`.
    names: Vec<String>,
    /// The largest size in `by_addr`, to bound the search back.
    max_size: usize,
    /// The object's unwind information, for what no symbol covers.
    frames: Option<Frames>,
}

impl SymbolIndex {
    fn read(path: &Path) -> Option<Self> {
        let file = crate::process::file::Mapped::open(path).ok()?;
        Self::parse(file.bytes())
    }

    /// The index of the ELF object `bytes`; `None` if it is not one.
    pub(crate) fn parse(bytes: &[u8]) -> Option<Self> {
        let elf = ElfFile64::<object::Endianness>::parse(bytes).ok()?;
        let mut by_name: std::collections::HashMap<String, Named> =
            std::collections::HashMap::new();
        let mut by_addr = Vec::new();
        let mut names = Vec::new();
        let exported: std::collections::HashSet<&str> = elf
            .dynamic_symbols()
            .filter(|s| s.kind() == SymbolKind::Text && !s.is_undefined())
            .filter_map(|s| s.name().ok())
            .collect();
        for sym in elf.symbols().chain(elf.dynamic_symbols()) {
            if sym.kind() != SymbolKind::Text || sym.is_undefined() {
                continue;
            }
            let Ok(name) = sym.name() else { continue };
            let addr = sym.address() as usize;
            let size = sym.size() as usize;
            let ifunc = sym.elf_symbol().st_type() == object::elf::STT_GNU_IFUNC;
            let entry = by_name.entry(name.to_string()).or_insert(Named {
                addr,
                size,
                resolve: exported.contains(name),
            });
            entry.resolve |= ifunc;
            if size > 0 {
                by_addr.push((addr, size, names.len()));
                names.push(name.to_string());
            }
        }
        by_addr.sort_unstable();
        let max_size = by_addr.iter().map(|e| e.1).max().unwrap_or(0);
        Some(Self {
            by_name,
            by_addr,
            names,
            max_size,
            frames: Frames::read(&elf),
        })
    }

    /// The size of the FDE starting at file address `addr`, if one does.
    pub(crate) fn frame_at(&self, addr: usize) -> Option<usize> {
        let (start, size) = self.frames.as_ref()?.extent(addr as u64)?;
        (start == addr as u64).then_some(size as usize)
    }

    /// The symbol covering file address `addr`: `(start, size, name)`.
    pub(crate) fn covering(&self, addr: usize) -> Option<(usize, usize, &str)> {
        let after = self.by_addr.partition_point(|e| e.0 <= addr);
        self.by_addr[..after]
            .iter()
            .rev()
            .take_while(|e| addr - e.0 < self.max_size)
            .filter(|e| addr - e.0 < e.1)
            .min_by_key(|e| e.2)
            .map(|e| (e.0, e.1, self.names[e.2].as_str()))
    }
}

/// A file's size, modification time and inode: an index is read again
/// when they change.
type Stamp = (u64, Option<std::time::SystemTime>, u64);
type Indexes = std::collections::HashMap<PathBuf, (Stamp, std::sync::Arc<SymbolIndex>)>;

/// The indexes read so far.
static INDEXES: std::sync::Mutex<Option<Indexes>> = std::sync::Mutex::new(None);

/// Forgets the indexes read so far (they are read again when needed).
pub(crate) fn forget_indexes() {
    *INDEXES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
}

/// The index of the file at `path`, read on first use and again when the
/// file changed (its size, modification time or inode).
fn index_of(path: &Path) -> Option<std::sync::Arc<SymbolIndex>> {
    // Opened, not `stat`ed, as in `loaded_objects`.
    let meta = std::fs::File::open(path).and_then(|f| f.metadata()).ok()?;
    let stamp = (
        meta.len(),
        meta.modified().ok(),
        std::os::unix::fs::MetadataExt::ino(&meta),
    );
    // Tried, never waited for: a lock another thread holds (or held at a
    // `fork`, which leaves it locked forever in the child) makes this call
    // read the file itself. Never held while a file is read.
    if let Ok(indexes) = INDEXES.try_lock()
        && let Some((seen, index)) = indexes.as_ref().and_then(|i| i.get(path))
        && *seen == stamp
    {
        return Some(index.clone());
    }
    let index = std::sync::Arc::new(SymbolIndex::read(path)?);
    if let Ok(mut indexes) = INDEXES.try_lock() {
        indexes
            .get_or_insert_with(Default::default)
            .insert(path.to_path_buf(), (stamp, index.clone()));
    }
    Some(index)
}
