//! `--list`: what each probe would attach, without attaching it: a slot
//! under the probe for each function (`object:name`, demangled) or USDT
//! site (`object:provider:name`) it matches in the objects loaded now.

use std::sync::atomic::Ordering::Relaxed;

use uprobe_core::AttachError;

use super::Agent;
use crate::names::{self, Name};
use crate::spec::{self, ProbeSpec, Target};

/// An object's file name, as labels show it.
fn file_name(path: &std::path::Path) -> String {
    path.file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned()
}

impl Agent {
    /// Lists probe `i`'s matches as slots under it; the error says why
    /// it matches nothing.
    pub(super) fn list(&'static self, i: usize, spec: &ProbeSpec) -> Result<(), String> {
        let labels: Vec<String> = match &spec.target {
            Target::Function { object, name } => {
                let pattern = spec::is_pattern(name);
                let demangled = names::is_demangled_form(name);
                let found = uprobe_core::functions::matching(object.as_deref(), |f| {
                    let f = Name::new(f);
                    if pattern {
                        f.matches(name) && !self.plan.exclude.iter().any(|x| f.matches(x))
                    } else if demangled {
                        f.demangled.is_some() && f.matches(name)
                    } else {
                        f.symbol == *name
                    }
                })
                .map_err(|e: AttachError| e.to_string())?;
                let found = found
                    .iter()
                    .filter(|f| self.own_object.as_ref() != Some(&f.object));
                // A plain name is the first object's, in load order, as
                // the attach resolves it.
                let take = if pattern || demangled { usize::MAX } else { 1 };
                found
                    .take(take)
                    .map(|f| {
                        spec::function_label(Some(&file_name(&f.object)), &names::display(&f.name))
                    })
                    .collect()
            }
            Target::Usdt {
                object,
                provider,
                name,
            } => {
                let sites = match object {
                    Some(o) => uprobe_core::usdt::probes(o).map_err(|e| e.to_string())?,
                    None => uprobe_core::usdt::loaded_probes(),
                };
                sites
                    .iter()
                    .filter(|p| &p.provider == provider && &p.name == name)
                    .map(|p| format!("{}:{}:{}", file_name(&p.object), p.provider, p.name))
                    .collect()
            }
        };
        if labels.is_empty() {
            return Err(format!(
                "nothing matches {} in the loaded objects",
                spec.label()
            ));
        }
        for label in labels {
            if let Some((_, slot)) = self.report.claim(i, &label) {
                slot.sites.fetch_add(1, Relaxed);
            }
        }
        Ok(())
    }
}
