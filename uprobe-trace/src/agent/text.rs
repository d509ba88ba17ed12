//! Giving back the agent's code pages when a session in a running process
//! ends.
//!
//! The agent stays loaded after its session (a later `--pid` session
//! reuses it), but nothing of it runs any more: the pages of its code and
//! read-only data that the attach touched (~1.3 MiB) would stay resident
//! in the program for good. They are clean copies of the agent's file, so
//! `madvise(MADV_DONTNEED)` drops them from the program's memory, and a
//! later access reads them from the file again, as at the first touch.
//!
//! Only a mapping of the agent's file that has never been written is
//! dropped: not writable, and no private page of its own in `smaps`
//! (`Anonymous: 0 kB`). The relocated read-only data (RELRO) is mapped
//! read-only too but is made of private pages written by the dynamic
//! linker: dropping it would bring back the file's unrelocated bytes, so
//! the check is by page, not by permission.

use std::path::Path;

/// One mapping of `/proc/self/smaps` that may be dropped.
#[derive(Debug, PartialEq, Eq)]
struct Clean {
    start: usize,
    end: usize,
}

/// The never-written mappings of `object` in the lines of an `smaps`.
fn clean_mappings<L: AsRef<str>>(smaps: impl IntoIterator<Item = L>, object: &Path) -> Vec<Clean> {
    let mut found = Vec::new();
    // The mapping whose fields are being read, if it is a candidate.
    let mut current: Option<Clean> = None;
    let mut written = false;
    let mut finish = |current: &mut Option<Clean>, written: bool| {
        if let Some(m) = current.take()
            && !written
        {
            found.push(m);
        }
    };
    for line in smaps {
        let line = line.as_ref();
        if let Some((range, perms, path)) = mapping_header(line) {
            finish(&mut current, written);
            written = false;
            current = (path == object && !perms.contains('w'))
                .then(|| {
                    let (start, end) = range.split_once('-')?;
                    Some(Clean {
                        start: usize::from_str_radix(start, 16).ok()?,
                        end: usize::from_str_radix(end, 16).ok()?,
                    })
                })
                .flatten();
        } else if let Some(kib) = line.strip_prefix("Anonymous:") {
            // Private copies (copy-on-write). Not `Private_Dirty`, which
            // also counts the file's own dirty page-cache pages.
            written |= kib.trim().trim_end_matches("kB").trim() != "0";
        }
    }
    finish(&mut current, written);
    found
}

/// A mapping's header line of `smaps` (`start-end perms offset dev inode
/// path`), as (range, perms, path); `None` for a field line.
fn mapping_header(line: &str) -> Option<(&str, &str, &Path)> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    if !range.contains('-') || range.ends_with(':') {
        return None;
    }
    let perms = fields.next()?;
    let path = fields.nth(3)?.trim_start();
    Some((range, perms, Path::new(path)))
}

/// Drops the resident pages of `object`'s never-written mappings from this
/// process; returns the bytes of address space advised. Not
/// async-signal-safe (reads `/proc`, allocates).
pub(crate) fn give_back(object: &Path) -> usize {
    let Ok(smaps) = std::fs::File::open("/proc/self/smaps") else {
        return 0;
    };
    // Line by line: the whole text (hundreds of KiB in a large process)
    // in one allocation would be served by `mmap`, and freeing it would
    // raise glibc's mmap threshold in the program for good.
    let lines = std::io::BufRead::lines(std::io::BufReader::new(smaps)).map_while(Result::ok);
    let mut advised = 0;
    for m in clean_mappings(lines, object) {
        // SAFETY: a whole mapping of the agent's file that holds no
        // private page and cannot be written: its pages are the file's,
        // and dropping them only makes the next access read them again.
        let done = unsafe {
            libc::madvise(
                m.start as *mut libc::c_void,
                m.end - m.start,
                libc::MADV_DONTNEED,
            )
        };
        if done == 0 {
            advised += m.end - m.start;
        }
    }
    advised
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000010000 r--p 00000000 08:01 42                         /opt/agent.so
Size:                 64 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000010000-7f0000020000 r-xp 00010000 08:01 42                         /opt/agent.so
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000020000-7f0000030000 r--p 00020000 08:01 42                         /opt/agent.so
Private_Dirty:        12 kB
Anonymous:            12 kB
7f0000030000-7f0000031000 rw-p 00030000 08:01 42                         /opt/agent.so
Anonymous:             0 kB
7f0000040000-7f0000050000 r-xp 00000000 08:01 43                         /usr/lib/libc.so.6
Anonymous:             0 kB
7f0000060000-7f0000061000 rw-p 00000000 00:00 0 
Anonymous:             4 kB
";

    #[test]
    fn only_never_written_mappings_of_the_object_are_dropped() {
        let found = clean_mappings(SMAPS.lines(), Path::new("/opt/agent.so"));
        assert_eq!(
            found,
            [
                Clean {
                    start: 0x7f00_0000_0000,
                    end: 0x7f00_0001_0000
                },
                Clean {
                    start: 0x7f00_0001_0000,
                    end: 0x7f00_0002_0000
                },
            ],
            "the RELRO mapping (private pages) and the writable one stay"
        );
        assert!(clean_mappings(SMAPS.lines(), Path::new("/opt/other.so")).is_empty());
    }

    #[test]
    fn dropped_pages_of_a_mapped_file_read_back_unchanged() {
        // A read-only mapping of a file, touched, dropped and read again.
        let path = std::env::temp_dir().join(format!("uprobe-trace-text-{}", std::process::id()));
        std::fs::write(&path, vec![0x5a_u8; 3 * 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let len = 3 * 4096;
        // SAFETY: a fresh private read-only mapping of a file we own.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping just made, `len` bytes.
        let bytes = unsafe { core::slice::from_raw_parts(p.cast::<u8>(), len) };
        assert!(bytes.iter().all(|&b| b == 0x5a));
        let canonical = std::fs::canonicalize(&path).unwrap();
        assert_eq!(give_back(&canonical), len);
        assert!(bytes.iter().all(|&b| b == 0x5a), "read back from the file");
        // SAFETY: unmaps the mapping made above, not used after.
        unsafe { libc::munmap(p, len) };
        std::fs::remove_file(&path).unwrap();
    }
}
