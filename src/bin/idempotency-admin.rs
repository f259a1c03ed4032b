//! `idempotency-admin`: inspect, purge and list the records of tower-idempotency, on Redis or
//! PostgreSQL, for operators.
//!
//! Install with `cargo install tower-idempotency --features cli`; in a checkout,
//! `cargo run --features cli --bin idempotency-admin -- inspect --url redis://… --scope tenant-7 --key order-42`.
//! `--help` prints the usage. Exit codes: 0 found or done, 1 not found (nothing listed), 2 usage
//! error, 3 store unreachable (or slower than `--timeout`), 4 a record this release cannot read,
//! 5 a purge refused (the record is in flight; `--force` purges it).
//!
//! The arguments are parsed by hand: the tool needs no dependency the library does not have.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tower_idempotency::{
    Coordinator, Error, IdempotencyKey, IdempotencyLayer, InFlightRecord, Inspection, RecordKey, RecordState,
    Store, StoreError,
};

const USAGE: &str = "\
idempotency-admin: inspect, purge and list tower-idempotency records

Usage:
  idempotency-admin inspect   --url URL --key KEY [--scope SCOPE] [--show-body [--raw]] [options]
  idempotency-admin purge     --url URL --key KEY [--scope SCOPE] [--force] [options]
  idempotency-admin in-flight --url URL [--older-than DURATION] [--limit N] [options]

  inspect    the record of KEY in SCOPE: state, lease or retention left, stored status and
             size (the stored body only with --show-body: it may hold personal data;
             bytes a terminal would act on are shown escaped, as \\xNN or \\u{NNNN},
             unless --raw)
  purge      delete the record of KEY in SCOPE: the next request with the key runs the
             handler again. A record in flight (a request running it, or an instance that
             died holding it until its lease ends) is not purged without --force: its
             lease and owner are shown, and a purge would let a retry run beside it
  in-flight  the records in flight claimed at least DURATION ago (default 0s), oldest first,
             at most N (default 100): digests, ages, lease left and owners, never keys

The scope is what the layer's with_scope function gives the request (none if the layer has
no scope function); the key is the Idempotency-Key header's value.

Options:
  --url URL            redis://, rediss://, redis-cluster://, rediss-cluster://,
                       redis-sentinel://, rediss-sentinel:// (as RedisStore::connect takes
                       them), or postgres:// and postgresql:// (PostgresStore::connect);
                       default: the IDEMPOTENCY_STORE_URL environment variable, which keeps
                       a password out of the process list
  --prefix PREFIX      the RedisStore's key prefix (default: idempotency)
  --table NAME         the PostgresStore's table (default: idempotency_records)
  --timeout DURATION   give up after this long, exit 3 (default: 10s; in-flight: 5m, as
                       a listing reads the whole store; each store call gives up after 2s)
  --json               print one JSON object on stdout
  -h, --help           print this help

Durations: 500ms, 30s, 5m, 2h (a bare number is seconds).
Exit codes: 0 found or done, 1 not found (in-flight: nothing listed), 2 usage error,
3 store unreachable or too slow, 4 a record this release cannot read, 5 purge refused
(the record is in flight; --force purges it).
";

const NOT_FOUND: u8 = 1;
const USAGE_ERROR: u8 = 2;
const UNREACHABLE: u8 = 3;
const UNREADABLE: u8 = 4;
const REFUSED: u8 = 5;

#[derive(Debug)]
enum Command {
    Inspect {
        scope: Option<String>,
        key: String,
        show: ShowBody,
    },
    Purge {
        scope: Option<String>,
        key: String,
        /// Purge a record in flight too.
        force: bool,
    },
    InFlight {
        older_than: Duration,
        limit: usize,
    },
}

#[derive(Debug)]
struct Args {
    command: Command,
    url: String,
    prefix: Option<String>,
    table: Option<String>,
    timeout: Duration,
    json: bool,
}

/// What parsing the arguments ends in when it does not end in [`Args`].
#[derive(Debug)]
enum Parsed {
    Help,
    Usage(String),
}

fn main() -> ExitCode {
    let args = match parse(
        std::env::args().skip(1),
        std::env::var("IDEMPOTENCY_STORE_URL").ok(),
    ) {
        Ok(args) => args,
        Err(Parsed::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(Parsed::Usage(problem)) => {
            eprintln!("idempotency-admin: {problem}\n\n{USAGE}");
            return ExitCode::from(USAGE_ERROR);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idempotency-admin: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        match tokio::time::timeout(args.timeout, run(&args)).await {
            Ok(code) => code,
            Err(_) => {
                eprintln!(
                    "idempotency-admin: the store at {} did not answer within {:?} (--timeout){}",
                    redacted(&args.url),
                    args.timeout,
                    match args.command {
                        Command::InFlight { .. } =>
                            "; a listing reads the whole store: raise --timeout for a large one",
                        _ => "",
                    }
                );
                UNREACHABLE
            }
        }
    });
    // Connection tasks of the stores may linger; the answer is out, so do not wait for them.
    runtime.shutdown_background();
    ExitCode::from(code)
}

fn parse(mut argv: impl Iterator<Item = String>, url_from_env: Option<String>) -> Result<Args, Parsed> {
    let usage = |problem: String| Parsed::Usage(problem);
    let command_name = match argv.next() {
        None => return Err(usage("no command given".into())),
        Some(flag) if flag == "-h" || flag == "--help" => return Err(Parsed::Help),
        Some(name) => name,
    };
    let (mut url, mut prefix, mut table, mut timeout, mut json) = (None, None, None, None, false);
    let (mut scope, mut key, mut show_body, mut older_than, mut limit) = (None, None, false, None, None);
    let (mut raw, mut force) = (false, false);
    while let Some(flag) = argv.next() {
        let mut value = |name: &str| argv.next().ok_or_else(|| usage(format!("{name} needs a value")));
        match flag.as_str() {
            "-h" | "--help" => return Err(Parsed::Help),
            "--url" => url = Some(value("--url")?),
            "--prefix" => prefix = Some(value("--prefix")?),
            "--table" => table = Some(value("--table")?),
            "--timeout" => timeout = Some(duration(&value("--timeout")?).map_err(usage)?),
            "--json" => json = true,
            "--scope" => scope = Some(value("--scope")?),
            "--key" => key = Some(value("--key")?),
            "--show-body" => show_body = true,
            "--raw" => raw = true,
            "--force" => force = true,
            "--older-than" => older_than = Some(duration(&value("--older-than")?).map_err(usage)?),
            "--limit" => {
                let text = value("--limit")?;
                limit = Some(
                    text.parse::<usize>()
                        .map_err(|_| usage(format!("--limit {text:?} is not a number")))?,
                );
            }
            other => return Err(usage(format!("unknown argument {other:?}"))),
        }
    }
    let only_for = |flag: &str, given: bool, command: &str| {
        if given {
            Err(usage(format!("{flag} is not an option of {command}")))
        } else {
            Ok(())
        }
    };
    let command = match command_name.as_str() {
        "inspect" | "purge" => {
            only_for("--older-than", older_than.is_some(), &command_name)?;
            only_for("--limit", limit.is_some(), &command_name)?;
            let key = key.ok_or_else(|| usage(format!("{command_name} needs --key")))?;
            if IdempotencyKey::parse(&key).is_err() {
                return Err(usage(format!(
                    "--key {key:?} is not a valid Idempotency-Key (1 to 255 visible ASCII characters)"
                )));
            }
            if command_name == "inspect" {
                only_for("--force", force, "inspect")?;
                if raw && (!show_body || json) {
                    return Err(usage(
                        "--raw is for the body printed as text: give it with --show-body, without --json"
                            .into(),
                    ));
                }
                let show = match (show_body, raw) {
                    (false, _) => ShowBody::No,
                    (true, false) => ShowBody::Escaped,
                    (true, true) => ShowBody::Raw,
                };
                Command::Inspect { scope, key, show }
            } else {
                only_for("--show-body", show_body, "purge")?;
                only_for("--raw", raw, "purge")?;
                Command::Purge { scope, key, force }
            }
        }
        "in-flight" => {
            only_for("--scope", scope.is_some(), "in-flight")?;
            only_for("--key", key.is_some(), "in-flight")?;
            only_for("--show-body", show_body, "in-flight")?;
            only_for("--raw", raw, "in-flight")?;
            only_for("--force", force, "in-flight")?;
            Command::InFlight {
                older_than: older_than.unwrap_or(Duration::ZERO),
                limit: limit.unwrap_or(100),
            }
        }
        other => return Err(usage(format!("unknown command {other:?}"))),
    };
    let url = url
        .or(url_from_env)
        .ok_or_else(|| usage("no --url given (nor IDEMPOTENCY_STORE_URL)".into()))?;
    let is_postgres = is_postgres(&url);
    if !is_postgres && !is_redis(&url) {
        return Err(usage(format!(
            "{} is neither a Redis nor a PostgreSQL URL",
            redacted(&url)
        )));
    }
    if let Some(prefix) = &prefix {
        only_for("--prefix", is_postgres, "a PostgreSQL store")?;
        if prefix.contains(['{', '}']) {
            return Err(usage(format!("--prefix {prefix:?} contains a brace")));
        }
    }
    if let Some(table) = &table {
        only_for("--table", !is_postgres, "a Redis store")?;
        if !plain_table_name(table) {
            return Err(usage(format!(
                "--table {table:?} is not name or schema.name in lower-case letters, digits and _"
            )));
        }
    }
    let timeout = timeout.unwrap_or(match command {
        // A listing reads every record: a million take tens of seconds. Each of its store calls
        // is bounded on its own, so an unreachable store still fails within seconds.
        Command::InFlight { .. } => Duration::from_secs(300),
        Command::Inspect { .. } | Command::Purge { .. } => Duration::from_secs(10),
    });
    Ok(Args {
        command,
        url,
        prefix,
        table,
        timeout,
        json,
    })
}

/// `500ms`, `30s`, `5m`, `2h`, or a bare number of seconds.
fn duration(text: &str) -> Result<Duration, String> {
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let bad = || format!("{text:?} is not a duration (500ms, 30s, 5m, 2h)");
    let number: u64 = number.parse().map_err(|_| bad())?;
    let millis = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        _ => return Err(bad()),
    };
    number
        .checked_mul(millis)
        .map(Duration::from_millis)
        .ok_or_else(bad)
}

fn scheme(url: &str) -> String {
    url.split_once("://")
        .map_or(String::new(), |(scheme, _)| scheme.to_ascii_lowercase())
}

fn is_postgres(url: &str) -> bool {
    matches!(scheme(url).as_str(), "postgres" | "postgresql")
}

fn is_redis(url: &str) -> bool {
    let scheme = scheme(url);
    let base = scheme.split('-').next().unwrap_or_default();
    let topology = scheme.split_once('-').map_or("", |(_, topology)| topology);
    matches!(base, "redis" | "rediss" | "valkey" | "valkeys")
        && matches!(topology, "" | "cluster" | "sentinel")
}

/// The rule `PostgresStore::with_table` enforces (it panics on anything else).
fn plain_table_name(table: &str) -> bool {
    let part = |p: &str| {
        let mut chars = p.chars();
        matches!(chars.next(), Some('a'..='z' | '_'))
            && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
            && p.len() <= 48
    };
    (table.split_once('.')).map_or_else(|| part(table), |(schema, name)| part(schema) && part(name))
}

/// `url` fit to print: its scheme and host, without credentials, path or query (where
/// sentinel passwords go).
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "the URL given".into();
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}"),
        None => format!("{scheme}://{authority}"),
    }
}

async fn connect(args: &Args) -> Result<Arc<dyn Store>, StoreError> {
    if is_postgres(&args.url) {
        let store = tower_idempotency::PostgresStore::connect(&args.url).await?;
        Ok(match &args.table {
            Some(table) => Arc::new(store.with_table(table)),
            None => Arc::new(store),
        })
    } else {
        let store = tower_idempotency::RedisStore::connect(&args.url).await?;
        Ok(match &args.prefix {
            Some(prefix) => Arc::new(store.with_prefix(prefix.as_str())),
            None => Arc::new(store),
        })
    }
}

async fn run(args: &Args) -> u8 {
    let store = match connect(args).await {
        Ok(store) => store,
        Err(error) => return failed(args, Error::Store(error)),
    };
    let layer = IdempotencyLayer::new(store);
    let mut out = std::io::stdout().lock();
    let code = match &args.command {
        Command::Inspect { scope, key, show } => {
            inspect(args, &layer, scope.as_deref(), key, *show, &mut out).await
        }
        Command::Purge { scope, key, force } => {
            purge(args, &layer, scope.as_deref(), key, *force, &mut out).await
        }
        Command::InFlight { older_than, limit } => {
            in_flight(args, &layer, *older_than, *limit, &mut out).await
        }
    };
    let _ = out.flush();
    code.unwrap_or_else(|error| failed(args, error))
}

/// Exit code and message for a failed store call.
fn failed(args: &Args, error: Error) -> u8 {
    let url = redacted(&args.url);
    match error {
        Error::Store(StoreError::Corrupt(reason)) => {
            eprintln!("idempotency-admin: the record is unreadable: {reason}");
            UNREADABLE
        }
        Error::Store(StoreError::Unsupported(what)) => {
            eprintln!("idempotency-admin: {what}");
            UNREADABLE
        }
        Error::Store(StoreError::Timeout(after)) => {
            eprintln!("idempotency-admin: the store at {url} did not answer within {after:?}");
            UNREACHABLE
        }
        Error::Store(error) => {
            eprintln!("idempotency-admin: cannot reach the store at {url}: {error}");
            UNREACHABLE
        }
        error => {
            eprintln!("idempotency-admin: {error}");
            UNREACHABLE
        }
    }
}

fn record_key(scope: Option<&str>, key: &str) -> Option<RecordKey> {
    IdempotencyKey::parse(key)
        .ok()
        .map(|key| RecordKey::new(scope, key))
}

fn described(scope: Option<&str>, key: &str) -> String {
    match scope {
        Some(scope) => format!("key {key:?} in scope {scope:?}"),
        None => format!("key {key:?} (no scope)"),
    }
}

/// Whether and how `inspect` prints the stored body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ShowBody {
    No,
    /// As text, with what a terminal would act on escaped.
    Escaped,
    /// Byte for byte (`--raw`).
    Raw,
}

async fn inspect(
    args: &Args,
    layer: &IdempotencyLayer,
    scope: Option<&str>,
    key: &str,
    show: ShowBody,
    out: &mut impl Write,
) -> Result<u8, Error> {
    let show_body = show != ShowBody::No;
    let digest = record_key(scope, key).map_or_else(String::new, |key| key.digest_hex());
    let found = match layer.inspect(scope, key).await {
        Ok(found) => found.map(Found::Http),
        // Not a stored HTTP response (a queue consumer's result through the Coordinator, say):
        // what the store itself says about the record is still worth showing.
        Err(Error::Store(StoreError::Corrupt(reason))) => {
            let info = raw_inspect(layer.coordinator(), scope, key).await?;
            info.map(|info| Found::Raw(info, reason))
        }
        Err(error) => return Err(error),
    };
    let Some(found) = found else {
        if args.json {
            let _ = writeln!(out, "{}", json!({ "found": false, "digest": digest }));
        } else {
            let _ = writeln!(out, "no record for {}", described(scope, key));
        }
        return Ok(NOT_FOUND);
    };
    let (state, expires_in, stored_bytes) = match &found {
        Found::Http(record) => (record.state, record.expires_in, record.stored_bytes),
        Found::Raw(info, _) => (
            info.state,
            info.expires_in,
            info.payload.as_ref().map_or(0, |payload| payload.len()),
        ),
    };
    let (state_name, state_text, time_left) = match state {
        RecordState::InFlight => ("in_flight", "in flight", "lease left "),
        RecordState::Completed => ("completed", "completed", "kept for   "),
    };
    let (status, not_stored, body, unreadable) = match &found {
        Found::Http(record) => (
            record.status,
            record.not_stored.map(|why| why.to_string()),
            record.body.clone(),
            None,
        ),
        Found::Raw(_, reason) => (None, None, None, Some(reason.clone())),
    };
    if args.json {
        let mut document = json!({
            "found": true,
            "digest": digest,
            "state": state_name,
            "expires_in_ms": u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX),
            "status": status.map(|status| status.as_u16()),
            "not_stored": not_stored,
            "stored_bytes": stored_bytes,
            "body_bytes": body.as_ref().map(|body| body.len()),
        });
        if let Some(reason) = &unreadable {
            document["payload_unreadable"] = Value::from(reason.as_str());
        }
        if show_body {
            if let Some(body) = &body {
                match std::str::from_utf8(body) {
                    Ok(text) => document["body"] = Value::from(text),
                    Err(_) => document["body_hex"] = Value::from(hex(body)),
                }
            }
        }
        let _ = writeln!(out, "{document}");
        return Ok(0);
    }
    let _ = writeln!(out, "record      {} ({digest})", described(scope, key));
    let _ = writeln!(out, "state       {state_text}");
    let _ = writeln!(out, "{time_left} {}", human(expires_in));
    if let Some(status) = status {
        let _ = writeln!(out, "status      {status}");
    }
    if let Some(why) = &not_stored {
        let _ = writeln!(out, "not stored  {why} (a retry gets 409 ResponseNotStored)");
    }
    if state == RecordState::Completed {
        let body_bytes = body.as_ref().map(|body| format!(" (body {} bytes)", body.len()));
        let _ = writeln!(
            out,
            "stored      {stored_bytes} bytes{}",
            body_bytes.unwrap_or_default()
        );
    }
    if let Some(reason) = &unreadable {
        let _ = writeln!(out, "payload     not a stored HTTP response ({reason})");
    }
    if show_body {
        if let Some(body) = &body {
            let _ = writeln!(out, "body:");
            let _ = match show {
                ShowBody::Raw => out.write_all(body),
                _ => out.write_all(escaped(body).as_bytes()),
            };
            let _ = writeln!(out);
        }
    } else if body.as_ref().is_some_and(|body| !body.is_empty()) {
        let _ = writeln!(out, "(body not shown: --show-body prints it)");
    }
    Ok(0)
}

enum Found {
    Http(Inspection),
    Raw(tower_idempotency::RecordInfo, String),
}

async fn raw_inspect(
    coordinator: &Coordinator,
    scope: Option<&str>,
    key: &str,
) -> Result<Option<tower_idempotency::RecordInfo>, Error> {
    match record_key(scope, key) {
        Some(key) => coordinator.inspect(&key).await,
        None => Ok(None),
    }
}

async fn purge(
    args: &Args,
    layer: &IdempotencyLayer,
    scope: Option<&str>,
    key: &str,
    force: bool,
    out: &mut impl Write,
) -> Result<u8, Error> {
    let digest = record_key(scope, key).map_or_else(String::new, |key| key.digest_hex());
    if !force {
        // A record in flight is a request running now, or one whose instance died and holds
        // the key until its lease ends: purging it lets a retry run beside the first run.
        // (Checked, then purged: a claim landing in between is purged, as with --force.)
        match raw_inspect(layer.coordinator(), scope, key).await {
            Ok(Some(info)) if info.state == RecordState::InFlight => {
                let owner = info.owner.as_ref().map(|owner| owner.as_str().to_owned());
                let age = info.owner.as_ref().and_then(|owner| owner.issued_at()).map(|at| {
                    std::time::SystemTime::now()
                        .duration_since(at)
                        .unwrap_or_default()
                });
                if args.json {
                    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                    let document = json!({
                        "purged": false,
                        "refused": "in_flight",
                        "digest": digest,
                        "lease_left_ms": millis(info.expires_in),
                        "age_ms": age.map(millis),
                        "owner": owner,
                    });
                    let _ = writeln!(out, "{document}");
                } else {
                    let _ = writeln!(
                        out,
                        "not purged: the record of {} is in flight\n\
                         lease left  {}\n\
                         claimed     {}\n\
                         owner       {}\n\
                         A request may be running it now (or an instance that died holds it until its \
                         lease ends): after a purge, a retry runs the handler beside it. Wait for the \
                         lease, or rerun with --force.",
                        described(scope, key),
                        human(info.expires_in),
                        age.map_or_else(
                            || "at an unknown time".to_owned(),
                            |age| format!("{} ago", human(age))
                        ),
                        owner.as_deref().unwrap_or("unknown"),
                    );
                }
                return Ok(REFUSED);
            }
            Ok(_) => {}
            // A record this release cannot read is what purge is for.
            Err(Error::Store(StoreError::Corrupt(_))) => {}
            Err(error) => return Err(error),
        }
    }
    let purged = layer.purge(scope, key).await?;
    if args.json {
        let _ = writeln!(out, "{}", json!({ "purged": purged, "digest": digest }));
    } else if purged {
        let _ = writeln!(
            out,
            "purged the record of {}: the next request with it runs the handler",
            described(scope, key)
        );
    } else {
        let _ = writeln!(out, "no record for {}", described(scope, key));
    }
    Ok(if purged { 0 } else { NOT_FOUND })
}

async fn in_flight(
    args: &Args,
    layer: &IdempotencyLayer,
    older_than: Duration,
    limit: usize,
    out: &mut impl Write,
) -> Result<u8, Error> {
    let records = layer.in_flight(older_than, limit).await?;
    if args.json {
        let listed: Vec<Value> = records.iter().map(record_json).collect();
        let _ = writeln!(out, "{}", json!({ "records": listed }));
    } else if records.is_empty() {
        let _ = writeln!(out, "no records in flight for {} or more", human(older_than));
    } else {
        let _ = writeln!(
            out,
            "{:<64}  {:>12}  {:>10}  OWNER",
            "DIGEST", "AGE", "LEASE LEFT"
        );
        for record in &records {
            let age = record.age.map_or_else(|| "unknown".to_owned(), human);
            let _ = writeln!(
                out,
                "{:<64}  {:>12}  {:>10}  {}",
                record.digest_hex(),
                age,
                human(record.lease_left),
                record.owner.as_str()
            );
        }
        if records.len() == limit {
            let _ = writeln!(out, "(the {limit} oldest; --limit shows more)");
        }
    }
    Ok(if records.is_empty() { NOT_FOUND } else { 0 })
}

fn record_json(record: &InFlightRecord) -> Value {
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    json!({
        "digest": record.digest_hex(),
        "age_ms": record.age.map(millis),
        "lease_left_ms": millis(record.lease_left),
        "owner": record.owner.as_str(),
    })
}

/// `d` for people: `1h 2m 3s`, `4.5s`, `120ms`.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    match secs {
        0 => format!("{}ms", d.as_millis()),
        1..=59 => format!("{:.1}s", d.as_secs_f64()),
        60..=3599 => format!("{}m {}s", secs / 60, secs % 60),
        _ => format!("{}h {}m {}s", secs / 3600, secs / 60 % 60, secs % 60),
    }
}

/// `body` as text fit for a terminal: valid UTF-8 as it is, but for control characters (`\n` and
/// `\t` aside) and the invisible characters that reorder or hide text, shown as `\u{NNNN}`;
/// bytes that are not UTF-8 as `\xNN`. A stored body comes from a handler, and so often from a
/// client: printed raw it could move the cursor, rewrite the screen or the window title.
fn escaped(body: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut text = String::with_capacity(body.len());
    for chunk in body.utf8_chunks() {
        for c in chunk.valid().chars() {
            let invisible =
                matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if (c.is_control() && c != '\n' && c != '\t') || invisible {
                let _ = write!(text, "\\u{{{:04x}}}", u32::from(c));
            } else {
                text.push(c);
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(text, "\\x{byte:02x}");
        }
    }
    text
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Result<Args, Parsed> {
        parse(line.split_whitespace().map(str::to_owned), None)
    }

    fn problem(line: &str) -> String {
        match args(line) {
            Err(Parsed::Usage(problem)) => problem,
            Err(Parsed::Help) => "help".into(),
            Ok(args) => panic!("{line}: parsed as {args:?}"),
        }
    }

    /// What a terminal would act on is shown escaped; text, newlines and tabs as they are.
    #[test]
    fn bodies_are_escaped_for_the_terminal() {
        assert_eq!(escaped("{\"a\": \"é\"}\n\tok".as_bytes()), "{\"a\": \"é\"}\n\tok");
        assert_eq!(
            escaped(b"\x1b]0;pwned\x07\x1b[2Jx\r"),
            "\\u{001b}]0;pwned\\u{0007}\\u{001b}[2Jx\\u{000d}"
        );
        assert_eq!(escaped(b"caf\xe9 \xff"), "caf\\xe9 \\xff");
        assert_eq!(escaped("abc\u{202e}fed".as_bytes()), "abc\\u{202e}fed");
        assert_eq!(escaped("\u{9b}".as_bytes()), "\\u{009b}", "C1 controls too");
    }

    #[test]
    fn durations() {
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(duration("2h"), Ok(Duration::from_secs(7200)));
        for bad in ["", "s", "5x", "-1s", "1.5s", "99999999999999999999h"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn commands_and_their_options() {
        let parsed = args("inspect --url redis://h:1 --scope t --key k --show-body --json").unwrap();
        assert!(parsed.json);
        assert!(matches!(
            parsed.command,
            Command::Inspect { scope: Some(ref s), ref key, show: ShowBody::Escaped } if s == "t" && key == "k"
        ));
        let parsed = args("inspect --url redis://h:1 --key k --show-body --raw").unwrap();
        assert!(matches!(
            parsed.command,
            Command::Inspect {
                show: ShowBody::Raw,
                ..
            }
        ));
        let parsed = args("purge --url redis://h:1 --key k --force").unwrap();
        assert!(matches!(parsed.command, Command::Purge { force: true, .. }));
        let parsed = args("purge --url redis://h:1 --key k").unwrap();
        assert!(matches!(parsed.command, Command::Purge { force: false, .. }));
        let parsed = args("in-flight --url postgres://h/db --older-than 5m --limit 7").unwrap();
        assert!(matches!(
            parsed.command,
            Command::InFlight { older_than, limit: 7 } if older_than == Duration::from_secs(300)
        ));
        let from_env = parse(
            ["purge", "--key", "k"].map(str::to_owned).into_iter(),
            Some("redis-sentinel://h?sentinelServiceName=m".into()),
        );
        assert!(from_env.is_ok());
        assert!(matches!(args("--help"), Err(Parsed::Help)));
        assert!(matches!(args("purge --help"), Err(Parsed::Help)));
    }

    #[test]
    fn usage_errors() {
        for (line, says) in [
            ("", "no command"),
            ("frobnicate --url redis://h", "unknown command"),
            ("inspect --url redis://h", "needs --key"),
            ("inspect --url redis://h --key", "needs a value"),
            (
                "inspect --url redis://h --key a\u{7f}",
                "not a valid Idempotency-Key",
            ),
            (
                "purge --url redis://h --key k --show-body",
                "not an option of purge",
            ),
            ("in-flight --url redis://h --key k", "not an option of in-flight"),
            (
                "inspect --url redis://h --key k --raw",
                "give it with --show-body",
            ),
            (
                "inspect --url redis://h --key k --show-body --raw --json",
                "without --json",
            ),
            (
                "inspect --url redis://h --key k --force",
                "not an option of inspect",
            ),
            ("purge --url redis://h --key k --raw", "not an option of purge"),
            ("in-flight --url redis://h --force", "not an option of in-flight"),
            ("in-flight --url redis://h --limit many", "not a number"),
            ("in-flight --url redis://h --older-than soon", "not a duration"),
            ("in-flight", "no --url"),
            ("in-flight --url http://h", "neither a Redis nor a PostgreSQL URL"),
            (
                "in-flight --url redis://h --table t",
                "not an option of a Redis store",
            ),
            (
                "in-flight --url postgres://h --prefix p",
                "not an option of a PostgreSQL store",
            ),
            (
                "in-flight --url postgres://h --table T;drop",
                "not name or schema.name",
            ),
            ("in-flight --url redis://h --prefix a{b}", "contains a brace"),
            ("in-flight --url redis://h --verbose", "unknown argument"),
        ] {
            let problem = problem(line);
            assert!(problem.contains(says), "{line}: {problem}");
        }
    }

    #[test]
    fn every_url_form_of_the_stores_is_recognised() {
        for url in [
            "redis://h:6379",
            "rediss://h",
            "redis-cluster://h:1",
            "rediss-cluster://h",
            "redis-sentinel://h?sentinelServiceName=m",
            "rediss-sentinel://h",
            "valkey://h",
            "REDIS://h",
        ] {
            assert!(is_redis(url) && !is_postgres(url), "{url}");
        }
        for url in ["postgres://u@h/db", "postgresql://h/db"] {
            assert!(is_postgres(url) && !is_redis(url), "{url}");
        }
    }

    #[test]
    fn printed_urls_carry_no_credentials() {
        assert_eq!(redacted("redis://:secret@h:1/0"), "redis://***@h:1");
        assert_eq!(
            redacted("postgres://u:pw@db:5432/app?sslmode=require"),
            "postgres://***@db:5432"
        );
        assert_eq!(
            redacted("redis-sentinel://h:1?sentinelPassword=secret"),
            "redis-sentinel://h:1"
        );
        assert_eq!(redacted("nonsense"), "the URL given");
    }

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_millis(120)), "120ms");
        assert_eq!(human(Duration::from_millis(4_500)), "4.5s");
        assert_eq!(human(Duration::from_secs(61)), "1m 1s");
        assert_eq!(human(Duration::from_secs(3_723)), "1h 2m 3s");
    }
}
