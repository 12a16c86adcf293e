//! Seed `002_…` across processes: one publisher process and 10 consumer
//! processes with 100,000 handler subscriptions each (1,000,000 in all),
//! joined by the bridge through one `nats-server`, one event.
//!
//! Reported: the time from publish until all 1,000,000 handlers ran (each
//! node reports the wall-clock instant its last handler ran over a pipe;
//! all processes share the machine's clock), the engine-to-node messages for
//! that event (nats-server's `/varz` `out_msgs` delta: must be exactly 10,
//! one per node), the time to subscribe all, and the RSS of each node. The
//! same again with the 10 nodes spread over a 3-server cluster (the
//! publisher on the first server), where the count is the sum of the
//! nodes' connections' `out_msgs` (`/connz`), since `/varz` also counts
//! route traffic. Then a warm measurement with criterion: one event per
//! iteration, until every node reported.
//!
//! The bench re-runs its own binary as the consumer nodes
//! (`FANOUT_NODES_ROLE=node`). Consumers use the bus's defaults (a worker
//! pool with one worker per core); every handler adds one to a counter, and
//! the one that completes the count reports.
//!
//! In bench mode it writes `docs/fanout_nodes.md`. In test mode
//! (`cargo test --all-features --bench fanout_nodes`) it runs 3 nodes of
//! 2,000 subscribers, once, and checks the message count.
//!
//! `cargo bench --features nats --bench fanout_nodes` (needs `nats-server`
//! on PATH or in `BLAZESUB_NATS_SERVER`).

mod common;
#[path = "../tests/common/nats_server.rs"]
mod nats_server;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use blazesub::bridge::Bridge;
use blazesub::{Bus, Message};
use bytes::Bytes;
use criterion::{criterion_group, Criterion};

use common::report::{Chart, Report, Series, Table};
use common::rss;
use nats_server::NatsServer;

const EVENT: &str = "bench/event";
const PROBE: &str = "bench/probe";

fn unix_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// What one consumer node says on its stdout, one line each.
enum Line {
    Ready { subscribe_ns: u128, rss: u64 },
    Done { event: u64, at_ns: u128 },
}

fn parse(line: &str) -> Option<Line> {
    let mut words = line.split_whitespace();
    match words.next()? {
        "ready" => Some(Line::Ready {
            subscribe_ns: words.next()?.parse().ok()?,
            rss: words.next()?.parse().ok()?,
        }),
        "done" => Some(Line::Done {
            event: words.next()?.parse().ok()?,
            at_ns: words.next()?.parse().ok()?,
        }),
        _ => None,
    }
}

/// The consumer node: subscribes, bridges, reports; exits when stdin closes.
fn node_main() {
    let url = std::env::var("FANOUT_NODES_URL").expect("url");
    let name = std::env::var("FANOUT_NODES_NAME").expect("name");
    let subscribers: u64 = std::env::var("FANOUT_NODES_SUBS")
        .expect("subs")
        .parse()
        .expect("a number");
    let runtime = common::runtime();
    let bus: Bus<Bytes> = Bus::builder()
        .runtime(runtime.handle().clone())
        .build()
        .expect("bus");
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let say = {
        let out = Arc::clone(&out);
        move |line: String| {
            let mut out = out.lock().unwrap();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }
    };
    let bridge = runtime.block_on(async {
        Bridge::builder(&bus)
            .nats(url)
            .name(name)
            .import("bench/#")
            .start()
            .await
            .expect("bridge")
    });
    let started = Instant::now();
    let count = Arc::new(AtomicU64::new(0));
    let events = Arc::new(AtomicU64::new(0));
    let mut subs = Vec::with_capacity(subscribers as usize);
    for _ in 0..subscribers {
        let count = Arc::clone(&count);
        let events = Arc::clone(&events);
        let say = say.clone();
        subs.push(
            bus.subscribe(EVENT, move |_: &Message<Bytes>| {
                let n = count.fetch_add(1, Ordering::AcqRel) + 1;
                if n % subscribers == 0 {
                    let at = unix_ns();
                    let event = events.fetch_add(1, Ordering::Relaxed) + 1;
                    say(format!("done {event} {at}"));
                }
            })
            .expect("subscribe"),
        );
    }
    let subscribe_ns = started.elapsed().as_nanos();
    let probe_say = say.clone();
    let _probe = bus
        .subscribe(PROBE, move |_: &Message<Bytes>| probe_say("probe".into()))
        .expect("subscribe");
    // Ready once both upstream subscriptions exist.
    let deadline = Instant::now() + Duration::from_secs(60);
    while bridge.stats().upstream_subscriptions < 2 || !bridge.stats().connected {
        assert!(Instant::now() < deadline, "node never subscribed upstream");
        std::thread::sleep(Duration::from_millis(5));
    }
    say(format!(
        "ready {subscribe_ns} {}",
        rss::current().unwrap_or(0)
    ));
    // Run until the parent closes stdin.
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
    drop(subs);
    let _ = runtime.block_on(bridge.close());
}

/// The consumer processes, as the publisher sees them.
struct Nodes {
    children: Vec<Child>,
    reports: mpsc::Receiver<(usize, String)>,
    subscribe_ns: Vec<u128>,
    rss: Vec<u64>,
}

impl Nodes {
    fn start(urls: &[String], nodes: usize, subscribers: u64) -> Self {
        let exe = std::env::current_exe().expect("own binary");
        let (tx, reports) = mpsc::channel();
        let mut children = Vec::new();
        for i in 0..nodes {
            let mut child = Command::new(&exe)
                .env("FANOUT_NODES_ROLE", "node")
                .env("FANOUT_NODES_URL", &urls[i % urls.len()])
                .env("FANOUT_NODES_NAME", format!("node-{i}"))
                .env("FANOUT_NODES_SUBS", subscribers.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("a node process");
            let stdout = child.stdout.take().expect("piped");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send((i, line)).is_err() {
                        break;
                    }
                }
            });
            children.push(child);
        }
        let mut this = Self {
            children,
            reports,
            subscribe_ns: vec![0; nodes],
            rss: vec![0; nodes],
        };
        let mut ready = 0;
        while ready < nodes {
            let (i, line) = this.next_line(Duration::from_secs(120));
            if let Some(Line::Ready { subscribe_ns, rss }) = parse(&line) {
                this.subscribe_ns[i] = subscribe_ns;
                this.rss[i] = rss;
                ready += 1;
            }
        }
        this
    }

    fn next_line(&self, within: Duration) -> (usize, String) {
        self.reports
            .recv_timeout(within)
            .expect("a node stopped reporting")
    }

    /// Waits for every node's `probe` line (interest has crossed the cluster).
    fn wait_probe(&self, publish: &dyn Fn()) {
        let mut seen = vec![false; self.children.len()];
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.iter().any(|s| !s) {
            assert!(
                Instant::now() < deadline,
                "the probe did not reach every node"
            );
            publish();
            while let Ok((i, line)) = self.reports.recv_timeout(Duration::from_millis(100)) {
                if line == "probe" {
                    seen[i] = true;
                }
            }
        }
        // Later copies of the probe.
        while self
            .reports
            .recv_timeout(Duration::from_millis(200))
            .is_ok()
        {}
    }

    /// Waits for event number `event` on every node; the latest instant.
    fn wait_event(&self, event: u64) -> u128 {
        let mut latest = 0;
        let mut done = 0;
        while done < self.children.len() {
            let (_, line) = self.next_line(Duration::from_secs(60));
            if let Some(Line::Done { event: e, at_ns }) = parse(&line) {
                assert_eq!(e, event, "events out of step");
                latest = latest.max(at_ns);
                done += 1;
            }
        }
        latest
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for child in &mut self.children {
            drop(child.stdin.take());
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in &mut self.children {
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One run's figures.
struct Run {
    setup: &'static str,
    nodes: usize,
    subscribers: u64,
    deliver_ns: u128,
    publish_ns: u128,
    messages: u64,
    subscribe_ns: u128,
    rss: Vec<u64>,
    /// Each warm event's delivery, in order.
    warm_ns: Vec<u64>,
}

fn connz_out(servers: &[NatsServer], nodes: usize) -> u64 {
    (0..nodes)
        .map(|i| {
            let name = format!("node-{i}");
            servers
                .iter()
                .find_map(|s| s.connection(&name))
                .map_or(0, |c| c.1)
        })
        .sum()
}

fn run(
    setup: &'static str,
    servers: &[NatsServer],
    nodes: usize,
    subscribers: u64,
    criterion: Option<&mut Criterion>,
) -> Run {
    let runtime = common::runtime();
    let bus: Bus<Bytes> = Bus::builder()
        .runtime(runtime.handle().clone())
        .build()
        .expect("bus");
    let bridge = runtime.block_on(async {
        Bridge::builder(&bus)
            .nats(servers[0].url())
            .name("publisher")
            .export("bench/#")
            .start()
            .await
            .expect("bridge")
    });
    while !bridge.stats().connected {
        std::thread::sleep(Duration::from_millis(5));
    }
    let urls: Vec<String> = servers.iter().map(NatsServer::url).collect();
    let node_set = Nodes::start(&urls, nodes, subscribers);
    node_set.wait_probe(&|| {
        bus.publish(PROBE, Bytes::from_static(b"?"))
            .expect("publish");
    });

    let varz_before = servers[0].varz_field("out_msgs").unwrap_or(0);
    let connz_before = connz_out(servers, nodes);
    let t0 = unix_ns();
    let started = Instant::now();
    bus.publish(EVENT, Bytes::from_static(b"the event"))
        .expect("publish");
    let publish_ns = started.elapsed().as_nanos();
    let latest = node_set.wait_event(1);
    let deliver_ns = latest.saturating_sub(t0);
    std::thread::sleep(Duration::from_millis(300));
    let messages = if servers.len() == 1 {
        let varz = servers[0].varz_field("out_msgs").unwrap_or(0) - varz_before;
        let connz = connz_out(servers, nodes) - connz_before;
        assert_eq!(varz, connz, "varz and connz agree");
        varz
    } else {
        connz_out(servers, nodes) - connz_before
    };
    assert_eq!(
        messages, nodes as u64,
        "one engine-to-node message per node"
    );

    let mut event = 1;
    let mut warm_ns: Vec<u64> = Vec::new();
    if let Some(c) = criterion {
        let id = format!("fanout_nodes/{setup}");
        c.bench_function(&id, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    event += 1;
                    let t0 = unix_ns();
                    bus.publish(EVENT, Bytes::from_static(b"the event"))
                        .expect("publish");
                    let latest = node_set.wait_event(event);
                    let took = latest.saturating_sub(t0) as u64;
                    warm_ns.push(took);
                    total += Duration::from_nanos(took);
                }
                total
            })
        });
    }
    let subscribe_ns = node_set.subscribe_ns.iter().copied().max().unwrap_or(0);
    let rss = node_set.rss.clone();
    drop(node_set);
    let _ = runtime.block_on(bridge.close());
    Run {
        setup,
        nodes,
        subscribers,
        deliver_ns,
        publish_ns,
        messages,
        subscribe_ns,
        rss,
        warm_ns,
    }
}

fn ms(ns: u128) -> String {
    format!("{:.1} ms", ns as f64 / 1e6)
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn write_report(runs: &[Run]) {
    let mut report = Report::new(
        "fanout_nodes",
        "fanout_nodes: seed 002 across processes, through NATS",
        &["blazesub", "async-nats", "tokio", "criterion"],
    );
    report.environment.command = format!(
        "cargo bench --features nats --bench fanout_nodes ({})",
        nats_version()
    );
    let mut table = Table::new(
        "1 publisher process, 10 consumer processes × 100,000 handlers, one event",
        &[
            "setup",
            "delivery, first event",
            "warm delivery: median / mean / p99",
            "`publish` call",
            "engine→node messages",
            "subscribe all (slowest node)",
            "RSS per node (min–max)",
            "target (< 50 ms, exactly 10 messages)",
        ],
    );
    table.note = "Delivery: from the `publish` call in the publisher process until the last of \
                  the 1,000,000 handlers ran, as each node reports over a pipe (one machine, \
                  one clock). First event: the first publish after every node subscribed. \
                  Warm: every event of criterion's run (warm-up included) on the same \
                  processes. Messages: the engine-to-node messages for the first event \
                  (nats-server `/varz` `out_msgs`, equal to the nodes' `/connz` `out_msgs`; in \
                  the cluster only the latter, as `/varz` also counts route traffic). RSS: \
                  each node's resident memory after subscribing. Seed row: Ergo Framework on \
                  an Apple M4 Max, from `seeds/002_…` (10 nodes in one Go process)."
        .into();
    table.row(vec![
        "seed 002 (Ergo, M4 Max)".into(),
        "342.4 ms".into(),
        "–".into(),
        "64 µs".into(),
        "10".into(),
        "1.84 s".into(),
        "–".into(),
        "–".into(),
    ]);
    let mut chart = Chart {
        file: "fanout_nodes-delivery".into(),
        title: "One event to 10 nodes × 100,000 handlers: delivery per event".into(),
        x_label: "event (warm run)".into(),
        y_label: "milliseconds until every handler ran".into(),
        log_x: false,
        log_y: true,
        ..Chart::default()
    };
    let mut longest = 1;
    for r in runs {
        let mut sorted = r.warm_ns.clone();
        sorted.sort_unstable();
        let mean = sorted.iter().sum::<u64>() as f64 / sorted.len().max(1) as f64;
        let (lo, hi) = (
            r.rss.iter().min().copied().unwrap_or(0),
            r.rss.iter().max().copied().unwrap_or(0),
        );
        let met = r.deliver_ns < 50_000_000 && r.messages == r.nodes as u64;
        table.row(vec![
            format!("{} ({} × {})", r.setup, r.nodes, thousands(r.subscribers)),
            ms(r.deliver_ns),
            format!(
                "{} / {} / {}",
                ms(u128::from(percentile(&sorted, 0.5))),
                ms(mean as u128),
                ms(u128::from(percentile(&sorted, 0.99)))
            ),
            format!("{:.0} µs", r.publish_ns as f64 / 1e3),
            r.messages.to_string(),
            ms(r.subscribe_ns),
            format!("{:.1}–{:.1} MB", lo as f64 / 1e6, hi as f64 / 1e6),
            if met { "met" } else { "missed" }.into(),
        ]);
        let shown = r.warm_ns.len().min(200);
        longest = longest.max(shown);
        chart.series.push(Series {
            name: r.setup.into(),
            points: r.warm_ns[..shown]
                .iter()
                .enumerate()
                .map(|(i, &ns)| ((i + 1) as f64, ns as f64 / 1e6))
                .collect(),
        });
    }
    for (name, value) in [("seed 002: 342 ms", 342.4), ("target: 50 ms", 50.0)] {
        chart.series.push(Series {
            name: name.into(),
            points: vec![(1.0, value), (longest as f64, value)],
        });
    }
    report.tables.push(table);
    report.charts.push(chart);
    report.save().expect("write docs/fanout_nodes.md");
}

fn nats_version() -> String {
    nats_server::server_binary()
        .ok()
        .and_then(|b| Command::new(b).arg("--version").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn benches(c: &mut Criterion) {
    if !common::bench_mode() {
        let server = NatsServer::start();
        let r = run("test", std::slice::from_ref(&server), 3, 2_000, None);
        assert_eq!(r.messages, 3);
        eprintln!(
            "fanout_nodes (test mode): 3 nodes x 2,000 handlers, delivered in {}, {} messages",
            ms(r.deliver_ns),
            r.messages
        );
        return;
    }
    let mut runs = Vec::new();
    {
        let server = NatsServer::start();
        runs.push(run(
            "one nats-server",
            std::slice::from_ref(&server),
            10,
            100_000,
            Some(c),
        ));
    }
    {
        let cluster = NatsServer::cluster3();
        runs.push(run("3-server cluster", &cluster, 10, 100_000, Some(c)));
    }
    for r in &runs {
        eprintln!(
            "{}: delivery {}, messages {}, subscribe {}, rss {:?}",
            r.setup,
            ms(r.deliver_ns),
            r.messages,
            ms(r.subscribe_ns),
            r.rss
        );
    }
    write_report(&runs);
}

criterion_group! {
    name = group;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    targets = benches
}

fn main() {
    if std::env::var("FANOUT_NODES_ROLE").as_deref() == Ok("node") {
        node_main();
        return;
    }
    group();
    Criterion::default().configure_from_args().final_summary();
}
