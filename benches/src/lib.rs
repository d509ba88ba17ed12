//! The benchmark harness behind the `bench` binary, and its scenarios.
//!
//! A [`Scenario`](harness::Scenario) names implementations; for each
//! (implementation, thread count) the harness builds a fresh
//! [`Workload`](harness::Workload), runs it on pinned threads for a fixed
//! time, interleaving implementations run by run so a noisy machine's drift
//! hits all of them alike, and reports medians in the kernel selftests'
//! format with the thread count spelled out
//! (`SCENARIO/IMPL (  N threads): TOTAL ± STDDEV M/s ( PER_CPU M/s/cpu)`,
//! or `(  N threads on C cpus)` when threads share CPUs).
//! [`seeds`] runs every seed's comparison in one interleaved pass and
//! [`chart`] draws each seed's table as an SVG chart.
// Throughput statistics convert operation counts to f64 on purpose.
#![allow(missing_docs, clippy::missing_panics_doc, clippy::cast_precision_loss)]

pub mod chart;
pub mod harness;
pub mod scenarios;
pub mod seeds;
