//! `--metrics ADDR`: serves the live report in the `OpenMetrics` text
//! format over HTTP (`GET /metrics`, as Prometheus scrapes it), from a
//! thread of the tool, while tracing runs.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::Path;

use uprobe_trace::shared::Report;
use uprobe_trace::spec::Plan;

use crate::Failure;

/// Binds `addr` and serves the report at `path` from a thread of its own;
/// says where on standard error.
pub fn serve(addr: &str, path: &Path, plan: &Plan) -> Result<(), Failure> {
    let listener =
        TcpListener::bind(addr).map_err(|e| Failure::Run(format!("--metrics {addr}: {e}")))?;
    let report =
        Report::open(path).map_err(|e| Failure::Run(format!("{}: {e}", path.display())))?;
    if let Ok(at) = listener.local_addr() {
        eprintln!("uprobe-trace: metrics at http://{at}/metrics");
    }
    let plan = plan.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = answer(stream, &report, &plan);
        }
    });
    Ok(())
}

/// Answers one request: the metrics for `GET /metrics` (or `/`), 404 for
/// any other path.
fn answer(stream: TcpStream, report: &Report, plan: &Plan) -> std::io::Result<()> {
    stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    // The headers, up to the blank line.
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let path = request.split_whitespace().nth(1).unwrap_or("/");
    let mut stream = stream;
    if path == "/metrics" || path == "/" {
        let body = crate::report::openmetrics(report, plan);
        write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        write!(
            stream,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
    }
}
