//! `bench`: seed-style scaling tables for the workspace's primitives.
//!
//! ```text
//! cargo run --release -p benches --bin bench -- SCENARIO [--threads 1,2]
//!     [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
//! cargo run --release -p benches --bin bench -- --list
//! ```

use std::process::ExitCode;
use std::time::Duration;

use benches::harness::{Options, allowed_cpus, run_scenario};
use benches::scenarios;

const USAGE: &str = "\
usage: bench SCENARIO [--threads 1,2] [--duration-ms 500] [--runs 5] [--impl a,b] [--json FILE]
       bench --list

Runs every implementation of SCENARIO at each thread count, --runs times for
--duration-ms each, interleaving implementations run by run, threads pinned
round-robin to the allowed CPUs; prints the median total throughput per row.
--threads defaults to 1 up to the number of allowed CPUs.";

struct Args {
    scenario: String,
    opts: Options,
    json: Option<String>,
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
    let mut duration_ms = 500u64;
    let mut runs = 5usize;
    let mut impls = None;
    let mut json = None;
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
                duration_ms = value("--duration-ms")?
                    .parse()
                    .map_err(|_| "--duration-ms: not a number of milliseconds".to_string())?;
            }
            "--runs" => {
                runs = match value("--runs")?.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err("--runs: not a positive integer".into()),
                };
            }
            "--impl" => impls = Some(value("--impl")?.split(',').map(str::to_string).collect()),
            "--json" => json = Some(value("--json")?),
            f if f.starts_with('-') => return Err(format!("unknown option {f}")),
            _ if scenario.is_none() => scenario = Some(arg),
            _ => {
                return Err(format!(
                    "unexpected argument {arg:?} (one scenario at a time)"
                ));
            }
        }
    }
    let scenario = scenario.ok_or("no scenario given (see --list)")?;
    let threads = threads.unwrap_or_else(|| (1..=allowed_cpus().len()).collect());
    Ok(Some(Args {
        scenario,
        opts: Options {
            threads,
            duration: Duration::from_millis(duration_ms),
            runs,
            impls,
        },
        json,
    }))
}

fn list() {
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
        let text = serde_json::to_string_pretty(&rows).expect("rows serialise");
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("bench: cannot write {path}: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
