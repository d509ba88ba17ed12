//! What a hit does: count into the probe's slot, take the time for
//! `--latency`, draw a value for `--hist`, write a line for `--print`.
//! Every handler is async-signal-safe. A probe that only counts has no
//! handler: the engine counts its calls into the slot's count cells; one
//! that only times calls (`--latency` alone) has none either: the engine
//! times them into the slot's latency cells.

use std::sync::atomic::Ordering::Relaxed;

use uprobe_core::{EntryContext, ReturnContext, Uprobe};

use pcpu::unstable::time::monotonic_ns as now;

use super::Agent;
use crate::by::By;
use crate::filter::{Filter, Values};
use crate::shared::Flow;
use crate::shared::{MAX_FRAMES, Slot};
use crate::spec::{ArgType, Drawn, ProbeSpec, Target, Value};

/// What a probe's return handler does (owned by it, freed with it).
#[allow(clippy::struct_excessive_bools)] // what the command line asked for
struct OnReturn {
    slot: &'static Slot,
    index: u32,
    latency: bool,
    print: bool,
    /// `--hist F:ret`.
    hist_ret: bool,
    /// `--by ret`.
    by_ret: bool,
    flow: Option<&'static Flow>,
    /// The probe has a filter: a call its entry did not count has cookie 0.
    filtered: bool,
    /// A filter on the return value, tested here.
    filter: Option<Box<Filter>>,
    label: Box<str>,
}

impl Agent {
    /// `builder` with the handlers `spec` needs, counting into `slot`.
    pub(super) fn with_handlers(
        &'static self,
        slot: &'static Slot,
        spec: &ProbeSpec,
        builder: Uprobe,
    ) -> Uprobe {
        let index = self.report.index_of(slot);
        // A `--by` key read in the hit needs a handler.
        let by = self.plan.by.filter(|b| b.in_hit());
        if by.is_none()
            && spec.only_counts()
            && let Some(cells) = self.report.count_cells(index)
        {
            // No handler: the trampoline counts each call itself, on its
            // CPU, into the report (a few nanoseconds a call); the agent's
            // threads are not observed, so their calls count nothing.
            return builder.count_into(cells);
        }
        if by.is_none()
            && spec.only_times()
            && let Some(cells) = self.report.latency_cells(index)
        {
            // No handler either: the entry and the return count and time
            // each call themselves, into the report.
            return builder.time_into(cells);
        }
        let (latency, print, hist, stacks) = (spec.latency, spec.print, spec.hist, spec.stacks);
        // `--flow`: this slot's calls and returns recorded.
        let flow = self.flow.as_ref().filter(|_| spec.flow);
        let index = index as u32;
        let usdt = matches!(spec.target, Target::Usdt { .. });
        // Owned by the handlers, freed with them (never in a hit).
        let types: Box<[ArgType]> = spec.args.clone().into_boxed_slice();
        let label: Box<str> = slot.label().into_boxed_str();
        let return_label = label.clone();
        // The agent's threads are not observed (`threads::mark_self`, the
        // engine's own service threads likewise): no handler runs there.
        // A filter on the return value decides at the return (the call is
        // counted there); any other, at the entry.
        let filter: Option<Box<Filter>> = spec.filter.clone().map(Box::new);
        let at_return = filter.as_deref().is_some_and(Filter::uses_ret);
        let return_filter = filter.clone().filter(|_| at_return);
        let entry_filter = filter.filter(|_| !at_return);
        let entry_filtered = entry_filter.is_some();
        let builder = builder.on_entry(move |cx| {
            if let Some(f) = entry_filter.as_deref()
                && !f.holds(&entry_values(cx, f, usdt))
            {
                // Not counted; its return (if probed) is skipped.
                cx.set_cookie(0);
                return;
            }
            if at_return {
                // Counted at the return, if the filter holds there.
                cx.set_cookie(if latency { now() } else { 1 });
                return;
            }
            slot.hits.add(1);
            if let Some(key) = by.and_then(|b| entry_key(cx, b, usdt)) {
                self.report.record_key(index, self.id, key);
            }
            if let Some(flow) = flow {
                flow.append(cx.tid() as u32, index, false, now());
            }
            if latency {
                cx.set_cookie(now());
            } else if entry_filtered {
                cx.set_cookie(1); // the return goes on
            }
            if let Some(Drawn::Arg(n)) = hist {
                let n = usize::from(n);
                let ty = types.get(n).copied().unwrap_or(ArgType::I64);
                slot.record_value(ty.value(arg(cx, n, usdt).unwrap_or(0)));
            }
            if print {
                self.print_entry(&label, cx, &types);
            }
            if stacks {
                let mut frames = [0usize; MAX_FRAMES];
                let n = cx.user_stack(&mut frames);
                self.report.record_stack(index, self.id, &frames[..n]);
            }
        });
        let by_ret = by == Some(By::Ret) && !usdt;
        if !spec.wants_return() && !by_ret {
            return builder;
        }
        let on_return = OnReturn {
            slot,
            index,
            latency,
            print,
            hist_ret: hist == Some(Drawn::Ret),
            by_ret,
            flow,
            filtered: spec.filter.is_some(),
            filter: return_filter,
            label: return_label,
        };
        builder.on_return(move |cx| self.returned(cx, &on_return))
    }

    /// What a return does. Async-signal-safe.
    fn returned(&self, cx: &ReturnContext<'_>, r: &OnReturn) {
        if r.filtered && cx.cookie() == 0 {
            return; // the entry's filter did not hold
        }
        if let Some(f) = r.filter.as_deref() {
            let v = Values {
                ret: cx.return_value() as i64,
                pid: if f.uses_pid() {
                    i64::from(std::process::id())
                } else {
                    0
                },
                tid: i64::from(cx.tid()),
                ..Values::default()
            };
            if !f.holds(&v) {
                return;
            }
            r.slot.hits.add(1);
        }
        if r.by_ret {
            self.report.record_key(r.index, self.id, cx.return_value());
        }
        if let Some(flow) = r.flow {
            flow.append(cx.tid() as u32, r.index, true, now());
        }
        if r.latency {
            r.slot.record_latency(now().wrapping_sub(cx.cookie()));
        }
        if r.hist_ret {
            r.slot.record_value(Value::Signed(cx.return_value() as i64));
        }
        if r.print {
            self.print_return(&r.label, cx);
        }
    }

    /// `--print`: the line for a hit (the time, the thread, the arguments,
    /// as their types say, or the first three registers in hexadecimal
    /// where none are given).
    fn print_entry(&self, label: &str, cx: &EntryContext<'_>, types: &[ArgType]) {
        use core::fmt::Write as _;
        let mut line = Line::default();
        line.time();
        let _ = write!(line, "{} {label}", cx.tid());
        if cx.usdt_arg_count() > 0 {
            for n in 0..cx.usdt_arg_count() {
                let value = cx.usdt_arg(n).unwrap_or(0) as u64;
                let _ = line.write_str(" ");
                line.value(types.get(n).copied().unwrap_or(ArgType::I64), value);
            }
        } else if types.is_empty() {
            for n in 0..3 {
                let _ = write!(line, " {:#x}", cx.arg(n).unwrap_or(0));
            }
        } else {
            let _ = line.write_str("(");
            for (n, &ty) in types.iter().enumerate() {
                if n > 0 {
                    let _ = line.write_str(", ");
                }
                line.value(ty, cx.arg(n).unwrap_or(0));
            }
            let _ = line.write_str(")");
        }
        self.send(&mut line);
    }

    /// `--print`: the line for a return (`= value`: in decimal when it
    /// reads as a small signed number, else in hexadecimal).
    fn print_return(&self, label: &str, cx: &ReturnContext<'_>) {
        use core::fmt::Write as _;
        let mut line = Line::default();
        line.time();
        let value = cx.return_value();
        let _ = if i32::try_from(value as i64).is_ok() {
            write!(line, "{} {label} = {}", cx.tid(), value as i64)
        } else {
            write!(line, "{} {label} = {value:#x}", cx.tid())
        };
        self.send(&mut line);
    }

    /// Writes a line to the tool.
    fn send(&self, line: &mut Line) {
        let Some(fd) = self.print_fd else { return };
        let _ = core::fmt::Write::write_str(line, "\n");
        // SAFETY: writing our buffer to the tool's pipe.
        let written = unsafe { libc::write(fd, line.buf.as_ptr().cast(), line.len) };
        if written != line.len as isize {
            self.report.header().lost_lines.fetch_add(1, Relaxed);
        }
    }
}

/// Argument `n` of a hit: a USDT probe's from its spec, a function's
/// from its calling convention. Async-signal-safe.
fn arg(cx: &EntryContext<'_>, n: usize, usdt: bool) -> Option<u64> {
    if usdt {
        cx.usdt_arg(n).map(|v| v as u64)
    } else {
        cx.arg(n)
    }
}

/// A `--by` key read at the entry: the thread, the caller's return
/// address, an argument. Async-signal-safe.
fn entry_key(cx: &EntryContext<'_>, by: By, usdt: bool) -> Option<u64> {
    match by {
        By::Tid => Some(cx.tid() as u64),
        // At a function's first instruction the return address is where
        // the call left it; a USDT site, anywhere in its function, is
        // unwound (frames[0] the function, frames[1] its caller).
        By::Caller if !usdt => Some(return_address(cx)),
        By::Caller => {
            let mut frames = [0usize; 2];
            (cx.user_stack(&mut frames) == 2).then_some(frames[1] as u64)
        }
        By::Arg(n) => arg(cx, usize::from(n), usdt),
        By::Pid | By::Comm | By::Ret => None,
    }
}

/// The return address at a function's first instruction: on the stack
/// (x86-64), in the link register (aarch64). Async-signal-safe.
fn return_address(cx: &EntryContext<'_>) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let sp = cx.reg(uprobe_core::Reg::Rsp);
        // SAFETY: at a function's entry the stack pointer addresses the
        // return address its call pushed, in the thread's own stack.
        unsafe { (sp as *const u64).read() }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // Without a pointer authentication code (a jump after `paciasp`
        // sees the link register signed): user addresses fit 48 bits.
        cx.reg(uprobe_core::Reg::LR) & 0x0000_ffff_ffff_ffff
    }
}

/// What an entry filter reads: the arguments it names (a USDT probe's
/// from its spec), the thread id, the process id if it names it.
/// Async-signal-safe.
fn entry_values(cx: &EntryContext<'_>, f: &Filter, usdt: bool) -> Values {
    let mut v = Values {
        tid: i64::from(cx.tid()),
        ..Values::default()
    };
    if let Some(max) = f.max_arg() {
        for n in 0..=usize::from(max) {
            v.args[n] = arg(cx, n, usdt).unwrap_or(0) as i64;
        }
    }
    if f.uses_pid() {
        v.pid = i64::from(std::process::id());
    }
    v
}

/// A line formatted on the stack (no allocation: usable in a handler).
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Self {
            buf: [0; 512],
            len: 0,
        }
    }
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let room = self.buf.len() - 1 - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

impl Line {
    /// Starts the line with the time (`CLOCK_MONOTONIC`, seconds with
    /// microseconds: the clock `--flow` and the latencies use).
    fn time(&mut self) {
        use core::fmt::Write as _;
        let t = now();
        let _ = write!(self, "{}.{:06} ", t / 1_000_000_000, t / 1_000 % 1_000_000);
    }

    /// Appends an argument as its type shows it.
    fn value(&mut self, ty: ArgType, raw: u64) {
        use core::fmt::Write as _;
        let _ = match (ty, ty.value(raw)) {
            (ArgType::Str, _) => {
                let _ = self.write_str("\"");
                self.c_string(raw as usize);
                self.write_str("\"")
            }
            (ArgType::Hex, _) => write!(self, "{raw:#x}"),
            (_, Value::Signed(v)) => write!(self, "{v}"),
            (_, Value::Unsigned(v)) => write!(self, "{v}"),
        };
    }

    /// Appends the C string at `addr` (at most 128 bytes), read with
    /// `process_vm_readv` so that a bad pointer is an error, not a crash.
    fn c_string(&mut self, addr: usize) {
        let mut text = [0u8; 128];
        let local = libc::iovec {
            iov_base: text.as_mut_ptr().cast(),
            iov_len: text.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: text.len(),
        };
        // SAFETY: reading our own memory into our buffer; a bad address
        // fails with EFAULT. (A string near the end of a mapping reads
        // short: read again byte by byte is not worth it here.)
        let n = unsafe {
            libc::process_vm_readv(libc::getpid(), &raw const local, 1, &raw const remote, 1, 0)
        };
        let n = usize::try_from(n).unwrap_or(0);
        let end = text[..n].iter().position(|&b| b == 0).unwrap_or(n);
        for &b in &text[..end] {
            let c = if b.is_ascii_graphic() || b == b' ' {
                b
            } else {
                b'?'
            };
            if self.len < self.buf.len() - 1 {
                self.buf[self.len] = c;
                self.len += 1;
            }
        }
    }
}
