//! Publishing to a stream so that a retried publish is not added twice, where the server can
//! tell (Redis 8.6's `XADD … IDMP`).

use fred::clients::Client;
use fred::error::Error;
use fred::interfaces::{ClientLike, StreamsInterface};
use fred::types::{CustomCommand, Value};
use tokio::sync::OnceCell;

/// Adds entries to a stream, each under its idempotency id: on a server with `XADD … IDMP`
/// (Redis 8.6 and later) a publish retried with the same id (after a timeout, a reconnect, a
/// producer restart) answers the first entry's id and adds nothing; on older servers it is a
/// plain `XADD`, and the consumer's [`Coordinator::once`](crate::Coordinator::once) still applies
/// the effect once (the duplicate entry is acknowledged as a replay).
///
/// The server remembers each producer's ids for its IDMP window (`XCFGSET <stream>
/// IDMP-DURATION <seconds> IDMP-MAXSIZE <ids>`; 100 s and 100 ids by default): a retry later
/// than that, or after more ids from the same producer, is added again, and left to the consumer.
#[derive(Clone, Debug)]
pub struct StreamPublisher {
    redis: Client,
    stream: String,
    producer: String,
    idmp: std::sync::Arc<OnceCell<bool>>,
}

impl StreamPublisher {
    /// A publisher to `stream` through `redis`, naming itself `producer` to the server (ids are
    /// remembered per producer: keep the name across restarts of one producer).
    pub fn new(redis: Client, stream: impl Into<String>, producer: impl Into<String>) -> Self {
        Self {
            redis,
            stream: stream.into(),
            producer: producer.into(),
            idmp: Default::default(),
        }
    }

    /// Whether the server deduplicates publishes (`XADD … IDMP`); asked once (`COMMAND INFO
    /// XCFGSET`), then remembered. A server that does not answer counts as one without.
    pub async fn deduplicates(&self) -> bool {
        *self
            .idmp
            .get_or_init(|| async {
                let info: Result<Value, Error> = self
                    .redis
                    .custom(
                        CustomCommand::new_static("COMMAND", fred::types::ClusterHash::Random, false),
                        vec!["INFO", "XCFGSET"],
                    )
                    .await;
                info.is_ok_and(|info| info.into_array().first().is_some_and(|cmd| !cmd.is_null()))
            })
            .await
    }

    /// Adds an entry with `fields` under the idempotency id `id` (usually the value of the
    /// consumer's id field too), and answers its entry id: on a deduplicating server, the first
    /// entry's id if `id` was published before within the window.
    pub async fn publish<F, K, V>(&self, id: &str, fields: F) -> Result<String, Error>
    where
        F: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<Value>,
    {
        let fields = fields
            .into_iter()
            .map(|(name, value)| (name.into(), value.into()));
        if !self.deduplicates().await {
            let fields: Vec<(String, Value)> = fields.collect();
            return self.redis.xadd(&self.stream, false, None, "*", fields).await;
        }
        let mut args: Vec<Value> = vec![
            self.stream.as_str().into(),
            "IDMP".into(),
            self.producer.as_str().into(),
            id.into(),
            "*".into(),
        ];
        for (name, value) in fields {
            args.push(name.into());
            args.push(value);
        }
        self.redis
            .custom(
                CustomCommand::new_static("XADD", fred::types::ClusterHash::FirstKey, false),
                args,
            )
            .await
    }
}
