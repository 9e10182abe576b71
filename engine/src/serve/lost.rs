//! Rank 0's last word when the peer watch finds a peer gone (`dist::on_lost`). Most of the
//! time the collective that waits on the dead peer fails, and the lane fails its requests
//! itself (`Worker::peer_lost`, `Worker::lane_lost`). Now and then MLX's ring leaves that
//! collective waiting forever, with the model thread blocked in it; the watch's thread then
//! fails every open request here, naming the loss, before the rank exits. Each request's
//! event sender is held weakly, so a request that ended is not kept open by this list.

use std::sync::Mutex;

use tokio::sync::mpsc::{Sender, WeakSender};

use super::emit::Event;
use super::error::ApiError;

static OPEN: Mutex<Vec<WeakSender<Event>>> = Mutex::new(Vec::new());

/// Follows the request whose events go to `events` under a group (the ended ones are
/// dropped meanwhile); one process has no peer to lose, and keeps no list.
pub(super) fn track(events: &Sender<Event>) {
    if !crate::dist::active() {
        return;
    }
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    open.retain(|w| w.strong_count() > 0);
    open.push(events.downgrade());
}

/// The peer watch's hook: every open request fails with the lost-peer error (a client whose
/// event slots are full, one that stopped reading, misses it).
pub(super) fn fail_open_requests(why: &str) {
    let open = std::mem::take(&mut *OPEN.lock().unwrap_or_else(|e| e.into_inner()));
    for events in open.iter().filter_map(WeakSender::upgrade) {
        let error = ApiError::server(super::dist_plan::lost_message(why));
        let _ = events.try_send(Event::Failed(error));
    }
}
