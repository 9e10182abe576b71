//! The ledger's arithmetic: bounds, refusals, reservations, prompt caches across models.

use super::*;

#[test]
fn the_kv_bound_covers_a_partly_filled_step() {
    // 10 fixed bytes, 4 per token: 1 token allocates a step, 257 two.
    let kv = KvBound::from_probe(10 + 4 * 256, 10 + 4 * 512);
    assert_eq!(
        kv,
        KvBound {
            fixed: 10,
            per_token: 4
        }
    );
    assert_eq!(kv.bytes(0), 10 + 4 * 256);
    assert!(kv.bytes(300) >= 10 + 4 * 512);
}

#[test]
fn the_activation_bound_grows_past_the_chunk() {
    let act = ActBound::from_probe(256, 1000, 1000 + 512 * 3);
    assert_eq!(act.per_token, 3);
    // Decode steps: 3 bytes per token per 256-token chunk, rounded up: 1 per token.
    assert_eq!(act.bytes(100, 100), 1000 + 100);
    assert_eq!(act.bytes(256 + 10, 300), 1000 + 30 + 300);
    // Past the probed depth, as measured there and beyond.
    assert_eq!(act.bytes(256 + 512, 256 + 512), 1000 + 1536 + 768);
}

fn ledger() -> Arc<Budget> {
    ledger_waiting(Duration::from_millis(50))
}

/// `ledger` whose requests wait up to `wait` for room.
fn ledger_waiting(wait: Duration) -> Arc<Budget> {
    let b = Budget::new(1000, wait);
    b.reserve_weights("m", 300);
    let act = ActBound {
        at_chunk: 50,
        per_token: 0,
        chunk: 16,
    };
    // kv(T) = T + 256, act = 50.
    b.set_measured(
        "m",
        KvBound {
            fixed: 0,
            per_token: 1,
        },
        act,
    );
    b
}

#[test]
fn the_ledger_refuses_what_never_fits_and_reserves_what_does() {
    let b = ledger();
    // 300 weights + 50 cache = 350 fixed; 650 left.
    let big = b.need("m", 400, 100); // 756 + 50
    assert!(matches!(b.check(big), Err(Refusal::TooBig { .. })));
    let msg = b.check(big).unwrap_err().to_string();
    for part in [
        "400 prompt tokens",
        "max_tokens 100",
        "806 bytes",
        "1000",
        "300",
    ] {
        assert!(msg.contains(part), "{part} not in {msg}");
    }
    let small = b.need("m", 10, 10); // 276 + 50 = 326
    let r1 = b.try_reserve("m", small).unwrap();
    assert_eq!(b.prompt_cache_room("m"), 1000 - 350 - 326);
    let r2 = b.try_reserve("m", small).unwrap_err();
    assert!(matches!(r2, Refusal::Busy { need: 326, .. }));
    drop(r1);
    assert_eq!(b.snapshot().reserved, 0);
    assert_eq!(b.snapshot().peak_reserved, 326);
    assert_eq!(b.prompt_cache_room("m"), 650);
    b.release_weights("m");
    assert_eq!(b.prompt_cache_room("m"), 950);
}

#[test]
fn models_sharing_a_budget_reserve_by_their_own_bounds() {
    let b = ledger();
    b.reserve_weights("n", 200);
    let big = KvBound {
        fixed: 0,
        per_token: 2,
    };
    let act = ActBound {
        at_chunk: 80,
        per_token: 0,
        chunk: 16,
    };
    b.set_measured("n", big, act);
    // Each model's need is its own; the buffer cache is the largest model's.
    assert_eq!(b.need("m", 10, 10).bytes(), 276 + 50);
    assert_eq!(b.need("n", 10, 10).bytes(), 2 * 276 + 80);
    assert_eq!(b.mlx_cache_limit(), 80);
    assert_eq!(b.min_request(), 2 * 257 + 80);
    assert_eq!(b.snapshot().models.len(), 2);
    // Unloaded: its weights and bounds leave; the cache limit stays as MLX has it.
    b.release_weights("n");
    assert_eq!((b.weights(), b.min_request()), (300, 257 + 50));
    assert_eq!(b.need("n", 10, 10).bytes(), 0);
    assert_eq!(b.mlx_cache_limit(), 80);
}

#[test]
fn a_waiting_reservation_gets_the_bytes_a_finished_one_frees() {
    let b = ledger();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let need = b.need("m", 10, 10);
    let held = b.try_reserve("m", need).unwrap();
    // Nothing frees: refused once the wait is over.
    let busy = rt.block_on(b.reserve("m", need, None));
    assert!(matches!(busy, Err(Refusal::Busy { .. })));
    // Freed while waiting: granted (a long wait, so a stalled machine does not time the
    // waiter out before the freer runs).
    drop(held);
    let b = ledger_waiting(PRESS_WAIT);
    let held = b.try_reserve("m", need).unwrap();
    let b2 = b.clone();
    let got = rt.block_on(async move {
        let waiter = b2.reserve("m", need, None);
        let freer = async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(held);
        };
        let (got, ()) = tokio::join!(waiter, freer);
        got
    });
    assert_eq!(got.unwrap().bytes(), 326);
    assert_eq!(b.snapshot().reservations, 0);
}

#[test]
fn an_embedding_needs_its_longest_inputs_forward_at_once() {
    let act = ActBound {
        at_chunk: 100,
        per_token: 2,
        chunk: 16,
    };
    assert_eq!(act.one_forward(1), 100);
    assert_eq!(act.one_forward(16), 100);
    // 40 tokens at once: three chunks' worth, each attending to 40.
    assert_eq!(act.one_forward(40), 3 * (100 + 2 * 24));
    assert!(act.one_forward(40) >= act.bytes(40, 40));
    let b = ledger();
    let need = b.embed_need("m", 10);
    assert_eq!((need.kv, need.activations, need.embedding), (266, 50, true));
    let msg = b.check(b.embed_need("m", 700)).unwrap_err().to_string();
    for part in ["longest input, 700 tokens", "3156 bytes", "shorter inputs"] {
        assert!(msg.contains(part), "{part} not in {msg}");
    }
    assert!(!msg.contains("max_tokens"), "{msg}");
}

/// Two models, `m` (weights 300) and `n` (weights 100), cache 50: 550 left for
/// reservations and prompt caches.
fn two() -> Arc<Budget> {
    two_waiting(Duration::from_millis(50))
}

/// `two` whose requests wait up to `wait` for room.
fn two_waiting(wait: Duration) -> Arc<Budget> {
    let b = ledger_waiting(wait);
    b.reserve_weights("n", 100);
    let (kv, act) = b.ledger().bounds["m"];
    b.set_measured("n", kv, act);
    b
}

#[test]
fn one_models_prompt_cache_counts_against_the_others_room_and_requests() {
    let b = two();
    // m's cache claims 400 of the 550: n's cache may keep the other 150.
    assert_eq!(b.claim_prompt_cache("m", 400), 550);
    assert_eq!(b.prompt_cache_room("n"), 150);
    assert_eq!(b.prompt_cache_room("m"), 550);
    // n's request of 326 does not fit beside m's cache; m's own does (its thread trims
    // its cache first), and its cache is counted at what it may keep then.
    let need = b.need("m", 10, 10);
    assert!(matches!(
        b.try_reserve("n", need),
        Err(Refusal::Busy { free: 150, .. })
    ));
    let r = b.try_reserve("m", need).unwrap();
    assert_eq!(b.snapshot().models["m"].prompt_cache, 550 - 326);
    assert_eq!(b.snapshot().peak_held, 1000);
    drop(r);
    // A trim lowers the count; a claim never passes the room.
    b.set_prompt_cache("m", 100);
    assert_eq!(b.claim_prompt_cache("n", 900), 450);
    let s = b.snapshot();
    assert_eq!((s.models["n"].prompt_cache, s.prompt_caches), (450, 550));
    assert_eq!(s.peak_held, 1000);
    b.release_weights("n");
    assert_eq!(b.snapshot().prompt_caches, 100);
}

/// How long the tests' requests wait for room freed by another thread or task, which may
/// start late on a loaded machine.
const PRESS_WAIT: Duration = Duration::from_secs(10);

/// `two` with m's prompt cache claiming `held` bytes and its requests waiting up to
/// `PRESS_WAIT`; a runtime for `Budget::reserve`, and how m's "thread" hears it is pressed.
fn pressed(
    held: u64,
) -> (
    Arc<Budget>,
    tokio::runtime::Runtime,
    std::sync::mpsc::Receiver<()>,
) {
    let b = two_waiting(PRESS_WAIT);
    b.claim_prompt_cache("m", held);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let tx = std::sync::Mutex::new(tx);
    b.on_pressure("m", move || {
        let _ = tx.lock().unwrap().send(());
    });
    (b, rt, rx)
}

#[test]
fn a_waiting_request_presses_the_other_models_cache_to_give_way() {
    // m's "thread": on pressure it trims to its room, which the waiter's need lowers.
    let (b, rt, rx) = pressed(600);
    let b2 = b.clone();
    let thread = std::thread::spawn(move || {
        if rx.recv_timeout(PRESS_WAIT).is_ok() {
            let room = b2.prompt_cache_room("m");
            b2.set_prompt_cache("m", room);
        }
    });
    let need = b.need("m", 10, 10);
    let got = rt.block_on(b.reserve("n", need, None));
    thread.join().unwrap();
    assert_eq!(got.unwrap().bytes(), 326);
    let s = b.snapshot();
    assert_eq!(s.models["m"].prompt_cache, 550 - 326);
    assert!(s.peak_held <= 1000, "{s:?}");
    assert!(b.ledger().waiting.is_empty());
}

/// The thread's trim (`Share::trim`) first claims its cache at the room, then trims: a trim
/// that lands exactly on the room leaves the count where the claim put it, and the waiter
/// must still be woken (it was not: a CI run's request waited out `--budget-wait` and got
/// a 429 while the other model's cache stood trimmed to 0).
#[test]
fn a_trim_down_to_exactly_the_room_wakes_the_waiting_request() {
    let (b, rt, rx) = pressed(550);
    let (back, kept) = std::sync::mpsc::channel();
    let b2 = b.clone();
    let thread = std::thread::spawn(move || {
        if rx.recv_timeout(PRESS_WAIT).is_ok() {
            // m's thread: its cache drops whole entries, here down to the room exactly.
            let share = Share {
                budget: b2,
                key: "m".to_owned(),
            };
            let held = std::cell::Cell::new(550);
            share.trim(|_| held.get(), |room, _| held.set(room));
            // Kept alive past the wait: dropping a share wakes the waiters too.
            let _ = back.send(share);
        }
    });
    let need = b.need("m", 10, 10);
    let start = std::time::Instant::now();
    let got = rt.block_on(b.reserve("n", need, None));
    thread.join().unwrap();
    let _share = kept.recv().expect("m's cache was pressed");
    assert!(got.is_ok(), "{got:?} after {:?}", start.elapsed());
    assert!(start.elapsed() < PRESS_WAIT);
    assert_eq!(b.snapshot().models["m"].prompt_cache, 550 - 326);
}
