//! `bench`: seed-style scaling tables for the workspace's primitives.
//!
//! ```text
//! cargo run --release -p benches --bin bench -- seeds [--threads 1,2]
//!     [--duration-ms 250] [--runs 3] [--out DIR]
//! cargo run --release -p benches --bin bench -- SCENARIO [--threads 1,2]
//!     [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
//! cargo run --release -p benches --bin bench -- --list
//! ```
//!
//! Usage errors (an unknown option, a bad value, an unknown scenario or
//! implementation, an output path that cannot be written) exit with 2
//! before anything runs; a run whose workload fails its check exits with 1.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use clap::builder::PossibleValuesParser;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

use benches::harness::{Columns, Options, Row, Scenario, allowed_cpus, run_scenario};
use benches::{chart, scenarios, seeds};

const USAGE: &str = "\
bench seeds [--threads 1,2] [--duration-ms 250] [--runs 3] [--out DIR]
       bench SCENARIO [--threads 1,2] [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
       bench --list";

const SEEDS_HELP: &str = "\
`seeds` runs every seed's before/after comparison with the peers and the
kernel's uprobes, in one interleaved pass, and prints one table per seed
with each row's ratio to the seed's before; it writes the rows as JSON and
one SVG chart per seed to --out (default target/bench/seeds).";

const SCENARIO_HELP: &str = "\
SCENARIO runs every implementation of one scenario at each thread count,
--runs times for --duration-ms each, interleaving implementations run by
run, threads pinned round-robin to the allowed CPUs; prints the median
total throughput per row.";

const THREADS_HELP: &str = "\
--threads defaults to 1 up to the number of allowed CPUs. A row with more
threads than allowed CPUs says so: `(  4 threads on 2 cpus)`.";

const ABOUT: &str = "Seed-style scaling tables for the workspace's primitives.";

const SEEDS_ABOUT: &str =
    "Every seed's before/after with the peers and the kernel, in one interleaved pass.";

/// Seed-style scaling tables for the workspace's primitives.
#[derive(Debug, Parser)]
#[command(
    name = "bench",
    version,
    override_usage = USAGE,
    long_about = format!("{ABOUT}\n\n{SEEDS_HELP}\n\n{SCENARIO_HELP}\n\n{THREADS_HELP}"),
    after_help = "`bench --list` names the scenarios; `bench SCENARIO --help` shows one's options.",
    arg_required_else_help = true,
    // `bench help X` is `bench X --help`, for scenarios too (see `run`).
    disable_help_subcommand = true
)]
struct Cli {
    /// List `seeds` and every scenario with its implementations
    #[arg(long)]
    list: bool,
    #[command(subcommand)]
    form: Option<Form>,
}

/// `bench seeds` or `bench SCENARIO`.
#[derive(Debug, Subcommand)]
enum Form {
    /// Every seed's before/after with the peers and the kernel, in one
    /// interleaved pass
    #[command(long_about = format!("{SEEDS_ABOUT}\n\n{SEEDS_HELP}\n\n{THREADS_HELP}"))]
    Seeds(SeedsArgs),
    /// A scenario's name and options, parsed by [`ScenarioArgs`] once the
    /// scenario is known.
    #[command(external_subcommand)]
    Scenario(Vec<OsString>),
}

/// `bench seeds`'s options.
#[derive(Debug, Args)]
struct SeedsArgs {
    /// Thread counts, comma-separated [default: 1 up to the number of
    /// allowed CPUs]
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        value_parser = positive::<usize>,
        allow_negative_numbers = true
    )]
    threads: Vec<usize>,
    /// How long each measurement runs, in milliseconds
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 250,
        value_parser = positive::<u64>,
        allow_negative_numbers = true
    )]
    duration_ms: u64,
    /// Measurements of each row; the row reports their median
    #[arg(
        long,
        value_name = "N",
        default_value_t = 3,
        value_parser = positive::<usize>,
        allow_negative_numbers = true
    )]
    runs: usize,
    /// Directory for rows.json and one chart per seed (seed-NNN.svg)
    #[arg(long, value_name = "DIR", default_value = "target/bench/seeds")]
    out: PathBuf,
}

/// `bench SCENARIO`'s options (the command is completed for the chosen
/// scenario by [`ScenarioRun::prepare`]).
#[derive(Debug, Parser)]
struct ScenarioArgs {
    /// Thread counts, comma-separated [default: 1 up to the number of
    /// allowed CPUs]
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        value_parser = positive::<usize>,
        allow_negative_numbers = true
    )]
    threads: Vec<usize>,
    /// How long each measurement runs, in milliseconds
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 500,
        value_parser = positive::<u64>,
        allow_negative_numbers = true
    )]
    duration_ms: u64,
    /// Measurements of each row; the row reports their median
    #[arg(
        long,
        value_name = "N",
        default_value_t = 5,
        value_parser = positive::<usize>,
        allow_negative_numbers = true
    )]
    runs: usize,
    /// Implementations to run, comma-separated [default: all of the
    /// scenario's]
    #[arg(long = "impl", value_name = "IMPL,...", value_delimiter = ',')]
    impls: Option<Vec<String>>,
    /// Also write the rows as JSON to FILE
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Build the pools (or locks) of the implementations that can be, as
    /// if the machine had N CPUs, once per N, comma-separated: their rows
    /// are IMPL@N [default: the machine's CPUs]
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        value_parser = positive::<usize>,
        allow_negative_numbers = true
    )]
    lists: Vec<usize>,
}

/// Parses a whole number of at least 1.
fn positive<T>(s: &str) -> Result<T, String>
where
    T: FromStr<Err = std::num::ParseIntError> + Default + PartialEq,
{
    let s = s.trim();
    if s.starts_with('-') {
        return Err("must be at least 1".into());
    }
    let n: T = s
        .parse()
        .map_err(|e| format!("expected a positive whole number ({e})"))?;
    if n == T::default() {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

/// Adds to clap's refusal of an option the reason when the option
/// belongs to the other form (or goes after the form).
fn explain(mut e: clap::Error) -> clap::Error {
    if e.kind() != ErrorKind::UnknownArgument {
        return e;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let tip = match arg.split('=').next().unwrap_or_default() {
        "--impl" | "--json" => {
            "--impl and --json go with a single scenario (`bench SCENARIO --impl a,b --json FILE`); \
             `bench seeds` runs every seed's implementations and writes its rows to --out"
        }
        "--out" => {
            "--out goes with `bench seeds --out DIR`; a single scenario writes its rows with --json FILE"
        }
        "--threads" | "--duration-ms" | "--runs" => {
            "options go after the form: `bench seeds --runs 3`, `bench SCENARIO --runs 5`"
        }
        _ => return e,
    };
    e.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![tip.into()]),
    );
    e
}

/// A usage error (exit code 2, like clap's) about the path given to
/// `flag`, with `cmd`'s usage.
fn bad_path(cmd: &mut clap::Command, flag: &str, path: &Path, why: &str, e: &io::Error) -> ! {
    cmd.error(
        ErrorKind::ValueValidation,
        format!("{flag} {}: {why}: {e}", path.display()),
    )
    .exit()
}

/// A file the run ends by writing, opened before the run starts so that a
/// path that cannot be written is refused before any time is spent.
struct Report {
    path: PathBuf,
    file: File,
    /// Whether opening it created it (a failed run then removes it).
    created: bool,
}

impl Report {
    /// Opens `path` for writing without truncating it yet.
    fn open(path: PathBuf) -> io::Result<Self> {
        let (file, created) = match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(f) => (f, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                (OpenOptions::new().write(true).open(&path)?, false)
            }
            Err(e) => return Err(e),
        };
        Ok(Self {
            path,
            file,
            created,
        })
    }

    /// Replaces the file's contents with `rows` as JSON; returns its path.
    fn write(mut self, rows: &[&Row]) -> Result<PathBuf, String> {
        let text = serde_json::to_string_pretty(rows).expect("rows serialise") + "\n";
        let fail = |e: io::Error| format!("cannot write {}: {e}", self.path.display());
        // A pipe or a device (--json /dev/stdout) cannot be truncated.
        if self.file.metadata().map_err(fail)?.is_file() {
            self.file.set_len(0).map_err(fail)?;
        }
        self.file.write_all(text.as_bytes()).map_err(fail)?;
        Ok(self.path)
    }

    /// Gives the file up after a failed run: removed if opening created it.
    fn abandon(self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The run's options: the given thread counts or 1 up to the allowed CPUs.
fn options(
    threads: Vec<usize>,
    duration_ms: u64,
    runs: usize,
    impls: Option<Vec<String>>,
    lists: Vec<usize>,
) -> Options {
    let threads = if threads.is_empty() {
        (1..=allowed_cpus().len()).collect()
    } else {
        threads
    };
    Options {
        threads,
        duration: Duration::from_millis(duration_ms),
        runs,
        impls,
        lists,
    }
}

/// `bench seeds`, its output directory checked: ready to run.
struct SeedsRun {
    opts: Options,
    dir: PathBuf,
    report: Report,
}

impl SeedsRun {
    /// Creates the output directory and opens its rows.json; exits with a
    /// usage error if either cannot be done.
    fn prepare(args: SeedsArgs) -> Self {
        let mut cli = Cli::command();
        cli.build();
        let cmd = cli
            .find_subcommand_mut("seeds")
            .expect("seeds is a subcommand");
        let dir = args.out;
        if let Err(e) = std::fs::create_dir_all(&dir) {
            bad_path(cmd, "--out", &dir, "cannot create the directory", &e);
        }
        let report = Report::open(dir.join("rows.json"))
            .unwrap_or_else(|e| bad_path(cmd, "--out", &dir, "cannot write rows.json there", &e));
        Self {
            opts: options(args.threads, args.duration_ms, args.runs, None, Vec::new()),
            dir,
            report,
        }
    }

    /// The tables, then the JSON rows and the charts.
    fn run(self) -> Result<(), String> {
        let results = match seeds::run(&self.opts) {
            Ok(r) => r,
            Err(e) => {
                self.report.abandon();
                return Err(e);
            }
        };
        for r in &results {
            println!("{}", r.table());
        }
        let rows: Vec<&Row> = results.iter().flat_map(seeds::SeedResult::rows).collect();
        let mut written = vec![self.report.write(&rows)?];
        let cpus = allowed_cpus().len();
        for r in &results {
            let svg = self.dir.join(format!("seed-{}.svg", r.seed.id));
            chart::draw(r, cpus, &svg)?;
            written.push(svg);
        }
        for w in written {
            println!("wrote {}", w.display());
        }
        Ok(())
    }
}

/// `bench SCENARIO`, its options checked against the scenario: ready to run.
struct ScenarioRun {
    sc: Scenario,
    opts: Options,
    report: Option<Report>,
}

impl ScenarioRun {
    /// Parses `argv` (the scenario's name, then its options) for the
    /// scenario it names and opens the --json file; exits with a usage
    /// error if there is no such scenario, an option is refused or the
    /// file cannot be written.
    fn prepare(argv: Vec<OsString>) -> Self {
        let name = argv
            .first()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(sc) = scenarios::find(&name) else {
            Cli::command()
                .error(
                    ErrorKind::InvalidSubcommand,
                    format!("unknown scenario '{name}' (`bench --list` names every scenario)"),
                )
                .exit()
        };
        let mut cmd = ScenarioArgs::command()
            .name(sc.name)
            .bin_name(format!("bench {}", sc.name))
            .about(sc.about)
            .long_about(format!("{}\n\n{SCENARIO_HELP}\n\n{THREADS_HELP}", sc.about))
            .mut_arg("impls", |a| {
                a.value_parser(PossibleValuesParser::new(sc.impls.iter().copied()))
            });
        let parsed = cmd
            .try_get_matches_from_mut(argv)
            .and_then(|mut m| ScenarioArgs::from_arg_matches_mut(&mut m))
            .unwrap_or_else(|e| explain(e.format(&mut cmd)).exit());
        let report = parsed.json.map(|path| {
            Report::open(path.clone())
                .unwrap_or_else(|e| bad_path(&mut cmd, "--json", &path, "cannot be written", &e))
        });
        Self {
            sc,
            opts: options(
                parsed.threads,
                parsed.duration_ms,
                parsed.runs,
                parsed.impls,
                parsed.lists,
            ),
            report,
        }
    }

    /// The rows, the skipped implementations, the JSON.
    fn run(self) -> Result<(), String> {
        let (rows, skipped) = match run_scenario(&self.sc, &self.opts) {
            Ok(r) => r,
            Err(e) => {
                if let Some(report) = self.report {
                    report.abandon();
                }
                return Err(e);
            }
        };
        let cols = Columns::fit(&rows);
        for r in &rows {
            println!("{}", r.line(cols));
        }
        for s in &skipped {
            println!("{s}");
        }
        if let Some(report) = self.report {
            report.write(&rows.iter().collect::<Vec<_>>())?;
        }
        Ok(())
    }
}

fn list() {
    println!(
        "{:<20} every seed's before/after with peers and the kernel, one interleaved pass",
        "seeds"
    );
    for sc in scenarios::all() {
        println!("{:<20} {}", sc.name, sc.about);
        println!("{:<20} impls: {}", "", sc.impls.join(", "));
    }
}

/// Runs what `cli` asks for; usage errors exit (with 2) from here.
fn run(cli: Cli) -> Result<(), String> {
    match (cli.list, cli.form) {
        (true, None) => {
            list();
            Ok(())
        }
        (true, Some(_)) => Cli::command()
            .error(
                ErrorKind::ArgumentConflict,
                "--list takes no scenario and no options",
            )
            .exit(),
        (false, Some(Form::Seeds(args))) => SeedsRun::prepare(args).run(),
        (false, Some(Form::Scenario(argv))) if argv.first().is_some_and(|a| a == "help") => {
            // `bench help [X]` is `bench [X] --help`.
            let argv = std::iter::once("bench".into())
                .chain(argv.into_iter().skip(1))
                .chain(std::iter::once("--help".into()));
            run(Cli::try_parse_from::<_, OsString>(argv).unwrap_or_else(|e| explain(e).exit()))
        }
        (false, Some(Form::Scenario(argv))) => ScenarioRun::prepare(argv).run(),
        (false, None) => Cli::command()
            .error(
                ErrorKind::MissingSubcommand,
                "no scenario given (`bench --list` names them)",
            )
            .exit(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::try_parse().unwrap_or_else(|e| explain(e).exit());
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
