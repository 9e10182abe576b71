//! What every distributed test needs to start ranks as mlx.launch starts them: loopback
//! ports, the ring hostfile, the committed models.

use std::net::TcpListener;
use std::path::{Path, PathBuf};

/// A committed tiny model's directory.
pub fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../goldens/models")
        .join(name)
}

/// Ports nobody listens on (all bound to :0 at once, read, released).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// mlx.launch's ring hostfile in `dir`: one `["127.0.0.1:port"]` per rank.
pub fn hostfile(dir: &Path, name: &str, ports: &[u16]) -> PathBuf {
    let hosts: Vec<Vec<String>> = ports
        .iter()
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string(&hosts).unwrap()).unwrap();
    path
}
