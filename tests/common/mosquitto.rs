//! A real `mosquitto` (MQTT 5) for the bridge's MQTT tests: found on `PATH`,
//! in `/usr/sbin`, or through `BLAZESUB_MOSQUITTO`, started on a free
//! loopback port with a configuration of its own, killed by pid when
//! dropped.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

#[path = "broker_process.rs"]
mod broker_process;
use broker_process::{kill, wait_until_up, with_retries};

/// The broker binary.
pub fn broker_binary() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("BLAZESUB_MOSQUITTO") {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.push("/usr/sbin".into());
    dirs.into_iter()
        .map(|dir| dir.join("mosquitto"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            "mosquitto not found: install it (Debian: `apt-get install -y mosquitto`) \
             or point BLAZESUB_MOSQUITTO at the binary"
                .into()
        })
}

/// One running broker; killed when dropped.
pub struct Mosquitto {
    child: Option<Child>,
    pub port: u16,
    config: PathBuf,
}

impl Mosquitto {
    /// A broker on a free port; tried on a fresh port a few times, since a
    /// port chosen free can be taken by another test's server before ours
    /// binds it.
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// [`Self::start`] with `extra` lines in its configuration.
    #[allow(dead_code)]
    pub fn start_with(extra: &str) -> Self {
        with_retries("mosquitto did not start", || Self::try_start(extra))
    }

    fn try_start(extra: &str) -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let config = std::env::temp_dir().join(format!(
            "blazesub-mosquitto-{}-{port}.conf",
            std::process::id()
        ));
        std::fs::write(
            &config,
            format!("listener {port} 127.0.0.1\nallow_anonymous true\n{extra}"),
        )
        .expect("write the broker's configuration");
        let mut broker = Self {
            child: None,
            port,
            config,
        };
        broker.try_restart()?;
        Ok(broker)
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// (Re)starts the process on the same port; waits until it accepts.
    pub fn restart(&mut self) {
        self.try_restart().unwrap_or_else(|e| panic!("{e}"));
    }

    fn try_restart(&mut self) -> Result<(), String> {
        self.kill();
        let binary = broker_binary().unwrap_or_else(|e| panic!("{e}"));
        self.child = Some(
            Command::new(binary)
                .arg("-c")
                .arg(&self.config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("mosquitto: {e}"))?,
        );
        let port = self.port;
        wait_until_up("mosquitto", port, &mut self.child, || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
    }

    /// Kills the process (by pid) and waits for it.
    pub fn kill(&mut self) {
        kill(&mut self.child);
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.config);
    }
}
