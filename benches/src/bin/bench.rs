//! `bench`: seed-style scaling tables for the workspace's primitives.
//!
//! ```text
//! cargo run --release -p benches --bin bench -- seeds [--threads 1,2]
//!     [--duration-ms 250] [--runs 3] [--out DIR]
//! cargo run --release -p benches --bin bench -- SCENARIO [--threads 1,2]
//!     [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
//! cargo run --release -p benches --bin bench -- --list
//! ```

use std::process::ExitCode;
use std::time::Duration;

use std::path::PathBuf;

use benches::harness::{Options, Row, allowed_cpus, run_scenario};
use benches::{chart, scenarios, seeds};

const USAGE: &str = "\
usage: bench seeds [--threads 1,2] [--duration-ms 250] [--runs 3] [--out DIR]
       bench SCENARIO [--threads 1,2] [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
       bench --list

`seeds` runs every seed's before/after comparison with the peers and the
kernel's uprobes, in one interleaved pass, and prints one table per seed
with each row's ratio to the seed's before; it writes the rows as JSON and
one SVG chart per seed to --out (default target/bench/seeds).

SCENARIO runs every implementation of one scenario at each thread count,
--runs times for --duration-ms each, interleaving implementations run by
run, threads pinned round-robin to the allowed CPUs; prints the median
total throughput per row.

--threads defaults to 1 up to the number of allowed CPUs.";

struct Args {
    scenario: String,
    opts: Options,
    json: Option<String>,
    out: Option<PathBuf>,
}

fn parse_list(flag: &str, value: &str) -> Result<Vec<usize>, String> {
    value
        .split(',')
        .map(|t| match t.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{flag}: {t:?} is not a positive integer")),
        })
        .collect()
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut scenario = None;
    let mut threads = None;
    let mut duration_ms = None;
    let mut runs = None;
    let mut impls = None;
    let mut json = None;
    let mut out = None;
    while let Some(arg) = argv.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| argv.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--list" => {
                list();
                return Ok(None);
            }
            "--threads" => threads = Some(parse_list("--threads", &value("--threads")?)?),
            "--duration-ms" => {
                duration_ms = Some(
                    value("--duration-ms")?
                        .parse::<u64>()
                        .map_err(|_| "--duration-ms: not a number of milliseconds".to_string())?,
                );
            }
            "--runs" => {
                runs = match value("--runs")?.parse() {
                    Ok(n) if n > 0 => Some(n),
                    _ => return Err("--runs: not a positive integer".into()),
                };
            }
            "--impl" => impls = Some(value("--impl")?.split(',').map(str::to_string).collect()),
            "--json" => json = Some(value("--json")?),
            "--out" => out = Some(PathBuf::from(value("--out")?)),
            f if f.starts_with('-') => return Err(format!("unknown option {f}")),
            _ if scenario.is_none() => scenario = Some(arg),
            _ => {
                return Err(format!(
                    "unexpected argument {arg:?} (one scenario at a time)"
                ));
            }
        }
    }
    let scenario: String = scenario.ok_or("no scenario given (see --list)")?;
    let is_seeds = scenario == "seeds";
    if is_seeds && (impls.is_some() || json.is_some()) {
        return Err(
            "seeds: --impl and --json are for single scenarios (seeds writes to --out)".into(),
        );
    }
    if !is_seeds && out.is_some() {
        return Err("--out is for `seeds` (a single scenario writes --json)".into());
    }
    // seeds: short defaults, so that the whole pass takes minutes.
    let (default_ms, default_runs) = if is_seeds { (250, 3) } else { (500, 5) };
    let threads = threads.unwrap_or_else(|| (1..=allowed_cpus().len()).collect());
    Ok(Some(Args {
        scenario,
        opts: Options {
            threads,
            duration: Duration::from_millis(duration_ms.unwrap_or(default_ms)),
            runs: runs.unwrap_or(default_runs),
            impls,
        },
        json,
        out,
    }))
}

/// `bench seeds`: the tables, then the JSON rows and the charts.
fn run_seeds(opts: &Options, out: Option<PathBuf>) -> Result<(), String> {
    let results = seeds::run(opts)?;
    for r in &results {
        println!("{}", r.table());
    }
    let dir = out.unwrap_or_else(|| PathBuf::from("target/bench/seeds"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let rows: Vec<&Row> = results.iter().flat_map(seeds::SeedResult::rows).collect();
    let json = dir.join("rows.json");
    write_json(&json, &rows)?;
    let cpus = allowed_cpus().len();
    let mut written = vec![json];
    for r in &results {
        let svg = dir.join(format!("seed-{}.svg", r.seed.id));
        chart::draw(r, cpus, &svg)?;
        written.push(svg);
    }
    for w in written {
        println!("wrote {}", w.display());
    }
    Ok(())
}

fn write_json(path: &std::path::Path, rows: &[&Row]) -> Result<(), String> {
    let text = serde_json::to_string_pretty(rows).expect("rows serialise");
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))
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

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            if !std::env::args().any(|a| a == "--list") {
                println!("{USAGE}");
            }
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if args.scenario == "seeds" {
        return match run_seeds(&args.opts, args.out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let Some(sc) = scenarios::find(&args.scenario) else {
        eprintln!(
            "bench: unknown scenario {:?}; `bench --list` shows them",
            args.scenario
        );
        return ExitCode::from(2);
    };
    let (rows, skipped) = match run_scenario(&sc, &args.opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let width = rows
        .iter()
        .map(|r| r.scenario.len() + r.imp.len() + 1)
        .max()
        .unwrap_or(0);
    for r in &rows {
        println!("{}", r.line(width));
    }
    for s in &skipped {
        println!("{s}");
    }
    if let Some(path) = args.json {
        let rows: Vec<&Row> = rows.iter().collect();
        if let Err(e) = write_json(std::path::Path::new(&path), &rows) {
            eprintln!("bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
