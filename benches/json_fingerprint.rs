//! Run with: cargo bench --bench json_fingerprint
//!
//! What fingerprinting a body by its JSON meaning (`FingerprintPolicy::json_body`, and with
//! members chosen or left out) costs beside the default, SHA-256 over the body's bytes, for
//! bodies of 100 B, 16 KiB and 1 MiB (the default body limit). Ratios are against the default
//! measured in the same run, round by round (the rounds interleave the policies, so a noisy
//! neighbour slows all alike); the median ratio and its range are printed, with the time per
//! body and the throughput of each.
//!
//! Set `BENCH_ROUNDS` (default 7) and `BENCH_MILLIS` (each policy's time per round, default 200).

use std::hint::black_box;
use std::time::{Duration, Instant};

use http::Request;
use tower_idempotency::{FingerprintPolicy, JsonPointer};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A payment-like JSON body of about `size` bytes: a few top-level members and a list of items,
/// strings, integers, decimals, nested objects, as APIs send.
fn body(size: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut text = String::new();
    let mut i = 0;
    loop {
        let item = format!(
            r#"{{"sku": "SKU-{i:06}", "quantity": {}, "unit_price": {}.{:02}, "tags": ["a", "b{}"], "meta": {{"note": "item number {i}", "gift": {}}}}}"#,
            i % 7 + 1,
            i * 13 % 1000,
            i % 100,
            i % 10,
            i % 2 == 0
        );
        let candidate = format!(
            r#"{{"amount": 4200, "currency": "EUR", "sent_at": "2026-11-29T03:00:00Z", "to": {{"iban": "DE89370400440532013000", "name": "A. Payee"}}, "items": [{}]}}"#,
            items
                .iter()
                .chain([&item])
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        );
        if candidate.len() > size && !items.is_empty() {
            break;
        }
        text = candidate;
        items.push(item);
        i += 1;
        if size < 300 {
            break;
        }
    }
    if size < 300 {
        // 100 B: no item fits; the smallest payment.
        text = r#"{"amount": 4200, "currency": "EUR", "sent_at": "2026-11-29T03:00:00Z", "to": {"iban": "DE89"}}"#.into();
    }
    text.into_bytes()
}

/// Bodies fingerprinted per second, running for about `budget`.
fn rate(policy: &FingerprintPolicy, parts: &http::request::Parts, body: &[u8], budget: Duration) -> f64 {
    let started = Instant::now();
    let mut done = 0u64;
    while started.elapsed() < budget {
        for _ in 0..16 {
            black_box(policy.fingerprint(black_box(parts), black_box(body)));
        }
        done += 16;
    }
    done as f64 / started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let rounds = env("BENCH_ROUNDS", 7) as usize;
    let budget = Duration::from_millis(env("BENCH_MILLIS", 200));
    let pointer = |p: &str| JsonPointer::parse(p).expect("a pointer");
    let policies = [
        ("bytes (SHA-256, the default)", FingerprintPolicy::new()),
        ("json_body", FingerprintPolicy::new().json_body()),
        (
            "json_body_except [/sent_at]",
            FingerprintPolicy::new().json_body_except([pointer("/sent_at")]),
        ),
        (
            "json_body_only [/amount, /currency, /to/iban]",
            FingerprintPolicy::new().json_body_only([
                pointer("/amount"),
                pointer("/currency"),
                pointer("/to/iban"),
            ]),
        ),
    ];
    let parts = Request::post("/payments")
        .header("host", "api.example.com")
        .header("content-type", "application/json")
        .body(())
        .expect("a request")
        .into_parts()
        .0;
    println!("{rounds} rounds of {budget:?} per policy; ratio = the policy's time per body / the default's, median (range)");
    for size in [100, 16 * 1024, 1024 * 1024] {
        let body = body(size);
        // Each JSON policy must see JSON here, or it would measure the bytes fallback.
        assert_ne!(
            policies[1].1.fingerprint(&parts, &body),
            policies[1].1.fingerprint(&parts, b"{")
        );
        let mut rates = vec![Vec::new(); policies.len()];
        for _ in 0..rounds {
            for (i, (_, policy)) in policies.iter().enumerate() {
                rates[i].push(rate(policy, &parts, &body, budget));
            }
        }
        println!("\nbody of {} bytes", body.len());
        for (i, (name, _)) in policies.iter().enumerate() {
            let ratios: Vec<f64> = (0..rounds).map(|r| rates[0][r] / rates[i][r]).collect();
            let per_body = 1.0 / median(rates[i].clone());
            let (low, high) = ratios
                .iter()
                .fold((f64::MAX, 0f64), |(l, h), r| (l.min(*r), h.max(*r)));
            println!(
                "  {name:<46} {:>10.2} µs/body {:>8.1} MB/s  {:>6.2} × ({low:.2}–{high:.2})",
                per_body * 1e6,
                body.len() as f64 / per_body / 1e6,
                median(ratios.clone()),
            );
        }
    }
}
