//! The guides: README and each page of `docs/`, as pages of these docs, so that docs.rs shows
//! them and `cargo test --doc` compiles their Rust code.
//!
//! - [README](readme): what the crate does, how to add it, the axum example, the behaviour
//!   table, every setting with its default, the guarantees in short and the checklist before
//!   going live.
//! - [With axum](with_axum): mounting, the handler's body, scopes, the key in the handler,
//!   fingerprints
//! - [Waiting for the first request](waiting)
//! - [gRPC](grpc)
//! - [For API clients](api_clients): what each rejection's `key_state`, `retryable` and
//!   `retry_after` mean, and what a client should do
//! - [Queue consumers](queue_consumers)
//! - [Guarantees](guarantees), in full, and where they end
//! - [Policy file](policy_file)
//! - [Stores](stores): Redis, the replay cache, memory
//! - [Running Redis for this](running_redis)
//! - [Connections that die without a word](dead_connections)
//! - [Topologies and failover](topologies_and_failover)
//! - [PostgreSQL](postgresql)
//! - [Performance](performance)
//! - [Operators](operators)
//! - [Metrics and tracing](metrics_and_tracing)
//! - [Crate features and MSRV](crate_features)
//! - [Development](development)
//!
//! The pages link to each other as files on GitHub (`docs/grpc.md`); here each such link is
//! defined once more, ahead of the page, as a link to the page's module, and the first
//! definition of a link is the one that counts.

/// The link targets the pages name, as modules of this one (see the module's docs).
macro_rules! links {
    () => {
        "[metrics-and-tracing]: crate::guide::metrics_and_tracing\n\
         [waiting]: crate::guide::waiting\n\
         [rolling-back]: crate::guide::guarantees#rolling-back\n\
         [reconciliation]: crate::guide::guarantees#knowing-when-it-happened-the-reconciliation-hook\n\
         [with-axum]: crate::guide::readme#with-axum\n\
         [policy-file]: crate::guide::policy_file\n\
         [dead-connections]: crate::guide::dead_connections\n\
         [topologies-and-failover]: crate::guide::topologies_and_failover\n\
         [durability]: crate::guide::topologies_and_failover#durability-waiting-for-replicas\n\
         [where-the-guarantees-end]: crate::guide::guarantees#where-the-guarantees-end\n\
         [checked-by-a-model]: crate::guide::guarantees#checked-by-a-model\n\
         [postgresql]: crate::guide::postgresql\n\
         [performance]: crate::guide::performance\n\
         [stores]: crate::guide::stores\n\
         [operators]: crate::guide::operators\n\
         [grpc]: crate::guide::grpc\n\
         [api-clients]: crate::guide::api_clients\n\
         [queue-consumers]: crate::guide::queue_consumers\n\
         [running-redis]: crate::guide::running_redis\n\
         [with-axum-guide]: crate::guide::with_axum\n\
         [json-fingerprints]: crate::guide::with_axum#json-bodies-by-their-meaning\n\
         [guarantees]: crate::guide::guarantees\n\
         [crate-features]: crate::guide::crate_features\n\
         [development]: crate::guide::development\n\
         [readme]: crate::guide::readme\n\
         [changelog]: https://docs.rs/crate/tower-idempotency/latest/source/CHANGELOG.md\n\
         [architecture]: https://docs.rs/crate/tower-idempotency/latest/source/ARCHITECTURE.md\n\
         [bench-chart]: https://docs.rs/crate/tower-idempotency/latest/source/bench/chart.svg\n\
         [bench-history]: https://docs.rs/crate/tower-idempotency/latest/source/bench/history.md\n\
         [bench-history-runs]: https://docs.rs/crate/tower-idempotency/latest/source/bench/history-runs.md\n\
         [bench-model-history]: https://docs.rs/crate/tower-idempotency/latest/source/bench/model-history.md\n\
         [bench-ci-times]: https://docs.rs/crate/tower-idempotency/latest/source/bench/ci-times.md\n\n"
    };
}

// A page whose Rust code needs a crate feature is included only with that feature, so that
// `cargo test --doc` without it does not try to compile that code; `scripts/test.sh` runs the
// doctests with every feature.
macro_rules! page {
    ($name:ident, $file:literal) => {
        #[doc = links!()]
        #[doc = include_str!($file)]
        pub mod $name {}
    };
    ($name:ident, $file:literal, $title:literal, $feature:literal) => {
        #[doc = links!()]
        #[cfg_attr(feature = $feature, doc = include_str!($file))]
        #[cfg_attr(
            not(feature = $feature),
            doc = concat!("# ", $title, "\n\nThis page needs the crate feature `", $feature, "`: build the docs with it.")
        )]
        pub mod $name {}
    };
}

page!(readme, "../README.md", "README", "redis");
page!(with_axum, "../docs/with-axum.md");
page!(waiting, "../docs/waiting.md");
page!(grpc, "../docs/grpc.md");
page!(api_clients, "../docs/api-clients.md");
page!(
    queue_consumers,
    "../docs/queue-consumers.md",
    "Queue consumers",
    "streams"
);
page!(guarantees, "../docs/guarantees.md");
page!(policy_file, "../docs/policy-file.md", "Policy file", "policy");
page!(stores, "../docs/stores.md");
page!(running_redis, "../docs/running-redis.md");
page!(dead_connections, "../docs/dead-connections.md");
page!(topologies_and_failover, "../docs/topologies-and-failover.md");
page!(postgresql, "../docs/postgresql.md", "PostgreSQL", "postgres");
page!(performance, "../docs/performance.md");
page!(operators, "../docs/operators.md");
page!(metrics_and_tracing, "../docs/metrics-and-tracing.md");
page!(crate_features, "../docs/crate-features.md");
page!(development, "../docs/development.md");
