//! Redraws a bench's charts and the generated part of its page in `docs/`
//! from the data its last run saved (`docs/data/<name>.json`), without
//! rerunning it.
//!
//! `cargo run --release --example bench_report -- <name> [<name> ...]`
//! (no name: every saved report).

#[path = "../benches/common/report.rs"]
mod report;

fn main() -> std::io::Result<()> {
    let mut names: Vec<String> = std::env::args().skip(1).collect();
    if names.is_empty() {
        let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/data");
        for entry in std::fs::read_dir(data)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "json") {
                if let Some(stem) = path.file_stem() {
                    names.push(stem.to_string_lossy().into_owned());
                }
            }
        }
        names.sort();
    }
    for name in names {
        report::Report::load(&name)?.render()?;
        println!("redrew docs/{name}.md and its charts");
    }
    Ok(())
}
