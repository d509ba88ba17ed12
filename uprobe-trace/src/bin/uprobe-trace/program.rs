//! The program to start and the agent to load: where they are, and the
//! programs the dynamic linker will not preload into.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

/// `name` as `execvp` would find it.
pub fn find(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Programs the dynamic linker will not preload into: statically linked
/// ones (no dynamic linker at all) and setuid/setgid ones (secure mode
/// ignores `LD_PRELOAD` paths).
pub fn refuse_unpreloadable(program: &Path) -> Result<(), String> {
    let meta = program
        .metadata()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Err(format!(
            "{} is setuid or setgid: the dynamic linker does not preload the agent into it",
            program.display()
        ));
    }
    let data = std::fs::read(program).map_err(|e| format!("{}: {e}", program.display()))?;
    if data.starts_with(b"#!") {
        return Ok(()); // a script: its interpreter is what runs
    }
    if !has_interpreter(&data) {
        return Err(format!(
            "{} is statically linked (or not an ELF program): nothing can be preloaded into it",
            program.display()
        ));
    }
    Ok(())
}

/// Whether an ELF file has a `PT_INTERP` program header (a dynamic
/// linker).
fn has_interpreter(elf: &[u8]) -> bool {
    use object::read::elf::{ElfFile64, ProgramHeader as _};
    let Ok(file) = ElfFile64::<object::Endianness>::parse(elf) else {
        return false; // not a 64-bit ELF file
    };
    let endian = file.endian();
    file.elf_program_headers()
        .iter()
        .any(|ph| ph.p_type(endian) == object::elf::PT_INTERP)
}

/// The agent library: `--agent`, or `libuprobe_trace.so` next to this
/// executable (where `cargo build` puts both), or in its `deps` folder
/// (where a build of the tests alone leaves it).
pub fn agent_path(given: Option<&Path>) -> Result<PathBuf, String> {
    let path = if let Some(p) = given {
        p.to_path_buf()
    } else {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let next_to = exe.with_file_name("libuprobe_trace.so");
        // A build of the tests only leaves it among the dependencies (and
        // leaves the one next to the tool as an earlier build made it):
        // the newer of the two.
        let in_deps = exe.with_file_name("deps").join("libuprobe_trace.so");
        let modified = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
        match (modified(&next_to), modified(&in_deps)) {
            (Some(a), Some(b)) if b > a => in_deps,
            (None, Some(_)) => in_deps,
            _ => next_to,
        }
    };
    if !path.is_file() {
        return Err(format!(
            "the agent library {} is missing (build it with `cargo build --release -p uprobe-trace`, or give --agent)",
            path.display()
        ));
    }
    std::fs::canonicalize(&path).map_err(|e| format!("{}: {e}", path.display()))
}
