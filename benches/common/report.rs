//! The report step: turns a bench's results into what a reader of `docs/`
//! sees without running anything.
//!
//! A bench builds a [`Report`] (tables, charts, the machine it ran on) and
//! calls [`Report::save`], which writes:
//! - `docs/data/<name>.json` — the results, so charts can be redrawn without
//!   rerunning (`cargo run --release --example bench_report -- <name>`);
//! - `docs/img/<chart>.svg` — one SVG per chart, drawn with `plotters`;
//! - the generated part of `docs/<name>.md`, between the markers
//!   `<!-- generated:start -->` and `<!-- generated:end -->`. Everything
//!   outside the markers (the seed's figures, the reading of the results) is
//!   written by people and left alone.
//!
//! [`criterion_results`] reads criterion's own estimates from
//! `target/criterion/<group>/`.
//!
//! Only `cargo bench` (bench mode) writes reports; `cargo test --benches`
//! runs each bench once to check it works and writes nothing.

#![allow(dead_code)] // each bench target uses a different part of this module

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

const START: &str = "<!-- generated:start -->";
const END: &str = "<!-- generated:end -->";

/// Everything one analysis produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The bench target's name; also the page's file name.
    pub name: String,
    pub title: String,
    pub environment: Environment,
    pub tables: Vec<Table>,
    pub charts: Vec<Chart>,
}

/// Where and with what a report was produced.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Environment {
    pub command: String,
    pub date: String,
    pub cores: usize,
    pub cpu: String,
    /// Crate name → version, from Cargo.lock.
    pub versions: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Table {
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// A line printed under the table (units, what a column means).
    pub note: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Chart {
    /// File name under `docs/img/`, without `.svg`.
    pub file: String,
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub log_y: bool,
    pub series: Vec<Series>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Table {
    pub fn new(title: &str, columns: &[&str]) -> Self {
        Self {
            title: title.to_owned(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            ..Self::default()
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        if !self.title.is_empty() {
            let _ = writeln!(out, "### {}\n", self.title);
        }
        let _ = writeln!(out, "| {} |", self.columns.join(" | "));
        let align: Vec<&str> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, _)| if i == 0 { "---" } else { "---:" })
            .collect();
        let _ = writeln!(out, "|{}|", align.join("|"));
        for row in &self.rows {
            let _ = writeln!(out, "| {} |", row.join(" | "));
        }
        if !self.note.is_empty() {
            let _ = writeln!(out, "\n{}", self.note);
        }
        out
    }
}

impl Environment {
    /// The machine this runs on, and the versions of `crates` in Cargo.lock.
    pub fn current(command: &str, crates: &[&str]) -> Self {
        Self {
            command: command.to_owned(),
            date: today(),
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            cpu: cpu_model(),
            versions: lock_versions(crates),
        }
    }

    fn markdown(&self) -> String {
        let versions: Vec<String> = self
            .versions
            .iter()
            .map(|(name, version)| format!("{name} {version}"))
            .collect();
        format!(
            "Measured {} on {} cores ({}) with `{}`; crates: {}.\n",
            self.date,
            self.cores,
            self.cpu,
            self.command,
            versions.join(", ")
        )
    }
}

impl Report {
    pub fn new(name: &str, title: &str, crates: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            title: title.to_owned(),
            environment: Environment::current(&format!("cargo bench --bench {name}"), crates),
            tables: Vec::new(),
            charts: Vec::new(),
        }
    }

    /// Writes the data, the charts and the generated part of the page.
    pub fn save(&self) -> std::io::Result<()> {
        let docs = docs_dir();
        std::fs::create_dir_all(docs.join("data"))?;
        std::fs::write(
            docs.join("data").join(format!("{}.json", self.name)),
            serde_json::to_string_pretty(self).expect("report serialises"),
        )?;
        self.render()
    }

    /// Draws the charts and rewrites the generated part of the page.
    pub fn render(&self) -> std::io::Result<()> {
        let docs = docs_dir();
        std::fs::create_dir_all(docs.join("img"))?;
        for chart in &self.charts {
            let path = docs.join("img").join(format!("{}.svg", chart.file));
            chart
                .draw(&path)
                .map_err(|e| std::io::Error::other(format!("drawing {}: {e}", path.display())))?;
        }
        let page = docs.join(format!("{}.md", self.name));
        let existing = std::fs::read_to_string(&page).unwrap_or_else(|_| {
            format!(
                "# {}\n\n{START}\n{END}\n\n## Reading\n\n(To be written after a run.)\n",
                self.title
            )
        });
        std::fs::write(&page, splice(&existing, &self.generated()))
    }

    /// Loads a saved report (for redrawing).
    pub fn load(name: &str) -> std::io::Result<Self> {
        let path = docs_dir().join("data").join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path)?;
        serde_json::from_str(&text).map_err(std::io::Error::other)
    }

    fn generated(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "<!-- Written by `{}`; redraw with `cargo run --release --example bench_report -- {}`. -->\n",
            self.environment.command, self.name
        );
        out.push_str(&self.environment.markdown());
        for table in &self.tables {
            out.push('\n');
            out.push_str(&table.markdown());
        }
        for chart in &self.charts {
            let _ = write!(out, "\n![{}](img/{}.svg)\n", chart.title, chart.file);
        }
        out
    }
}

/// Replaces what lies between the markers (adding them at the end if absent).
fn splice(page: &str, generated: &str) -> String {
    match (page.find(START), page.find(END)) {
        (Some(start), Some(end)) if start < end => {
            format!("{}{START}\n{}{}", &page[..start], generated, &page[end..])
        }
        _ => format!("{page}\n{START}\n{generated}{END}\n"),
    }
}

impl Chart {
    fn draw(&self, path: &Path) -> Result<(), String> {
        let points = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in points {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            return Ok(()); // nothing to draw
        }
        // Log axes get a margin either side; linear ones start at zero.
        let pad = |lo: f64, hi: f64, log: bool| {
            if log {
                (lo.max(1e-9) / 1.5, hi * 1.5)
            } else {
                (lo.min(0.0), hi + (hi - lo.min(0.0)).max(1e-9) * 0.1)
            }
        };
        let (x0, x1) = pad(x0, x1, self.log_x);
        let (y0, y1) = pad(y0, y1, self.log_y);
        let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(&self.title, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(80);
        // plotters types log and linear axes differently: four cases.
        let e = |e: plotters::drawing::DrawingAreaErrorKind<_>| e.to_string();
        match (self.log_x, self.log_y) {
            (false, false) => self.plot(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(e)?),
            (true, false) => self.plot(
                builder
                    .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
                    .map_err(e)?,
            ),
            (false, true) => self.plot(
                builder
                    .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                    .map_err(e)?,
            ),
            (true, true) => self.plot(
                builder
                    .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
                    .map_err(e)?,
            ),
        }?;
        root.present().map_err(|e| e.to_string())
    }

    fn plot<'a, X, Y>(
        &self,
        mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    ) -> Result<(), String>
    where
        X: Ranged<ValueType = f64> + ValueFormatter<f64>,
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let e = |e: plotters::drawing::DrawingAreaErrorKind<_>| e.to_string();
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .x_label_formatter(&|v| axis_number(*v))
            .y_label_formatter(&|v| axis_number(*v))
            .draw()
            .map_err(e)?;
        for (index, series) in self.series.iter().enumerate() {
            let color = COLORS[index % COLORS.len()].to_rgba();
            chart
                .draw_series(LineSeries::new(
                    series.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(e)?
                .label(series.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    series
                        .points
                        .iter()
                        .map(|&point| Circle::new(point, 3, color.filled())),
                )
                .map_err(e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(e)
    }
}

/// Colours that stay readable on white, in the order series get them.
const COLORS: [RGBColor; 8] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x33, 0x33, 0x33),
];

/// Axis labels without needless decimals: 10, 1k, 2.5M, 0.25.
fn axis_number(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e4 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        trim(format!("{v:.2}"))
    }
}

/// One criterion result: its typical time per iteration (the slope of its
/// linear regression when criterion computed one, as its console shows; else
/// the mean) with that estimate's 95% confidence interval.
#[derive(Clone, Copy, Debug)]
pub struct Estimate {
    pub mean_ns: f64,
    pub low_ns: f64,
    pub high_ns: f64,
}

/// Criterion's estimates for every benchmark of `group` in this run, by the
/// part of their id after the group (`"<group>/<function>[/<parameter>]"`).
pub fn criterion_results(group: &str) -> BTreeMap<String, Estimate> {
    let mut out = BTreeMap::new();
    let dir = target_dir().join("criterion").join(group);
    let mut stack = vec![dir];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            let new = path.join("new");
            if let (Ok(bench), Ok(estimates)) = (
                std::fs::read_to_string(new.join("benchmark.json")),
                std::fs::read_to_string(new.join("estimates.json")),
            ) {
                let bench: serde_json::Value = serde_json::from_str(&bench).unwrap_or_default();
                let est: serde_json::Value = serde_json::from_str(&estimates).unwrap_or_default();
                let full_id = bench["full_id"].as_str().unwrap_or_default();
                let id = full_id
                    .strip_prefix(group)
                    .map(|rest| rest.trim_start_matches('/'))
                    .unwrap_or(full_id);
                let mean = if est["slope"].is_object() {
                    &est["slope"]
                } else {
                    &est["mean"]
                };
                if let Some(mean_ns) = mean["point_estimate"].as_f64() {
                    out.insert(
                        id.to_owned(),
                        Estimate {
                            mean_ns,
                            low_ns: mean["confidence_interval"]["lower_bound"]
                                .as_f64()
                                .unwrap_or(mean_ns),
                            high_ns: mean["confidence_interval"]["upper_bound"]
                                .as_f64()
                                .unwrap_or(mean_ns),
                        },
                    );
                }
            }
            stack.push(path);
        }
    }
    out
}

/// Formats nanoseconds for a table: "6.30 µs", "164 µs", "1.02 ms".
pub fn format_ns(ns: f64) -> String {
    match ns {
        n if n < 1_000.0 => format!("{n:.0} ns"),
        n if n < 10_000.0 => format!("{:.2} µs", n / 1e3),
        n if n < 1_000_000.0 => format!("{:.0} µs", n / 1e3),
        n if n < 10_000_000.0 => format!("{:.2} ms", n / 1e6),
        n => format!("{:.0} ms", n / 1e6),
    }
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn docs_dir() -> PathBuf {
    manifest_dir().join("docs")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("target"))
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|model| model.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

fn lock_versions(crates: &[&str]) -> BTreeMap<String, String> {
    let lock = std::fs::read_to_string(manifest_dir().join("Cargo.lock")).unwrap_or_default();
    let mut versions = BTreeMap::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(value) = line.strip_prefix("name = ") {
            name = Some(value.trim_matches('"').to_owned());
        } else if let (Some(value), Some(current)) = (line.strip_prefix("version = "), &name) {
            if crates.contains(&current.as_str()) {
                versions.insert(current.clone(), value.trim_matches('"').to_owned());
            }
            name = None;
        }
    }
    versions
}

/// Today's date (UTC) as YYYY-MM-DD, from the system clock.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}
