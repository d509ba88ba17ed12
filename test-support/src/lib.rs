//! Helpers for the workspace's tests.
//!
//! Process-wide state (rseq registration, membarrier mode, signal handlers)
//! is decided at start-up or shared by every test of a process, so some
//! tests run again in a child process with a changed environment, and
//! tests that change such state, or count what other tests of their binary
//! change, run in a process of their own ([`in_own_process`]). When the
//! tests themselves run under a cross runner (qemu-user for aarch64, which
//! the cross environment exports as
//! `CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER`), children must be
//! started through that runner too: this crate does that.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The environment variable that tells a child started by
/// [`in_own_process`] which test it was started for: there, that test's
/// body runs in place.
pub const OWN_PROCESS_VAR: &str = "TEST_SUPPORT_OWN_PROCESS";

/// How long a child test process may run before it is killed (and the
/// test fails): a hang fails the test instead of holding the run.
pub const CHILD_LIMIT: Duration = Duration::from_mins(5);

/// How many times fewer iterations a test makes under Miri ([`scaled`]).
pub const MIRI_DIVISOR: u64 = 1000;

/// Counts up to this are left as they are under Miri ([`scaled`]).
pub const MIRI_FLOOR: u64 = 100;

/// An iteration count for a test: `n` itself in a normal run. Under
/// Miri, which interprets every step (thousands of times slower than the
/// machine) and explores interleavings by its scheduler and seeds rather
/// than by volume, `n /`[`MIRI_DIVISOR`], but never below
/// `min(n,`[`MIRI_FLOOR`]`)`: a stress loop still makes enough rounds
/// for its threads to interleave, and a small count (a test's exact
/// shape) is kept.
///
/// ```
/// let rounds = test_support::scaled(200_000u64);
/// assert_eq!(rounds, if cfg!(miri) { 200 } else { 200_000 });
/// assert_eq!(test_support::scaled(8usize), 8);
/// ```
///
/// # Panics
/// Never: the result is at most `n`, so it fits `T`.
#[must_use]
pub fn scaled<T>(n: T) -> T
where
    T: Copy + TryInto<u64> + TryFrom<u64>,
{
    if !cfg!(miri) {
        return n;
    }
    let Ok(wide) = n.try_into() else { return n };
    let less = (wide / MIRI_DIVISOR).max(wide.min(MIRI_FLOOR));
    T::try_from(less).unwrap_or_else(|_| unreachable!("{less} is at most n"))
}

/// A `Command` that runs the executable `exe` of this build, through the
/// cross runner when there is one.
///
/// # Panics
/// If the runner variable is set but empty.
#[must_use]
pub fn command(exe: impl AsRef<OsStr>) -> Command {
    let runner = std::env::var("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER")
        .ok()
        .filter(|_| cfg!(target_arch = "aarch64"));
    match runner.as_deref().map(str::split_whitespace) {
        Some(mut parts) => {
            let mut c = Command::new(parts.next().expect("empty runner"));
            c.args(parts).arg(exe);
            c
        }
        None => Command::new(exe),
    }
}

/// Runs `body`, the whole body of the test called `name`, in a process
/// that runs no other test.
///
/// For a test that changes process-wide state the other tests of its
/// binary depend on (a signal disposition, a thread blocking signals, a
/// switch of the library under test), or that asserts exact counts of
/// something other tests change meanwhile (hits of a probed function,
/// slots of a shared pool). `cargo test` runs a binary's tests as threads
/// of one process; `cargo nextest run` gives each test a process of its
/// own.
///
/// - Where the test already has its process, `body` runs here: under
///   nextest (`NEXTEST_EXECUTION_MODE=process-per-test`) and in the child
///   this function starts (its [`OWN_PROCESS_VAR`] names the test).
/// - Otherwise the current test binary is run again, through the cross
///   runner if there is one ([`command`]), filtered to exactly this test
///   (`--exact NAME --include-ignored --nocapture --test-threads=1`), with
///   no standard input and at most [`CHILD_LIMIT`]; the child's output is
///   printed here (libtest shows it for a failed test, or with
///   `--nocapture`).
///
/// `name` is the test's path as libtest lists it (`module::test` for a
/// test in a module). The child runs the whole test function again, so
/// everything the test does belongs in `body`; not for `#[should_panic]`
/// tests (the child's panic would pass there).
///
/// # Panics
/// If `name` is not the running test's, or the child cannot be started,
/// fails, runs past [`CHILD_LIMIT`], or ran no test (a `name` that matches
/// nothing fails here, it never passes unrun).
///
/// # Example
/// ```no_run
/// #[test]
/// fn a_silent_panic_hook_stays_silent() {
///     test_support::in_own_process("a_silent_panic_hook_stays_silent", || {
///         // Process-wide: beside other tests, it would hide their panics.
///         std::panic::set_hook(Box::new(|_| {}));
///         assert!(std::panic::catch_unwind(|| panic!("unseen")).is_err());
///     });
/// }
/// ```
pub fn in_own_process(name: &str, body: impl FnOnce()) {
    // libtest names each test's thread after the test: a name copied from
    // another test would run that one in the child, and this body never.
    if let Some(thread) = std::thread::current().name()
        && thread != "main"
    {
        assert_eq!(
            thread, name,
            "in_own_process: {name:?} is not the name of the running test"
        );
    }
    if let Some(child) = std::env::var_os(OWN_PROCESS_VAR) {
        assert_eq!(
            child,
            OsStr::new(name),
            "in_own_process: a child started for {} runs {name:?}",
            child.display()
        );
        body();
        return;
    }
    if std::env::var_os("NEXTEST_EXECUTION_MODE").as_deref() == Some(OsStr::new("process-per-test"))
    {
        body();
        return;
    }
    let out = run_test_in_child(name, &[(OWN_PROCESS_VAR, name)])
        .unwrap_or_else(|failure| panic!("{failure}"));
    println!("[{name}: ran in a process of its own; its output follows]");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
}

/// Runs test `name` of the current test binary in a child process with
/// `env` added, and asserts that it ran and passed.
///
/// # Panics
/// If the child cannot be started, fails, runs past [`CHILD_LIMIT`] or ran
/// no test.
#[must_use]
pub fn rerun_in_child(name: &str, env: &[(&str, &str)]) -> Output {
    run_test_in_child(name, env).unwrap_or_else(|failure| panic!("{failure}"))
}

/// Whether the child's standard output contains `line`.
#[must_use]
pub fn printed(out: &Output, line: &str) -> bool {
    printed_raw(&out.stdout, line)
}

/// What libtest prints when exactly one test ran and passed.
const ONE_PASSED: &str = "test result: ok. 1 passed;";

/// Runs test `name` of the current test binary alone in a child process
/// with `env` added: its output if it ran and passed, else why not (with
/// its output).
fn run_test_in_child(name: &str, env: &[(&str, &str)]) -> Result<Output, String> {
    // Said plainly, rather than as Miri's "unsupported operation" deep in
    // `Command::spawn`.
    if cfg!(miri) {
        return Err(format!(
            "child test {name}: Miri cannot start a process: \
             mark the test `#[cfg_attr(miri, ignore = \"...\")]`"
        ));
    }
    let exe = std::env::current_exe().map_err(|e| format!("the current test binary: {e}"))?;
    let mut cmd = command(exe);
    cmd.args([
        "--exact",
        name,
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .envs(env.iter().copied())
    .stdin(Stdio::null());
    let out = output_within(&mut cmd, CHILD_LIMIT)
        .map_err(|e| format!("child test {name}: cannot run it: {e}"))?;
    let shown = || {
        format!(
            "--- stdout\n{}\n--- stderr\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    match out.status {
        None => Err(format!(
            "child test {name}: killed after {} s\n{}",
            CHILD_LIMIT.as_secs(),
            shown()
        )),
        Some(status) if !status.success() => {
            Err(format!("child test {name} failed ({status}):\n{}", shown()))
        }
        Some(_) if !printed_raw(&out.stdout, ONE_PASSED) => Err(format!(
            "child test {name}: no test of that name ran (libtest did not say \"{ONE_PASSED}\"):\n{}",
            shown()
        )),
        Some(status) => Ok(Output {
            status,
            stdout: out.stdout,
            stderr: out.stderr,
        }),
    }
}

/// Whether `stdout` contains `line`.
fn printed_raw(stdout: &[u8], line: &str) -> bool {
    String::from_utf8_lossy(stdout).contains(line)
}

/// A child's output: `status` is `None` if it was killed at the limit.
struct Bounded {
    status: Option<ExitStatus>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Runs `cmd` with its standard output and error in files, killing it once
/// `limit` has passed; what it wrote by then. Files, not pipes: nothing
/// waits for a grandchild that keeps them open, and no thread of this
/// process reads them meanwhile.
///
/// The child is forked, then executes `cmd` (not `posix_spawn`, which
/// keeps every signal of the spawning thread blocked until the child has
/// executed, while other tests of this process may look at the masks of
/// its threads: uprobe-core's attach refuses while a thread blocks
/// SIGTRAP, and its trap-free probes need every thread to answer a
/// signal).
fn output_within(cmd: &mut Command, limit: Duration) -> std::io::Result<Bounded> {
    let deadline = Instant::now() + limit;
    let (mut stdout, mut stderr) = (unlinked_file()?, unlinked_file()?);
    cmd.stdout(stdout.try_clone()?).stderr(stderr.try_clone()?);
    // SAFETY: the closure, run in the forked child before it executes the
    // command, does nothing (so nothing that is not async-signal-safe).
    unsafe { cmd.pre_exec(|| Ok(())) };
    let mut child = cmd.spawn()?;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if Instant::now() >= deadline {
            // Killing a child that just exited fails harmlessly.
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let read = |file: &mut File| -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        file.seek(SeekFrom::Start(0))?;
        file.read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    Ok(Bounded {
        status,
        stdout: read(&mut stdout)?,
        stderr: read(&mut stderr)?,
    })
}

/// A new file, open for reading and writing, whose name is already gone.
fn unlinked_file() -> std::io::Result<File> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "test-support-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let file = File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test the others run in children: fails where it is asked to.
    #[test]
    fn fails_when_asked() {
        assert!(
            std::env::var_os("TEST_SUPPORT_FAIL").is_none(),
            "asked to fail"
        );
    }

    #[test]
    fn a_child_that_passes_gives_its_output() {
        let out = run_test_in_child("tests::fails_when_asked", &[]).unwrap();
        assert!(printed(&out, ONE_PASSED));
    }

    #[test]
    fn a_child_that_fails_is_an_error_with_its_output() {
        let err = run_test_in_child("tests::fails_when_asked", &[("TEST_SUPPORT_FAIL", "1")])
            .unwrap_err();
        assert!(err.contains("failed"), "{err}");
        assert!(err.contains("asked to fail"), "{err}");
    }

    #[test]
    fn a_name_that_matches_no_test_is_an_error() {
        // Not even a prefix match: `--exact`.
        for name in ["no_such_test", "tests::fails_when", "fails_when_asked"] {
            let err = run_test_in_child(name, &[]).unwrap_err();
            assert!(err.contains("no test of that name ran"), "{err}");
        }
    }

    #[test]
    fn a_child_past_the_limit_is_killed() {
        let start = Instant::now();
        let out =
            output_within(Command::new("sleep").arg("30"), Duration::from_millis(200)).unwrap();
        assert!(out.status.is_none(), "not killed");
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_grandchild_keeping_the_output_open_is_not_waited_for() {
        // The shell exits at once; the `sleep` it leaves behind keeps its
        // standard output and error open.
        let start = Instant::now();
        let out = output_within(
            Command::new("sh").args(["-c", "echo started; sleep 30 &"]),
            Duration::from_millis(500),
        )
        .unwrap();
        assert!(out.status.is_some_and(|s| s.success()));
        assert_eq!(out.stdout, b"started\n");
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    #[should_panic(expected = "is not the name of the running test")]
    fn a_name_other_than_the_running_tests_panics() {
        in_own_process("tests::fails_when_asked", || {});
    }
}
