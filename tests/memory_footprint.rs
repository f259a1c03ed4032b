//! `MemoryStore::with_max_bytes` bounds the heap the store really takes, not a figure unrelated
//! to it: records are charged their payload plus an estimate of their bookkeeping, and this
//! checks the estimate against a counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tower_idempotency::{
    ClaimOutcome, Fingerprint, IdempotencyKey, MemoryStore, OwnerToken, RecordKey, Store,
};

/// The system allocator, keeping count of the bytes allocated and not yet freed.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Fills a store bounded at `bound` with records of `payload` bytes, three times over, and
/// answers the heap it holds at the end per byte of the bound.
async fn heap_per_bound_byte(bound: usize, payload: usize) -> f64 {
    let store = MemoryStore::new().with_max_bytes(bound);
    let fingerprint = Fingerprint::new([b"body".as_slice()]);
    // Enough records to fill the store three times over, so it has evicted for a while.
    let records = 3 * bound / (payload + 300);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for i in 0..records {
        let key = RecordKey::new(None, IdempotencyKey::parse(&format!("key-{i}")).unwrap());
        let owner = OwnerToken::generate();
        let claimed = store
            .claim(&key, &fingerprint, &owner, Duration::from_secs(30))
            .await;
        assert_eq!(claimed.unwrap(), ClaimOutcome::Claimed);
        let result = Bytes::from(vec![b'r'; payload]);
        assert!(store
            .complete(&key, &owner, result, Duration::from_secs(3600))
            .await
            .unwrap());
    }
    let held = LIVE_BYTES.load(Ordering::Relaxed) - before;
    assert!(store.evicted_early() > 0, "the store filled up");
    held as f64 / bound as f64
}

// The single-threaded runtime keeps other threads' allocations out of the count.
#[tokio::test(flavor = "current_thread")]
async fn a_full_store_holds_about_its_byte_bound_of_heap() {
    for (bound, payload) in [(4 << 20, 0), (4 << 20, 200), (8 << 20, 2_000), (8 << 20, 50_000)] {
        let ratio = heap_per_bound_byte(bound, payload).await;
        println!("{bound} bytes bound, {payload}-byte payloads: heap = {ratio:.2} × bound");
        assert!(
            (0.8..=1.2).contains(&ratio),
            "{payload}-byte payloads: heap = {ratio:.2} × bound"
        );
    }
}
