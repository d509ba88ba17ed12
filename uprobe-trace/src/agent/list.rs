//! `--list`: what each probe would attach, without attaching it: a slot
//! under the probe for each function (`object:name`, demangled) or USDT
//! site (`object:provider:name`) it matches in the objects loaded now.

use std::sync::atomic::Ordering::Relaxed;

use super::Agent;
use super::attach::{function_label, usdt_sites};
use crate::names;
use crate::spec::{self, ProbeSpec, Target};

impl Agent {
    /// Lists probe `i`'s matches as slots under it; the error says why
    /// it matches nothing.
    pub(super) fn list(&'static self, i: usize, spec: &ProbeSpec) -> Result<(), String> {
        let labels: Vec<String> = match &spec.target {
            Target::Function { object, name } => {
                let found = uprobe_core::functions::matching(object.as_deref(), self.selects(name))
                    .map_err(|e| e.to_string())?;
                let found = found
                    .iter()
                    .filter(|f| self.own_object.as_ref() != Some(&f.object));
                // A plain name is the first object's, in load order, as
                // the attach resolves it.
                let many = spec::is_pattern(name) || names::is_demangled_form(name);
                found
                    .take(if many { usize::MAX } else { 1 })
                    .map(function_label)
                    .collect()
            }
            Target::Usdt {
                object,
                provider,
                name,
            } => usdt_sites(object.as_deref(), provider, name)
                .map_err(|e| e.to_string())?
                .iter()
                .map(|p| {
                    let file = p.object.file_name().unwrap_or(p.object.as_os_str());
                    format!("{}:{}:{}", file.to_string_lossy(), p.provider, p.name)
                })
                .collect(),
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
