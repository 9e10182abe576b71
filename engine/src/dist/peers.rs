//! The peer watch. MLX's ring reports a lost peer through the collective that fails, most
//! of the time; now and then (about 1 kill in 15 with MLX 0.32.2) the collective queued on
//! the dead peer's socket never fails, and the rank waited out `--dist-timeout` (status 5).
//! The kernel knows at once: a dead peer's sockets are closed, and ours see the hang-up.
//! Once the rank starts its work with the others (`watchdog::arm`), a thread polls the
//! ring's connected sockets for it — `POLLRDHUP`, which reads nothing, so MLX's own threads
//! are undisturbed — and ends the rank with `exit::PEER_LOST`. An orderly end (the last
//! token of `engine generate`, rank 0's shutdown of `engine serve`) says so first
//! ([`done`]), and a hang-up is judged only after a short grace, so a peer that ends as
//! planned is no loss. Linux only (POLLRDHUP); elsewhere the collective's failure and the
//! step watchdog remain.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Set when this rank's last collective is behind it.
static DONE: AtomicBool = AtomicBool::new(false);
static STARTED: AtomicBool = AtomicBool::new(false);
/// What the rank says to those it serves before the watch ends it (`on_lost`).
static ON_LOST: std::sync::OnceLock<fn(&str)> = std::sync::OnceLock::new();

/// How long the rank waits after `ON_LOST` before it exits: the HTTP side's moment to send
/// what the hook gave it (as `engine serve`'s own end on a failed collective waits).
const TELL: Duration = Duration::from_millis(500);

/// How long a hang-up waits for an orderly end to be declared (a peer's planned exit races
/// this rank's own last steps by milliseconds).
const GRACE: Duration = Duration::from_millis(300);

/// This rank's collectives are over, or it is ending in order on a lost peer (`engine
/// serve`'s rank 0 answers its requests first): from now on the watch does nothing.
pub fn done() {
    DONE.store(true, Ordering::SeqCst);
}

/// Registers what a lost peer's hang-up does before the rank exits (`engine serve`'s rank 0
/// fails every open request naming the loss): the model thread may wait forever inside a
/// collective, so the watch's thread does it. The first registration wins.
pub fn on_lost(hook: fn(&str)) {
    let _ = ON_LOST.set(hook);
}

/// Starts the watch once (a no-op without a ring hostfile, or off Linux).
pub(super) fn watch(group: &super::Group) {
    if STARTED.swap(true, Ordering::SeqCst) {
        return;
    }
    // Entries that do not parse as `ip:port` (a host name) are left out.
    let hosts: Vec<Vec<SocketAddr>> = group
        .ring_hosts
        .iter()
        .map(|h| h.iter().filter_map(|a| a.parse().ok()).collect())
        .collect();
    let fds = ring_sockets(&hosts, group.rank);
    if fds.is_empty() {
        return;
    }
    std::thread::spawn(move || {
        if poll_until_hang_up(&fds) {
            let why = "a peer rank closed its ring connection";
            let untold = crate::plant::is(crate::plant::Defect::LostPeerUntold);
            if let Some(hook) = ON_LOST.get().filter(|_| !untold) {
                hook(why);
                std::thread::sleep(TELL);
            }
            super::fatal(&why);
        }
    });
}

#[cfg(target_os = "linux")]
fn addr_of(
    fd: i32,
    get: unsafe extern "C" fn(i32, *mut libc::sockaddr, *mut libc::socklen_t) -> i32,
) -> Option<SocketAddr> {
    // SAFETY: `storage` is large enough for any address; `len` says how large.
    unsafe {
        let mut storage: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        if get(fd, &mut storage as *mut _ as *mut libc::sockaddr, &mut len) != 0 {
            return None;
        }
        match storage.ss_family as i32 {
            libc::AF_INET => {
                let a = &*(&storage as *const _ as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 => {
                let a = &*(&storage as *const _ as *const libc::sockaddr_in6);
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
            }
            _ => None,
        }
    }
}

/// The process's connected TCP sockets that belong to the ring: accepted on one of this
/// rank's listening addresses, or connected to another rank's.
#[cfg(target_os = "linux")]
fn ring_sockets(hosts: &[Vec<SocketAddr>], rank: usize) -> Vec<i32> {
    let Some(mine) = hosts.get(rank) else {
        return Vec::new();
    };
    let theirs: Vec<SocketAddr> = hosts
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != rank)
        .flat_map(|(_, h)| h.iter().copied())
        .collect();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| {
            let (Some(local), Some(peer)) = (
                addr_of(fd, libc::getsockname),
                addr_of(fd, libc::getpeername),
            ) else {
                return false;
            };
            mine.contains(&local) || theirs.contains(&peer)
        })
        .collect()
}

#[cfg(not(target_os = "linux"))]
fn ring_sockets(_hosts: &[Vec<SocketAddr>], _rank: usize) -> Vec<i32> {
    Vec::new()
}

/// Waits until one of `fds` hangs up (true; after the grace, unless the rank declared its
/// end meanwhile: false).
#[cfg(target_os = "linux")]
fn poll_until_hang_up(fds: &[i32]) -> bool {
    let events = if crate::plant::is(crate::plant::Defect::PeerWatchDeaf) {
        libc::POLLPRI
    } else {
        libc::POLLRDHUP
    };
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let hung_up = if crate::plant::is(crate::plant::Defect::PeerWatchDeaf) {
        0
    } else {
        libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR
    };
    loop {
        // SAFETY: `polled` is a live array of `polled.len()` entries.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 1000) };
        if DONE.load(Ordering::SeqCst) {
            return false;
        }
        if n <= 0 || !polled.iter().any(|p| p.revents & hung_up != 0) {
            continue;
        }
        std::thread::sleep(GRACE);
        return !DONE.load(Ordering::SeqCst);
    }
}

#[cfg(not(target_os = "linux"))]
fn poll_until_hang_up(_fds: &[i32]) -> bool {
    false
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::{poll_until_hang_up, ring_sockets};

    /// This rank listens on its hostfile address; the peer connects from elsewhere. The
    /// accepted socket is found as the ring's, and the peer's end (its process killed: its
    /// socket closed) is seen within the grace and a poll.
    fn hang_up_seen_within_a_second() -> bool {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mine = listener.local_addr().unwrap();
        let other = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let peer = TcpStream::connect(mine).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let fds = ring_sockets(&[vec![mine], vec![other]], 0);
        use std::os::fd::AsRawFd;
        assert_eq!(
            fds,
            vec![accepted.as_raw_fd()],
            "the accepted ring socket only"
        );
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(poll_until_hang_up(&fds));
        });
        let t0 = Instant::now();
        drop(peer);
        let seen = rx.recv_timeout(Duration::from_secs(3)).unwrap_or(false);
        drop(accepted);
        seen && t0.elapsed() < Duration::from_secs(1)
    }

    #[test]
    fn a_peer_hanging_up_is_seen_within_a_second() {
        assert!(hang_up_seen_within_a_second());
    }

    #[test]
    fn planted_deaf_peer_watch_is_caught() {
        let _on = crate::plant::on(crate::plant::Defect::PeerWatchDeaf).unwrap();
        assert!(!hang_up_seen_within_a_second());
    }
}
