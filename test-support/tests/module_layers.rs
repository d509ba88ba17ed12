//! Every crate of the workspace keeps its modules in layers, and the
//! layers are the ones ARCHITECTURE.md declares. Read from the sources, as
//! a newcomer reads them.
//!
//! A module is a file under `src/` (`foo.rs` or `foo/mod.rs`; nested files
//! are modules of their own, named by path; `lib.rs`, `main.rs` and
//! `bin/` are the crate's roots and not counted). An edge `A -> B` is a
//! path in A's code (comments left out) that names module B:
//! `crate::b::...`, `super::b` (resolved against A's parent), the items of
//! a `use crate::{b, c::d}` group, and a name the crate root re-exports
//! (`crate::Item` for `pub use b::Item;` names `b`). A name a module
//! re-exports from one of its children (`pub use child::Item;`) resolves
//! to that child. References between a module and its own children are
//! structure, not edges.
//!
//! A crate's *rooms* are its top-level modules (a folder or a file under
//! `src/`). ARCHITECTURE.md declares, in a fenced block marked `layers`,
//! each crate's floors (bottom first) and the rooms on each, and rules of
//! the form `never A -> B` (module paths: A or a module under it never
//! names B or a module under it). The test fails on a module cycle, on a
//! room the declaration does not place, on an edge from a room to one on
//! its own floor or above (an arrow back up), and on a broken `never`
//! rule; it prints each crate's drawing: floors, rooms, the rooms each
//! uses.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One crate's modules: name (`a::b`) -> file.
type Modules = BTreeMap<String, PathBuf>;
/// Module -> the modules it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-support lives in the workspace")
        .to_path_buf()
}

/// The workspace's crates: folders with a `Cargo.toml` and a `src/`.
fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(workspace_root())
        .expect("read the workspace root")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .collect();
    out.sort();
    out
}

fn modules(src: &Path) -> Modules {
    let mut mods = Modules::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("read a source folder").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let root = parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main");
            if root || parts.is_empty() || parts[0] == "bin" {
                continue;
            }
            mods.insert(parts.join("::"), path);
        }
    }
    mods
}

/// The code of a file without its comments (line comments, doc comments
/// and block comments; string contents are kept, which is harmless here).
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]);
        } else if rest.starts_with("//") {
            rest = rest.find('\n').map_or("", |end| &rest[end..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// `code` without its unit test modules (`#[cfg(test)] mod name { ... }`):
/// a test may use anything, and is no part of the layers.
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = rest[at + "#[cfg(test)]".len()..].trim_start();
        let is_mod = after.starts_with("mod ") || after.starts_with("pub(crate) mod ");
        let Some(open) = after
            .find('{')
            .filter(|&o| is_mod && !after[..o].contains(';'))
        else {
            out.push_str("#[cfg(test)]");
            rest = &rest[at + "#[cfg(test)]".len()..];
            continue;
        };
        let mut depth = 0;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths in `code` that start with `keyword` (`crate`, `super`) as a
/// whole word, each as its segments after the keyword; `use` groups
/// (`crate::a::{b, c::{d, e}}`) are expanded.
fn paths_after(code: &str, keyword: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(found) = code[from..].find(keyword) {
        let at = from + found;
        from = at + keyword.len();
        let before_ok = at == 0 || !is_ident(char::from(bytes[at - 1]));
        let after = &code[from..];
        if !before_ok || !after.starts_with("::") {
            continue;
        }
        expand(&after[2..], &mut Vec::new(), &mut out);
    }
    out
}

/// Reads one path (with groups) from the start of `text`, with `prefix`
/// before it, into `out`.
fn expand(text: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let text = text.trim_start();
    if let Some(group) = text.strip_prefix('{') {
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    expand(&group[start..i], &mut prefix.clone(), out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand(&group[start..i], &mut prefix.clone(), out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let end = text.find(|c: char| !is_ident(c)).unwrap_or(text.len());
    if end == 0 {
        out.push(prefix.clone());
        return;
    }
    prefix.push(text[..end].to_string());
    match text[end..].strip_prefix("::") {
        Some(rest) => expand(rest, prefix, out),
        None => out.push(prefix.clone()),
    }
}

/// Module aliases the crate root declares: alias -> the modules it may
/// stand for (`use x86_64 as arch;` under one cfg, `use aarch64 as arch;`
/// under another).
fn aliases(src: &Path, mods: &Modules) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let Ok(text) = fs::read_to_string(src.join("lib.rs")) else {
        return out;
    };
    for line in code_of(&text).lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("use ") else {
            continue;
        };
        let Some((target, alias)) = rest.trim_end_matches(';').split_once(" as ") else {
            continue;
        };
        let target = target
            .trim()
            .trim_start_matches("self::")
            .trim_start_matches("crate::");
        if mods.contains_key(target) {
            out.entry(alias.trim().to_string())
                .or_default()
                .push(target.to_string());
        }
    }
    out
}

/// The paths of a file's `pub use` / `pub(crate) use` statements
/// (attributes before them skipped, a leading `self::` dropped), each with
/// the name it is re-exported as.
fn reexported_paths(code: &str) -> Vec<(Vec<String>, String)> {
    let mut out = Vec::new();
    for stmt in code.split(';') {
        let stmt = stmt.trim();
        let stmt = stmt.rsplit(']').next().unwrap_or(stmt).trim();
        let Some(rest) = stmt
            .strip_prefix("pub use ")
            .or_else(|| stmt.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let mut paths = Vec::new();
        expand(
            rest.trim_start_matches("self::"),
            &mut Vec::new(),
            &mut paths,
        );
        for p in paths {
            let Some(item) = p.last() else { continue };
            let name = item.split(" as ").last().unwrap_or(item).to_string();
            out.push((p, name));
        }
    }
    out
}

/// For each module, the names it re-exports from its own children:
/// `pub use child::Item;` / `pub(crate) use child::{A, B};`.
fn reexports(mods: &Modules) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (m, path) in mods {
        let code = code_of(&fs::read_to_string(path).expect("read a module"));
        let mut names = BTreeMap::new();
        for (p, name) in reexported_paths(&code) {
            let child = format!("{m}::{}", p[0]);
            if p.len() > 1 && mods.contains_key(&child) {
                names.insert(name, child);
            }
        }
        out.insert(m.clone(), names);
    }
    out
}

/// The names the crate root re-exports, each with the module it comes
/// from (`pub use a::b::{X, Y};` in `lib.rs`: `X` and `Y` name `a::b`).
fn root_reexports(src: &Path, mods: &Modules) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    let Ok(text) = fs::read_to_string(src.join("lib.rs")) else {
        return names;
    };
    for (p, name) in reexported_paths(&code_of(&text)) {
        let p = p.strip_prefix(&["crate".to_string()][..]).unwrap_or(&p);
        if let Some(m) = (1..p.len())
            .rev()
            .map(|n| p[..n].join("::"))
            .find(|m| mods.contains_key(m))
        {
            names.insert(name, m);
        }
    }
    names
}

/// The module a path names: the longest module prefix, the child a
/// re-exported name comes from, or the module a name the crate root
/// re-exports comes from.
fn resolve(
    segs: &[String],
    mods: &Modules,
    reexports: &BTreeMap<String, BTreeMap<String, String>>,
    root: &BTreeMap<String, String>,
) -> Option<String> {
    if let Some(m) = segs.first().and_then(|s| root.get(s))
        && !mods.contains_key(&segs[0])
    {
        return Some(m.clone());
    }
    for n in (1..=segs.len()).rev() {
        let m = segs[..n].join("::");
        if mods.contains_key(&m) {
            if let Some(child) = segs.get(n).and_then(|item| reexports[&m].get(item)) {
                return Some(child.clone());
            }
            return Some(m);
        }
    }
    None
}

/// The graph of one crate with each alias bound to one of its targets
/// (the alternatives not bound, another architecture's modules, left
/// out: they are not built with this one).
fn graph(
    all: &Modules,
    aliases: &BTreeMap<String, Vec<String>>,
    binding: &BTreeMap<String, String>,
    root: &BTreeMap<String, String>,
) -> Graph {
    let unbound: Vec<&String> = aliases
        .iter()
        .flat_map(|(alias, targets)| {
            targets
                .iter()
                .filter(move |t| binding.get(alias) != Some(t))
        })
        .collect();
    let mods: Modules = all
        .iter()
        .filter(|(m, _)| {
            !unbound
                .iter()
                .any(|u| *m == *u || m.starts_with(&format!("{u}::")))
        })
        .map(|(m, p)| (m.clone(), p.clone()))
        .collect();
    let mods = &mods;
    let reexports = reexports(mods);
    let mut g = Graph::new();
    for (m, path) in mods {
        let code = without_tests(&code_of(&fs::read_to_string(path).expect("read a module")));
        let parent: Vec<String> = {
            let mut p: Vec<String> = m.split("::").map(str::to_string).collect();
            p.pop();
            p
        };
        let mut refs = paths_after(&code, "crate");
        for p in paths_after(&code, "super") {
            let mut full = parent.clone();
            full.extend(p);
            refs.push(full);
        }
        let edges = g.entry(m.clone()).or_default();
        for mut segs in refs {
            if let Some(target) = segs.first().and_then(|s| binding.get(s)) {
                segs[0].clone_from(target);
            }
            let Some(t) = resolve(&segs, mods, &reexports, root) else {
                continue;
            };
            let structural =
                t == *m || t.starts_with(&format!("{m}::")) || m.starts_with(&format!("{t}::"));
            if !structural {
                edges.insert(t);
            }
        }
    }
    g
}

/// Strongly connected components of two or more modules (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct State<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on: BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for w in &s.g[v] {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().expect("on the stack");
                s.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The modules in layer order (each after those it uses), when there is
/// no cycle: `(layer, module)`, layer 0 using no other module.
fn layers(g: &Graph) -> Vec<(usize, String)> {
    let mut layer: BTreeMap<&str, usize> = BTreeMap::new();
    while layer.len() < g.len() {
        let before = layer.len();
        for (m, uses) in g {
            if layer.contains_key(m.as_str()) {
                continue;
            }
            if uses.iter().all(|u| layer.contains_key(u.as_str())) {
                let l = uses
                    .iter()
                    .map(|u| layer[u.as_str()] + 1)
                    .max()
                    .unwrap_or(0);
                layer.insert(m, l);
            }
        }
        if layer.len() == before {
            break;
        }
    }
    let mut out: Vec<(usize, String)> =
        layer.into_iter().map(|(m, l)| (l, m.to_string())).collect();
    out.sort();
    out
}

/// Every binding of the crate's aliases to one of their targets.
fn bindings(aliases: &BTreeMap<String, Vec<String>>) -> Vec<BTreeMap<String, String>> {
    let mut out = vec![BTreeMap::new()];
    for (alias, targets) in aliases {
        out = out
            .into_iter()
            .flat_map(|b| {
                targets.iter().map(move |t| {
                    let mut b = b.clone();
                    b.insert(alias.clone(), t.clone());
                    b
                })
            })
            .collect();
    }
    out
}

/// One crate's declared layers: its floors, bottom first, each a list of
/// rooms, and its `never` rules.
#[derive(Debug, Default, PartialEq)]
struct Declared {
    floors: Vec<Vec<String>>,
    never: Vec<(String, String)>,
}

impl Declared {
    /// The floor a room is on (0: the bottom).
    fn floor(&self, room: &str) -> Option<usize> {
        self.floors.iter().position(|f| f.iter().any(|r| r == room))
    }
}

/// The declarations in the `layers` blocks of a Markdown text:
/// `crate NAME`, then a line per floor, bottom first (`floor ROOM ROOM
/// ...`), and `never A -> B` lines.
fn declarations(markdown: &str) -> BTreeMap<String, Declared> {
    let mut out: BTreeMap<String, Declared> = BTreeMap::new();
    let mut in_block = false;
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        let line = line.trim();
        if line.starts_with("```") {
            in_block = !in_block && line == "```layers";
            current = None;
            continue;
        }
        if !in_block || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        match words.next() {
            Some("crate") => {
                let name = words.next().expect("crate NAME").to_string();
                out.entry(name.clone()).or_default();
                current = Some(name);
            }
            Some("floor") => {
                let c = current.as_ref().expect("`crate NAME` before its floors");
                let rooms = words.map(str::to_string).collect();
                out.get_mut(c).expect("declared").floors.push(rooms);
            }
            Some("never") => {
                let c = current.as_ref().expect("`crate NAME` before its rules");
                let rest: Vec<&str> = words.collect();
                let [from, "->", to] = rest[..] else {
                    panic!("`never A -> B`, not `{line}`");
                };
                out.get_mut(c)
                    .expect("declared")
                    .never
                    .push((from.to_string(), to.to_string()));
            }
            _ => panic!("a `layers` block holds `crate`, `floor` and `never` lines, not `{line}`"),
        }
    }
    out
}

/// A module's room: its first path segment.
fn room(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// Whether `module` is `path` or a module under it.
fn under(module: &str, path: &str) -> bool {
    module == path || module.starts_with(&format!("{path}::"))
}

/// Room -> (room it uses -> how many module edges).
type Rooms = BTreeMap<String, BTreeMap<String, usize>>;

fn rooms(g: &Graph) -> Rooms {
    let mut out = Rooms::new();
    for (m, uses) in g {
        let from = out.entry(room(m).to_string()).or_default();
        for u in uses {
            if room(u) != room(m) {
                *from.entry(room(u).to_string()).or_default() += 1;
            }
        }
    }
    out
}

/// What breaks a declaration: rooms it does not place, rooms it places
/// that do not exist, arrows from a room to one on its own floor or
/// above, broken `never` rules.
fn violations(g: &Graph, declared: &Declared) -> Vec<String> {
    let mut out = Vec::new();
    let r = rooms(g);
    for room in r.keys() {
        if declared.floor(room).is_none() {
            out.push(format!("room `{room}` is on no declared floor"));
        }
    }
    for room in declared.floors.iter().flatten() {
        if !r.contains_key(room) {
            out.push(format!("declared room `{room}` is no module of the crate"));
        }
    }
    for (m, uses) in g {
        for u in uses {
            let (from, to) = (room(m), room(u));
            if from == to {
                continue;
            }
            if let (Some(f), Some(t)) = (declared.floor(from), declared.floor(to))
                && t >= f
            {
                out.push(format!(
                    "`{m}` (floor {f}) uses `{u}` (floor {t}): an arrow back up"
                ));
            }
            for (a, b) in &declared.never {
                if under(m, a) && under(u, b) {
                    out.push(format!("`{m}` uses `{u}`: never {a} -> {b}"));
                }
            }
        }
    }
    out
}

/// The drawing of one crate: its floors top down, the rooms on each, and
/// what each room uses.
fn drawing(g: &Graph, declared: &Declared) -> String {
    let r = rooms(g);
    let mut lines = Vec::new();
    for (i, floor) in declared.floors.iter().enumerate().rev() {
        for room in floor {
            let uses: Vec<String> = r
                .get(room)
                .map(|u| u.iter().map(|(to, n)| format!("{to}({n})")).collect())
                .unwrap_or_default();
            lines.push(format!("  {i:>2} {room:<16} uses {}", uses.join(" ")));
        }
    }
    lines.join("\n")
}

#[test]
fn every_crate_keeps_its_modules_in_the_declared_layers() {
    let architecture =
        fs::read_to_string(workspace_root().join("ARCHITECTURE.md")).expect("read ARCHITECTURE.md");
    let declared = declarations(&architecture);
    let mut found = Vec::new();
    for dir in crates() {
        let name = dir
            .file_name()
            .expect("a crate folder")
            .to_string_lossy()
            .into_owned();
        let src = dir.join("src");
        let mods = modules(&src);
        let root = root_reexports(&src, &mods);
        let aliases = aliases(&src, &mods);
        for binding in bindings(&aliases) {
            let g = graph(&mods, &aliases, &binding, &root);
            let how: String = binding
                .iter()
                .map(|(a, t)| [" (", a, " = ", t, ")"].concat())
                .collect();
            let cs = cycles(&g);
            for c in &cs {
                found.push(format!("{name}{how}: a cycle: {}", c.join(" <-> ")));
            }
            match declared.get(&name) {
                Some(d) => {
                    let v = violations(&g, d);
                    let back_up = v.iter().filter(|x| x.ends_with("an arrow back up")).count();
                    println!(
                        "{name}{how}: {} floors, {} rooms, {} modules, {back_up} arrows back up, {} circles",
                        d.floors.len(),
                        rooms(&g).len(),
                        g.len(),
                        cs.len()
                    );
                    println!("{}", drawing(&g, d));
                    found.extend(v.into_iter().map(|x| format!("{name}{how}: {x}")));
                }
                None => {
                    found.push(format!("{name}: ARCHITECTURE.md declares no layers"));
                }
            }
        }
    }
    println!("{} problems", found.len());
    assert!(found.is_empty(), "module layers:\n{}", found.join("\n"));
}

#[test]
fn declarations_are_read_and_checked() {
    let d = declarations(
        "text\n```layers\ncrate x\nfloor a\nfloor b c\nnever c -> a::z\n```\n```rust\nfloor no\n```",
    );
    let x = &d["x"];
    assert_eq!(x.floors, [vec!["a"], vec!["b", "c"]]);
    assert_eq!(x.never, [("c".to_string(), "a::z".to_string())]);
    let mut g = Graph::new();
    g.insert("a".into(), BTreeSet::new());
    g.insert("a::z".into(), BTreeSet::new());
    g.insert("b".into(), ["a".to_string()].into());
    g.insert("c".into(), ["a::z".to_string(), "b".to_string()].into());
    let v = violations(&g, x);
    assert_eq!(v.len(), 2, "{v:?}");
    assert!(v[0].contains("never c -> a::z"), "{v:?}");
    assert!(v[1].contains("arrow back up"), "{v:?}");
    g.insert("d".into(), BTreeSet::new());
    assert!(
        violations(&g, x)
            .iter()
            .any(|v| v.contains("`d` is on no declared floor"))
    );
    g.remove("b");
    assert!(
        violations(&g, x)
            .iter()
            .any(|v| v.contains("declared room `b` is no module"))
    );
}

#[test]
fn the_reader_finds_paths_groups_and_comments() {
    let code =
        code_of("use crate::a::{b, c::{d, e}}; // crate::f\n/* crate::g */ x = super::h::i;");
    assert_eq!(
        paths_after(&code, "crate"),
        [vec!["a", "b"], vec!["a", "c", "d"], vec!["a", "c", "e"]]
            .map(|v| v.into_iter().map(String::from).collect::<Vec<_>>())
    );
    assert_eq!(
        paths_after(&code, "super"),
        [vec!["h".to_string(), "i".to_string()]]
    );
    // `mycrate::x` is not `crate::x`.
    assert!(paths_after("mycrate::x", "crate").is_empty());
    // Unit tests are no part of the layers.
    let code = without_tests("a\n#[cfg(test)]\nmod tests {\n fn f() { crate::x::y(); }\n}\nb");
    assert_eq!(code.split_whitespace().collect::<Vec<_>>(), ["a", "b"]);
}

#[test]
fn a_cycle_is_found() {
    let mut g = Graph::new();
    g.insert("a".into(), ["b".to_string()].into());
    g.insert("b".into(), ["c".to_string()].into());
    g.insert("c".into(), ["a".to_string()].into());
    g.insert("d".into(), ["a".to_string()].into());
    assert_eq!(cycles(&g), [vec!["a", "b", "c"]]);
    g.get_mut("c").expect("c").clear();
    assert!(cycles(&g).is_empty());
    assert_eq!(
        layers(&g),
        [
            (0, "c".into()),
            (1, "b".into()),
            (2, "a".into()),
            (3, "d".into())
        ]
    );
}
