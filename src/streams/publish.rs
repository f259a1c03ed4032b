//! Publishing to a stream so that a retried publish is not added twice, where the server can
//! tell (Redis 8.6's `XADD … IDMP`).

use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::interfaces::{ClientLike, StreamsInterface};
use fred::types::{CustomCommand, Value};
use tokio::sync::OnceCell;

use super::commands::bounded;

/// Adds entries to a stream, each under its idempotency id: on a server with `XADD … IDMP`
/// (Redis 8.6 and later) a publish retried with the same id (after a timeout, a reconnect, a
/// producer restart) answers the first entry's id and adds nothing; on older servers it is a
/// plain `XADD`, and the consumer's [`Coordinator::once`](crate::Coordinator::once) still applies
/// the effect once (the duplicate entry is acknowledged as a replay).
///
/// The server remembers each producer's ids for its IDMP window (`XCFGSET <stream>
/// IDMP-DURATION <seconds> IDMP-MAXSIZE <ids>`; 100 s and 100 ids by default): a retry later
/// than that, or after more ids from the same producer, is added again, and left to the consumer.
///
/// Every command is bounded (5 s, as the consumer's are) whatever the client's own timeout: a
/// publish to a server that stopped answering errs, with a timeout, rather than hang.
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
    /// XCFGSET`), then remembered. A server that refuses the question (`COMMAND` renamed away)
    /// counts as one without; one that does not answer too, and is asked again next time.
    pub async fn deduplicates(&self) -> bool {
        self.idmp().await.unwrap_or(false)
    }

    /// [`deduplicates`](Self::deduplicates), or the error of a server that did not answer (not
    /// remembered: the next publish asks again).
    async fn idmp(&self) -> Result<bool, Error> {
        let ask = || async {
            let command = CustomCommand::new_static("COMMAND", fred::types::ClusterHash::Random, false);
            match bounded(self.redis.custom::<Value, _>(command, vec!["INFO", "XCFGSET"])).await {
                Ok(info) => Ok(info.into_array().first().is_some_and(|cmd| !cmd.is_null())),
                Err(error) if no_answer(&error) => Err(error),
                Err(_) => Ok(false),
            }
        };
        self.idmp.get_or_try_init(ask).await.copied()
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
        if !self.idmp().await? {
            let fields: Vec<(String, Value)> = fields.collect();
            return bounded(self.redis.xadd(&self.stream, false, None, "*", fields)).await;
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
        let xadd = CustomCommand::new_static("XADD", fred::types::ClusterHash::FirstKey, false);
        bounded(self.redis.custom(xadd, args)).await
    }
}

/// Whether `error` means the server gave no answer (a timeout, a lost connection) rather than
/// an answer that refuses.
fn no_answer(error: &Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled | ErrorKind::Backpressure
    )
}
