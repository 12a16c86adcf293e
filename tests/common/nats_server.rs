//! Real `nats-server`s for the bridge's tests, benches and example: found on
//! `PATH` or through `BLAZESUB_NATS_SERVER`, started on free loopback
//! ports, killed by pid when dropped. A tiny HTTP GET reads the server's
//! monitoring endpoints (`/varz`, `/connz`, `/subsz`).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "broker_process.rs"]
mod broker_process;
use broker_process::{kill, wait_until_up, with_retries};

/// The server binary: `$BLAZESUB_NATS_SERVER`, else `nats-server` on PATH.
pub fn server_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("BLAZESUB_NATS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join("nats-server");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(
        "nats-server not found: install it (Debian: `apt-get install -y nats-server`) \
         or point BLAZESUB_NATS_SERVER at the binary"
            .into(),
    )
}

/// A loopback port nobody listens on now.
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct loopback ports nobody listens on now (each held until all
/// are chosen, so the system cannot hand out one twice).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("a bound port").port())
}

/// Tries a server set on fresh ports a few times: a port chosen free can be
/// taken by another test's server before ours binds it.
/// One running server; killed (by its pid) when dropped.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    pub monitor: u16,
    pub cluster_port: u16,
    routes: Vec<u16>,
}

impl NatsServer {
    /// A standalone server on free ports.
    pub fn start() -> Self {
        with_retries("nats-server did not start", || {
            let [port, monitor] = free_ports();
            Self::try_start_on(port, monitor, 0, &[])
        })
    }

    /// A server on `port` with monitoring on `monitor`; with a non-zero
    /// `cluster_port` it is a cluster member routing to `routes` (cluster ports).
    pub fn start_on(port: u16, monitor: u16, cluster_port: u16, routes: &[u16]) -> Self {
        Self::try_start_on(port, monitor, cluster_port, routes).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_start_on(
        port: u16,
        monitor: u16,
        cluster_port: u16,
        routes: &[u16],
    ) -> Result<Self, String> {
        let mut server = Self {
            child: None,
            port,
            monitor,
            cluster_port,
            routes: routes.to_vec(),
        };
        server.try_restart()?;
        Ok(server)
    }

    /// Starts three servers routed to each other.
    pub fn cluster3() -> [Self; 3] {
        with_retries("the cluster did not form", || {
            let ports: [u16; 9] = free_ports();
            let clusters = [ports[0], ports[1], ports[2]];
            let make = |i: usize| {
                let routes: Vec<u16> = clusters
                    .iter()
                    .copied()
                    .filter(|&c| c != clusters[i])
                    .collect();
                Self::try_start_on(ports[3 + 2 * i], ports[4 + 2 * i], clusters[i], &routes)
            };
            let servers = [make(0)?, make(1)?, make(2)?];
            // Wait until each sees the two others.
            let deadline = Instant::now() + Duration::from_secs(20);
            for server in &servers {
                while server.varz_field("routes").unwrap_or(0) < 2 {
                    if Instant::now() > deadline {
                        return Err("routes missing after 20 s".into());
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Ok(servers)
        })
    }

    /// A handle on the same server that only reads its monitoring
    /// endpoints (it owns no process, so dropping it kills nothing).
    pub fn monitor_only(server: &Self) -> Self {
        Self {
            child: None,
            port: server.port,
            monitor: server.monitor,
            cluster_port: server.cluster_port,
            routes: Vec::new(),
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the process on the same ports; waits until it accepts.
    pub fn restart(&mut self) {
        self.try_restart().unwrap_or_else(|e| panic!("{e}"));
    }

    fn try_restart(&mut self) -> Result<(), String> {
        self.kill();
        let binary = server_binary().unwrap_or_else(|e| panic!("{e}"));
        let mut command = Command::new(binary);
        command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-m", &self.monitor.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster_port != 0 {
            let routes: Vec<String> = self
                .routes
                .iter()
                .map(|p| format!("nats-route://127.0.0.1:{p}"))
                .collect();
            command
                .args(["--cluster_name", "blazesub"])
                .args([
                    "--cluster",
                    &format!("nats://127.0.0.1:{}", self.cluster_port),
                ])
                .args(["--routes", &routes.join(",")]);
        }
        self.child = Some(command.spawn().map_err(|e| format!("nats-server: {e}"))?);
        let (port, monitor) = (self.port, self.monitor);
        wait_until_up("nats-server", port, &mut self.child, || {
            TcpStream::connect(("127.0.0.1", port)).is_ok() && get(monitor, "/varz").is_ok()
        })
    }

    /// Kills the process (by pid) and waits for it.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }

    /// The body of a monitoring endpoint.
    pub fn get(&self, path: &str) -> Result<String, std::io::Error> {
        get(self.monitor, path)
    }

    /// A monitoring endpoint parsed as JSON.
    pub fn json(&self, path: &str) -> serde_json::Value {
        let body = self.get(path).expect("monitoring endpoint answers");
        serde_json::from_str(&body).expect("monitoring endpoint returns JSON")
    }

    /// A numeric field of `/varz` (`in_msgs`, `out_msgs`, `subscriptions`, `routes`...).
    pub fn varz_field(&self, field: &str) -> Option<u64> {
        let body = self.get("/varz").ok()?;
        let value: serde_json::Value = serde_json::from_str(&body).ok()?;
        value.get(field)?.as_u64()
    }

    /// `(num_subscriptions, out_msgs)` of the client connection named `name`.
    pub fn connection(&self, name: &str) -> Option<(u64, u64)> {
        let connz = self.json("/connz?subs=1");
        connz["connections"].as_array()?.iter().find_map(|c| {
            (c["name"].as_str() == Some(name)).then(|| {
                (
                    c["subscriptions"].as_u64().unwrap_or(0),
                    c["out_msgs"].as_u64().unwrap_or(0),
                )
            })
        })
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The body of monitoring endpoint `path` of the server monitored on
/// `monitor`.
fn get(monitor: u16, path: &str) -> Result<String, std::io::Error> {
    let mut stream = TcpStream::connect(("127.0.0.1", monitor))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default())
}
